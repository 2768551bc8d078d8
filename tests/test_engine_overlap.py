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
import random

import pytest

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
                       EngineConfig(scheduler=SchedulerConfig(prefill_chunk=23), overlap=overlap))
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
    # an executor without `launch` (TP > 1's leader), or overlap turned off: every step serial
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


def test_overlapped_equals_serial_on_the_tiny_model(model):
    greedy = SamplingParams(temperature=0.0)
    first = run_model(model, [GenerationRequest(prompt(0, 9), 12, greedy)], [0], overlap="off")[0][0][0]
    stop = first[4].token_id  # a token the greedy reply produces: it stops there
    requests = [
        GenerationRequest(prompt(0, 9), 12, greedy, stop_token_ids=frozenset({stop}), logprobs=2),
        GenerationRequest(prompt(1, 23), 9, SamplingParams(temperature=0.7, seed=11), logprobs=1),
        [GenerationRequest(prompt(2, 14), 7, SamplingParams(temperature=0.7, seed=5 + i, top_p=0.9), logprobs=0)
         for i in range(2)],  # n = 2: one prefill, two forks
        GenerationRequest(prompt(3, 40), 6, greedy),  # arrives while others decode: its prefill in chunks
        GenerationRequest(prompt(4, 12), 20, SamplingParams(temperature=0.7, top_k=20)),  # cancelled mid-decode
    ]
    arrivals, cancel = [0, 0, 1, 4, 2], {9: 4}
    serial, _ = run_model(model, requests, arrivals, cancel, overlap="off", prefill_chunk=16)
    events, core = run_model(model, requests, arrivals, cancel, overlap="on", prefill_chunk=16)
    assert events == serial
    assert events[0][0][-1].reason == "stop" and events[4][0][-1].reason == "cancelled"
    assert events[1][0][-2].logprob is not None and len(events[0][0][0].top_logprobs) == 2
    stats = core.stats()["overlap"]
    assert stats["on"] and stats["steps"] >= 10 and stats["discarded_rows"] >= 1
