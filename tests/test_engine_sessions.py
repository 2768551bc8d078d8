"""Session entries in RAM (issue 34, engine/sessions.py) on the real tiny model: a next turn resumes from the
state the last turn left and its reply equals, bit for bit, the one an engine without sessions gives (tokens and
logprobs, T = 0 and 0.7), with the page S falls inside copied (16- and 64-token pages) or not (S on a page
boundary); an identical resend resumes just before its last token (the prompt's mark); entries yield their pages to live requests
and stay within their RAM budget; requests sharing a prefix resume together."""

from __future__ import annotations

import pytest

from dsv41.engine import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from dsv41.engine.block_manager import BlockManager
from dsv41.compose.build import build_engine, engine_defaults
from dsv41.engine.sessions import SessionCache, SessionConfig, SessionIndex, prompt_mark


def ids(k: int, n: int, first: int = 0) -> list[int]:
    return [first] + [(i * 37 + 11 * k) % 500 + 5 for i in range(n - 1)]


@pytest.fixture(scope="module")
def model():
    from dsv41.model.loader import load_model
    from dsv41.tiny.model import default_model_dir

    return load_model(default_model_dir(), dspark=False)


def engine(model, max_model_len: int = 512, **opts):
    return build_engine(engine_defaults(**opts), model, max_model_len=max_model_len, log=lambda line: None)


def run(eng, requests, together: bool = False):
    """Events per request: one after the other, or all added before the first step."""
    core, out = eng.core, []
    seqs = []
    for r in requests:
        out.append([])
        seqs.append(eng.make_sequence(r, out[-1].append))
        if not together:
            core.add(seqs[-1])
            while core.has_work():
                core.step()
    if together:
        for s in seqs:
            core.add(s)
        while core.has_work():
            core.step()
    return out


def tokens(events) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def finish(events) -> FinishEvent:
    assert isinstance(events[-1], FinishEvent)
    return events[-1]


# ---------------------------------------------------------------------------------------------------- the index
def test_index_finds_the_longest_strict_prefix_through_the_page_chain():
    blocks = BlockManager(num_pages=64, num_slots=2, page_tokens=4)
    cache = SessionCache(SessionConfig(min_tokens=1, slot_bytes=10), blocks)
    prompt = list(range(100, 140))
    made = {}
    for n in (3, 8, 13, 21):  # inside the first page, on a boundary, inside later pages
        slot, pages = blocks.allocate(n)
        made[n] = cache.take(prompt[:n], pages, slot)
        blocks.free(slot, pages)  # the sequence lets go; the entry keeps its references
    assert cache.find(prompt).length == 21
    assert cache.find(prompt[:21]).length == 13  # strict: the last prompt token is always absorbed
    assert cache.find(prompt[:13] + [1] + prompt[14:]).length == 13  # differs inside entry 21's tail page
    assert cache.find(prompt[:5] + [1] + prompt[6:]).length == 3  # differs inside the second page
    assert cache.find([7] + prompt[1:]) is None
    assert cache.take(prompt[:8], made[8].pages, slot=1) is None  # the same ids: kept once
    cache.evict()  # the coldest: 3 (8 was touched by the repeat)
    assert cache.find(prompt[:7]) is None and cache.find(prompt[:12]).length == 8
    cache.clear()
    assert blocks.empty() and cache.stats.made == 4 and cache.stats.evicted == 4
    ops, freed = cache.batch_ops()
    assert not any(ops.values()) and sorted(freed) == list(range(13))  # never saved: no drops


def test_prompt_mark_is_just_before_the_last_token():
    assert prompt_mark(17, 16) == 16 and prompt_mark(16, 16) is None and prompt_mark(48, 16) == 47
    assert prompt_mark(2, 1) == 1 and prompt_mark(1, 1) is None


