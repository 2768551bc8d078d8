"""DSpark on the fast path (runtime/draft_fast.py, the taps in runtime/model.py) against the reference path.

CPU: the kernels run in Triton's interpreter (set before Triton decorates them), so one child process (this file
as a script) runs everything on a slimmed tiny model (3 layers: a ratio-2 and a ratio-1 source, Engram, the taps of
every layer, two draft blocks) and reports; the tests check its parts:
- taps: the fast forward's taps of every row it ran (a prefill chunk on the load-and-store path, decode rows and a
  verify window in place over the pool) within the fast path's logits tolerance of the reference's
  (`Model.hidden`), and the DSpark rings the two forwards leave in their pools: the same positions written, the
  values within that tolerance (fake quantisers off: test_runtime_fast.py's LOGITS_TOL);
- proposals: the fast drafter's pass over the reference's rings == the reference `draft_many`'s: tokens equal where
  the reference's top-2 margin is clear of the kernels' rounding, confidences close; through both drafters' seam
  (`propose`) the same;
- exactness (fake quantisers on, as served): the batched engine over the fast forward with DSpark drafting gives
  the serial run's events bit for bit (tokens, logprobs, top logprobs) at T = 0 and T = 0.7 with a seed, two
  streams batched == the stream alone (drafting on), and a drafter that proposes the serial continuation has
  every draft accepted with the reply unchanged (the verify rows' open-group rollback on the in-place path).
The GPU variant runs the same engine checks on CUDA with the step kernels and graphs (`@pytest.mark.gpu`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from test_runtime_build import _walk, no_dense  # noqa: F401 (a fixture)
from test_runtime_fast import LITE, LOGITS_TOL

# 3 layers (a ratio-2 and a ratio-1 source, Engram), the taps of all three, two draft blocks: the interpreter's
# time goes per layer and block
SLIM = {**LITE, "num_hidden_layers": 3, "num_nextn_predict_layers": 2, "compress_ratios": [0, 2, 1, 0, 0],
        "kv_source_layer_ids": [1, 2], "index_source_layer_ids": [1, 2], "candidate_source_layer_id": 2,
        "engram_layer_ids": [1], "dspark_target_layer_ids": [0, 1, 2]}
STAGES = SLIM["num_nextn_predict_layers"]
PROMPTS = ([0] + [(i * 37) % 500 + 5 for i in range(11)], [0] + [(i * 91) % 500 + 7 for i in range(8)])
MARGIN_MIN = 0.02  # a draft row's top-2 margin / rms below which a token may follow the kernels' rounding
CONF_TOL = 0.02  # confidences (probabilities), fast against reference: the kernels' fp16 rounding
FLAT = "1:0.01"  # a flat step cost: the depth is the cap


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---------------------------------------------------------------------------------------------------- taps, rings
def taps_and_rings(model_dir: str, device: str) -> dict:
    from dsv41.engine.batch import DECODE, PREFILL, VERIFY, Row
    from dsv41.model.loader import load_model
    from dsv41.runtime.build import build_fast_model
    from dsv41.runtime.draft_fast import FastDSpark
    from dsv41.runtime.fast_forward import FastForward, pool_layout
    from dsv41.runtime.kv_pool import pool_for_model
    from dsv41.runtime.pool_forward import PoolForward

    ref = load_model(model_dir, torch.float32, device, fake_quant=False, dspark=True)
    fast = build_fast_model(model_dir, device, torch.float32, fake_quant=False, dspark=True)
    ids = list(PROMPTS[0])
    steps = [(PREFILL, ids[:8]), (DECODE, ids[8:9]), (VERIFY, ids[9:12])]
    pools, recorded = [], []
    stage_rows = FastDSpark.stage_rows

    def recording(self, taps, P, *, n, **kw):
        recorded.append(torch.cat(list(taps), dim=-1)[:n].clone())
        return stage_rows(self, taps, P, n=n, **kw)

    FastDSpark.stage_rows = recording
    try:
        for model, forward in ((ref, PoolForward(ref)), (fast, FastForward(fast))):
            pool = pool_for_model(model if model is ref else pool_layout(fast), num_slots=2, num_pages=2,
                                  page_tokens=16, verify_rows=6)
            pos = 0
            for phase, chunk in steps:
                forward.execute([Row(0, 1, chunk, pos, [1], phase, lookback=ids[:pos])], pool)
                pos += len(chunk)
            pools.append(pool)
    finally:
        FastDSpark.stage_rows = stage_rows
    _, ref_taps = ref.hidden(ref.new_state(), torch.tensor(ids, device=device))
    rings = [[p.stores[("dspark", s)][1].clone() for s in range(STAGES)] for p in pools]
    decoded = [[p.window_codec.decode(r, torch.float32).clone() for r in rs] for p, rs in zip(pools, rings)]
    # the drafts of two sequences from the reference's rings (the same ring tensors for both passes)
    from dsv41.runtime.pool_forward import PoolSequence, decoder_start

    end = len(ids)
    view = PoolSequence(pools[0], Row(0, 1, [], end, [1]), ref.cfg, decoder_start(ref.cfg))
    ring = [view.dspark_window(s).kv for s in range(STAGES)]
    short = [r[-5:] for r in ring]  # a second sequence: a shorter history (other ring lengths in one pass)
    ys, last = [ids[-1], 7], [end - 1, end - 3]
    drafts = {name: m.dspark.draft_many(m, ys, last, [ring, short], [None, None]) for name, m in
              (("ref", ref), ("fast", fast))}
    return {"taps": [torch.cat(recorded), ref_taps], "rings": decoded, "raw_rings": rings,
            "drafts": {k: [(d.tokens, d.logits, d.confidence) for d in v] for k, v in drafts.items()},
            "pool_pass": pool_pass(fast, pools[1], end)}


class HostReads:
    """Counts the calls that read a tensor's values back to the host (`item`, `tolist`, `cpu`, `numpy`, `int()`,
    `float()`, `bool()`, `__index__`) made from dsv41's own code (Triton's interpreter reads its arguments too: not
    counted). On a GPU each is a device->host sync."""

    NAMES = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")

    def __enter__(self):
        import dsv41

        root, self.calls, self.saved = os.path.dirname(dsv41.__file__), [], {}
        for name in self.NAMES:
            original = self.saved[name] = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, _name=name, **k):
                where = sys._getframe(1).f_code.co_filename
                if where.startswith(root):
                    self.calls.append(f"{_name} at {os.path.relpath(where, root)}:{sys._getframe(1).f_lineno}")
                return _original(t, *a, **k)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)


def pool_pass(fast, pool, end: int) -> dict:
    """The drafter's pass over the pool in place (rings gathered from the pool, the chain on the device) against
    the pass as it was (rings read through the views, the reference chain choosing row by row on the host), for a
    greedy and a filtered T > 0 sequence with other ring lengths; and the host reads each makes."""
    from dsv41.engine.batch import Row
    from dsv41.runtime.draft_chain import KeyedChoice
    from dsv41.runtime.draft_fast import FastDSparkDrafter
    from dsv41.runtime.pool_forward import PoolSequence, decoder_start
    from dsv41.runtime.sampling import SamplingParams

    filtered = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.02, seed=5)
    asks = [(Row(0, 1, [], 0, [1]), end - 1, 7, SamplingParams(temperature=0.0), 12, 5),
            (Row(1, 1, [], 0, [1]), end - 4, 9, filtered, 30, 4)]
    rings = [[PoolSequence(pool, Row(r.seq_id, r.slot, [], p + 1, r.page_ids), fast.cfg, decoder_start(fast.cfg))
              .dspark_window(s).kv for s in range(STAGES)] for r, p, *_ in asks]
    with HostReads() as host:
        before = fast.dspark.draft_many(fast, [y for _, _, y, *_ in asks], [p for _, p, *_ in asks], rings,
                                        [lambda lg, i, c=KeyedChoice(prm, s0): c(lg, i) for *_, prm, s0, _ in asks])
        before = [(d.tokens[:k], [float(c) for c in d.confidence[:k]]) for d, (*_, k) in zip(before, asks)]
    with HostReads() as device:
        now = FastDSparkDrafter(fast).propose(pool, asks)
    return {"before": before, "now": now, "host_reads": host.calls, "device_reads": device.calls}


# ---------------------------------------------------------------------------------------------------- engine
def requests(max_tokens: int, streams: int = 2):
    """T = 0 and T = 0.7 (seeded) streams, logprobs asked; more streams: other prompts, depths capped apart."""
    from dsv41.engine import GenerationRequest, SamplingParams

    more = [[0] + [(i * 53 + 3) % 500 + 5 for i in range(13)], [0] + [(i * 29 + 1) % 500 + 9 for i in range(10)]]
    out = [GenerationRequest(list(PROMPTS[0]), max_tokens, SamplingParams(temperature=0.0), logprobs=2),
           GenerationRequest(list(PROMPTS[1]), max_tokens, SamplingParams(temperature=0.7, seed=3), logprobs=1),
           GenerationRequest(more[0], max_tokens, SamplingParams(temperature=0.7, seed=11, top_p=0.9), draft=2),
           GenerationRequest(more[1], max_tokens, SamplingParams(temperature=0.0), logprobs=0, draft=3)]
    return out[:streams]


def run_engine(model, reqs, continuations=None, **opts):
    """Every request added at once over the fast forward; steps until done. Returns (events, drafting stats).
    `continuations` (per request, prompt + serial reply): the drafter proposes them (`ScriptedDrafter`)."""
    from dsv41.compose.build import build_engine, engine_defaults

    engine = build_engine(engine_defaults(forward="fast", draft_cost=FLAT, sessions="off", **opts), model,
                          max_model_len=64, log=lambda line: None)
    core = engine.core
    events = [[] for _ in reqs]
    seqs = [engine.make_sequence(r, events[i].append) for i, r in enumerate(reqs)]
    if continuations is not None:
        core.executor.runner.drafter = ScriptedDrafter({s.seq_id: c for s, c in zip(seqs, continuations)})
    for s in seqs:
        core.add(s)
    while core.has_work():
        core.step()
    assert core.pool_idle()
    return events, core.stats()["drafting"]


class ScriptedDrafter:
    """Proposes the serial continuation at every position (every draft accepted)."""

    def __init__(self, continuation: dict[int, list[int]]):
        self.continuation = continuation

    def propose(self, pool, asks):
        out = []
        for row, last, y, _, _, n in asks:
            ids = self.continuation[row.seq_id][last + 2:last + 2 + n]
            out.append((ids, [1.0] * len(ids)))
        return out


def engine_runs(model_dir: str, device: str, max_tokens: int, streams: int = 2, alone: bool = False) -> dict:
    """Serial (drafting off) and DSpark-drafted runs of `streams` streams together, and the seeded stream alone
    with every draft the serial continuation (and with `alone`, alone with DSpark drafts too)."""
    from dsv41.engine import TokenEvent
    from dsv41.runtime.build import build_fast_model

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    fast = build_fast_model(model_dir, device, dtype, dspark=True)  # fake quantisers on, as served
    reqs = requests(max_tokens, streams)
    serial, _ = run_engine(fast, reqs, draft_depth=0)
    drafted, stats = run_engine(fast, reqs, draft_dspark="on")
    continuations = [list(r.prompt_ids) + [e.token_id for e in ev if isinstance(e, TokenEvent)]
                     for r, ev in zip(reqs, serial)]
    # the seeded stream alone, every draft the serial continuation: accepted drafts and batched == alone
    forced, forced_stats = run_engine(fast, reqs[1:], continuations[1:], draft_dspark="on")
    out = {"serial": serial, "drafted": drafted, "forced": forced, "stats": stats, "forced_stats": forced_stats}
    if alone:
        out["alone"] = run_engine(fast, reqs[1:2], draft_dspark="on")[0]
    # the pieces the last run captured (CUDA): the drafter's pass as one graph among them
    out["pieces"] = sorted({key[0] for key in fast.graphs._pieces}) if fast.graphs is not None else []
    return out


def check_engine(res: dict) -> None:
    dspark = res["stats"]["dspark"]
    print(f"drafting: {dspark}; forced: {res['forced_stats']['dspark']}")
    assert res["drafted"] == res["serial"]  # tokens, logprobs, top logprobs, finish
    assert res["forced"][0] == res["serial"][1]  # alone, its drafts all accepted == among the others, serial
    if "alone" in res:
        assert res["alone"][0] == res["serial"][1]
    assert dspark["num_draft_tokens"] > 0
    forced = res["forced_stats"]["dspark"]
    assert forced["num_draft_tokens"] > 0 and forced["num_accepted_tokens"] == forced["num_draft_tokens"]


# ---------------------------------------------------------------------------------------------------- the tests
def test_build_holds_the_drafter_in_stored_form(tiny_model_dir, no_dense):
    """`build_fast_model(dspark=True)`: the draft blocks as FastBlocks (their own expert count and top-k, the routed
    experts stacked), main_proj a fast linear, every EXL3 byte of the checkpoint held as stored and no dense copy;
    by default the drafter's tensors are accepted and nothing of it is built."""
    from dsv41.runtime.build import build_fast_model
    from dsv41.runtime.draft_fast import FastDSpark
    from dsv41.runtime.layers.linear import Exl3Linear
    from dsv41.runtime.layers.moe import StackedExperts
    from dsv41.weights import Checkpoint

    model = build_fast_model(tiny_model_dir, "cpu", torch.float32, dspark=True)
    cfg, d = model.cfg, model.dspark
    assert isinstance(d, FastDSpark) and len(d.blocks) == cfg.n_dspark
    assert [b.index for b in d.blocks] == [cfg.num_hidden_layers + s for s in range(cfg.n_dspark)]
    for b in d.blocks:
        assert isinstance(b.moe.experts, StackedExperts) and b.moe.topk == cfg.dspark_num_experts_per_tok
        assert b.moe.experts.w1.experts == cfg.dspark_n_routed_experts
    assert isinstance(d.main_proj, Exl3Linear)
    held = sum(o.nbytes for o in _walk(model) if isinstance(o, (Exl3Linear, StackedExperts)))
    ckpt = Checkpoint(tiny_model_dir)
    assert held == sum(ckpt.info(n).nbytes for n in ckpt.names() if n.rsplit(".", 1)[-1] in ("trellis", "suh", "svh"))
    assert build_fast_model(tiny_model_dir, "cpu", torch.float32).dspark is None


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    from dsv41.tiny.model import make_tiny

    tmp = tmp_path_factory.mktemp("fast-dspark")
    model = make_tiny(tmp / "model", "exl3", seed=0, overrides=SLIM)
    out = tmp / "out.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, __file__, json.dumps({"model": str(model), "out": str(out)})], env=env,
                   check=True, timeout=900)
    return torch.load(out, weights_only=False)


