"""The decode graphs captured before serving (FastForward.capture_graphs, ENGINE.md §5; issue 16 item 6), and
the row buckets.

The plan (`boot_plan`: page buckets from the smallest up, every row count within each), the time budget
(`DSV41_GRAPHS_BOOT_S`; checked with a counting clock, not the machine's), the whole plan at TP > 1, nothing on a
device without graphs, and what matters most: the scratch steps write nothing, so the pool a server then serves
from is exactly as it was (CPU: the step's kernels in Triton's interpreter, in a child process). Beside it, the row
buckets a step runs: the rule, a step of nine rows run as its 12-row bucket, and rows padded to a bucket giving
every logit and pool byte of the unpadded step (interpreter).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from dsv41.runtime.fast_forward import FastForward, boot_plan
from dsv41.runtime.model import ROW_BUCKETS, STEP_ROWS, row_bucket
from dsv41.runtime.graphs import GraphStats, env_boot_budget
from step_harness import interpreted

PAGE_TOKENS = 8


def test_boot_plan_takes_short_contexts_first():
    assert boot_plan(3, 1) == [(1, 1), (1, 2), (1, 3)]
    assert boot_plan(2, 5) == [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2), (8, 1), (8, 2)]
    assert [p for p, _ in boot_plan(1, 1172)] == [1 << i for i in range(12)]  # 300K positions of 256-token pages
    assert [n for _, n in boot_plan(10, 1)] == [1, 2, 3, 4, 5, 6, 7, 8, 12]  # row buckets, up to the one of 10
    assert [n for _, n in boot_plan(16, 1)] == [1, 2, 3, 4, 5, 6, 7, 8, 12, 16]
    assert [n for _, n in boot_plan(32, 1)] == list(ROW_BUCKETS)
    with pytest.raises(ValueError, match=">= 1"):
        boot_plan(0, 4)


def test_row_buckets():
    assert [row_bucket(n) for n in range(1, 17)] == [1, 2, 3, 4, 5, 6, 7, 8, 12, 12, 12, 12, 16, 16, 16, 16]
    assert [row_bucket(n) for n in (17, 24, 25, 32)] == [24, 24, 32, 32]
    assert ROW_BUCKETS[-1] == STEP_ROWS == 32
    with pytest.raises(ValueError, match="at most 32"):
        row_bucket(33)


def test_boot_budget_knob():
    assert env_boot_budget({}) == 15.0
    assert env_boot_budget({"DSV41_GRAPHS_BOOT_S": "0"}) == 0.0
    assert env_boot_budget({"DSV41_GRAPHS_BOOT_S": " 2.5 "}) == 2.5
    with pytest.raises(ValueError, match="DSV41_GRAPHS_BOOT_S"):
        env_boot_budget({"DSV41_GRAPHS_BOOT_S": "-1"})


class _Recorder:
    """Graphs that record each step they are asked to capture (phase, rows, page bucket) and run nothing."""

    active = True

    def __init__(self, vocab: int):
        self.vocab, self.keys, self.tables, self.stats = vocab, [], [], GraphStats()

    def run(self, name, phase, n, fn, *args, warmup=None):
        tables = fn.args[4]  # partial(FastModel._pool_step, sites, n, phase, pool, tables)
        self.keys.append((name, phase, n, tables.pages_bucket, tables.B))
        self.tables.append(tables)
        self.stats.captures += 1
        return torch.zeros(n, self.vocab)


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t


@pytest.fixture(scope="module")
def lite(tmp_path_factory):
    from dsv41.runtime.build import build_fast_model
    from dsv41.runtime.fast_forward import pool_layout
    from dsv41.runtime.kv_pool import pool_for_model
    from dsv41.tiny.model import make_tiny
    from test_runtime_fast import LITE

    model = build_fast_model(make_tiny(tmp_path_factory.mktemp("lite") / "model", "exl3", seed=0, overrides=LITE),
                             "cpu", torch.float32)
    pool = pool_for_model(pool_layout(model), num_slots=3, num_pages=8, page_tokens=PAGE_TOKENS, device="cpu")
    return model, pool


def test_capture_follows_the_plan_within_the_budget(lite, monkeypatch):
    model, pool = lite
    monkeypatch.setattr(model, "pool_runs", lambda phase, trace=None: True)
    recorder = _Recorder(model.vocab_end - model.vocab_start)
    monkeypatch.setattr(model, "graphs", recorder)
    ff = FastForward(model)
    # 3 pages of 8 positions: page buckets 1, 2, 4; row buckets 1..5
    done = ff.capture_graphs(pool, max_rows=5, max_len=3 * PAGE_TOKENS, budget_s=1e9, clock=_Clock())
    plan = boot_plan(5, 3)
    assert done["planned"] == len(plan) == 15 and done["run"] == 15 and done["captured"] == 15
    assert recorder.keys == [("step", "decode", n, P, n) for P, n in plan]
    # the clock ticks once at the start and once before each step (1, 2, 3 ticks gone): a budget of 2.5 runs two
    recorder.keys.clear()
    done = ff.capture_graphs(pool, max_rows=5, max_len=3 * PAGE_TOKENS, budget_s=2.5, clock=_Clock())
    assert done["run"] == 2 and recorder.keys == [("step", "decode", n, P, n) for P, n in plan[:2]]
    # at TP > 1 the ranks run the whole plan whatever their clocks say
    recorder.keys.clear()
    monkeypatch.setattr(model, "comm", SimpleNamespace(world=2, gather_cat=lambda x, dim: x))
    done = ff.capture_graphs(pool, max_rows=1, max_len=2 * PAGE_TOKENS, budget_s=0.5, clock=_Clock())
    assert done["run"] == 2 and [k[3] for k in recorder.keys] == [1, 2]


def test_a_step_runs_its_row_bucket(lite, monkeypatch):
    """Nine decode rows run as the 12-row bucket's step (its graph), the tables holding the nine real rows (the
    rest mirror row 0 and write nothing), and the forward returns the nine rows' logits."""
    from dsv41.engine.batch import DECODE, Row

    model, pool = lite
    monkeypatch.setattr(model, "pool_runs", lambda phase, trace=None: True)
    recorder = _Recorder(model.vocab_end - model.vocab_start)
    monkeypatch.setattr(model, "graphs", recorder)
    rows = [Row(i, i % pool.num_slots, [5 + i], 3, [i % pool.num_pages], phase=DECODE, scores=[(0, 0, 0)])
            for i in range(9)]
    out = FastForward(model).execute(rows, pool)
    assert [k[2] for k in recorder.keys] == [12] and recorder.tables[0].n == 9
    assert recorder.tables[0].B == 12 and recorder.tables[0].ring_dest.tolist()[9:] == [-1] * 3
    assert len(out) == 9 and all(o.shape == (1, model.vocab_end - model.vocab_start) for o in out)


