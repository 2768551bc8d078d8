"""CED bounded replay (`--prefill replay`, MODEL.md §11) on the fast path against the reference pool forward.

The fast path (`FastForward` over `FastModel`, `FastModel._replay_cut`) runs a prompt's rows before its replay
segment through the encoder layers and the first decoder layer's compressor only, as `PoolForward` does. CPU: the
FP8 release layout of the slimmed tiny model (test_runtime_fast.py's LITE: 6 layers, the first decoder layer 3,
window 16) takes the dequant path, the reference's own math, so the fast path's replay logits match the pool
forward's far inside the EXL3 tolerance (test_runtime_fast.py's `test_fp8_release_layout_takes_the_dequant_path`
bound, 1e-4 relative L2; measured ~1e-6); chunked == one-shot holds to the CPU BLAS's row blocking there (the bits
are the GPU test's claim). The engine over `--forward fast --prefill replay` needs the interpreter (serving_forward),
so it runs in a child process (this file as a script) and reports JSON: its greedy tokens are the reference
engine's under replay and its replies carry the tag. GPU: chunked == one-shot bitwise at the full shape.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PARITY_TOL = 1e-4  # the FP8 dequant path against the reference (test_runtime_fast.py), measured ~1e-6
CHUNK_TOL = 1e-5  # CPU chunked against one-shot: BLAS's row blocking only (measured ~1e-6)
IDS = [0] + [(i * 37 + 11) % 500 + 5 for i in range(44)]  # 45 tokens: the replay segment starts at 29


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    from dsv41.tiny.model import make_tiny
    from test_runtime_fast import LITE

    return make_tiny(tmp_path_factory.mktemp("fp8") / "model", "fp8", seed=1, overrides=LITE)


@pytest.fixture(scope="module")
def models(fp8_dir):
    from dsv41.model.loader import load_model
    from dsv41.runtime.build import build_fast_model

    ref = load_model(fp8_dir, torch.float32, "cpu", fake_quant=False, dspark=False)
    return ref, build_fast_model(fp8_dir, "cpu", torch.float32, fake_quant=False)


def prefill_and_decode(forward, layout, prompts: list[list[int]], chunks: list[int], replay: bool = True):
    """Each prompt in one pool slot of its own, all in the same steps: chunks of `chunks` rows (every sequence the
    same cut), then two decode steps. Returns each sequence's logits of its replay segment's rows and the decode
    rows, concatenated (a sequence's first rows before its replay segment ask for none)."""
    from dsv41.engine.batch import Row
    from dsv41.runtime.kv_pool import pool_for_model

    W = layout.cfg.sliding_window
    pool = pool_for_model(layout, num_slots=len(prompts), num_pages=len(prompts), page_tokens=128)
    pos, out = [0] * len(prompts), [[] for _ in prompts]
    for n in chunks + [1, 1]:
        rows = []
        for s, ids in enumerate(prompts):
            at = pos[s]
            toks = ids[at:at + n] if at < len(ids) else [5]
            scores = [(j, 0, 0) for j in range(len(toks)) if at + j >= len(ids) - W]
            rows.append(Row(s, s, toks, at, [s], "prefill" if at < len(ids) else "decode",
                            (ids + [5])[max(0, at - 3):at], None, scores, max(0, len(ids) - W) if replay else 0))
            pos[s] += len(toks)
        for s, logits in enumerate(forward.execute(rows, pool)):
            out[s] += [logits] if logits is not None and logits.numel() else []
    return [torch.cat(o) for o in out]


def test_fast_replay_matches_the_pool_forward_chunked_and_batched(models):
    """One-shot and chunked (cuts across the replay segment's start, a chunk wholly before it), alone and beside a
    second sequence (shorter prompt, its own replay start): the fast path's logits of the replay segment and the
    decode rows after it are the pool forward's; replay really skips work (its logits are not full prefill's)."""
    from dsv41.runtime.fast_forward import FastForward, pool_layout
    from dsv41.runtime.pool_forward import PoolForward

    ref, fast = models
    layout = pool_layout(fast)
    W = fast.cfg.sliding_window
    want = prefill_and_decode(PoolForward(ref, replay=True), ref, [IDS], [len(IDS)])[0]
    got = prefill_and_decode(FastForward(fast), layout, [IDS], [len(IDS)])[0]
    assert got.shape[0] == want.shape[0] == W + 2
    assert rel_l2(got, want) <= PARITY_TOL
    full = prefill_and_decode(FastForward(fast), layout, [IDS], [len(IDS)], replay=False)[0]
    assert rel_l2(full, got) > 1e-2  # the decoder layers saw only the replay segment
    for cut in ([7] * 7, [3, 30, 9, 3]):
        assert rel_l2(prefill_and_decode(FastForward(fast), layout, [IDS], cut)[0], got) <= CHUNK_TOL
    other = IDS[5:38]
    pair = prefill_and_decode(FastForward(fast), layout, [IDS, other], [20, 25])
    assert rel_l2(pair[0], got) <= CHUNK_TOL
    ref_other = prefill_and_decode(PoolForward(ref, replay=True), ref, [other], [len(other)])[0]
    assert rel_l2(pair[1], ref_other) <= PARITY_TOL


def test_fast_replay_refuses_logits_of_rows_it_leaves_out(models):
    from dsv41.engine.batch import Row
    from dsv41.runtime.fast_forward import FastForward, pool_layout
    from dsv41.runtime.kv_pool import pool_for_model

    _, fast = models
    pool = pool_for_model(pool_layout(fast), num_slots=1, num_pages=1, page_tokens=128)
    row = Row(0, 0, IDS, 0, [0], "prefill", [], None, [(3, 0, 0)], len(IDS) - fast.cfg.sliding_window)
    with pytest.raises(ValueError, match="replay leaves out"):
        FastForward(fast).execute([row], pool)


# ---------------------------------------------------------------------------------------------------------------
# the engine over --forward fast --prefill replay (interpreter: child process)
# ---------------------------------------------------------------------------------------------------------------


def engine_replies(model, forward: str, prompts, **opts) -> list[tuple[list[int], str]]:
    """Greedy tokens and the finish tag of each prompt through one batched engine (`prefill="replay"`)."""
    from dsv41.compose.build import build_engine, engine_defaults
    from dsv41.engine import FinishEvent, GenerationRequest, SamplingParams, TokenEvent

    engine = build_engine(engine_defaults(forward=forward, prefill="replay", prefill_chunk=12,
                                          prefill_chunk_alone=0, **opts), model,
                          max_model_len=128, log=lambda line: None)
    events = [[] for _ in prompts]
    for i, ids in enumerate(prompts):
        engine.core.add(engine.make_sequence(GenerationRequest(list(ids), 2, SamplingParams(temperature=0.0)),
                                             events[i].append))
    while engine.core.step() or engine.core.has_work():
        pass
    assert engine.core.pool_idle()
    return [([e.token_id for e in ev if isinstance(e, TokenEvent)],
             next(e.tag for e in ev if isinstance(e, FinishEvent))) for ev in events]


def engine_run(model_dir: str) -> dict:
    from dsv41.model.loader import load_model
    from dsv41.runtime.build import build_fast_model

    prompts = [IDS[:34], IDS[:10]]  # past the window (12-row chunks: one before the replay start, one across), in
    ref = load_model(model_dir, torch.float32, "cpu", fake_quant=False, dspark=False)
    fast = build_fast_model(model_dir, "cpu", torch.float32, fake_quant=False)
    return {"reference": engine_replies(ref, "reference", prompts), "fast": engine_replies(fast, "fast", prompts)}


def test_fast_engine_replay_replies_are_the_reference_engines_and_tagged(fp8_dir, tmp_path):
    out = tmp_path / "engine.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, __file__, json.dumps({"model": str(fp8_dir), "out": str(out)})], env=env,
                   check=True, timeout=600)
    res = json.loads(out.read_text())
    print(f"fast replay engine: {res}")
    assert res["fast"] == res["reference"]
    assert all(tag == "prefill=replay" and len(tokens) == 2 for tokens, tag in res["fast"])


# ---------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_full_shape_replay_prefill_chunked_is_one_shot_bitwise():
    """The full-shape synthetic rank (21 layers: the first decoder layer 20 is the last), a 4K prompt under replay in
    1K chunks and in 512-row chunks cut at an odd row: the replay segment's logits are the same bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the full-shape synthetic rank)")
    from dsv41.runtime.synthetic import synthetic_rank
    from test_runtime_prefill_chunks import _HalfOfTwo, _bits

    model = synthetic_rank(None, rank=0, world=2, device="cuda", dtype=torch.bfloat16, comm=_HalfOfTwo(), layers=21)
    n, W = 4096, model.cfg.sliding_window
    ids = torch.randint(0, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(4))

    def run(cuts: list[int]):
        st, out, a = model.new_state(), [], 0
        for c in cuts:
            out.append(model.forward([(st, ids[a:a + c])], "prefill", logits="all", replay_from=[n - W]).cpu())
            a += c
        assert a == n
        return torch.cat(out)

    one = run([1024] * 4)
    assert one.shape[0] == W
    assert torch.equal(_bits(run([511] + [512] * 7 + [1])), _bits(one))


if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    Path(cfg["out"]).write_text(json.dumps(engine_run(cfg["model"])))
