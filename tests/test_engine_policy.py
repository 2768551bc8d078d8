"""The engine's policy without a model (nano-vllm's rule): scheduler, block manager and LLMEngine over a fake
runner whose next token is a hash of everything its ring slot has absorbed — so a row that lands in the wrong
slot, at the wrong position or out of order changes the reply. Checked: batched == alone, pool pressure, prefill
chunks and their share of the time, FIFO with a background class, the memory floor, 1,000 random cancellations
back to an empty pool, and that engine/ (but the async bridge) imports no torch."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from dsv41.engine.batch import PREFILL, RowOutput, StepOutput
from dsv41.engine.block_manager import BlockManager
from dsv41.engine.interface import EngineRejected, FinishEvent, PromptLogprobsEvent, TokenEvent
from dsv41.engine.llm_engine import EngineConfig, LLMEngine
from dsv41.engine.params import SamplingParams
from dsv41.engine.request import Sequence
from dsv41.engine.scheduler import SchedulerConfig

M61 = (1 << 61) - 1


class FakeRunner:
    """Next token = f(every id absorbed in this slot since position 0, seed, step): a model in miniature."""

    def __init__(self, seconds=None):
        self.slots: dict[int, tuple[int, int]] = {}
        self.batches = []
        self.seconds = seconds  # fake clock: (clock, per prefill row, per step)

    def execute(self, batch):
        self.batches.append(batch)
        outs = []
        for row in batch.rows:
            h, n = self.slots.get(row.slot, (0, 0)) if row.start_pos else (0, 0)
            assert n == row.start_pos, f"slot {row.slot} holds {n} positions, the row starts at {row.start_pos}"
            for t in row.token_ids:
                h = (h * 1000003 + t + 1) % M61
            self.slots[row.slot] = (h, row.start_pos + len(row.token_ids))
            out = RowOutput(row.seq_id, scored=[(-float(tok), []) for _, tok, _ in row.scores])
            if row.sample is not None:
                out.token = (h ^ (row.sample.seed * 31 + row.sample.step)) % 500
            outs.append(out)
        if self.seconds is not None:
            clock, per_row, per_step = self.seconds
            clock[0] += per_step + per_row * sum(len(r.token_ids) for r in batch.rows if r.phase == PREFILL)
        return StepOutput(batch.step, outs)


def make_engine(slots=4, pages=64, page_tokens=16, chunk=2048, share=1.0, runner=None, clock=None, **cfg):
    runner = runner or FakeRunner()
    config = EngineConfig(scheduler=SchedulerConfig(prefill_chunk=chunk, prefill_share=share, **cfg))
    kw = {"clock": clock} if clock else {}
    return LLMEngine(runner, BlockManager(pages, slots, page_tokens), config, **kw), runner


def request(k: int, events: dict, **kw) -> Sequence:
    rng = random.Random(k)
    prompt = [rng.randrange(500) for _ in range(rng.randrange(1, 60))]
    seq = Sequence(prompt, limit=rng.randrange(1, 25), sampling=SamplingParams(seed=k), **kw)
    seq.emit = events.setdefault(k, []).append
    return seq


def run(engine, max_steps=100_000):
    for _ in range(max_steps):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def alone(k: int, **kw) -> list:
    engine, _ = make_engine()
    events = {}
    engine.add(request(k, events, **kw))
    run(engine)
    return events[k]


def test_batched_requests_get_exactly_their_alone_replies_and_the_pool_empties():
    engine, runner = make_engine(slots=3, pages=20, chunk=37)
    events = {}
    for k in range(12):
        engine.add(request(k, events))
        engine.step()  # staggered arrivals
    run(engine)
    for k in range(12):
        assert events[k] == alone(k), k
        assert isinstance(events[k][-1], FinishEvent) and events[k][-1].reason == "length"
    assert engine.pool_idle() and max(len(b.rows) for b in runner.batches) == 3


def test_pool_pressure_waits_never_refuses_never_changes():
    # 2 slots, pages for barely two requests: 10 requests queue for them and all complete unchanged
    engine, _ = make_engine(slots=2, pages=11, page_tokens=8)
    events = {}
    for k in range(10):
        engine.add(request(k, events))
    assert engine.scheduler.num_waiting == 10
    run(engine)
    assert all(events[k] == alone(k) for k in range(10))
    assert engine.pool_idle()


def test_prompt_logprobs_cover_every_prompt_token_across_chunks():
    engine, _ = make_engine(chunk=5)
    events = {}
    seq = request(3, events, prompt_logprobs=2)
    engine.add(seq)
    run(engine)
    first = events[3][0]
    assert isinstance(first, PromptLogprobsEvent) and len(first.entries) == len(seq.prompt)
    assert first.entries[0] == (None, ()) and [e[0] for e in first.entries[1:]] == [-t for t in seq.prompt[1:]]
    assert events[3][1:] == alone(3)


def test_prefill_is_chunked_and_bounded_while_others_decode():
    clock = [0.0]
    runner = FakeRunner(seconds=(clock, 0.01, 0.005))
    engine, _ = make_engine(chunk=16, share=0.3, pages=300, runner=runner, clock=lambda: clock[0])
    events = {}
    engine.add(Sequence([1] * 5, limit=4000, emit=events.setdefault(0, []).append))
    for _ in range(3):
        engine.step()  # the first request decodes
    long = Sequence([2] * 300, limit=2, emit=events.setdefault(1, []).append)
    engine.add(long)
    steps, prefill_time, total = 0, 0.0, 0.0
    while long.prefilling:
        before = clock[0]
        engine.step()
        batch = runner.batches[-1]
        rows = sum(len(r.token_ids) for r in batch.rows if r.phase == PREFILL)
        assert rows <= 16 and any(r.phase != PREFILL for r in batch.rows)  # the stream keeps flowing
        prefill_time += 0.01 * rows
        total += clock[0] - before
        steps += 1
    assert prefill_time <= 0.3 * total + 2 * 0.16 and steps > 300 // 16  # some steps were decode-only
    engine.abort(engine.scheduler.running[0])
    run(engine)
    assert events[1][-1].reason == "length" and engine.pool_idle()


def test_a_step_without_decode_rows_takes_the_longer_alone_chunk_and_the_replies_stay():
    """No stream waits on a step without decode rows, so its prefill takes `prefill_chunk_alone` rows; once a stream
    decodes, steps go back to `prefill_chunk`. The replies are the 16-row chunks' (chunking never changes a bit)."""
    runner = FakeRunner()
    engine, _ = make_engine(chunk=16, pages=300, runner=runner, prefill_chunk_alone=64)
    events = {}
    first = Sequence([3] * 150, limit=40, emit=events.setdefault(0, []).append)
    engine.add(first)
    while first.prefilling:
        engine.step()
    alone_rows = [sum(len(r.token_ids) for r in b.rows if r.phase == PREFILL) for b in runner.batches]
    assert alone_rows == [64, 64, 22]  # 150 rows in three steps, not ten
    second = Sequence([4] * 100, limit=3, emit=events.setdefault(1, []).append)
    engine.add(second)
    mark = len(runner.batches)
    while second.prefilling:
        engine.step()
    shared = [b for b in runner.batches[mark:] if any(r.phase == PREFILL for r in b.rows)]
    assert all(any(r.phase != PREFILL for r in b.rows) for b in shared)  # the first stream decodes beside it
    assert max(sum(len(r.token_ids) for r in b.rows if r.phase == PREFILL) for b in shared) == 16
    run(engine)
    base, _ = make_engine(chunk=16, pages=300)
    base_events = {}
    base.add(Sequence([3] * 150, limit=40, emit=base_events.setdefault(0, []).append))
    base.add(Sequence([4] * 100, limit=3, emit=base_events.setdefault(1, []).append))
    run(base)
    assert events == base_events and engine.pool_idle()
    assert sum(isinstance(e, TokenEvent) for e in events[0]) == 40


