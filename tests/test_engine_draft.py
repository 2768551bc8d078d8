"""Drafting on the CPU path (issue 32; tiny model with its DSpark blocks, one thread): a drafted reply is the serial
one bit for bit — tokens, logprobs, top logprobs — at T = 0 and T = 0.7 for DSpark, lookup and both; batched ==
alone with drafting on at different depths; after rejected drafts every live cache byte equals the serial run's;
a drafter that proposes the serial continuation has every draft accepted and one that proposes garbage none, with
the reply unchanged; DSpark's proposals over the pool are model/dspark.py's drafts at the keyed choices."""

from __future__ import annotations

import pytest
import torch

from dsv41.engine import GenerationRequest, SamplingParams, TokenEvent
from dsv41.compose.build import build_engine, engine_defaults
from dsv41.engine.drafting import CostTable, choose_depth, expected_tokens, lookup_draft
from dsv41.runtime.sampling import sample_token


def prompt(k: int, n: int) -> list[int]:
    return [0] + [(i * 37 + 11 * k) % 500 + 5 for i in range(n - 1)]


def looping(k: int, n: int) -> list[int]:  # a prompt that repeats itself: lookup finds matches in it
    return [0] + [(5, 9, 13, 21, 7, 30)[i % 6] + k for i in range(n - 1)]


REQUESTS = [
    GenerationRequest(prompt(0, 20), 12, SamplingParams(temperature=0.0), logprobs=2),
    GenerationRequest(looping(1, 30), 12, SamplingParams(temperature=0.7, seed=3), logprobs=1),
    # a three-id alphabet: the reply repeats itself, so lookup drafts get accepted (and adjustments meet drafts)
    GenerationRequest(looping(2, 26), 14, SamplingParams(temperature=0.0, allowed_token_ids=(7, 11, 15)), logprobs=0),
    GenerationRequest(prompt(3, 18), 11, SamplingParams(temperature=0.7, seed=5, top_p=0.9, frequency_penalty=0.5)),
]
FLAT = "1:0.01"  # a flat step cost: the depth is the cap (what a GPU's verify window costs, nearly)


@pytest.fixture(scope="module")
def model():
    from dsv41.model.loader import load_model
    from dsv41.tiny.model import default_model_dir

    torch.set_num_threads(1)
    m = load_model(default_model_dir())
    assert m.dspark is not None, "the tiny model ships its DSpark blocks"
    return m


def run(model, requests, *, setup=None, **opts):
    """Every request added at once; steps until done. Returns (events per request, engine core)."""
    opts.setdefault("draft_dspark", "on")  # the CPU's default is off (auto: a GPU's verify rows are the cheap ones)
    engine = build_engine(engine_defaults(**opts), model, max_model_len=256, log=lambda line: None)
    core = engine.core
    if setup is not None:
        setup(core)
    events = [[] for _ in requests]
    for i, r in enumerate(requests):
        core.add(engine.make_sequence(r, events[i].append))
    while core.has_work():
        core.step()
    assert core.pool_idle()
    return events, core


def tokens(evs) -> list[int]:
    return [e.token_id for e in evs if isinstance(e, TokenEvent)]


@pytest.fixture(scope="module")
def reference(model):
    return run(model, REQUESTS, draft_depth=0)[0]


def figures(core, name):
    return core.stats()["drafting"][name]


@pytest.mark.parametrize("drafters", ["dspark", "lookup", "both"])
def test_drafted_equals_serial_bitwise(model, reference, drafters):
    opts = {"dspark": dict(draft_dspark="on"), "lookup": dict(draft_dspark="off", draft_lookup="on"),
            "both": dict(draft_dspark="on", draft_lookup="on")}[drafters]
    events, core = run(model, REQUESTS, draft_cost=FLAT, **opts)
    assert events == reference  # tokens, logprobs, top logprobs, finish
    used = [n for n in ("dspark", "lookup") if figures(core, n)["num_draft_tokens"]]
    assert used == {"dspark": ["dspark"], "lookup": ["lookup"], "both": used}[drafters] and used
    if drafters == "lookup":
        assert figures(core, "lookup")["num_accepted_tokens"] > 0  # the looping prompts' continuations


class ScriptedDrafter:
    """A DSpark stand-in that proposes the serial continuation (or a token that is never it) at every position."""

    def __init__(self, continuation: dict[int, list[int]], garbage: bool, vocab: int):
        self.continuation, self.garbage, self.vocab = continuation, garbage, vocab

    def propose(self, pool, asks):
        out = []
        for row, last, y, _, _, n in asks:
            ref = self.continuation[row.seq_id]
            assert ref[last + 1] == y
            ids = ref[last + 2:last + 2 + n]
            out.append(([(t + 1) % self.vocab for t in ids] if self.garbage else ids, [1.0] * len(ids)))
        return out


