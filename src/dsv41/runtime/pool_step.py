"""One decode / verify bucket over the KV pool as one CUDA graph (`FastModel._forward_pool`; docs/ENGINE.md §5):
its inputs (token ids, positions, Engram rows as stored) and the tables (runtime/step_tables.py) in one copy, then
the graph of `FastModel._pool_step`. In the overlapped loop (ENGINE.md §6) the tables are planned before the
follow rows' ids are taken from the previous step's sample (`follow`). With the Engram gate (runtime/engram_gate.py)
the tables carry the rows' place and the step's number instead of the rows: the step's graph copies the rows into
that place itself (the one write a step makes to its own input), after the host has published them.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from .engram_gate import GATE_STEP
from .graphs import piece_key
from .mhc_sites import MhcSites
from .sections import section
from .step_tables import StepTables, ring_chunk_rows


def ids_positions(segs, ids: list, B: int):
    """The bucket's ids and positions (int64, the rows past the real ones mirroring row 0), built in numpy (a
    few µs an op where torch's CPU ops cost ~10: host work before every step's graph)."""
    n = sum(s.T for s in segs)
    flat = np.concatenate([i.numpy() for i in ids])
    pos = np.concatenate([np.arange(s.pos, s.pos + s.T, dtype=np.int64) for s in segs])
    return (torch.from_numpy(np.concatenate((flat, np.full(B - n, flat[0], dtype=np.int64)))),
            torch.from_numpy(np.concatenate((pos, np.full(B - n, pos[0], dtype=np.int64)))))


def engram_stored(model, segs, ids: list, B: int) -> dict:
    """Every Engram layer's rows of the bucket as stored (hashed from each segment's history and ids, every
    layer's reads in flight at once), padding rows mirroring row 0."""
    cfg = model.cfg
    n = sum(s.T for s in segs)
    with section("engram"):
        row_ids = model.engram_hasher.hash_many([(i, s.state.engram) for s, i in zip(segs, ids)])
        row_ids = torch.cat((row_ids, row_ids[:1].expand(B - n, *row_ids.shape[1:])))
        reads = {L: e.table.submit(row_ids[:, cfg.engram_layer_ids.index(L)]) for L, e in model.engram.items()}
        return {L: read.wait_bytes() for L, read in reads.items()}


def forward_pool(model, segs, chunks, pool, phase: str, n: int, B: int, writes=True, follow=None):
    """One bucket over the pool: the tables (one host-to-device copy, which also carries the step's token ids,
    positions and Engram rows as stored), then the whole step as one graph (`graphs.run("step", ...)`, keyed
    by phase, the row bucket B of n and the tables' page bucket: the tables and kernels hold B rows, those
    past n mirroring row 0 and writing nothing, and the first n rows' logits are returned). The capture's warm-up
    runs on tables that write nothing, so the step's writes to the pool happen once, in the replay.

    `follow` (`forward`'s, this bucket's chunks): the tables are planned first (nothing in them depends on the
    ids), then the follow rows' ids are taken: on the device (gathered from the previous step's sample into
    the tables' ids after the copy) or, where Engram rows are hashed from them, read on the host here (the
    only wait for the previous step). With the Engram gate (`model.engram_gate`, runtime/engram_gate.py) the ids
    stay on the device there too: the step's rows are published by the host after the step's graph is launched
    (it waits on the device before the first Engram layer), or before it where the graph is not replayed."""
    dev = model.device
    for s in segs:
        if s.T > ring_chunk_rows(pool, model.cfg.sliding_window):
            raise ValueError(f"a {phase} chunk of {s.T} rows does not fit a ring of {pool.ring_rows} rows "
                             f"over a window of {model.cfg.sliding_window}")
    planned = StepTables.plan(segs, B, pool)
    ids = [c[1] for c in chunks]
    engram = model.engram_hasher is not None
    gate = model.engram_gate if engram else None
    stored = None
    if follow is not None and engram and (gate is None or not gate.ready):  # the hash needs the ids now
        ids, follow = host_ids(ids, follow), None
    if gate is not None and not gate.ready:  # the gate's first step: its read gives the rows' shapes
        stored = engram_stored(model, segs, ids, B)
        gate.learn(stored)
    ids_b, pos_b = ids_positions(segs, ids, B)
    inputs = {"ids": ids_b, "pos": pos_b}
    if gate is not None:
        step_no = gate.number()
        inputs.update({GATE_STEP: np.array([step_no], dtype=np.int64), **gate.placeholders(B)})
    elif engram:
        stored = engram_stored(model, segs, ids, B)
        inputs.update({f"engram.{L}": r.data for L, r in stored.items()})
    if follow is not None:  # each bucket row's source in the previous step's sample (-1: its own id)
        src = np.full(B, -1, dtype=np.int64)
        for s, f in zip(segs, follow[1]):
            src[s.start:s.start + s.T] = f
        src[n:] = src[0]  # padding rows mirror row 0
        inputs["follow"] = src
    tables = planned.pack(dev, inputs)  # one copy for all
    if follow is not None:  # the ids from the device: no host round trip between the two steps
        t_ids, t_src = tables["ids"], tables["follow"]
        t_ids.copy_(torch.where(t_src >= 0, follow[0].device_ids()[t_src.clamp(min=0)], t_ids))
    if not writes:
        tables = tables.without_writes()
    step = partial(model._pool_step, MhcSites.of(model.cfg, dev, rows=B), B, phase, pool, tables)
    formats = {L: f[:2] for L, f in gate.formats.items()} if gate is not None else \
        {L: (r.kind, r.head_dim) for L, r in (stored or {}).items()}
    args = (tables.packed, formats, gate is not None)
    warm = lambda: (tables.without_writes().packed, *args[1:])  # noqa: E731
    graphs = model.piece_graphs()
    deferred = False
    if gate is not None:  # the host's part: after the launch where the graph replays, else before it
        read = (lambda: stored) if stored is not None else \
            (lambda: engram_stored(model, segs, host_ids(ids, follow) if follow is not None else ids, B))
        deferred = stored is None and graphs.decide(piece_key("step", phase, B, args)) == "replay"
        gate.fed["after" if deferred else "before"] += 1
        if not deferred:
            gate.feed(step_no, read, B)
    try:
        local = graphs.run("step", phase, B, step, *args, warmup=warm)[:n]
    except BaseException:
        if deferred:  # its gate may be enqueued: never leave the device waiting for rows that will not come
            gate.abandon(step_no)
        raise
    if gate is not None:
        gate.launched(step_no)
        if deferred:
            with section("engram"):
                gate.feed(step_no, read, B)
    for s, i in zip(segs, ids):
        s.state.pos += s.T
        s.state.ids.extend(i.tolist())  # a follow row's placeholder where its id stayed on the device
    with section("comm"):
        return model.comm.gather_cat(local, dim=-1)


def host_ids(ids: list, follow) -> list:
    """The chunks' ids with each follow row's read on the host from the previous step's sample (waits for it)."""
    host = torch.tensor(follow[0].host_ids(), dtype=torch.int64)
    return [host[f:f + 1] if f >= 0 else i for i, f in zip(ids, follow[1])]
