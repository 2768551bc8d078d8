"""One decode / verify bucket over the KV pool as one CUDA graph (`FastModel._forward_pool`; docs/ENGINE.md §5):
its inputs (token ids, positions, Engram rows as stored) and the tables (runtime/step_tables.py) in one copy, then
the graph of `FastModel._pool_step`. In the overlapped loop (ENGINE.md §6) the tables are planned before the
follow rows' ids are taken from the previous step's sample (`follow`).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

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
    only wait for the previous step; the device-side gate before layer 1 would take it off: docs/ENGINE.md)."""
    dev = model.device
    for s in segs:
        if s.T > ring_chunk_rows(pool, model.cfg.sliding_window):
            raise ValueError(f"a {phase} chunk of {s.T} rows does not fit a ring of {pool.ring_rows} rows "
                             f"over a window of {model.cfg.sliding_window}")
    planned = StepTables.plan(segs, B, pool)
    ids = [c[1] for c in chunks]
    if follow is not None and model.engram_hasher is not None:  # the hash needs them: the host reads them now
        host = torch.tensor(follow[0].host_ids(), dtype=torch.int64)
        ids = [host[f:f + 1] if f >= 0 else i for i, f in zip(ids, follow[1])]
        follow = None
    ids_b, pos_b = ids_positions(segs, ids, B)
    stored = engram_stored(model, segs, ids, B) if model.engram_hasher is not None else None
    inputs = {"ids": ids_b, "pos": pos_b, **{f"engram.{L}": r.data for L, r in (stored or {}).items()}}
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
    args = (tables.packed, {L: (r.kind, r.head_dim) for L, r in (stored or {}).items()})
    warm = lambda: (tables.without_writes().packed, *args[1:])  # noqa: E731
    local = model.piece_graphs().run("step", phase, B, step, *args, warmup=warm)[:n]
    for s, i in zip(segs, ids):
        s.state.pos += s.T
        s.state.ids.extend(i.tolist())  # a follow row's placeholder where its id stayed on the device
    with section("comm"):
        return model.comm.gather_cat(local, dim=-1)
