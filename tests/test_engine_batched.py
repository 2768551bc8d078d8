"""The batched engine on the real tiny model (CPU, one thread): every reply is bit for bit the one the request gets
alone and the one `SerialEngine` gives over model/ (tokens and logprobs, T = 0 and 0.7), under concurrency, pool
pressure, chunked prefill (chunks of 1, 7, 128, 2048 rows and odd cuts inside ratio-2 groups, against the
reference forward's logits), random cancellations, grammar-forced text, and the tagged approximate knobs."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from dsv41.engine import FinishEvent, GenerationRequest, PromptLogprobsEvent, SamplingParams, TokenEvent
from dsv41.engine.batch import Row
from dsv41.compose.build import build_engine, build_runner, engine_defaults


def prompt(k: int, n: int) -> list[int]:
    return [0] + [(i * 37 + 11 * k) % 500 + 5 for i in range(n - 1)]


REQUESTS = [  # different prompt lengths, temperatures, seeds, budgets, logprobs; submitted at different steps
    GenerationRequest(prompt(0, 5), 9, SamplingParams(temperature=0.0)),
    GenerationRequest(prompt(1, 23), 6, SamplingParams(temperature=0.7, seed=11), logprobs=2),
    GenerationRequest(prompt(2, 40), 8, SamplingParams(temperature=0.7, seed=5, top_p=0.9), prompt_logprobs=1),
    GenerationRequest(prompt(3, 12), 12, SamplingParams(temperature=0.0), logprobs=0),
    GenerationRequest(prompt(4, 31), 7, SamplingParams(temperature=0.7, top_k=20)),
]


@pytest.fixture(scope="module")
def model():
    from dsv41.model.loader import load_model
    from dsv41.tiny.model import default_model_dir

    return load_model(default_model_dir(), dspark=False)


@pytest.fixture(scope="module")
def reference(model):
    """SerialEngine's events for every request of REQUESTS."""
    from dsv41.compose.serial import SerialEngine

    async def main():
        engine = SerialEngine(model, max_model_len=512)
        await engine.start()
        out = []
        for req in REQUESTS:
            out.append([e async for e in engine.submit(req)])
        await engine.shutdown()
        return out

    return asyncio.run(main())


def batched(model, requests, arrivals, cancel=None, **opts):
    """Run `requests` through the batched engine, request i added before step arrivals[i]; `cancel(step)` may
    return a request index to cancel. Returns (events per request, the engine core)."""
    engine = build_engine(engine_defaults(**opts), model, max_model_len=512, log=lambda line: None)
    core = engine.core
    events = [[] for _ in requests]
    seqs = [engine.make_sequence(r, events[i].append) for i, r in enumerate(requests)]
    step = 0
    while step < 10_000:
        for i, at in enumerate(arrivals):
            if at == step:
                core.add(seqs[i])
        if cancel is not None and (victim := cancel(step)) is not None:
            core.abort(seqs[victim])
        if not core.step() and step > max(arrivals) and not core.has_work():
            break
        step += 1
    return events, core


def test_batched_equals_the_reference_engine_and_alone(model, reference):
    events, core = batched(model, REQUESTS, arrivals=[0, 0, 1, 3, 6])
    assert max(core.rows_hist) and core.pool_idle()
    assert events == reference
    assert isinstance(reference[2][0], PromptLogprobsEvent) and reference[1][0].logprob is not None
    for i in (1, 3):  # alone, in an engine of its own
        assert batched(model, [REQUESTS[i]], arrivals=[0])[0][0] == reference[i]


def test_pool_pressure_two_slots_and_pages_for_two(model, reference):
    requests = REQUESTS + REQUESTS[:2]
    events, core = batched(model, requests, arrivals=[0] * len(requests), parallel=2, pool_tokens=2 * 513,
                           page_tokens=64)
    assert events == reference + reference[:2]
    assert core.pool_idle() and core.stats()["slots_total"] == 2