def test_fast_taps_and_rings_match_the_reference(interpreted):
    fast_taps, ref_taps = interpreted["taps"]
    assert fast_taps.shape == ref_taps.shape  # every row of every phase tapped once
    err = rel_l2(fast_taps, ref_taps)
    print(f"taps rel. L2 {err:.2e}")
    assert err <= LOGITS_TOL
    (ref_rings, fast_rings), (ref_raw, fast_raw) = interpreted["rings"], interpreted["raw_rings"]
    for s, (a, b, ra, rb) in enumerate(zip(ref_rings, fast_rings, ref_raw, fast_raw)):
        written_ref, written_fast = ra.flatten(1).any(dim=1), rb.flatten(1).any(dim=1)
        assert torch.equal(written_ref, written_fast), s  # the same ring rows (positions 0..11 of 22)
        assert int(written_ref.sum()) == len(PROMPTS[0])
        print(f"stage {s} ring rel. L2 {rel_l2(b, a):.2e}")
        assert rel_l2(b, a) <= LOGITS_TOL


def test_fast_drafts_match_the_reference_drafts(interpreted):
    d = interpreted["drafts"]
    checked = 0
    for (rt, rl, rc), (ft, fl, fc) in zip(d["ref"], d["fast"]):
        assert rel_l2(fl, rl) <= LOGITS_TOL
        assert float((fc - rc).abs().max()) <= CONF_TOL
        for i in range(len(rt)):
            top = rl[i].double().topk(2).values
            if float((top[0] - top[1]) / rl[i].double().pow(2).mean().sqrt()) < MARGIN_MIN:
                break  # a near tie: the chain after it may follow the rounding
            assert ft[i] == rt[i], (i, ft, rt)
            checked += 1
    assert checked >= 4, "too few clear draft rows to compare: pick other prompts"


