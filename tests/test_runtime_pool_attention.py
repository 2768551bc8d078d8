"""Attention over the KV pool in place (FastAttention.attend_pool, FastModel._pool_step) == the load-and-store path.

Both paths run the same fast forward over the same pool contents; the in-place one writes the pool itself (window
rows, entries and index keys by their closer, open groups) and reads it through the step's tables, the other loads
each sequence's state from the pool, runs `attend` and stores the new rows back. Claimed and checked bit for bit:
every step's logits, and every stored value afterwards (each store decoded; an entry's bytes may differ where two
encodings decode alike). The schedule covers decode rows of several sequences in one bucket, verify windows and
multi-token decode chunks (rows that see the rows before them, groups closed and opened inside the step, entries
crossing pages), a sequence still inside its first window, and the candidate pool and re-indexing layers of the
slimmed tiny model (test_runtime_fast.LITE).

CPU: the kernels in Triton's interpreter, in a child process (tests/step_harness.py); GPU: the same, in-process,
where the in-place step runs as one CUDA graph.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from step_harness import interpreted, need_compiled_cuda  # noqa: E402

PAGE_TOKENS = 8
PROMPTS = ([0] + [(i * 37) % 500 + 5 for i in range(18)],  # 19 tokens: ratio-2 open group at the end
           [0] + [(i * 91) % 500 + 7 for i in range(13)],  # 14
           [0, 11, 12, 13, 14, 15])  # 6: inside its first window, few entries
# per step: (sequence, phase, tokens) rows
SCHEDULE = ([(0, "decode", 1), (1, "decode", 1), (2, "decode", 2)],
            [(0, "verify", 4), (1, "verify", 5), (2, "verify", 3)],
            [(0, "decode", 2), (1, "decode", 1), (2, "decode", 1)])


def _pool(model, device):
    from dsv41.runtime.fast_forward import pool_layout
    from dsv41.runtime.kv_pool import pool_for_model

    return pool_for_model(pool_layout(model), num_slots=3, num_pages=3 * 8, page_tokens=PAGE_TOKENS, verify_rows=5,
                          device=device)


def run(model_dir: str, device: str, dtype=torch.float32) -> dict:
    from dsv41.engine.batch import PREFILL, Row
    from dsv41.runtime.build import build_fast_model
    from dsv41.runtime.fast_forward import FastForward

    torch.manual_seed(0)
    fast = build_fast_model(model_dir, device, dtype, fake_quant=True, dspark=True)  # its rings compared too
    pages = [[3 * p + s for p in (2, 0, 5, 1, 7, 3, 6, 4)] for s in range(3)]  # non-sequential page tables
    pool = _pool(fast, device)
    pos = [0, 0, 0]

    def rows_of(step):
        out = []
        for seq, phase, T in step:
            ids = [(pos[seq] * 7 + k * 13 + seq) % 500 + 3 for k in range(T)]
            out.append(Row(seq, seq, ids, pos[seq], pages[seq], phase=phase, scores=[(k, 0, 0) for k in range(T)]))
        return out

    prefill = [Row(i, i, list(p), 0, pages[i], phase=PREFILL, scores=[(len(p) - 1, 0, 0)])
               for i, p in enumerate(PROMPTS)]
    FastForward(fast, in_place=False).execute(prefill, pool)
    twin = _pool(fast, device)
    twin.buffer.copy_(pool.buffer)
    for i, p in enumerate(PROMPTS):
        pos[i] = len(p)
    in_place, loaded = FastForward(fast), FastForward(fast, in_place=False)
    steps, forward_pool = [], fast._forward_pool
    fast._forward_pool = lambda *a: (steps.append(a[3]), forward_pool(*a))[1]  # which phases ran in place
    logits = {"in_place": [], "loaded": []}
    for step in SCHEDULE:
        rows = rows_of(step)
        logits["in_place"].append([t.cpu() for t in in_place.execute(rows, pool)])
        logits["loaded"].append([t.cpu() for t in loaded.execute(rows, twin)])
        for seq, _, T in step:
            pos[seq] += T
    stores = {}
    for key, store in pool.stores.items():
        codec = {"window": pool.window_codec, "dspark": pool.window_codec, "kv": pool.kv_codec,
                 "index_k": pool.index_codec}.get(key[0])
        pair = (store, twin.stores[key])
        if codec is not None:
            pair = tuple(codec.decode(s.reshape(-1, codec.row_bytes), torch.float32) for s in pair)
        stores[f"{key[0]}.{key[1]}"] = tuple(t.cpu() for t in pair)
    graphs = fast.graphs.stats.as_dict() if fast.graphs is not None else None
    return {"logits": logits, "stores": stores, "graphs": graphs, "in_place_steps": steps}


def _check(res: dict) -> None:
    a, b = res["logits"]["in_place"], res["logits"]["loaded"]
    # every step ran in place once per phase present (and the loaded run never did)
    assert res["in_place_steps"] == [p for step in SCHEDULE for p in ("decode", "verify")
                                     if any(ph == p for _, ph, _ in step)], res["in_place_steps"]
    assert len(a) == len(SCHEDULE)
    for step, (x, y) in enumerate(zip(a, b)):
        for r, (u, v) in enumerate(zip(x, y)):
            assert u.shape == v.shape and u.shape[0] == SCHEDULE[step][r][2]
            assert torch.equal(u.view(torch.int32), v.view(torch.int32)), (step, r, (u - v).abs().max())
    for name, (u, v) in res["stores"].items():
        assert torch.equal(u.view(torch.int32), v.view(torch.int32)), name


@pytest.fixture(scope="module")
def lite_dir(tmp_path_factory):
    from dsv41.tiny.model import make_tiny
    from test_runtime_fast import LITE

    return make_tiny(tmp_path_factory.mktemp("lite") / "model", "exl3", seed=0, overrides=LITE)


def _interp_worker(out_path: str) -> None:
    torch.set_num_threads(1)
    torch.save(run(sys.argv[3], "cpu"), out_path)


def test_interpreted_in_place_equals_load_and_store(lite_dir, tmp_path_factory):
    _check(interpreted(tmp_path_factory, __file__, "pool_attention", timeout=600, extra_args=[str(lite_dir)]))


def test_step_tables_by_hand():
    """The tables of a bucket of 8 rows: a 3-row verify window at positions 5-7 (at ratio 2, 5 closes the group
    of 4 and 5, 7 the group of 6 and 7; the step ends at 8 with nothing open) and a decode row at position 10
    (its group stays open), padding after them. A ring of 20 rows, 8-token pages."""
    from types import SimpleNamespace

    from dsv41.runtime.kv_pool import SourceLayout
    from dsv41.runtime.layers.attention import Segment
    from dsv41.runtime.step_tables import StepTables

    pool = SimpleNamespace(ring_rows=20, sources={1: SourceLayout(1, 2, 4, True), 3: SourceLayout(3, 1, 8, True)})
    a = SimpleNamespace(row=SimpleNamespace(slot=2, page_ids=[9, 4]))
    b = SimpleNamespace(row=SimpleNamespace(slot=0, page_ids=[1, 6, 3]))
    t = StepTables.build([Segment(a, 0, 3, 5), Segment(b, 3, 1, 10)], 8, pool, torch.device("cpu"))
    assert t.pages_bucket == 4 and t.pages.shape == (8, 4)
    assert t.slot.tolist() == [2, 2, 2, 0, 2, 2, 2, 2]
    assert t.ring_dest.tolist() == [45, 46, 47, 10, -1, -1, -1, -1]
    r2, r1 = t.source(2), t.source(1)
    assert r2.ncols == 16 and r1.ncols == 32
    assert r2.n_vis.tolist() == [3, 3, 4, 5, 3, 3, 3, 3]
    # closers: positions 5 and 7 close entries 2 and 3 (page 9, rows 2 and 3 of 4 per page)
    assert r2.entry_dest.tolist() == [9 * 4 + 2, -1, 9 * 4 + 3, -1, -1, -1, -1, -1]
    assert r2.entry_pos.tolist()[:3] == [4, 4, 6]
    # ratio 1: every real row closes its own entry: position 5 -> page 9 row 5; 10 -> page 6 row 2
    assert r1.entry_dest.tolist()[:4] == [9 * 8 + 5, 9 * 8 + 6, 9 * 8 + 7, 6 * 8 + 2]
    # the group of 4 (positions 4, 5): 4 is before the step -> the open store of slot 2; 7's mate 6 is row 1
    assert r2.back_row[0].tolist()[:4] == [-1, 0, 1, -1]
    assert r2.back_open[0].tolist()[:4] == [2, 2, 2, 0]
    # open at the step's end: sequence a ends at 8 (no open group); b ends at 11: position 10 stays open
    assert r2.open_dest.tolist() == [-1, -1, -1, 0, -1, -1, -1, -1]
    w = t.without_writes()
    assert w.ring_dest.tolist() == [-1] * 8 and w.source(2).open_dest.tolist() == [-1] * 8
    assert w.source(1).entry_dest.tolist() == [-1] * 8 and torch.equal(w.pages, t.pages)
    assert t.ring_dest.tolist()[0] == 45  # the original is untouched


def test_step_tables_carry_byte_inputs_whole():
    """A uint8 input (the step's Engram rows as stored) travels in the same int64 buffer as whole words, its last
    dimension padded; `bytes_of` gives back exactly its bytes, also over another buffer (`on`, a graph's static
    copy) and in the tables without writes."""
    from types import SimpleNamespace

    from dsv41.runtime.kv_pool import SourceLayout
    from dsv41.runtime.layers.attention import Segment
    from dsv41.runtime.step_tables import StepTables

    pool = SimpleNamespace(ring_rows=20, sources={1: SourceLayout(1, 2, 4, True)})
    a = SimpleNamespace(row=SimpleNamespace(slot=1, page_ids=[3]))
    rng = np.random.default_rng(0)
    inputs = {"ids": np.arange(4), "engram.1": rng.integers(0, 256, (4, 3, 13), dtype=np.uint8),
              "engram.14": rng.integers(0, 256, (4, 2, 264), dtype=np.uint8)}
    t = StepTables.build([Segment(a, 0, 1, 7)], 4, pool, torch.device("cpu"), inputs=inputs)
    for tables in (t, t.on(t.packed.clone()), t.without_writes()):
        for name in ("engram.1", "engram.14"):
            assert torch.equal(tables.bytes_of(name), torch.from_numpy(inputs[name]))
        assert tables["ids"].tolist() == [0, 1, 2, 3]


def _tables_by_rule(segs, B, pool):
    """The tables row by row from step_tables.py's docstring, in plain Python: what `StepTables.build` must give."""
    rows = [(s.state.row, s.pos + k, k, s.pos + s.T) for s in segs for k in range(s.T)]
    n = len(rows)
    rows += [rows[0]] * (B - n)
    P = max(1, 1 << (max(len(r[0].page_ids) for r in rows) - 1).bit_length())
    out = {"slot": [r[0].slot for r in rows], "pages": [r[0].page_ids + [0] * (P - len(r[0].page_ids)) for r in rows],
           "ring_dest": [r[0].slot * pool.ring_rows + r[1] % pool.ring_rows if b < n else -1
                         for b, r in enumerate(rows)]}
    for src in pool.sources.values():
        q, per = src.ratio, src.per_page
        out[f"r{q}.n_vis"] = [(pos + 1) // q for _, pos, _, _ in rows]
        ents = [max((pos + 1) // q - 1, 0) for _, pos, _, _ in rows]
        out[f"r{q}.entry_pos"] = [e * q for e in ents]
        out[f"r{q}.entry_dest"] = [out["pages"][b][min(e // per, P - 1)] * per + e % per
                                   if b < n and (rows[b][1] + 1) % q == 0 else -1 for b, e in enumerate(ents)]
        if q > 1:
            out[f"r{q}.open_dest"] = [row.slot * (q - 1) + min(pos % q, q - 2)
                                      if b < n and pos >= end // q * q and pos % q < q - 1 else -1
                                      for b, (row, pos, _, end) in enumerate(rows)]
            out[f"r{q}.back_row"] = [[b - d if rows[b][2] >= d else -1 for b in range(B)] for d in range(1, q)]
            out[f"r{q}.back_open"] = [[row.slot * (q - 1) + min((pos - d) % q, q - 2) for row, pos, _, _ in rows]
                                      for d in range(1, q)]
    return out


def test_step_tables_follow_their_rule_on_random_buckets():
    """Random buckets (1-16 rows of 1-4 sequences: decode rows, verify windows, a first window; ratios 1, 2, 4 and
    128; page tables of 1-9 pages): every table of `StepTables.build` equals the row-by-row rule."""
    import random
    from types import SimpleNamespace

    from dsv41.runtime.kv_pool import SourceLayout
    from dsv41.runtime.layers.attention import Segment
    from dsv41.runtime.step_tables import StepTables

    rng = random.Random(3)
    pool = SimpleNamespace(ring_rows=134, sources={1: SourceLayout(1, 1, 16, True), 2: SourceLayout(2, 2, 8, True),
                                                   3: SourceLayout(3, 4, 8, False), 4: SourceLayout(4, 128, 2, True)})
    for _ in range(60):
        segs, at = [], 0
        for slot in rng.sample(range(8), rng.randint(1, 4)):
            T = rng.randint(1, 4)
            if at + T > 16:
                break
            row = SimpleNamespace(slot=slot, page_ids=rng.sample(range(40), rng.randint(1, 9)))
            segs.append(Segment(SimpleNamespace(row=row), at, T, rng.choice([0, 3, rng.randint(0, 2000)])))
            at += T
        t = StepTables.build(segs, 16, pool, torch.device("cpu"))
        for name, want in _tables_by_rule(segs, 16, pool).items():
            assert t[name].tolist() == want, name


@pytest.mark.gpu
def test_gpu_in_place_equals_load_and_store(lite_dir):
    need_compiled_cuda()
    res = run(str(lite_dir), "cuda")
    _check(res)
    print("graphs:", res["graphs"])
    assert res["graphs"]["captures"] >= 1 and res["graphs"]["failed"] == 0, res["graphs"]




@pytest.mark.gpu
def test_gpu_tables_queued_without_waiting_arrive_whole():
    """Tables of several steps built back to back with no wait between them (each leaves from its own pinned
    buffer by a non-blocking copy), of varied sizes, each reach the device intact."""
    from types import SimpleNamespace

    from dsv41.runtime.kv_pool import SourceLayout
    from dsv41.runtime.layers.attention import Segment
    from dsv41.runtime.step_tables import StepTables

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: run on a GPU machine (`pytest -m gpu`)")
    pool = SimpleNamespace(ring_rows=20, sources={1: SourceLayout(1, 2, 4, True)})
    a = SimpleNamespace(row=SimpleNamespace(slot=1, page_ids=[3]))
    rng = np.random.default_rng(1)
    built, want = [], []
    for step, width in enumerate((264, 264, 4096, 264, 264)):
        stored = rng.integers(0, 256, (8, 2, width), dtype=np.uint8)
        cpu = StepTables.build([Segment(a, 0, 1, 7 + step)], 8, pool, torch.device("cpu"), inputs={"e": stored})
        built.append(StepTables.build([Segment(a, 0, 1, 7 + step)], 8, pool, torch.device("cuda"),
                                      inputs={"e": stored}))
        want.append(cpu.packed)
    torch.cuda.synchronize()
    for t, packed in zip(built, want):
        assert torch.equal(t.packed.cpu(), packed)


if __name__ == "__main__" and sys.argv[1:2] == ["--interp-worker"]:
    _interp_worker(sys.argv[2])