@pytest.mark.parametrize("count,steps", [(20, [(24, 20)]), (40, [(32, 32), (8, 8)])])
def test_rows_past_sixteen_run_as_one_step_over_the_pool(lite, monkeypatch, count, steps):
    """Over the pool a step holds up to STEP_ROWS rows: 20 decode rows are one 24-row step, 40 are a 32-row step
    and an 8-row one (the forward without a pool keeps its fixed 16-row bucket)."""
    from dsv41.engine.batch import DECODE, Row

    model, pool = lite
    monkeypatch.setattr(model, "pool_runs", lambda phase, trace=None: True)
    recorder = _Recorder(model.vocab_end - model.vocab_start)
    monkeypatch.setattr(model, "graphs", recorder)
    rows = [Row(i, i % pool.num_slots, [5 + i % 7], 3, [i % pool.num_pages], phase=DECODE, scores=[(0, 0, 0)])
            for i in range(count)]
    out = FastForward(model).execute(rows, pool)
    assert [(k[2], t.n) for k, t in zip(recorder.keys, recorder.tables)] == steps
    assert all(k[4] == k[2] for k in recorder.keys)  # the tables hold the bucket's rows
    assert len(out) == count and all(o.shape == (1, model.vocab_end - model.vocab_start) for o in out)


def test_nothing_is_captured_without_graphs_or_budget(lite, monkeypatch):
    model, pool = lite
    monkeypatch.setattr(model, "graphs", None)
    done = FastForward(model).capture_graphs(pool, max_rows=2, max_len=16, budget_s=10)
    assert done == {"captured": 0, "planned": 0, "run": 0, "seconds": 0.0}  # the CPU: graphs are not active
    assert model.graphs is not None and not model.graphs.active
    monkeypatch.setattr(model, "graphs", _Recorder(1))
    monkeypatch.setattr(model, "pool_runs", lambda phase, trace=None: True)
    assert FastForward(model).capture_graphs(pool, max_rows=2, max_len=16, budget_s=0)["planned"] == 0


def _interp_worker(out_path: str, model_dir: str) -> None:
    """Both interpreted checks of this file in one child (one interpreter start and one model build): the padded
    bucket's (`_bucket_worker`) and the boot capture's scratch steps (`_scratch_worker`)."""
    from dsv41.runtime.build import build_fast_model

    torch.set_num_threads(1)
    model = build_fast_model(model_dir, "cpu", torch.float32, fake_quant=True)
    bucket, pool = _bucket_worker(model)
    torch.save({"bucket": bucket, "boot": _scratch_worker(model, pool)}, out_path)


