"""The DSpark draft pass over the pool as CUDA graphs (runtime/draft_fast.py `FastDSpark.pool_pass`), on a GPU:
graph == eager bit for bit for 1 and 4 sequences, draft depths 1..5, greedy and sampled chains; the pass == the
pass through the views' rings (the piecewise path) bit for bit; one device->host sync a pass (torch's sync debug
mode). Drafted == serial with the graphs on is tests/test_runtime_fast_dspark.py's GPU test (the engine drafts
through this pass and the test checks that its graph was captured)."""

from __future__ import annotations

import warnings

import pytest
import torch

PROMPTS = [[0] + [(i * m + 3) % 500 + 5 for i in range(n)] for m, n in ((37, 30), (91, 21), (53, 40), (29, 12))]
CHAINS = {"g": dict(temperature=0.0), "sp": dict(temperature=0.7, top_p=0.9, seed=3),
          "sktp": dict(temperature=1.1, top_k=40, top_p=0.95, min_p=0.02, seed=7)}


@pytest.fixture(scope="module")
def seeded(tiny_model_dir):
    """The tiny model's fast path on CUDA (fake quantisers on, as served) and a pool whose four slots hold the
    prompts' prefill (their DSpark rings seeded by the fast forward)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from dsv41.engine.batch import PREFILL, Row
    from dsv41.runtime.build import build_fast_model
    from dsv41.runtime.fast_forward import FastForward, pool_layout
    from dsv41.runtime.kv_pool import pool_for_model

    fast = build_fast_model(str(tiny_model_dir), "cuda", torch.bfloat16, dspark=True)
    pool = pool_for_model(pool_layout(fast), num_slots=4, num_pages=4, page_tokens=64,
                          verify_rows=fast.cfg.dspark_block_size + 1, device=torch.device("cuda"))
    forward = FastForward(fast)
    for i, ids in enumerate(PROMPTS):
        forward.execute([Row(i, i, ids, 0, [i], PREFILL)], pool)
    return fast, pool


def asks(q: int, depth: int, chain: str):
    from dsv41.engine.batch import Row
    from dsv41.runtime.sampling import SamplingParams

    return [(Row(i, i, [], 0, [i]), len(PROMPTS[i]) - 1, 17 + i, SamplingParams(**CHAINS[chain]), 40 + i, depth)
            for i in range(q)]


@pytest.mark.gpu
def test_the_draft_pass_graph_equals_eager_gpu(seeded):
    from dsv41.runtime.draft_dspark import DSparkDrafter
    from dsv41.runtime.draft_tables import DraftTables

    fast, pool = seeded
    d = fast.dspark
    fast.graphs = None  # a fresh PieceGraphs (graphs on)
    for chain in CHAINS:
        for q in (1, 4):
            for depth in range(1, 6):
                a = asks(q, depth, chain)
                eager = d.pool_pass(fast, pool, DraftTables.build(fast.cfg, pool, a, fast.device), graphs=False)
                eager = eager.clone()
                first = d.pool_pass(fast, pool, DraftTables.build(fast.cfg, pool, a, fast.device)).clone()
                again = d.pool_pass(fast, pool, DraftTables.build(fast.cfg, pool, a, fast.device)).clone()
                assert torch.equal(first, eager) and torch.equal(again, eager), (chain, q, depth)
                # through the drafter's seam, and as the pass through the views' rings and pieces gives them
                got = d.propose_pool(fast, pool, a)
                assert [len(t) for t, _ in got] == [depth] * q
                assert got == DSparkDrafter(fast).propose(pool, a), (chain, q, depth)
    stats = fast.graphs.stats
    names = {key[0] for key in fast.graphs._pieces}
    print(f"graphs: {stats.as_dict()}; draft pieces {sorted(n for n in names if n.startswith('dspark.draft'))}")
    assert stats.failed == 0
    assert {f"dspark.draft.{c}" for c in CHAINS} <= names


@pytest.mark.gpu
def test_the_draft_pass_syncs_once_gpu(seeded):
    """One device->host sync a pass (the ids and confidences read back), replayed and eager: the tables go out
    pinned and asynchronously, the chain chooses on the device."""
    from dsv41.runtime.graphs import PieceGraphs

    fast, pool = seeded
    a = asks(4, 5, "sp")
    fast.graphs = None
    fast.dspark.propose_pool(fast, pool, a)  # captured before the count
    for mode in ("replay", "eager"):
        if mode == "eager":
            fast.graphs = PieceGraphs(fast.device, fast.comm, enabled=False)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fast.dspark.propose_pool(fast, pool, a)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        # the mode's own notice ("... is a prototype feature ...", once per switch-on) names no operation
        syncs = [str(w.message).splitlines()[0] for w in caught
                 if "synchronizing" in str(w.message).lower() and "prototype" not in str(w.message)]
        print(f"{mode}: {len(syncs)} syncs {syncs}")
        assert len(syncs) == 1, (mode, syncs)
    fast.graphs = None


@pytest.mark.gpu
def test_the_draft_graphs_captured_before_serving_gpu(seeded):
    """`FastDSparkDrafter.capture_graphs` (what `build_runner` runs at start): one graph per sequences count and
    boot chain, the pool left as it was (the pass writes nothing), and a served pass of those shapes replays."""
    from dsv41.runtime.draft_fast import BOOT_CHAINS, FastDSparkDrafter

    fast, pool = seeded
    fast.graphs = None
    stores = [t.clone() for t in pool.stores.values()]
    drafter = FastDSparkDrafter(fast)
    boot = drafter.capture_graphs(pool, max_seqs=4, budget_s=600.0)
    print(f"boot: {boot}")
    assert boot["run"] == boot["planned"] == boot["captured"] == 4 * len(BOOT_CHAINS)
    assert all(torch.equal(a, b) for a, b in zip(stores, pool.stores.values()))
    captures = fast.graphs.stats.captures
    for chain in ("g", "sp"):
        for q in (1, 4):
            drafter.propose(pool, asks(q, 5, chain))
    assert fast.graphs.stats.captures == captures  # replays only
    fast.graphs = None