def test_random_cancellations_then_the_next_reply_is_unchanged(model, reference):
    rng = random.Random(3)
    requests = [REQUESTS[i % 5] for i in range(12)]
    arrivals = [rng.randrange(20) for _ in requests]
    plan = {arrivals[i] + rng.randrange(12): i for i in range(12)}  # step -> cancel (queued, prefilling, decoding)
    events, core = batched(model, requests, arrivals=arrivals, cancel=plan.get, parallel=3, prefill_chunk=16,
                           prefill_chunk_alone=0)
    assert core.pool_idle() and not core.has_work()
    for i, evs in enumerate(events):
        assert isinstance(evs[-1], FinishEvent)
        if evs[-1].reason != "cancelled":
            assert evs == reference[i % 5]
    assert sum(evs[-1].reason == "cancelled" for evs in events) >= 4
    assert batched(model, [REQUESTS[2]], arrivals=[0])[0][0] == reference[2]


def test_a_step_whose_requests_all_left_stops_between_layers_and_keeps_nothing(model, reference):
    """A client that leaves during a long prefill chunk (issue 31, item 7): the forward stops before the next layer
    (runtime/abort.py), the request ends as cancelled with its slot and pages back, and the engine's next replies
    keep their bits (nothing of the cut step was stored)."""
    engine = build_engine(engine_defaults(prefill_chunk=16, prefill_chunk_alone=0), model, max_model_len=512,
                          log=lambda line: None)
    core, watch = engine.core, engine.core.executor.runner.abort_watch
    events = []
    seq = engine.make_sequence(REQUESTS[2], events.append)
    core.add(seq)
    core.step()  # the first 16 rows, whole
    check = watch.check

    def leaves_during_layer_2(i, device=None):
        if i == 3:
            seq.cancel_requested = True  # what the server's event loop sets when the client goes
        check(i, device)

    watch.check = leaves_during_layer_2
    core.step()
    watch.check = check
    assert (watch.stopped_at, core.aborted_steps) == (3, 1)
    assert isinstance(events[-1], FinishEvent) and events[-1].reason == "cancelled" and core.pool_idle()
    for i in (2, 0):  # the same prompt again (its 16 rows may resume from the entry its finish left), another
        evs = []
        again = engine.make_sequence(REQUESTS[i], evs.append)
        core.add(again)
        while core.has_work():
            core.step()
        assert [e for e in evs if not isinstance(e, FinishEvent)] == reference[i][:-1]
    assert not engine.core.executor.runner.abort_watch.probe() and core.pool_idle()


SCHEMES = {"one shot (2048)": [2048], "128": [128], "7": [7], "1": [1], "odd cuts in ratio-2 groups": [1, 4, 3, 8, 5, 2048]}


def test_chunked_prefill_over_the_pool_equals_the_reference_one_shot(model):
    ids = prompt(9, 133)
    oneshot = model.forward(model.new_state(), torch.tensor(ids))
    runner = build_runner(engine_defaults(page_tokens=32, parallel=len(SCHEMES)), model, 512, log=lambda line: None)
    pos = {k: 0 for k in SCHEMES}
    cut = {k: 0 for k in SCHEMES}
    got = {k: [] for k in SCHEMES}
    while any(p < len(ids) for p in pos.values()):
        rows = []
        for slot, (name, chunks) in enumerate(SCHEMES.items()):
            if pos[name] >= len(ids):
                continue
            n = chunks[min(cut[name], len(chunks) - 1)]
            a = pos[name]
            row = Row(slot, slot, ids[a:a + n], a, list(range(slot * 5, slot * 5 + 5)), "prefill", ids[max(0, a - 3):a])
            row.scores = [(j, 0, 0) for j in range(len(row.token_ids))]
            rows.append(row)
            pos[name], cut[name] = a + len(row.token_ids), cut[name] + 1
        for row, logits in zip(rows, runner.forward.execute(rows, runner.pool)):
            got[list(SCHEMES)[row.slot]].append(logits)
    for name in SCHEMES:
        assert torch.equal(torch.cat(got[name]), oneshot), name


