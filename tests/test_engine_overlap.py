"""The overlapped loop (docs/ENGINE.md §6): step k + 1 planned and launched while step k runs, its follow rows'
token ids handed over from step k's sample, step k's tokens read afterwards. Overlapped == serial, reply by reply:

- over a fake runner that launches (its next token a hash of everything its ring slot absorbed, so a follow row at
  the wrong position, in the wrong slot, or with the wrong id changes the reply, and a discarded row's writes that
  leaked into a later sequence would too): 400 requests with stop ids, budgets, groups, staggered arrivals,
  prefill chunks and cancellations, overlap on and off;
- over the real tiny model (the pool forward on the CPU): tokens, logprobs and top logprobs at T = 0 and seeded
  T = 0.7, stops, budgets, n > 1, a cancellation, requests arriving while others decode, prefill chunks interleaving.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv41.engine.batch import FOLLOWS, StepOutput
from dsv41.engine.block_manager import BlockManager
from dsv41.engine.interface import FinishEvent, GenerationRequest, TokenEvent
from dsv41.engine.llm_engine import EngineConfig, LLMEngine
from dsv41.engine.params import SamplingParams
from dsv41.engine.request import Sequence
from dsv41.engine.scheduler import SchedulerConfig

from test_engine_fork import PagedFakeRunner  # noqa: E402


class Launched:
    def __init__(self, out: StepOutput):
        self.out = out

    def result(self) -> StepOutput:
        return self.out


class LaunchingRunner(PagedFakeRunner):
    """PagedFakeRunner (its token a hash of its ring slot's and page table's contents) with `launch`: a follow
    row's id is its sequence's token in the step launched just before (as the runtime hands it over); a follow
    row after a serial step, or of a sequence that step did not sample, fails."""

    def __init__(self, page_tokens: int):
        super().__init__(page_tokens)
        self.sampled: dict[int, int] | None = None
        self.follow_rows = 0

    def execute(self, batch):
        self.sampled = None
        assert not any(r.follows for r in batch.rows)
        return super().execute(batch)

    def launch(self, batch):
        rows = []
        for r in batch.rows:
            if r.follows:
                assert r.token_ids == [FOLLOWS] and self.sampled is not None and r.seq_id in self.sampled
                r = dataclasses.replace(r, token_ids=[self.sampled[r.seq_id]], follows=False)
                self.follow_rows += 1
            rows.append(r)
        out = PagedFakeRunner.execute(self, dataclasses.replace(batch, rows=rows))
        self.sampled = {o.seq_id: o.token for o in out.rows if o.token is not None}
        return Launched(out)


STOPS = frozenset(range(0, 500, 9))  # ~11 % of the fake's tokens stop a request


def fake_request(k: int, events: dict) -> Sequence:
    rng = random.Random(k)
    prompt = [rng.randrange(500) for _ in range(rng.randrange(1, 40))]
    seq = Sequence(prompt, limit=rng.randrange(1, 30), sampling=SamplingParams(seed=k), stop_ids=STOPS)
    seq.emit = events.setdefault(k, []).append
    return seq


def drive_fake(overlap: bool, n: int = 400, seed: int = 1):
    """n requests (every fifth a group of 3) arriving at random steps, a tenth cancelled a few steps later."""
    rng = random.Random(seed)
    runner = LaunchingRunner(8)
    engine = LLMEngine(runner, BlockManager(60, 5, 8),
                       EngineConfig(scheduler=SchedulerConfig(prefill_chunk=23), overlap=overlap),
                       clock=lambda: 0.0)  # no time passes: the prefill share never holds a chunk back
    events, arrivals, cancels = {}, {}, {}
    step = 0
    for k in range(n):
        step += rng.randrange(3)
        arrivals.setdefault(step, []).append(k)
        if rng.random() < 0.1:
            cancels.setdefault(step + rng.randrange(1, 8), []).append(k)
    seqs = {}
    for step in range(100_000):
        for k in arrivals.get(step, []):
            if k % 5 == 0:
                group = [fake_request(k, events)] + [fake_request(k, events) for _ in range(2)]
                for i, s in enumerate(group[1:], 1):  # siblings: the same prompt, their own seeds and streams
                    s.prompt, s.tokens, s.limit = group[0].prompt, list(group[0].prompt), group[0].limit
                    s.seed, s.emit = k + 1000 * i, events.setdefault(k + 1000 * i, []).append
                engine.add_group(group)
                seqs[k] = group[0]
            else:
                seqs[k] = fake_request(k, events)
                engine.add(seqs[k])
        for k in cancels.get(step, []):
            engine.abort(seqs[k])
        if not engine.step() and step > max(arrivals) and not engine.has_work():
            break
    assert engine.pool_idle() and not engine.has_work()
    return events, engine, runner


def test_overlapped_equals_serial_over_a_launching_fake_runner():
    serial, _, _ = drive_fake(overlap=False)
    events, engine, runner = drive_fake(overlap=True)
    assert events.keys() == serial.keys()
    for k, evs in events.items():
        assert sum(isinstance(e, FinishEvent) for e in evs) == 1, k
        if "cancelled" in (evs[-1].reason, serial[k][-1].reason):  # cut at another step: prefixes of one reply
            short, long = sorted((evs[:-1], serial[k][:-1]), key=len)
            assert long[:len(short)] == short, k
        else:
            assert evs == serial[k], k
    stats = engine.stats()["overlap"]
    # most decode steps followed the one before; stops found at step k discarded their follow rows
    assert stats["on"] and stats["steps"] > 0.5 * engine.step_no and runner.follow_rows > 1000
    assert stats["discarded_rows"] > 20
    reasons = {evs[-1].reason for evs in events.values()}
    assert reasons == {"stop", "length", "cancelled"}


def test_overlap_is_off_where_it_cannot_be_kept():
    # a runner without `launch`, or overlap turned off: every step serial
    engine = LLMEngine(PagedFakeRunner(8), BlockManager(60, 5, 8), EngineConfig())
    events = {}
    engine.add(fake_request(1, events))
    while engine.has_work():
        engine.step()
    assert engine.stats()["overlap"] == {"on": False, "steps": 0, "discarded_rows": 0}


# ---------------------------------------------------------------------------------------------------- tiny model
def prompt(k: int, n: int) -> list[int]:
    return [0] + [(i * 37 + 11 * k) % 500 + 5 for i in range(n - 1)]


@pytest.fixture(scope="module")
def model():
    from dsv41.model.loader import load_model
    from dsv41.tiny.model import default_model_dir

    return load_model(default_model_dir(), dspark=False)


def run_model(model, requests, arrivals, cancel=None, **opts):
    """Events per request (`requests[i]` a request or a list of n > 1 siblings, added before step arrivals[i];
    `cancel`: {step: request index}) and the engine core."""
    from dsv41.compose.build import build_engine, engine_defaults

    engine = build_engine(engine_defaults(sessions="off", **opts), model, max_model_len=256, log=lambda line: None)
    return drive(engine, requests, arrivals, cancel)


def drive(engine, requests, arrivals, cancel=None):
    """`run_model` over a built engine (its model in this process, or TP's `LeaderExecutor`)."""
    core = engine.core
    events, seqs = [], []
    for req in requests:
        group = req if isinstance(req, list) else [req]
        events.append([[] for _ in group])
        seqs.append([engine.make_sequence(r, ev.append) for r, ev in zip(group, events[-1])])
    for step in range(2000):
        for i, at in enumerate(arrivals):
            if at == step:
                core.add_group(seqs[i])
        if cancel and step in cancel:
            for s in seqs[cancel[step]]:
                core.abort(s)
        if not core.step() and step > max(arrivals) and not core.has_work():
            break
    assert core.pool_idle() and not core.has_work()
    return events, core


def workload(stop: int) -> list:
    """Requests for overlapped == serial (arrivals `ARRIVALS`, cancellation `CANCEL`); `stop`: a token the first
    request's greedy reply produces (`first_reply`), so that it stops there."""
    greedy = SamplingParams(temperature=0.0)
    return [
        GenerationRequest(prompt(0, 9), 12, greedy, stop_token_ids=frozenset({stop}), logprobs=2),
        GenerationRequest(prompt(1, 23), 9, SamplingParams(temperature=0.7, seed=11), logprobs=1),
        [GenerationRequest(prompt(2, 14), 7, SamplingParams(temperature=0.7, seed=5 + i, top_p=0.9), logprobs=0)
         for i in range(2)],  # n = 2: one prefill, two forks
        GenerationRequest(prompt(3, 40), 6, greedy),  # arrives while others decode: its prefill in chunks
        GenerationRequest(prompt(4, 12), 20, SamplingParams(temperature=0.7, top_k=20)),  # cancelled mid-decode
    ]


ARRIVALS, CANCEL = [0, 0, 1, 4, 2], {9: 4}
OPTS = dict(prefill_chunk=16, prefill_share=1.0)  # (the share by the clock would move chunks between runs)


def first_reply(model) -> list:
    return run_model(model, [GenerationRequest(prompt(0, 9), 12, SamplingParams(temperature=0.0))], [0],
                     overlap="off")[0][0][0]


def check_overlapped_equals_serial(events: list, serial: list) -> None:
    assert events[:4] == serial[:4]
    # the cancellation lands a step apart (a request arriving waits for the running step): prefixes of one reply
    short, long = sorted((events[4][0][:-1], serial[4][0][:-1]), key=len)
    assert len(short) >= 2 and long[:len(short)] == short
    assert events[0][0][-1].reason == "stop" and events[4][0][-1].reason == "cancelled"
    assert events[1][0][-2].logprob is not None and len(events[0][0][0].top_logprobs) == 2


def test_overlapped_equals_serial_on_the_tiny_model(model):
    requests = workload(first_reply(model)[4].token_id)
    serial, _ = run_model(model, requests, ARRIVALS, CANCEL, overlap="off", **OPTS)
    events, core = run_model(model, requests, ARRIVALS, CANCEL, overlap="on", **OPTS)
    check_overlapped_equals_serial(events, serial)
    stats = core.stats()["overlap"]
    print(f"tiny model, overlapped: {stats}, {core.step_no} steps")
    assert stats["on"] and stats["steps"] >= 0.4 * core.step_no and stats["discarded_rows"] >= 1


# ---------------------------------------------------------------------------------------------------- fast path
FAST_PROMPTS = ([0, 42, 7], [0, 98, 14, 3])
FAST_TOKENS = 2  # a prefill step, then one decode step whose ids come from the prefill's sample (~10 s each)


def fast_events(model_dir: str, device: str, engram: bool, gate: bool = False, tokens: int = FAST_TOKENS) -> dict:
    """The fast forward's engine, overlap off and on: each request's events (as plain lists), and how many follow
    rows took their ids on the device. `engram=False` drops the Engram layers (the same model for both runs), so
    the ids never leave the device; with them the host reads the ids just before the hash, unless `gate`: the
    overlapped run has the Engram gate (runtime/engram_gate.py; the serial run has none), `fed` says how often
    its rows were published before / after the step's launch."""
    from dsv41.compose.build import build_engine, engine_defaults
    from dsv41.runtime.build import build_fast_model
    from dsv41.runtime.engram_gate import EngramGate
    from dsv41.runtime.model import STEP_ROWS
    from dsv41.runtime.step_handoff import StepSample

    fast = build_fast_model(model_dir, device, torch.float32, fake_quant=False)
    if not engram:
        fast.engram, fast.engram_hasher = {}, None
    handed, device_ids = [0], StepSample.device_ids

    def counting(self):
        handed[0] += 1
        return device_ids(self)

    StepSample.device_ids = counting
    out = {}
    try:
        for overlap in ("off", "on"):
            fast.engram_gate = EngramGate(fast.device, max_rows=STEP_ROWS) if gate and overlap == "on" else None
            engine = build_engine(engine_defaults(overlap=overlap, forward="fast"), fast, max_model_len=128,
                                  log=lambda line: None)
            core = engine.core
            requests = [GenerationRequest(list(FAST_PROMPTS[0]), tokens, SamplingParams(temperature=0.0),
                                          logprobs=1),
                        GenerationRequest(list(FAST_PROMPTS[1]), tokens, SamplingParams(temperature=0.7, seed=3),
                                          logprobs=1)]
            events = [[] for _ in requests]
            for req, ev in zip(requests, events):
                core.add(engine.make_sequence(req, ev.append))
            while core.has_work():
                core.step()
            assert core.pool_idle()
            out[overlap] = [[[e.token_id, e.logprob, [list(t) for t in e.top_logprobs]] for e in ev
                             if isinstance(e, TokenEvent)] for ev in events]
            out[f"{overlap}_steps"] = core.stats()["overlap"]["steps"]
        if fast.engram_gate is not None:
            out["fed"] = dict(fast.engram_gate.fed)
    finally:
        StepSample.device_ids = device_ids
    out["handed"] = handed[0]
    return out


def check_fast(res: dict, device_path: bool) -> None:
    print(f"fast forward, overlap off / on: {res}")
    assert res["on"] == res["off"] and all(len(t) == FAST_TOKENS for t in res["on"])
    assert res["off_steps"] == 0 and res["on_steps"] >= FAST_TOKENS - 1
    assert (res["handed"] >= res["on_steps"]) if device_path else res["handed"] == 0


def test_overlapped_equals_serial_on_the_fast_forward_interpreted(tmp_path):
    """The fast forward in Triton's interpreter (a child process, the 3-layer model of test_runtime_fast_dspark.py:
    a window layer, a ratio-2 and a ratio-1 source; the follow rows' path is the same at every layer, and 6 layers
    took 30% longer) without its Engram layers: the follow rows' ids go from the previous step's device-side sample
    into the step's tables, never through the host; tokens and logprobs == serial, bitwise. (With Engram the same
    engine runs overlapped in test_runtime_fast_engine.py, its tokens == the pool forward's.)"""
    from dsv41.tiny.model import make_tiny
    from test_runtime_fast_dspark import SLIM

    lite = make_tiny(tmp_path / "model", "exl3", seed=0, overrides=SLIM)
    out = tmp_path / "overlap.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, __file__, json.dumps({"model": str(lite), "out": str(out)})], env=env,
                   check=True, timeout=600, cwd=Path(__file__).parent)
    check_fast(json.loads(out.read_text()), device_path=True)


@pytest.mark.gpu
def test_overlapped_equals_serial_on_the_fast_forward_gpu(tiny_model_dir):
    """On CUDA: the step's sample read on a side stream after its event, the next step's ids gathered on the
    device; overlapped == serial bitwise, without Engram (ids on the device) and with it (read before the hash)."""
    check_fast(fast_events(str(tiny_model_dir), "cuda", engram=False), device_path=True)
    check_fast(fast_events(str(tiny_model_dir), "cuda", engram=True), device_path=False)


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    Path(a["out"]).write_text(json.dumps(fast_events(a["model"], "cpu", engram=False)))