def test_the_index_walks_only_the_chains_it_holds():
    index = SessionIndex(SessionConfig(min_tokens=1), page_tokens=2)
    a = index.add([1, 2, 3, 4, 5], [0, 1, 2])
    index.add([1, 2, 9], [0, 3])
    assert index.find([1, 2, 3, 4, 5, 6], 5) is a and index.find([1, 2, 3, 4, 5, 6], 4) is None
    assert index.find([1, 2, 9, 9], 3).ids.tolist() == [1, 2, 9]
    index.remove(a)
    assert index.find([1, 2, 3, 4, 5, 6], 6) is None and not index._through.get(b"x")


# ---------------------------------------------------------------------------------------------------- resumed == fresh
@pytest.mark.parametrize("page_tokens", [16, 64])
def test_the_next_turn_resumes_and_equals_a_fresh_prefill(model, page_tokens):
    first = GenerationRequest(ids(1, 61), 9, SamplingParams(temperature=0.0), logprobs=2)
    eng = engine(model, page_tokens=page_tokens)
    (turn1,) = run(eng, [first])
    # turn 2: the history (prompt + reply) and a new message; at T = 0 and at T = 0.7 (seeded)
    history = first.prompt_ids + tokens(turn1)
    second = [GenerationRequest(history + [7, 8, 9, 10, 11], 8, SamplingParams(temperature=t, seed=3), logprobs=3)
              for t in (0.0, 0.7)]
    resumed = run(eng, second)
    fresh = run(engine(model, page_tokens=page_tokens, sessions="off"), second)
    assert resumed == fresh
    # turn 1 ended with 61 + 9 - 1 ids in the cache: the first resumes there; the second, the same prompt, from the
    # first's mark just before its last token
    assert [finish(r).cached_tokens for r in resumed] == [69, 74] and finish(fresh[0]).cached_tokens == 0
    assert eng.core.pool_idle() and eng.core.stats()["sessions"]["hits"] == 2


def test_without_reply_entries_the_next_turn_resumes_at_the_prompts_mark(model):
    """A forward whose decode rows are not its prefill rows bit for bit (the fast path) makes no entry at a reply's
    end: the next turn resumes at the last prompt's mark and prefills the reply again, and equals fresh."""
    eng = engine(model)
    assert eng.core.sessions.config.reply_entries  # the reference on the CPU: decoded rows are prefilled rows
    eng.core.sessions.config.reply_entries = False
    first = GenerationRequest(ids(4, 50), 7, SamplingParams(temperature=0.0))
    (turn1,) = run(eng, [first])
    second = GenerationRequest(first.prompt_ids + tokens(turn1) + [9, 8, 7], 6, SamplingParams(temperature=0.7, seed=5),
                               logprobs=2)
    (resumed,) = run(eng, [second])
    (fresh,) = run(engine(model, sessions="off"), [second])
    assert resumed == fresh and finish(resumed).cached_tokens == 49  # turn 1's mark, not its reply's end (56)
    assert eng.core.stats()["sessions"]["made"] == 2 and eng.core.pool_idle()  # the two prompts' marks only


def test_an_identical_resend_resumes_at_the_prompts_mark(model):
    req = GenerationRequest(ids(2, 40), 6, SamplingParams(temperature=0.7, seed=1), logprobs=1)
    eng = engine(model)
    once, again = run(eng, [req, req])
    assert once == again and finish(again).cached_tokens == 39 and finish(once).cached_tokens == 0


def test_requests_sharing_a_prefix_resume_together_and_equal_fresh(model):
    base = GenerationRequest(ids(3, 50), 4, SamplingParams(temperature=0.0))
    eng = engine(model, page_tokens=16)
    run(eng, [base])
    branches = [GenerationRequest(base.prompt_ids + [20 + k] * (k + 1), 6, SamplingParams(temperature=0.7, seed=k),
                                  logprobs=1) for k in range(3)]
    resumed = run(eng, branches, together=True)
    assert resumed == run(engine(model, page_tokens=16, sessions="off"), branches, together=True)
    assert all(finish(r).cached_tokens == 49 for r in resumed)  # base's mark (its end, 53, is no prefix)
    assert eng.core.pool_idle()


def run_group(eng, requests):
    core, out = eng.core, [[] for _ in requests]
    core.add_group([eng.make_sequence(r, out[i].append) for i, r in enumerate(requests)])
    while core.has_work():
        core.step()
    return out