def test_fifo_with_a_background_class():
    engine, runner = make_engine(slots=1, pages=64)
    events = {}
    bg = request(1, events, background=True)
    fg = [request(k, events) for k in (2, 3)]
    engine.add(bg)
    for seq in fg:
        engine.add(seq)
    run(engine)
    order = []
    for b in runner.batches:
        for r in b.rows:
            if r.seq_id not in order:
                order.append(r.seq_id)
    assert order == [fg[0].seq_id, fg[1].seq_id, bg.seq_id]


def test_memory_floor_holds_admission_and_gives_up_only_when_nothing_runs():
    free = [10]
    clock = [0.0]
    runner = FakeRunner()
    runner.free_bytes = lambda: free[0]
    engine, _ = make_engine(runner=runner, mem_floor_bytes=100, admit_timeout_s=5.0, clock=lambda: clock[0])
    events = {}
    engine.add(request(1, events))
    assert engine.step() is False and engine.scheduler.num_waiting == 1  # waits under the floor
    clock[0] = 6.0
    engine.step()
    assert isinstance(events[1][-1], EngineRejected) and "floor" in str(events[1][-1])
    assert events[1][-1].code == "insufficient_memory"  # the server answers 400, not 500
    free[0] = 1000
    engine.add(request(2, events))
    run(engine)
    assert events[2] == alone(2)