def test_the_pass_over_the_pool_drafts_as_before_with_one_host_read(interpreted):
    """The drafter's pass (rings gathered in place, the chain on the device) == the pass as it was (the views'
    rings, the reference chain) bit for bit, greedy and filtered T > 0; it reads the host once, where the reference
    chain reads it once a drafted row at least."""
    got = interpreted["pool_pass"]
    print(f"host reads: as before {len(got['host_reads'])}, over the pool {got['device_reads']}")
    assert got["now"] == got["before"]
    assert [len(t) for t, _ in got["now"]] == [5, 4]
    assert len(got["device_reads"]) == 1, got["device_reads"]
    assert len(got["host_reads"]) >= 9  # the counter sees a read per drafted row


def test_fast_drafted_equals_serial_bitwise(interpreted):
    check_engine(interpreted["engine"])


@pytest.mark.gpu
def test_fast_drafted_equals_serial_bitwise_gpu(tiny_model_dir):
    """CUDA: the step kernels, the in-place step's graphs and the drafter's pass as one graph (runtime/draft_fast.py
    `pool_pass`), four streams at different depths; the trained tiny model's DSpark blocks (the acceptance it gets
    is printed)."""
    res = engine_runs(str(tiny_model_dir), "cuda", max_tokens=32, streams=4, alone=True)
    check_engine(res)
    assert any(name.startswith("dspark.draft.") for name in res["pieces"]), res["pieces"]


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    res = taps_and_rings(a["model"], "cpu")
    res["engine"] = engine_runs(a["model"], "cpu", max_tokens=3)
    torch.save(res, a["out"])
