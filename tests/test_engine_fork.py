"""Groups of sequences over one prompt (n > 1, best_of): the prompt is prefilled once, the siblings fork from the
leader (its full pages shared, its ring slot and partial page copied) and each gives exactly the reply it gets
alone with its seed. First over a fake runner that keeps slots and pages (no torch), then over the real tiny
model (tokens and logprobs bitwise, the pool's pages counted, the pool empty at the end)."""

from __future__ import annotations

import asyncio
import random

import pytest

from dsv41.engine.batch import RowOutput, StepOutput
from dsv41.engine.block_manager import BlockManager
from dsv41.engine.interface import FinishEvent, GenerationRequest, TokenEvent
from dsv41.engine.llm_engine import EngineConfig, LLMEngine
from dsv41.engine.params import SamplingParams
from dsv41.engine.request import Sequence
from dsv41.engine.scheduler import SchedulerConfig

M61 = (1 << 61) - 1

from test_engine_policy import run  # noqa: E402 (the engine driven to its end)


class PagedFakeRunner:
    """Next token = f(the hash its ring slot holds, every token its page table holds up to the row's end, seed,
    step): a row reading another sequence's slot or page, or a page a sibling overwrote, changes the reply."""

    def __init__(self, page_tokens: int):
        self.page_tokens = page_tokens
        self.slots: dict[int, tuple[int, int]] = {}
        self.pages: dict[tuple[int, int], int] = {}
        self.batches = []

    def execute(self, batch):
        self.batches.append(batch)
        pt = self.page_tokens
        for src_slot, dst_slot, src_page, dst_page in batch.copies:
            self.slots[dst_slot] = self.slots[src_slot]
            if src_page >= 0:
                for off in range(pt):
                    if (src_page, off) in self.pages:
                        self.pages[(dst_page, off)] = self.pages[(src_page, off)]
        outs = []
        for row in batch.rows:
            h, n = self.slots.get(row.slot, (0, 0)) if row.start_pos else (0, 0)
            assert n == row.start_pos, f"slot {row.slot} holds {n} positions, the row starts at {row.start_pos}"
            for i, t in enumerate(row.token_ids):
                h = (h * 1000003 + t + 1) % M61
                p = row.start_pos + i
                self.pages[(row.page_ids[p // pt], p % pt)] = t
            seen = 0
            for p in range(row.start_pos + len(row.token_ids)):  # what the page table holds, this row included
                seen = (seen * 31 + self.pages[(row.page_ids[p // pt], p % pt)]) % M61
            self.slots[row.slot] = (h, row.start_pos + len(row.token_ids))
            out = RowOutput(row.seq_id, scored=[(-float(tok), []) for _, tok, _ in row.scores])
            if row.sample is not None:
                out.token = (h ^ seen ^ (row.sample.seed * 31 + row.sample.step)) % 500
                out.logprob = -float(out.token % 7)
            outs.append(out)
        return StepOutput(batch.step, outs)


def make_engine(slots=4, pages=64, page_tokens=8, chunk=2048):
    runner = PagedFakeRunner(page_tokens)
    config = EngineConfig(scheduler=SchedulerConfig(prefill_chunk=chunk, prefill_share=1.0))
    return LLMEngine(runner, BlockManager(pages, slots, page_tokens), config), runner


def siblings(k: int, n: int, events: dict, prompt_len=None, limit=None, stop=frozenset()) -> list[Sequence]:
    rng = random.Random(k)
    prompt = [rng.randrange(500) for _ in range(prompt_len or rng.randrange(1, 40))]
    limit = limit or rng.randrange(1, 20)
    return [Sequence(list(prompt), limit, SamplingParams(seed=1000 * k + i), stop_ids=stop, logprobs=0,
                     emit=events.setdefault((k, i), []).append) for i in range(n)]




def alone(k: int, i: int, n: int, **kw) -> list:
    engine, _ = make_engine()
    events = {}
    engine.add(siblings(k, n, events, **kw)[i])
    run(engine)
    return events[(k, i)]


def test_fake_groups_equal_their_members_alone_and_share_the_prompt_pages():
    engine, runner = make_engine(slots=8, pages=200, chunk=13)
    events = {}
    for k in range(6):
        engine.add_group(siblings(k, 3, events, prompt_len=10 + 7 * k, limit=5 + k))
        engine.step()  # staggered arrivals
    run(engine)
    for k in range(6):
        for i in range(3):
            assert events[(k, i)] == alone(k, i, 3, prompt_len=10 + 7 * k, limit=5 + k), (k, i)
    assert engine.pool_idle() and engine.forks_total == 12
    prefill = sum(len(r.token_ids) for b in runner.batches for r in b.rows if r.phase == "prefill")
    assert prefill == sum(10 + 7 * k - 1 + 3 for k in range(6))  # each prompt once, its last token per sibling


def test_fake_group_reserves_the_full_pages_once():
    engine, _ = make_engine(slots=4, pages=64, page_tokens=8)
    events = {}
    group = siblings(1, 3, events, prompt_len=30, limit=10)  # 40 positions: 5 pages each, 3 of them full at 29
    engine.add_group(group)
    engine.step()
    assert engine.blocks.num_used_pages == 5 + 2 * 2 and engine.blocks.num_used_slots == 3
    assert group[1].pages[:3] == group[0].pages[:3] == group[2].pages[:3]
    assert len({p for s in group for p in s.pages[3:]}) == 6
    run(engine)
    assert engine.pool_idle()


def test_fake_leader_cancelled_before_the_fork_hands_the_prefill_on():
    engine, _ = make_engine(chunk=4)
    events = {}
    group = siblings(2, 3, events, prompt_len=25, limit=6)
    engine.add_group(group)
    engine.step()
    engine.step()
    engine.abort(group[0])  # mid-prefill
    run(engine)
    assert events[(2, 0)][-1].reason == "cancelled"
    for i in (1, 2):
        assert events[(2, i)] == alone(2, i, 3, prompt_len=25, limit=6)
    assert engine.pool_idle()


def test_fake_group_larger_than_the_slots_is_cut_and_unchanged():
    engine, _ = make_engine(slots=2, pages=64)
    events = {}
    engine.add_group(siblings(3, 5, events, prompt_len=17, limit=4))
    run(engine)
    assert all(events[(3, i)] == alone(3, i, 5, prompt_len=17, limit=4) for i in range(5))
    assert engine.pool_idle() and engine.forks_total == 2  # groups of 2, 2, 1


def test_fake_random_cancellations_of_groups_leave_the_pool_empty():
    rng = random.Random(5)
    engine, _ = make_engine(slots=5, pages=60, chunk=6)
    events, live = {}, []
    for k in range(200):
        group = siblings(k, rng.randrange(1, 5), events)
        engine.add_group(group)
        live += group
        for _ in range(rng.randrange(4)):
            engine.step()
        for _ in range(rng.randrange(3)):
            if live:
                engine.abort(live.pop(rng.randrange(len(live))))
    run(engine)
    assert engine.pool_idle() and not engine.has_work()
    for (k, i), evs in events.items():
        assert isinstance(evs[-1], FinishEvent)


# ---------------------------------------------------------------------------------------------------- tiny model
def prompt(n: int) -> list[int]:
    return [0] + [(i * 41 + 7) % 500 + 5 for i in range(n - 1)]


@pytest.fixture(scope="module")
def model():
    from dsv41.model.loader import load_model
    from dsv41.tiny.model import default_model_dir

    return load_model(default_model_dir(), dspark=False)


def drive(model, groups, **opts):
    """Each entry of `groups` (a list of requests) added as one group before the first step; run to the end.
    Returns (events per request, per group, the engine core, the most pages used at once)."""
    from dsv41.compose.build import build_engine, engine_defaults

    engine = build_engine(engine_defaults(**opts), model, max_model_len=512, log=lambda line: None)
    core = engine.core
    events = [[[] for _ in g] for g in groups]
    for g, requests in enumerate(groups):
        core.add_group([engine.make_sequence(r, events[g][i].append) for i, r in enumerate(requests)])
    peak = 0
    while core.has_work():
        core.step()
        peak = max(peak, core.blocks.num_used_pages)
    assert core.pool_idle()
    return events, core, peak


def group_of(ids, n, max_tokens, seed, temperature=0.8, **kw):
    return [GenerationRequest(ids, max_tokens, SamplingParams(temperature=temperature, seed=seed + i), logprobs=2,
                              **kw) for i in range(n)]


def test_a_group_of_three_equals_three_single_requests_and_holds_the_prompt_once(model):
    ids = prompt(70)  # 69 shared positions: 4 full pages of 16, the fifth partial
    alone = [drive(model, [[r]], page_tokens=16) for r in group_of(ids, 3, 6, 40)]
    singles, single_peak = [a[0][0][0] for a in alone], alone[0][2]
    events, core, peak = drive(model, [group_of(ids, 3, 6, 40)], page_tokens=16)
    assert events[0] == singles  # token for token, logprob for logprob (bitwise floats)
    assert all(isinstance(e, TokenEvent) and e.logprob is not None for e in singles[0][:-1])
    assert len({tuple(e.token_id for e in evs[:-1]) for evs in singles}) > 1  # the seeds do differ
    assert core.forks_total == 2 and core.prompt_tokens_total == 70
    assert single_peak == 5 and peak == 5 + 2 * 1 < 3 * single_peak
    assert core.stats()["prefill_tokens_total"] == 69 + 3


def test_siblings_finishing_at_different_times_free_everything(model):
    ids = prompt(40)
    # a group's siblings share a budget: stopping on frequent tokens ends them at different steps
    requests = group_of(ids, 3, 12, 7, temperature=1.0, stop_token_ids=frozenset(range(5, 300)))
    events, core, _ = drive(model, [requests], page_tokens=16)
    lengths = [len(evs) for evs in events[0]]
    assert len(set(lengths)) > 1 and core.pool_idle()
    singles = [drive(model, [[r]], page_tokens=16)[0][0][0] for r in requests]
    assert events[0] == singles


def test_two_groups_and_a_single_batched_with_odd_chunks_equal_alone(model):
    a, b = group_of(prompt(33), 2, 5, 3), group_of(prompt(26), 3, 4, 9, temperature=0.0)
    lone = GenerationRequest(prompt(21), 6, SamplingParams(temperature=0.7, seed=1), prompt_logprobs=1)
    events, core, _ = drive(model, [a, b, [lone]], page_tokens=16, prefill_chunk=7, prefill_chunk_alone=0, parallel=6)
    for g, requests in enumerate((a, b, [lone])):
        for i, r in enumerate(requests):
            assert events[g][i] == drive(model, [[r]], page_tokens=16)[0][0][0], (g, i)
    assert core.forks_total == 3


def test_the_serial_engine_runs_a_group_one_by_one_with_the_same_results(model):
    from dsv41.compose.serial import SerialEngine

    requests = group_of(prompt(30), 3, 5, 21)
    batched_events = drive(model, [requests], page_tokens=16)[0][0]

    async def main():
        engine = SerialEngine(model, max_model_len=512)
        await engine.start()
        streams = engine.submit_group(requests)
        out = [[e async for e in s] for s in streams]
        await engine.shutdown()
        return out

    assert asyncio.run(main()) == batched_events


def test_groups_with_grammars_prompt_logprobs_and_replay_equal_alone(model):
    from dsv41.structured.grammar import Grammars
    from dsv41.tiny.model import default_model_dir
    from dsv41.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir())
    grammars = Grammars(default_model_dir() / "tokenizer.json", vocab_size=model.cfg.vocab_size,
                        stop_token_ids=[tok.eos_id])
    ids = [tok.bos_id] + tok.encode("Answer:")
    eos = frozenset({tok.eos_id})
    choice = grammars.choice(["the lighthouse keeper", "a red fox", "a red hen"], thinking=False)
    forced = grammars.choice(["the lighthouse keeper wrote"], thinking=False)  # all forced after the prompt
    groups = [group_of(ids, 3, 30, 4, temperature=1.0, grammar=choice, stop_token_ids=eos),
              group_of(ids, 2, 30, 8, grammar=forced, stop_token_ids=eos),
              group_of(prompt(37), 2, 4, 2, prompt_logprobs=1)]

    def engine_for(**opts):
        from dsv41.compose.build import build_engine, engine_defaults

        return build_engine(engine_defaults(page_tokens=16, **opts), model, max_model_len=512,
                            encode_text=tok.encode, log=lambda line: None)

    def run_groups(gs, **opts):
        engine = engine_for(**opts)
        events = [[[] for _ in g] for g in gs]
        for g, requests in enumerate(gs):
            engine.core.add_group([engine.make_sequence(r, events[g][i].append) for i, r in enumerate(requests)])
        while engine.core.has_work():
            engine.core.step()
        assert engine.core.pool_idle()
        return events, engine.core

    events, core = run_groups(groups)
    assert core.forks_total == 2 + 1 + 1
    for g, requests in enumerate(groups):
        for i, r in enumerate(requests):
            assert events[g][i] == run_groups([[r]])[0][0][0], (g, i)
    assert events[1][0][-1].reason == "stop" and events[2][1][0].entries == events[2][0][0].entries
    long = group_of(prompt(45), 3, 5, 6)  # past the window: the fork under CED replay == each alone under it
    replayed = run_groups([long], prefill="replay")[0][0]
    assert replayed == [run_groups([[r]], prefill="replay")[0][0][0] for r in long]
    assert replayed[0][-1].tag == "prefill=replay"


def test_fork_copies_travel_in_the_step_message():
    from dsv41.engine.batch import Batch, Row
    from dsv41.parallel.plan import decode_batch, encode_batch

    batch = Batch(4, [Row(1, 2, [7], 33, [0, 5])], copies=[[0, 2, 5, 9], [0, 3, -1, -1]])
    assert decode_batch(encode_batch(1, batch))[1].copies == [[0, 2, 5, 9], [0, 3, -1, -1]]
    assert decode_batch(encode_batch(1, Batch(5, [])))[1].copies == []