@pytest.mark.parametrize("extra", [0, 9])  # the group's fork point is the entry's end, or past it
def test_a_group_resumes_its_prompt_then_forks_and_equals_fresh(model, extra):
    base = GenerationRequest(ids(8, 45), 4, SamplingParams(temperature=0.0))
    eng = engine(model, page_tokens=16)
    run(eng, [base])  # entries at 44 (the mark) and 47 (the end)
    prompt = base.prompt_ids + [30 + i for i in range(extra)] if extra else base.prompt_ids
    group = [GenerationRequest(prompt, 5, SamplingParams(temperature=0.7, seed=s), logprobs=1) for s in range(3)]
    resumed = run_group(eng, group)
    assert resumed == run_group(engine(model, page_tokens=16, sessions="off"), group)
    assert [finish(r).cached_tokens for r in resumed] == [44] * 3 and eng.core.pool_idle()
    assert eng.core.forks_total == 2


def test_prompt_logprobs_prefill_from_the_start(model):
    req = GenerationRequest(ids(4, 30), 3, SamplingParams(temperature=0.0), prompt_logprobs=1)
    eng = engine(model)
    a, b = run(eng, [req, req])
    assert a == b and finish(b).cached_tokens == 0


# ---------------------------------------------------------------------------------------------------- memory
def test_entries_yield_their_pages_to_live_requests(model):
    # a pool of 8 pages of 64: every request needs 2; entries of earlier prompts hold pages until a request needs them
    eng = engine(model, page_tokens=64, pool_tokens=512, parallel=2)
    reqs = [GenerationRequest(ids(10 + k, 70), 8, SamplingParams(temperature=0.0)) for k in range(6)]
    events = run(eng, reqs) + run(eng, reqs[:3], together=True)
    assert all(finish(e).reason == "length" for e in events)
    figures = eng.core.stats()["sessions"]
    assert figures["evicted"] > 0 and figures["pages"] <= 8 and eng.core.pool_idle()
    fresh = run(engine(model, page_tokens=64, sessions="off"), reqs[:3])
    assert events[6:] == fresh


def test_in_a_pool_of_one_context_even_the_entry_to_resume_from_yields(model):
    # 2 pages of 64: turn 1's entries hold both; turn 2 needs both (its partial page is the entry's): it prefills
    first = GenerationRequest(ids(30, 70), 5, SamplingParams(temperature=0.0))
    eng = engine(model, max_model_len=127, page_tokens=64, parallel=1)
    assert eng.core.blocks.num_pages == 2
    (turn1,) = run(eng, [first])
    second = GenerationRequest(first.prompt_ids + tokens(turn1) + [5, 6], 40, SamplingParams(temperature=0.0))
    (replied,) = run(eng, [second])
    assert finish(replied).reason == "length" and finish(replied).cached_tokens == 0
    assert replied == run(engine(model, max_model_len=127, page_tokens=64, sessions="off"), [second])[0]


def test_the_ram_budget_keeps_the_most_recent_entries(model):
    eng = engine(model)
    slot = eng.core.sessions.config.slot_bytes
    eng = engine(model, session_ram_mib=2.5 * slot / (1 << 20))  # two snapshots
    run(eng, [GenerationRequest(ids(20 + k, 40), 3, SamplingParams(temperature=0.0)) for k in range(3)])
    figures = eng.core.stats()["sessions"]
    assert figures["entries"] == 2 and figures["snapshot_bytes"] <= 2.5 * slot and figures["made"] == 6
    assert len(eng.core.executor.runner.snapshots) == 2  # the runtime let go of the evicted ones


# ---------------------------------------------------------------------------------------------------- the NVMe tier
def parked_engine(model, directory, **opts):
    eng = engine(model, session_dir=str(directory), session_disk_min_tokens=16, page_tokens=16, **opts)
    eng.core.sessions.config.disk_gain = 1  # load any parked entry longer than what RAM holds
    return eng