def test_a_thousand_random_cancellations_leave_the_pool_empty():
    rng = random.Random(0)
    engine, _ = make_engine(slots=4, pages=40, page_tokens=8, chunk=9)
    events, live, stages = {}, [], set()
    for k in range(1000):
        seq = request(k, events)
        engine.add(seq)
        live.append(seq)
        for _ in range(rng.randrange(3)):
            engine.step()
        victim = live.pop(rng.randrange(len(live)))
        stages.add("queued" if victim.slot is None else "prefilling" if victim.prefilling else "decoding")
        engine.abort(victim)
    for seq in live:
        engine.abort(seq)
    run(engine)
    assert stages == {"queued", "prefilling", "decoding"}
    assert engine.pool_idle() and not engine.has_work()
    finishes = [e for evs in events.values() for e in evs if isinstance(e, FinishEvent)]
    assert len(finishes) == 1000  # every request ended exactly once
    later = {}
    engine.add(request(5000, later))
    run(engine)
    assert later[5000] == alone(5000)


def test_engine_policy_imports_no_torch():
    code = ("import sys; import dsv41.engine, dsv41.engine.batch, dsv41.engine.block_manager, "
            "dsv41.engine.request, dsv41.engine.scheduler, dsv41.engine.llm_engine, dsv41.compose.build; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_block_manager_ref_counts():
    b = BlockManager(4, 2, 16)
    slot, pages = b.allocate(40)
    assert len(pages) == 3 and b.num_free_pages == 1 and not b.can_allocate(17)
    b.share(pages[:1])
    assert b.free(slot, pages) == pages[1:]  # the shared page stays held
    assert b.free(None, pages[:1]) == pages[:1] and b.empty()
    with pytest.raises(RuntimeError, match="freed twice"):
        b.free(None, pages[:1])


def test_stats_show_each_prompt_s_prefill_progress_chunk_by_chunk():
    """/health's batching.prefilling: a prompt's prefilled tokens grow a chunk a step, and it leaves the list once
    its prompt is in the cache."""
    engine, _ = make_engine(chunk=16)
    seq = Sequence(list(range(50)), limit=3, sampling=SamplingParams(seed=1))
    engine.add(seq)
    seen = []
    while engine.has_work():
        engine.step()
        seen.append([(p["prompt_tokens"], p["prefilled"]) for p in engine.stats()["prefilling"]])
    assert seen[:3] == [[(50, 16)], [(50, 32)], [(50, 48)]], seen
    assert seen[3] == [] and all(s == [] for s in seen[3:])
