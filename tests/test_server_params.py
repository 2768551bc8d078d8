"""The sampling parameters on the real server with the official client: each honoured one changes the reply as
specified, and out-of-range values are 400s."""

from __future__ import annotations

import openai
import pytest

from server_harness import SERVED_NAME, client, server, tokenizer  # noqa: F401 (pytest fixtures)

PROMPT = "the cat sat on the mat and the cat sat on the mat and the cat"


def complete(client, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0.0)
    extra = {k: kw.pop(k) for k in list(kw) if k in (
        "repetition_penalty", "min_tokens", "stop_token_ids", "bad_words", "allowed_token_ids",
        "include_stop_str_in_output", "ignore_eos")}
    return client.completions.create(model=SERVED_NAME, prompt=PROMPT, extra_body=extra, **kw)


def test_logit_bias_removes_the_greedy_token_and_penalties_change_greedy_output(client, tokenizer):
    base = complete(client, ignore_eos=True, max_tokens=48)
    greedy = complete(client, max_tokens=1, logprobs=1).choices[0].logprobs
    same = [t for t in range(tokenizer.vocab_size) if tokenizer.decode_token(t) == greedy.tokens[0]]
    biased = complete(client, max_tokens=1, logit_bias={str(t): -100 for t in same[:300]}, logprobs=1)
    # logprobs are the raw model's: the greedy token had the highest, the one drawn instead has less
    assert biased.choices[0].logprobs.token_logprobs[0] < greedy.token_logprobs[0]
    text = base.choices[0].text
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 3.0}):
        assert complete(client, ignore_eos=True, max_tokens=48, **kw).choices[0].text != text, kw


def test_allowed_ids_bad_words_stop_token_ids_and_min_tokens(client, tokenizer):
    allowed = [283, 297, 307, 262]  # " c", "at", " m", " the"
    names = [tokenizer.decode_token(t) for t in allowed]
    resp = complete(client, allowed_token_ids=allowed, max_tokens=12, logprobs=0, ignore_eos=True)
    tokens = resp.choices[0].logprobs.tokens
    assert set(tokens) <= set(names) and len(tokens) == 12
    banned = complete(client, allowed_token_ids=allowed, max_tokens=12, logprobs=0, ignore_eos=True,
                      bad_words=["the"]).choices[0].logprobs.tokens
    assert " the" not in banned and set(banned) <= set(names)
    if " the" in tokens:
        assert banned != tokens
    stop = next(t for t in tokens[1:] if t in names)
    cut = complete(client, allowed_token_ids=allowed, max_tokens=12, stop_token_ids=[allowed[names.index(stop)]])
    at = tokens.index(stop)
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == at + 1
    assert cut.choices[0].text == "".join(tokens[:at])  # the stop token is not shown
    # EOS allowed and even favoured, but banned for the first 8 tokens: the reply runs its whole budget
    eos = tokenizer.eos_id
    long = complete(client, max_tokens=8, min_tokens=8, allowed_token_ids=[eos, *allowed], logit_bias={str(eos): 50})
    assert long.usage.completion_tokens == 8 and long.choices[0].finish_reason == "length"
    short = complete(client, max_tokens=8, min_tokens=3, allowed_token_ids=[eos, *allowed], logit_bias={str(eos): 50})
    assert short.usage.completion_tokens == 4 and short.choices[0].finish_reason == "stop"


def test_include_stop_str_in_output(client):
    base = complete(client, ignore_eos=True).choices[0].text
    stop = base.strip()[:3]
    cut = complete(client, ignore_eos=True, stop=[stop]).choices[0].text
    kept = complete(client, ignore_eos=True, stop=[stop], include_stop_str_in_output=True).choices[0].text
    assert kept == cut + stop and stop not in cut


@pytest.mark.parametrize("body", [
    {"frequency_penalty": 2.5}, {"presence_penalty": -3}, {"repetition_penalty": 0}, {"logit_bias": {"5": 101}},
    {"logit_bias": {"x": 1}}, {"logit_bias": {"99999999": 1}}, {"stop_token_ids": [-1]}, {"allowed_token_ids": []},
    {"min_tokens": 20, "max_tokens": 5}, {"bad_words": [""]},
])
def test_out_of_range_values_are_400(client, body):
    body = dict(body)
    max_tokens = body.pop("max_tokens", 5)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=max_tokens, extra_body=body)


MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def test_n_choices_equal_single_requests_with_the_corresponding_seeds(client):
    chat = dict(model=SERVED_NAME, messages=MESSAGES, max_tokens=10, temperature=1.0,
                extra_body={"reasoning_effort": "none"})
    many = client.chat.completions.create(n=3, seed=40, **chat)
    assert [c.index for c in many.choices] == [0, 1, 2] and many.seed == 40
    singles = [client.chat.completions.create(seed=40 + i, **chat) for i in range(3)]
    assert [c.message.content for c in many.choices] == [s.choices[0].message.content for s in singles]
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    streamed = {}
    for chunk in client.chat.completions.create(n=3, seed=40, stream=True, stream_options={"include_usage": True},
                                                **chat):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == many.usage.completion_tokens
    assert [streamed[i] for i in range(3)] == [c.message.content for c in many.choices]
    # completions: unseeded n=2 draws seed, seed + 1; the reply says which
    two = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0)
    again = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                      seed=(two.seed + 1) % 2**64)
    assert two.choices[1].text == again.choices[0].text


def test_completions_prompt_lists_and_echo_scoring(client, tokenizer):
    prompts = ["The lighthouse", "A red fox"]
    batch = client.completions.create(model=SERVED_NAME, prompt=prompts, max_tokens=6, temperature=0.0)
    alone = [client.completions.create(model=SERVED_NAME, prompt=p, max_tokens=6, temperature=0.0) for p in prompts]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert [c.index for c in batch.choices] == [0, 1]
    ids = [tokenizer.encode(p) for p in prompts]
    by_ids = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=6, temperature=0.0, n=2)
    assert [c.index for c in by_ids.choices] == [0, 1, 2, 3] and by_ids.usage.prompt_tokens == sum(map(len, ids))
    scored = client.completions.create(model=SERVED_NAME, prompt=prompts[0], max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == prompts[0] and scored.usage.completion_tokens == 0
    # the BOS the server put in front is neither echoed nor scored, so every echoed token has its logprob
    assert len(choice.logprobs.tokens) == len(ids[0]) and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    plain = client.completions.create(model=SERVED_NAME, prompt=prompts[0], max_tokens=0, echo=True)
    assert plain.choices[0].text == prompts[0] and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=0)


def test_a_tool_call_cut_by_max_tokens_is_length_with_nothing_invented(client):
    import json

    import jsonschema
    from test_server_tools import ASK, NO_THINKING, SCHEMAS, TOOLS

    seen_cut = False
    for budget in (3, 10, 22):
        resp = client.chat.completions.create(model=SERVED_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=budget, seed=0,
                                              extra_body=NO_THINKING)
        choice = resp.choices[0]
        assert "DSML" not in (choice.message.content or "") and "｜" not in (choice.message.content or "")
        if choice.finish_reason != "length":
            continue
        seen_cut = True
        for call in choice.message.tool_calls or []:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                continue  # what the model wrote before the cut, not closed by the server
            jsonschema.validate(arguments, SCHEMAS[call.function.name])  # never "{}" with fields missing
    assert seen_cut


def test_continuous_usage_stats(client):
    chunks = list(client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=5, stream=True,
                                            extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5 and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)


def test_chat_skip_special_tokens(client, tokenizer):
    user = tokenizer.special("user")
    chat = dict(model=SERVED_NAME, messages=MESSAGES, max_tokens=3, temperature=0.0)
    body = {"reasoning_effort": "none", "logit_bias": {str(user): 100}, "ignore_eos": True}
    hidden = client.chat.completions.create(extra_body=body, **chat).choices[0].message.content or ""
    shown = client.chat.completions.create(extra_body={**body, "skip_special_tokens": False}, **chat)
    assert "<｜User｜>" not in hidden and shown.choices[0].message.content == "<｜User｜>" * 3
