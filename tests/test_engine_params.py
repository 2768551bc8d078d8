"""The logit adjustments (penalties, logit_bias, allowed ids, bad words, min_tokens): pure functions of the request
and its own tokens, applied the same way by the batched engine and `SerialEngine`, so batched == alone == serial
holds with them on; and each one changes the draw as specified."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dsv41.engine import GenerationRequest, SamplingParams, TokenEvent
from dsv41.runtime.sampling import adjust_logits, banned_ids

from test_engine_batched import batched, prompt


def test_adjust_logits_as_specified():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    p = SamplingParams(repetition_penalty=2.0)
    assert adjust_logits(logits, p, [1], [3], []).tolist() == [2.0, -2.0, 0.5, 1.5, 0.0]
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    assert adjust_logits(logits, p, [0, 0, 2], [3], []).tolist() == [0.0, -1.0, -1.0, 3.0, 0.0]
    p = SamplingParams(logit_bias=((3, -100.0), (4, 5.0)))
    out = adjust_logits(logits, p, [], [], [])
    assert out[3] == -97.0 and out[4] == 5.0 and int(out.argmax()) == 4
    p = SamplingParams(allowed_token_ids=(1, 2))
    out = adjust_logits(logits, p, [], [], [2])
    assert torch.isinf(out[[0, 2, 3, 4]]).all() and out[1] == -1.0
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, 0.0]  # the input is untouched


def test_banned_ids_min_tokens_and_bad_words():
    p = SamplingParams(min_tokens=2, bad_words=((7,), (1, 2, 3)))
    assert banned_ids(p, [5], {0}) == [0, 7]
    assert banned_ids(p, [5, 1, 2], {0}) == [3, 7]
    assert banned_ids(p, [5, 1], {0}) == [7]


ADJUSTED = [
    GenerationRequest(prompt(0, 9), 10, SamplingParams(temperature=0.0, repetition_penalty=1.3)),
    GenerationRequest(prompt(0, 9), 10, SamplingParams(temperature=0.0, seed=3, frequency_penalty=1.5,
                                                       presence_penalty=0.5), logprobs=1),
    GenerationRequest(prompt(2, 6), 7, SamplingParams(temperature=0.0, logit_bias=((17, 4.0), (40, -3.0)),
                                                      bad_words=((21,), (8, 9)))),
    GenerationRequest(prompt(3, 11), 6, SamplingParams(temperature=0.9, seed=8, allowed_token_ids=tuple(range(5, 90)),
                                                       min_tokens=4), stop_token_ids=frozenset({1})),
]


@pytest.fixture(scope="module")
def model():
    from dsv41.model.loader import load_model
    from dsv41.tiny.model import default_model_dir

    return load_model(default_model_dir(), dspark=False)


def serial(model, requests):
    from dsv41.compose.serial import SerialEngine

    async def main():
        engine = SerialEngine(model, max_model_len=512)
        await engine.start()
        out = [[e async for e in engine.submit(r)] for r in requests]
        await engine.shutdown()
        return out

    return asyncio.run(main())


def tokens(events):
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def test_batched_equals_alone_equals_serial_with_adjustments_on(model):
    reference = serial(model, ADJUSTED)
    events, core = batched(model, ADJUSTED, arrivals=[0, 0, 1, 2])
    assert events == reference and core.pool_idle()
    assert batched(model, [ADJUSTED[1]], arrivals=[0])[0][0] == reference[1]
    plain = serial(model, [GenerationRequest(r.prompt_ids, r.max_tokens, SamplingParams(
        temperature=r.sampling.temperature, seed=r.sampling.seed), stop_token_ids=r.stop_token_ids)
        for r in ADJUSTED])
    assert all(tokens(a) != tokens(b) for a, b in zip(reference, plain))  # each adjustment changed the reply
    assert 21 not in tokens(reference[2]) and all(5 <= t < 90 for t in tokens(reference[3]))
    assert len(tokens(reference[3])) == 6 or 1 not in tokens(reference[3])[:4]