def _scratch_worker(model, pool) -> dict:
    """On the bucket check's pool (three prefilled and decoded sequences: the scratch rows, slot 0 pages 0-1, sit
    on sequence 0's written slot and pages), the boot capture's scratch steps run for real (the step's function,
    eagerly, in the interpreter): the pool's bytes before and after, and the logits' shapes."""
    before = pool.buffer.clone()
    ran, shapes = [], []

    class Eager:
        active = True
        stats = GraphStats()

        def run(self, name, phase, n, fn, *args, warmup=None):
            out = fn(*args)
            ran.append((phase, n, fn.args[4].pages_bucket))
            shapes.append(tuple(out.shape))
            return out

    graphs, model.graphs = model.graphs, Eager()
    try:
        FastForward(model).capture_graphs(pool, max_rows=1, max_len=2 * PAGE_TOKENS, budget_s=1e9)
    finally:
        model.graphs = graphs
    return {"before": before, "after": pool.buffer.clone(), "ran": ran, "shapes": shapes}


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    """The child's results for both interpreted tests (one run: `_interp_worker`), on the 3-layer model of
    test_runtime_fast_dspark.py: a window layer, a ratio-2 and a ratio-1 source, so every kind of pool store (window
    rows, entries, index keys, open groups) a padded row or a scratch step could write is there; LITE's three more
    layers are readers of a source's stores or write stores of these kinds (the GPU tests run LITE)."""
    from dsv41.tiny.model import make_tiny
    from test_runtime_fast_dspark import SLIM

    model_dir = make_tiny(tmp_path_factory.mktemp("slim_boot") / "model", "exl3", seed=0, overrides=SLIM)
    return interpreted(tmp_path_factory, __file__, "boot_graphs", timeout=900, extra_args=[str(model_dir)])


def test_interpreted_scratch_steps_leave_the_pool_as_it_was(lite, interp):
    res = interp["boot"]
    assert res["ran"] == [("decode", 1, 1), ("decode", 1, 2)]
    vocab = lite[0].vocab_end - lite[0].vocab_start
    assert res["shapes"] == [(1, vocab)] * 2
    assert torch.any(res["before"] != 0)  # the prefill wrote the pool: the check below can see a write
    assert torch.equal(res["before"], res["after"])


@pytest.mark.gpu
def test_gpu_boot_capture_leaves_the_pool_and_replays(tmp_path_factory):
    """On the GPU: the plan's graphs are captured (real PieceGraphs), the pool is untouched, and a served decode
    step afterwards replays a boot graph (no new capture)."""
    from step_harness import need_compiled_cuda

    need_compiled_cuda()
    from dsv41.engine.batch import DECODE, PREFILL, Row
    from dsv41.runtime.build import build_fast_model
    from dsv41.runtime.fast_forward import pool_layout
    from dsv41.runtime.kv_pool import pool_for_model
    from dsv41.tiny.model import make_tiny
    from test_runtime_fast import LITE

    model = build_fast_model(make_tiny(tmp_path_factory.mktemp("lite_gpu") / "model", "exl3", seed=0,
                                       overrides=LITE), "cuda", torch.float32)
    pool = pool_for_model(pool_layout(model), num_slots=2, num_pages=4, page_tokens=PAGE_TOKENS, device="cuda")
    prompt = [0] + [(i * 37) % 500 + 5 for i in range(12)]
    FastForward(model, in_place=False).execute([Row(0, 1, prompt, 0, [2, 0], phase=PREFILL)], pool)
    before = pool.buffer.clone()
    done = FastForward(model).capture_graphs(pool, max_rows=2, max_len=2 * PAGE_TOKENS, budget_s=1e9)
    assert done["run"] == done["planned"] == 4 and done["captured"] == 4, done
    assert torch.equal(pool.buffer, before)
    captures = model.graphs.stats.captures
    FastForward(model).execute([Row(0, 1, [7], len(prompt), [2, 0], phase=DECODE, scores=[(0, 0, 0)])], pool)
    assert model.graphs.stats.captures == captures and not torch.equal(pool.buffer, before)