@pytest.mark.parametrize("garbage", [False, True])
def test_forced_drafts_all_accepted_or_none_and_the_reply_unchanged(model, reference, garbage):
    engine = build_engine(engine_defaults(draft_cost=FLAT, draft_dspark="on"), model, max_model_len=256,
                          log=lambda line: None)
    core = engine.core
    events = [[] for _ in REQUESTS]
    seqs = [engine.make_sequence(r, events[i].append) for i, r in enumerate(REQUESTS)]
    core.executor.runner.drafter = ScriptedDrafter(
        {s.seq_id: list(r.prompt_ids) + tokens(ref) for s, r, ref in zip(seqs, REQUESTS, reference)}, garbage,
        model.cfg.vocab_size)
    for s in seqs:
        core.add(s)
    while core.has_work():
        core.step()
    assert events == reference
    f = figures(core, "dspark")
    assert f["num_draft_tokens"] > 10
    assert f["num_accepted_tokens"] == (0 if garbage else f["num_draft_tokens"])
    rounds = [evs[-1].tokens_per_round for evs in events]
    assert all(r == 1.0 for r in rounds) if garbage else all(r > 2.0 for r in rounds)


def test_batched_equals_alone_with_drafting_at_different_depths(model, reference):
    caps = [1, 2, 3, 5]
    requests = [GenerationRequest(r.prompt_ids, r.max_tokens, r.sampling, logprobs=r.logprobs, draft=c)
                for r, c in zip(REQUESTS, caps)]
    events, core = run(model, requests, draft_cost=FLAT, draft_lookup="on")
    assert events == reference
    per_pos = figures(core, "dspark")["num_accepted_tokens_per_pos"] + [0] * 5
    assert figures(core, "dspark")["num_draft_tokens"] > 0 and len(per_pos) >= 5
    alone, _ = run(model, [requests[3]], draft_cost=FLAT, draft_lookup="on")
    assert alone[0] == reference[3]
    off = GenerationRequest(REQUESTS[0].prompt_ids, REQUESTS[0].max_tokens, REQUESTS[0].sampling, logprobs=2, draft=0)
    events, core = run(model, [off], draft_cost=FLAT)
    assert events[0] == reference[0] and figures(core, "dspark")["num_drafts"] == 0