def stop(eng) -> None:
    """What the server's graceful stop does: every RAM entry parked, the pool operations run."""
    eng.core.sessions.park_all()
    while eng.core.has_work():
        eng.core.step()


def test_a_restarted_engine_resumes_parked_entries_and_equals_fresh(model, tmp_path):
    first = GenerationRequest(ids(5, 70), 6, SamplingParams(temperature=0.0))
    eng = parked_engine(model, tmp_path)
    (turn1,) = run(eng, [first])
    stop(eng)
    assert eng.core.stats()["sessions"]["parked"] == 2 and len(list((tmp_path / "rank0").glob("*.ses"))) == 2
    second = GenerationRequest(first.prompt_ids + tokens(turn1) + [9, 9, 8], 6, SamplingParams(temperature=0.7,
                               seed=2), logprobs=2)
    again = parked_engine(model, tmp_path)  # a new process's engine over the same folder
    (resumed,) = run(again, [second])
    (fresh,) = run(engine(model, page_tokens=16, sessions="off"), [second])
    assert resumed == fresh and finish(resumed).cached_tokens == 75
    assert again.core.stats()["sessions"]["disk_hits"] == 1 and again.core.pool_idle()


def test_a_damaged_parked_entry_is_dropped_and_the_reply_is_the_fresh_one(model, tmp_path):
    req = GenerationRequest(ids(6, 60), 5, SamplingParams(temperature=0.7, seed=4), logprobs=1)
    eng = parked_engine(model, tmp_path)
    run(eng, [req])
    stop(eng)
    from dsv41.sessions.files import read_header

    for path in (tmp_path / "rank0").glob("*.ses"):  # one byte of every file's slot snapshot
        with open(path, "rb") as f:
            header, start = read_header(f)
        at = start + next(b["offset"] for b in header["blocks"] if b["name"] == "slot") + 100
        raw = bytearray(path.read_bytes())
        raw[at] ^= 0x10
        path.write_bytes(bytes(raw))
    again = parked_engine(model, tmp_path)
    (replied,) = run(again, [req])
    (fresh,) = run(engine(model, page_tokens=16, sessions="off"), [req])
    figures = again.core.stats()["sessions"]
    assert replied == fresh and finish(replied).cached_tokens == 0
    assert figures["disk_failed"] == 1 and figures["disk"]["read_failures"] == 1


@pytest.mark.gpu
def test_the_fast_path_resumes_and_equals_a_fresh_prefill(tiny_model_dir, tmp_path):
    """On CUDA over the FastModel (the serving path): the next turn from RAM and from the NVMe tier equals a fresh
    prefill (tokens and logprobs at T = 0.7; the fast path's prefill is chunked == one-shot on the tiny shapes),
    resuming at turn 1's mark (no entry at a reply's end: decoded rows are not prefilled rows there)."""
    import torch

    from dsv41.runtime.build import build_fast_model

    fast = build_fast_model(tiny_model_dir, "cuda", torch.bfloat16)

    def gpu_engine(**opts):
        return build_engine(engine_defaults(forward="fast", page_tokens=16, **opts), fast, max_model_len=512,
                            log=lambda line: None)

    first = GenerationRequest(ids(9, 90), 6, SamplingParams(temperature=0.0))
    eng = gpu_engine(session_dir=str(tmp_path), session_disk_min_tokens=16)
    (turn1,) = run(eng, [first])
    second = GenerationRequest(first.prompt_ids + tokens(turn1) + [4, 5, 6], 8,
                               SamplingParams(temperature=0.7, seed=8), logprobs=2)
    (resumed,) = run(eng, [second])
    (fresh,) = run(gpu_engine(sessions="off"), [second])
    # the fast path's decoded rows are not its prefilled rows: the entry is turn 1's mark (89), not its end (95)
    assert resumed == fresh and finish(resumed).cached_tokens == 89
    stop(eng)
    again = gpu_engine(session_dir=str(tmp_path), session_disk_min_tokens=16)
    again.core.sessions.config.disk_gain = 1
    (parked,) = run(again, [second])
    assert parked == fresh and again.core.stats()["sessions"]["disk_hits"] == 1
