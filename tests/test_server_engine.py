"""The engine side of serving, in process with the real tiny model: stop strings, jump-forward, cancellation."""

import asyncio

import pytest

from dsv41.engine import EngineClosed, FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from dsv41.server.stop import StopMatcher
from server_harness import model_dir


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(["END", "xyz"])
    assert m.feed("abc E") == "abc "  # "E" could start "END"
    assert m.feed("N") == ""
    assert m.feed("D and more") == "" and m.stopped
    assert m.feed("ignored") == ""
    m = StopMatcher(["END"])
    assert m.feed("fine EN") == "fine "
    assert m.feed("ough") == "ENough"  # the partial match fell through
    assert m.feed(" E") == " " and m.flush() == "E"  # at the end a pending partial match is just text
    assert StopMatcher([]).feed("anything") == "anything"
    m = StopMatcher(["ab", "b"])
    assert m.feed("xab") == "x" and m.stopped  # the earliest match wins


class CountingModel:
    """The real model, with its forward calls counted."""

    def __init__(self, model):
        self.model, self.cfg, self.calls = model, model.cfg, []

    def new_state(self):
        return self.model.new_state()

    def forward(self, state, ids, **kw):
        self.calls.append(len(ids))
        return self.model.forward(state, ids, **kw)


@pytest.fixture(scope="module")
def parts():
    from dsv41.structured.grammar import Grammars
    from dsv41.model.loader import load_model
    from dsv41.tokenizer import Tokenizer

    folder = model_dir()
    tokenizer = Tokenizer.from_dir(folder)
    model = CountingModel(load_model(folder))
    grammars = Grammars(folder / "tokenizer.json", vocab_size=model.cfg.vocab_size, stop_token_ids=[tokenizer.eos_id])
    return model, tokenizer, grammars


def _run(engine, request, cancel_after=None):
    async def main():
        await engine.start()
        stream = engine.submit(request)
        events = []
        async for event in stream:
            events.append(event)
            if cancel_after is not None and len(events) == cancel_after:
                stream.cancel()
                break
        for _ in range(200):  # the worker frees the state within a step
            if engine.stats().live_sequences == 0 and engine.stats().running == 0:
                break
            await asyncio.sleep(0.02)
        stats = engine.stats()
        engine.begin_drain()
        with pytest.raises(EngineClosed):
            engine.submit(request)
        await engine.shutdown()
        return events, stats

    return asyncio.run(main())


def test_forced_text_is_one_forward(parts):
    from dsv41.compose.serial import SerialEngine

    model, tokenizer, grammars = parts
    text = "the lighthouse keeper wrote the time"
    grammar = grammars.choice([text], thinking=False)
    prompt = [tokenizer.bos_id] + tokenizer.encode("Answer:")
    model.calls.clear()
    engine = SerialEngine(model, max_model_len=256, encode_text=tokenizer.encode)
    events, _ = _run(engine, GenerationRequest(prompt_ids=prompt, max_tokens=64, grammar=grammar,
                                               stop_token_ids=frozenset({tokenizer.eos_id}), logprobs=0))
    tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert tokenizer.decode(tokens) == text + tokenizer.decode([tokenizer.eos_id])
    assert events[-1] == FinishEvent("stop", len(prompt), len(tokens))
    # prefill, one forward for the whole forced text, then EOS is sampled (no forward after the last token)
    assert model.calls == [len(prompt), len(tokens) - 1]
    assert all(e.logprob is not None and e.logprob <= 0 for e in events if isinstance(e, TokenEvent))


def test_cancel_frees_the_sequence(parts):
    from dsv41.compose.serial import SerialEngine

    model, tokenizer, _ = parts
    engine = SerialEngine(model, max_model_len=4096)
    request = GenerationRequest(prompt_ids=[tokenizer.bos_id, 5, 6], max_tokens=1000, ignore_eos=True,
                                sampling=SamplingParams(seed=3))
    events, stats = _run(engine, request, cancel_after=3)
    assert len(events) == 3 and stats.live_sequences == 0 and stats.running == 0
    assert stats.generation_tokens_total < 10  # it stopped right after the cancel


def test_engine_refuses_requests_it_cannot_serve(parts):
    from dsv41.compose.serial import SerialEngine

    model, tokenizer, _ = parts
    engine = SerialEngine(model, max_model_len=256)
    with pytest.raises(ValueError, match="prompt token"):
        engine.submit(GenerationRequest(prompt_ids=[], max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.submit(GenerationRequest(prompt_ids=[tokenizer.bos_id], max_tokens=0))