def live_bytes(pool, slot: int, pages: list[int], length: int) -> dict:
    """Every stored byte a sequence of `length` absorbed positions reads: its window and DSpark ring rows, its open
    groups' rows, its compressed entries and index keys."""
    out = {}
    for (kind, layer), store in pool.stores.items():
        if kind in ("window", "dspark"):
            window = pool.ring_rows - pool.verify_rows
            pos = torch.arange(max(0, length - window), length)
            out[kind, layer] = store[slot][pos % pool.ring_rows].clone()
        elif kind == "open":
            r = pool.sources[layer].ratio
            pos = torch.arange(length // r * r, length)
            out[kind, layer] = store[slot][pos % pool.open_modulus(r)].clone()
        else:
            per = pool.sources[layer].per_page
            e = torch.arange(length // pool.sources[layer].ratio)
            table = torch.tensor(pages, dtype=torch.long)
            out[kind, layer] = store.flatten(0, 1)[table[e // per] * per + e % per].clone()
    return out


def test_after_rejected_drafts_every_live_cache_byte_equals_the_serial_run(model, reference):
    req = REQUESTS[1]
    runs = {}
    for garbage in (None, True):
        engine = build_engine(engine_defaults(draft_cost=FLAT, draft_dspark="on",
                                              draft_depth=0 if garbage is None else 5), model,
                              max_model_len=256, log=lambda line: None)
        core = engine.core
        seq = engine.make_sequence(req, lambda e: None)
        if garbage:
            core.executor.runner.drafter = ScriptedDrafter({seq.seq_id: list(req.prompt_ids) + tokens(reference[1])},
                                                           True, model.cfg.vocab_size)
        core.add(seq)
        snaps = []
        while seq.produced < req.max_tokens - 1:
            core.step()
            if not seq.prefilling:
                snaps.append(live_bytes(core.executor.runner.pool, seq.slot, seq.pages, seq.num_computed))
        runs[garbage] = (snaps, figures(core, "dspark"))
    (serial, _), (drafted, f) = runs[None], runs[True]
    assert f["num_draft_tokens"] >= 20 and f["num_accepted_tokens"] == 0
    assert len(serial) == len(drafted) > 5
    for a, b in zip(serial, drafted):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_dspark_proposals_over_the_pool_are_the_reference_drafts(model):
    req = GenerationRequest(prompt(7, 21), 2, SamplingParams(temperature=0.7, seed=9))
    engine = build_engine(engine_defaults(draft_cost=FLAT, draft_dspark="on"), model, max_model_len=256,
                          log=lambda line: None)
    core, got = engine.core, []
    seq = engine.make_sequence(req, got.append)
    core.add(seq)
    while not tokens(got):  # the prompt (to its session mark, then the rest), the first token chosen, DSpark
        core.step()  # proposes from it
    y = tokens(got)[0]
    state = model.new_state()
    model.forward(state, torch.tensor(req.prompt_ids))
    params = SamplingParams(0.7, seed=9)
    want = model.dspark.draft(model, state, y, choose=lambda row, i: sample_token(row, params, 9, 1 + i))
    assert seq.proposal == want.tokens
    assert seq.confidence == [float(c) for c in want.confidence]
    core.abort(seq)


def test_lookup_and_depth_policy():
    assert lookup_draft([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert lookup_draft([4, 5, 6, 7], 3) == []
    assert lookup_draft([1, 2, 8, 1, 2, 9, 1, 2], 2) == [9, 1]  # the latest occurrence
    assert expected_tokens([0.5, 0.5], 2) == 1.75
    flat, linear = CostTable([(1, 0.02)]), CostTable([(1, 0.02), (6, 0.12)])
    assert choose_depth([0.9] * 5, 5, flat, 0)[0] == 5
    assert choose_depth([0.9] * 5, 3, flat, 0)[0] == 3
    assert choose_depth([0.9] * 5, 5, linear, 0)[0] == 0  # every row costs as much as a token is worth
    overhead = CostTable([(1, 0.05), (6, 0.08)])
    assert choose_depth([0.05] * 5, 5, overhead, 0)[0] == 0  # a poor drafting stream does not pay for a window
    assert choose_depth([0.95] * 5, 5, overhead, 0)[0] == 5
    assert CostTable.parse("1:0.02,8:0.04")(4) == pytest.approx(0.02 + 0.02 * 3 / 7)


def test_grammar_masks_and_forced_text_under_drafts_equal_serial(model):
    from dsv41.structured.grammar import Grammars
    from dsv41.tiny.model import default_model_dir
    from dsv41.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir())
    grammars = Grammars(default_model_dir() / "tokenizer.json", vocab_size=model.cfg.vocab_size,
                        stop_token_ids=[tok.eos_id])
    pattern = r"(ab|ba|a|b| ){12,40}(cat|dog)\."  # sampled at most positions; "cat"/"dog" forced after a letter

    def request(draft=None):  # a fresh matcher each run
        return GenerationRequest([tok.bos_id] + tok.encode("Animals:"), 40, SamplingParams(temperature=0.7, seed=2),
                                 logprobs=1, grammar=grammars.regex(pattern, thinking=False),
                                 stop_token_ids=frozenset({tok.eos_id}), draft=draft)

    def go(req, drafter=None, **opts):
        opts.setdefault("draft_dspark", "on")
        engine = build_engine(engine_defaults(draft_cost=FLAT, **opts), model, max_model_len=256,
                              encode_text=tok.encode, log=lambda line: None)
        core, events = engine.core, []
        seq = engine.make_sequence(req, events.append)
        if drafter is not None:
            core.executor.runner.drafter = drafter(seq)
        core.add(seq)
        while core.has_work():
            core.step()
        return events, core

    serial, _ = go(request(0))
    assert len(serial) > 8
    full = list(request().prompt_ids) + tokens(serial)
    scripted, core = go(request(), lambda seq: ScriptedDrafter({seq.seq_id: full}, False, model.cfg.vocab_size))
    f = figures(core, "dspark")
    assert scripted == serial and f["num_draft_tokens"] > 0 and f["num_accepted_tokens"] == f["num_draft_tokens"]
    looked, core = go(request(), draft_dspark="off", draft_lookup="on")
    assert looked == serial and figures(core, "lookup")["num_draft_tokens"] > 0


def test_step_cost_calibration_runs_scratch_windows_on_free_slots():
    from dsv41.engine.drafting import measure_step_costs

    seen, now = [], [0.0]

    def execute(batch):
        rows = sum(len(r.token_ids) for r in batch.rows)
        seen.append([(r.slot, len(r.token_ids), r.phase, r.sample) for r in batch.rows])
        now[0] += 0.01 + 0.002 * rows  # a step costs 10 ms + 2 ms a row

    points = measure_step_costs(execute, slots=4, pages=3, max_rows=24, window=6, clock=lambda: now[0])
    assert [n for n, _ in points] == [1, 2, 4, 8, 16, 24]
    assert [round(s, 6) for _, s in points] == [round(0.01 + 0.002 * n, 6) for n, _ in points]
    for rows in seen:
        assert len({slot for slot, *_ in rows}) == len(rows) and all(n <= 6 and s is None for _, n, _, s in rows)
    assert CostTable(points)(12) == pytest.approx(0.01 + 0.002 * 12)


def test_lookup_searches_a_bounded_span():
    ids = [1, 2, 3] + [9] * 50 + [1, 2]
    assert lookup_draft(ids, 2) == [3, 9]
    assert lookup_draft(ids, 2, span=40) == []  # the match lies further back than the span