def test_grammar_forced_text_matches_the_reference_engine(model):
    from dsv41.compose.serial import SerialEngine
    from dsv41.structured.grammar import Grammars
    from dsv41.tokenizer import Tokenizer
    from dsv41.tiny.model import default_model_dir

    tok = Tokenizer.from_dir(default_model_dir())
    grammars = Grammars(default_model_dir() / "tokenizer.json", vocab_size=model.cfg.vocab_size,
                        stop_token_ids=[tok.eos_id])
    requests = [GenerationRequest([tok.bos_id] + tok.encode("Answer:"), 40, logprobs=0, grammar=g,
                                  stop_token_ids=frozenset({tok.eos_id}))
                for g in (grammars.choice(["the lighthouse keeper", "a red fox"], thinking=False),
                          grammars.choice(["the lighthouse keeper wrote"], thinking=False))]

    async def serial():
        engine = SerialEngine(model, max_model_len=512, encode_text=tok.encode)
        await engine.start()
        out = [[e async for e in engine.submit(r)] for r in requests]
        await engine.shutdown()
        return out

    want = asyncio.run(serial())
    engine = build_engine(engine_defaults(), model, max_model_len=512, encode_text=tok.encode, log=lambda line: None)
    events = [[] for _ in requests]
    for i, r in enumerate(requests):
        r2 = GenerationRequest(r.prompt_ids, r.max_tokens, logprobs=0, grammar=r.grammar,
                               stop_token_ids=r.stop_token_ids)  # a fresh matcher: Serial's ran to the end
        engine.core.add(engine.make_sequence(r2, events[i].append))
    while engine.core.step():
        pass
    assert events == want and events[0][-1].reason == "stop"


def test_replay_equals_full_for_prompts_within_the_window_and_is_tagged(model, reference):
    window = model.cfg.sliding_window
    short = [GenerationRequest(prompt(7, n), 6, SamplingParams(temperature=0.7, seed=n)) for n in (3, window)]
    full, _ = batched(model, short, arrivals=[0, 0])
    replay, core = batched(model, short, arrivals=[0, 1], prefill="replay")
    strip = lambda evs: [e for e in evs if isinstance(e, TokenEvent)]  # noqa: E731
    assert [strip(e) for e in replay] == [strip(e) for e in full]
    assert replay[0][-1].tag == "prefill=replay" and full[0][-1].tag == "" and core.pool_idle()
    longer, _ = batched(model, [GenerationRequest(prompt(8, 3 * window), 5)], arrivals=[0], prefill="replay")
    assert longer[0][-1].reason == "length"  # it runs; how close it stays is measured by bench/engine_cells.py


def test_expert_pruning_is_exact_at_full_mass_and_tagged(model, reference):
    keep_all, _ = batched(model, REQUESTS[:2], arrivals=[0, 0], expert_topp=1.0, expert_min_k=1)
    assert [e[:-1] for e in keep_all] == [e[:-1] for e in reference[:2]]
    assert keep_all[0][-1].tag == "expert_topp=1,min_k=1"
    pruned, core = batched(model, REQUESTS[:2], arrivals=[0, 0], expert_topp=0.5, expert_min_k=1)
    assert all(e[-1].reason == "length" for e in pruned) and core.pool_idle()


def test_replay_prefill_is_chunk_invariant(model):
    """Bounded replay is approximate but still exact under chunking: any cut of the prompt (across the replay
    segment's start too) gives the bits of one shot."""
    from dsv41.runtime.kv_pool import pool_for_model
    from dsv41.runtime.pool_forward import PoolForward

    ids = prompt(6, 70)
    start = len(ids) - model.cfg.sliding_window
    forward = PoolForward(model, replay=True)
    results = []
    for chunks in ([len(ids)], [7] * 10, [3, 30, 9, 1, 27]):
        pool = pool_for_model(model, num_slots=1, num_pages=1, page_tokens=128)
        pos, rows = 0, []
        for n in chunks + [1, 1]:  # the prompt, then two decode steps
            toks = ids[pos:pos + n] if pos < len(ids) else [5]
            scores = [(j, 0, 0) for j in range(len(toks)) if pos + j >= start]
            row = Row(0, 0, toks, pos, [0], "prefill", (ids + [5])[max(0, pos - 3):pos], None, scores, start)
            out = forward.execute([row], pool)[0]
            rows += [out] if out is not None and out.numel() else []
            pos += len(toks)
        results.append(torch.cat(rows))
    assert results[0].shape[0] == model.cfg.sliding_window + 2
    assert all(torch.equal(r, results[0]) for r in results[1:])


