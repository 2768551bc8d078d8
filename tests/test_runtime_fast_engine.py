"""The batched engine over the fast forward (runtime/fast_forward.py) against the engine over the pool forward.

CPU: the kernels run in Triton's interpreter (set before Triton decorates them), so the fast runs happen in a child
process (this file as a script) on the 3-layer model of test_runtime_fast_dspark.py (a window layer, a ratio-2
source with Engram, a ratio-1 source: what the engine hands the forward is the same at every layer; the layers that
read another's KV are compared to the reference in test_runtime_fast.py), fake quantisers off, and report JSON.
Compared: greedy tokens of two short prompts run together (the second arriving a step later, so one step holds both
phases) on the fast forward == on the pool forward (the reference's top-2 margin at every generated
position is checked to be clear of a near-tie, so the comparison is not at the mercy of the kernels' fp16
rounding), a request's tokens alone == among the others on the fast forward, and its prompt logprobs within
LOGPROB_TOL of the pool forward's. Tokens only for alone == among others: the interpreter's bits follow BLAS's row
blocking (kernels/README.md), not the code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PROMPTS = ([0] + [(i * 37) % 500 + 5 for i in range(9)], [0] + [(i * 91) % 500 + 7 for i in range(6)])
NEW_TOKENS = 3
# the reference's top-2 logit margin at a generated position, relative to the logits' rms: twice the logits
# tolerance of test_runtime_fast.py (rel. L2 1e-2; ~10x the drift measured there), so a flip would be a bug
MARGIN_MIN = 0.02
LOGPROB_TOL = 0.02  # prompt logprobs (nats), fast against pool forward: the kernels' fp16 rounding (measured 6e-3)


def run_engine(model, requests_tokens: list[list[int]], max_tokens: int, arrivals=None, prompt_logprobs=None,
               **opts) -> list[list[int]]:
    """Greedy tokens of each prompt, prompt i added before step arrivals[i] (default 0) of one batched engine over
    `model`. With `prompt_logprobs`, each prompt's logprobs (the first entry's None left out) are appended to
    `prompt_logprobs`."""
    from dsv41.engine import GenerationRequest, PromptLogprobsEvent, SamplingParams, TokenEvent
    from dsv41.compose.build import build_engine, engine_defaults

    engine = build_engine(engine_defaults(**opts), model, max_model_len=128, log=lambda line: None)
    core = engine.core
    events = [[] for _ in requests_tokens]
    want = None if prompt_logprobs is None else 0
    seqs = [engine.make_sequence(GenerationRequest(list(ids), max_tokens, SamplingParams(temperature=0.0),
                                                   prompt_logprobs=want), events[i].append)
            for i, ids in enumerate(requests_tokens)]
    arrivals = arrivals or [0] * len(seqs)
    for step in range(1000):
        for seq, at in zip(seqs, arrivals):
            if at == step:
                core.add(seq)
        if not core.step() and step > max(arrivals) and not core.has_work():
            break
    assert core.pool_idle()
    if prompt_logprobs is not None:
        prompt_logprobs += [[lp for lp, _ in e.entries[1:]] for ev in events for e in ev
                            if isinstance(e, PromptLogprobsEvent)]
    return [[e.token_id for e in ev if isinstance(e, TokenEvent)] for ev in events]


def reference_margins(model, prompts, tokens) -> list[float]:
    """The reference's top-2 margin / rms at each generated position (teacher-forced on `tokens`)."""
    out = []
    for p, toks in zip(prompts, tokens):
        logits = model.forward(model.new_state(), torch.tensor(list(p) + toks[:-1]))[len(p) - 1:]
        top = logits.double().topk(2, dim=-1).values
        out += ((top[:, 0] - top[:, 1]) / logits.double().pow(2).mean(dim=-1).sqrt()).tolist()
    return out