def _bucket_worker(model) -> tuple:
    """Three decode rows in place, run padded to a bucket of five (`row_bucket` patched: the real buckets pad from
    nine rows up, which the interpreter runs too slowly for the suite) and unpadded, each from the same pool: the
    logits and the pool's bytes after each; and the pool (`_scratch_worker` runs on it next)."""
    from dsv41.engine.batch import DECODE, PREFILL, Row
    from dsv41.runtime import model as model_mod
    from dsv41.runtime.fast_forward import pool_layout
    from dsv41.runtime.kv_pool import pool_for_model

    pool = pool_for_model(pool_layout(model), num_slots=3, num_pages=6, page_tokens=PAGE_TOKENS, device="cpu")
    prompts = [[0] + [(i * (31 + 2 * s)) % 500 + 5 for i in range(6 + 3 * s)] for s in range(3)]
    FastForward(model, in_place=False).execute([Row(s, s, p, 0, [2 * s, 2 * s + 1], phase=PREFILL)
                                                for s, p in enumerate(prompts)], pool)
    start = pool.buffer.clone()
    rows = [Row(s, s, [7 + s], len(p), [2 * s, 2 * s + 1], phase=DECODE, scores=[(0, 0, 0)],
                lookback=p[-3:]) for s, p in enumerate(prompts)]
    out, row_bucket = {"start": start}, model_mod.row_bucket
    try:
        for name, bucket in (("padded", lambda n: 5), ("exact", lambda n: n)):
            pool.buffer.copy_(start)
            model_mod.row_bucket = bucket
            logits = FastForward(model).execute(rows, pool)
            out[name] = {"logits": [t.clone() for t in logits], "pool": pool.buffer.clone()}
    finally:
        model_mod.row_bucket = row_bucket
    return out, pool


def test_interpreted_a_padded_bucket_gives_the_rows_their_own_bits(interp):
    """Rows run in a bucket larger than their count (the rows past them mirroring row 0, writing nothing) give
    every row's logits and every pool byte of the unpadded step bit for bit."""
    res = interp["bucket"]
    a, b = res["padded"], res["exact"]
    assert len(a["logits"]) == 3
    for u, v in zip(a["logits"], b["logits"]):
        assert torch.equal(u.view(torch.int32), v.view(torch.int32))
    assert not torch.equal(a["pool"], res["start"])  # the step wrote the pool
    assert torch.equal(a["pool"], b["pool"])


@pytest.mark.gpu
@pytest.mark.parametrize("count", [20, 32])
def test_gpu_rows_of_the_large_buckets_keep_their_bits_alone(tmp_path_factory, count):
    """On the GPU, graphs on: `count` decode rows over the pool in one step (the 24- and 32-row buckets: the MoE
    runs them as 16-row windows) give every row the logits of its step alone, and the pool the bytes of the rows'
    steps one by one."""
    from step_harness import need_compiled_cuda

    need_compiled_cuda()
    from dsv41.engine.batch import DECODE, PREFILL, Row
    from dsv41.runtime.build import build_fast_model
    from dsv41.runtime.fast_forward import pool_layout
    from dsv41.runtime.kv_pool import pool_for_model
    from dsv41.tiny.model import make_tiny
    from test_runtime_fast import LITE

    model = build_fast_model(make_tiny(tmp_path_factory.mktemp(f"lite_rows{count}") / "model", "exl3", seed=0,
                                       overrides=LITE), "cuda", torch.float32, fake_quant=True)
    pool = pool_for_model(pool_layout(model), num_slots=count, num_pages=2 * count, page_tokens=PAGE_TOKENS,
                          device="cuda")
    prompts = [[0] + [(i * (31 + 2 * s)) % 500 + 5 for i in range(4 + s % 9)] for s in range(count)]
    FastForward(model, in_place=False).execute([Row(s, s, p, 0, [2 * s, 2 * s + 1], phase=PREFILL)
                                                for s, p in enumerate(prompts)], pool)
    start = pool.buffer.clone()
    rows = [Row(s, s, [7 + s], len(p), [2 * s, 2 * s + 1], phase=DECODE, scores=[(0, 0, 0)],
                lookback=p[-3:]) for s, p in enumerate(prompts)]
    alone = [FastForward(model).execute([r], pool)[0].clone() for r in rows]
    after_alone = pool.buffer.clone()
    pool.buffer.copy_(start)
    together = FastForward(model).execute(rows, pool)
    stats = model.graphs.stats
    assert stats.captures >= 2 and stats.failed == 0 and stats.eager == 0, stats.as_dict()  # every step a graph
    for s, (u, v) in enumerate(zip(together, alone)):
        assert torch.equal(u.view(torch.int32), v.view(torch.int32)), f"row {s} of {count}"
    assert not torch.equal(after_alone, start) and torch.equal(pool.buffer, after_alone)


if __name__ == "__main__" and sys.argv[1:2] == ["--interp-worker"]:
    _interp_worker(sys.argv[2], sys.argv[3])