def test_engine_figures_for_health_and_metrics(model):
    from prometheus_client import CollectorRegistry, generate_latest

    from dsv41.compose.build import EngineCollector, EngineDetail

    engine = build_engine(engine_defaults(parallel=2), model, max_model_len=512, log=lambda line: None)
    seq = engine.make_sequence(REQUESTS[0], lambda event: None)
    engine.core.add(seq)
    engine.core.step()
    detail = dict(EngineDetail(engine))["batching"]
    assert detail["slots_busy"] == 1 and detail["slots_total"] == 2 and detail["pages_used"] >= 1
    assert detail["rounds"] == 1 and detail["rows_per_round"] == {"8": 1} and detail["pool"]["bytes_per_token"] > 0
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    text = generate_latest(registry).decode()
    assert "dsv41_engine_slots_busy 1.0" in text and 'dsv41_engine_rows_per_round_bucket{le="8.0"} 1.0' in text
    engine.core.abort(seq)
    assert engine.stats().live_sequences == 0


@pytest.mark.gpu
def test_the_pool_on_cuda_gives_the_reference_engine_bits():
    """The pool forward on a CUDA pool: a request alone in the batched engine replies bit for bit as SerialEngine
    on CUDA (the same forwards' shapes, so this checks the pool's stores and loads on the device). Batched ==
    alone across row counts is a property of the fast path's kernels: torch's CUDA reductions (the norms' and
    mHC's means) may split a row differently for another row count, so the reference path on CUDA is exact per
    forward shape only."""
    from dsv41.compose.serial import SerialEngine
    from dsv41.model.loader import load_model
    from dsv41.tiny.model import default_model_dir

    model = load_model(default_model_dir(), device="cuda", dspark=False)

    async def serial():
        engine = SerialEngine(model, max_model_len=512, prefill_chunk=2048)
        await engine.start()
        out = [[e async for e in engine.submit(r)] for r in REQUESTS]
        await engine.shutdown()
        return out

    want = asyncio.run(serial())
    for i, request in enumerate(REQUESTS):
        events, core = batched(model, [request], arrivals=[0])
        assert core.executor.runner.pool.buffer.is_cuda and core.pool_idle()
        assert events[0] == want[i], i
    together, _ = batched(model, REQUESTS, arrivals=[0, 0, 1, 3, 6])
    assert all(isinstance(e[-1], FinishEvent) for e in together)


def test_dspark_rings_in_the_pool_hold_what_the_reference_absorbs():
    """With the drafter loaded, every committed row seeds each stage's ring: the pool's DSpark rings (and the
    window rows) after a chunked prefill are the reference state's, bit for bit."""
    from dsv41.model.loader import load_model
    from dsv41.runtime.kv_pool import pool_for_model
    from dsv41.runtime.pool_forward import PoolForward
    from dsv41.tiny.model import default_model_dir

    model = load_model(default_model_dir(), dspark=True)
    ids = prompt(5, 29)
    state = model.new_state()
    model.forward(state, torch.tensor(ids))
    pool = pool_for_model(model, num_slots=2, num_pages=1, page_tokens=64, verify_rows=6)
    forward = PoolForward(model)
    for a, b in ((0, 5), (5, 12), (12, 29)):
        forward.execute([Row(0, 1, ids[a:b], a, [0], "prefill", ids[max(0, a - 3):a])], pool)
    window = model.cfg.sliding_window
    for stage, cache in state.dspark_windows.items():
        assert torch.equal(pool.read_ring("dspark", stage, 1, 29 - window, 29), cache.kv)
    assert torch.equal(pool.read_ring("window", 3, 1, 29 - window, 29), state.windows[3].kv)


def test_the_block_manager_hands_out_only_the_pages_every_rank_holds(model, reference):
    """Under TP each rank sizes its pool from its own free memory; rank 0's executor carries the group's fewest
    pages (parallel/launch.py) and the engine's block manager takes those, never its own pool's count."""
    from dsv41.compose.build import build_runner
    from dsv41.parallel.executor import LocalExecutor

    args = engine_defaults()
    executor = LocalExecutor(build_runner(args, model, 512, log=lambda line: None))
    own = executor.runner.pool.num_pages
    executor.num_pages = own - 3  # as rank 0's LeaderExecutor carries it when rank 1 holds 3 pages fewer
    lines = []
    engine = build_engine(args, executor, max_model_len=512, log=lines.append)
    assert engine.core.blocks.num_pages == own - 3
    assert any(f"{own - 3} of this rank's {own} pages" in line for line in lines)
    events = []
    engine.core.add(engine.make_sequence(REQUESTS[2], events.append))
    while engine.core.has_work():
        engine.core.step()
    assert events == reference[2] and engine.core.pool_idle()