def fast_and_reference(model_dir: str, device: str) -> dict:
    from dsv41.model.loader import load_model
    from dsv41.runtime.build import build_fast_model

    torch.manual_seed(0)
    ref = load_model(model_dir, torch.float32, device, fake_quant=False, dspark=False)
    fast = build_fast_model(model_dir, device, torch.float32, fake_quant=False)
    # the second prompt arrives a step later: its prefill row and the first one's decode row share a step (one
    # FastModel.forward per phase)
    pool_tokens = run_engine(ref, PROMPTS, NEW_TOKENS, [0, 1], forward="reference")
    from dsv41.runtime.fast_forward import FastForward

    phases, execute = [], FastForward.execute

    def recording(self, rows, pool, **kw):  # (handoff=: the overlapped loop's follow rows, ENGINE.md §6)
        phases.append(sorted({self.phase_of(r) for r in rows}))
        return execute(self, rows, pool, **kw)

    FastForward.execute = recording
    try:
        fast_tokens = run_engine(fast, PROMPTS, NEW_TOKENS, [0, 1], forward="fast")
    finally:
        FastForward.execute = execute
    # the one that joined a running engine, alone, with prompt logprobs (its prefill asks every row's logits)
    ref_lp, fast_lp = [], []
    run_engine(ref, PROMPTS[1:], 1, prompt_logprobs=ref_lp, forward="reference")
    alone = run_engine(fast, PROMPTS[1:], NEW_TOKENS, prompt_logprobs=fast_lp, forward="fast")[0]
    return {"pool": pool_tokens, "fast": fast_tokens, "alone": alone, "phases": phases,
            "prompt_logprobs": [ref_lp[0], fast_lp[0]],
            "margins": reference_margins(ref, PROMPTS, pool_tokens)}


def check(res: dict) -> None:
    print(f"fast forward engine: {res}")
    assert min(res["margins"]) > MARGIN_MIN, "a generated position sits near a tie: pick other prompts"
    assert res["fast"] == res["pool"]
    assert res["alone"] == res["fast"][1]
    assert ["decode", "prefill"] in res["phases"], res["phases"]  # a step of both phases ran
    ref_lp, fast_lp = res["prompt_logprobs"]
    assert len(ref_lp) == len(fast_lp) == len(PROMPTS[1]) - 1
    assert max(abs(a - b) for a, b in zip(ref_lp, fast_lp)) <= LOGPROB_TOL
    assert all(len(t) == NEW_TOKENS for t in res["fast"])


@pytest.fixture(scope="module")
def slim_dir(tmp_path_factory) -> Path:
    from dsv41.tiny.model import make_tiny
    from test_runtime_fast_dspark import SLIM

    return make_tiny(tmp_path_factory.mktemp("slim") / "model", "exl3", seed=0, overrides=SLIM)


def test_fast_forward_engine_tokens_interpreted(slim_dir, tmp_path):
    out = tmp_path / "engine.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    args = json.dumps({"model": str(slim_dir), "out": str(out)})
    subprocess.run([sys.executable, __file__, args], env=env, check=True, timeout=600)
    check(json.loads(out.read_text()))


def test_forward_option_on_the_cpu(slim_dir, monkeypatch):
    """--forward fast on the CPU without the interpreter is a one-line ConfigError; the default stays reference."""
    from dsv41.compose.build import engine_defaults, serving_forward
    from dsv41.errors import ConfigError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        serving_forward(engine_defaults(forward="fast"), torch.device("cpu"))
    assert serving_forward(engine_defaults(), torch.device("cpu")) == "reference"
    assert serving_forward(engine_defaults(), torch.device("cuda")) == "fast"
    assert serving_forward(engine_defaults(forward="reference"), torch.device("cuda")) == "reference"
    from dsv41.compose.build import build_runner
    from dsv41.model.loader import load_model

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ref = load_model(slim_dir, torch.float32, "cpu", fake_quant=False, dspark=False)
    with pytest.raises(ConfigError, match="build_fast_model"):
        build_runner(engine_defaults(forward="fast"), ref, 64, log=lambda line: None)


@pytest.mark.gpu
def test_fast_forward_engine_tokens_gpu(tiny_model_dir):
    check(fast_and_reference(str(tiny_model_dir), "cuda"))


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    Path(a["out"]).write_text(json.dumps(fast_and_reference(a["model"], "cpu")))
