"""vLLM's request extras and the /v1/messages refusals (issue 33 items 8 and 10), with the official `openai` and
`anthropic` clients against the real server on the tiny model.

Item 8: `return_token_ids`, `prompt_logprobs`, chat `echo`, `truncate_prompt_tokens`, `priority`, `request_id`
honoured as vLLM defines them or refused with a 400 naming the field; `structural_tag` and
`structured_outputs.grammar` enforced through xgrammar.
Item 10: an unknown model on /v1/messages is a 404; what Anthropic refuses is refused (400, Anthropic's error
object); a pattern that matches nothing is refused up front; error messages carry no library internals.
"""

from __future__ import annotations

import json
import re

import anthropic
import openai
import pytest

from server_harness import API_KEY, SERVED_NAME, client, server  # noqa: F401  (shared fixtures)

HI = [{"role": "user", "content": "Hi"}]
OFF = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def claude(server):  # noqa: F811
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def _tokens(server, body: dict) -> list[int]:  # noqa: F811
    with server.http() as http:
        r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ---- item 8 ---------------------------------------------------------------------------------------------------
def test_return_token_ids(client, server):  # noqa: F811
    kwargs = dict(model=SERVED_NAME, messages=HI, max_tokens=8, seed=4, extra_body={**OFF, "return_token_ids": True})
    resp = client.chat.completions.create(**kwargs)
    body = resp.model_dump()
    assert body["prompt_token_ids"] == _tokens(server, {"messages": HI, **OFF})
    ids = body["choices"][0]["token_ids"]
    assert len(ids) == resp.usage.completion_tokens
    streamed, prompt_ids = [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        extra = chunk.model_dump()
        prompt_ids = extra.get("prompt_token_ids", prompt_ids)
        if chunk.choices:
            streamed += extra["choices"][0].get("token_ids") or []
    assert streamed == ids and prompt_ids == body["prompt_token_ids"]
    comp = client.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=5, seed=4,
                                     extra_body={"return_token_ids": True}).model_dump()
    choice = comp["choices"][0]
    assert choice["prompt_token_ids"] == _tokens(server, {"prompt": "Hi"})
    assert len(choice["token_ids"]) == comp["usage"]["completion_tokens"]


def test_prompt_logprobs(client, server):  # noqa: F811
    resp = client.chat.completions.create(model=SERVED_NAME, messages=HI, max_tokens=2, seed=4,
                                          extra_body={**OFF, "prompt_logprobs": 2}).model_dump()
    prompt = _tokens(server, {"messages": HI, **OFF})
    rows = resp["prompt_logprobs"]
    assert len(rows) == len(prompt) and rows[0] is None
    for token, row in zip(prompt[1:], rows[1:]):
        assert str(token) in row and len(row) <= 3
        ranks = sorted(v["rank"] for v in row.values() if v["rank"] is not None)
        assert ranks[:2] == [1, 2] and all(v["logprob"] <= 0 for v in row.values())
    comp = client.completions.create(model=SERVED_NAME, prompt="Hi there", max_tokens=1,
                                     extra_body={"prompt_logprobs": 0}).model_dump()
    assert len(comp["choices"][0]["prompt_logprobs"]) == comp["usage"]["prompt_tokens"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SERVED_NAME, messages=HI, max_tokens=2, stream=True,
                                       extra_body={"prompt_logprobs": 1})
    assert info.value.body["param"] == "prompt_logprobs"


def test_chat_echo_truncate_request_id_priority(client):  # noqa: F811
    prefill = [*HI, {"role": "assistant", "content": "Well, "}]
    resp = client.chat.completions.create(model=SERVED_NAME, messages=prefill, max_tokens=4, seed=4, extra_body={
        "echo": True, "continue_final_message": True, "add_generation_prompt": False})
    assert resp.choices[0].message.content.startswith("Well, ")
    stream = client.chat.completions.create(model=SERVED_NAME, messages=prefill, max_tokens=4, seed=4, stream=True,
                                            extra_body={"echo": True, "continue_final_message": True,
                                                        "add_generation_prompt": False})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == resp.choices[0].message.content
    cut = client.chat.completions.create(model=SERVED_NAME, messages=HI, max_tokens=2, seed=4,
                                         extra_body={"truncate_prompt_tokens": 3})
    assert cut.usage.prompt_tokens == 3
    comp = client.completions.create(model=SERVED_NAME, prompt="one two three four", max_tokens=1, echo=True,
                                     extra_body={"truncate_prompt_tokens": 2})
    assert comp.usage.prompt_tokens == 2 and "one" not in comp.choices[0].text
    named = client.chat.completions.create(model=SERVED_NAME, messages=HI, max_tokens=1,
                                           extra_body={"request_id": "my-trace-7"})
    assert named.id == "chatcmpl-my-trace-7"
    assert client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=1,
                                     extra_body={"request_id": "r1"}).id == "cmpl-r1"
    client.chat.completions.create(model=SERVED_NAME, messages=HI, max_tokens=1, extra_body={"priority": 0})
    for extra, param in (({"priority": 3}, "priority"), ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                         ({"truncate_prompt_tokens": 1 << 20}, "truncate_prompt_tokens"),
                         ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=SERVED_NAME, messages=HI, max_tokens=1, extra_body=extra)
        assert info.value.body["param"] == param, info.value.body


def test_structural_tag_and_grammar(client):  # noqa: F811
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<answer>", "end": "</answer>",
        "content": {"type": "json_schema", "json_schema": {"type": "object", "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": False}}}}
    for stream in (False, True):
        for extra in ({"response_format": tag}, {"structured_outputs": {"structural_tag": json.dumps(tag)}}):
            kwargs = dict(model=SERVED_NAME, messages=HI, max_tokens=100, seed=6, extra_body={**OFF, **extra})
            if stream:
                text = "".join(c.choices[0].delta.content or ""
                               for c in client.chat.completions.create(stream=True, **kwargs) if c.choices)
            else:
                text = client.chat.completions.create(**kwargs).choices[0].message.content
            match = re.fullmatch(r"<answer>(.*)</answer>", text, re.S)
            assert match, text
            assert 0 <= json.loads(match.group(1))["n"] <= 9
    legacy = {"type": "structural_tag", "triggers": ["<f>"],
              "structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}]}
    client.chat.completions.create(model=SERVED_NAME, messages=HI, max_tokens=4, extra_body={
        **OFF, "response_format": legacy})
    text = client.chat.completions.create(model=SERVED_NAME, messages=HI, max_tokens=8, seed=6, extra_body={
        **OFF, "structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}).choices[0].message.content
    assert text in ("yes", "no")
    for extra, words in (({"structured_outputs": {"grammar": 'root ::= "yes" |'}}, "grammar"),
                         ({"response_format": {"type": "structural_tag", "format": {"type": "token", "token": 449}}},
                          "token ids")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=SERVED_NAME, messages=HI, max_tokens=4, extra_body=extra)
        assert words in info.value.body["message"]


# ---- item 10 --------------------------------------------------------------------------------------------------
def test_messages_unknown_model_is_404(claude):
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=HI)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="no-such-model", messages=HI)
    assert claude.messages.create(model="deepseek-v4.1-flash", max_tokens=1, messages=HI).model == "deepseek-v4.1-flash"


TOOL = {"name": "f", "description": "d", "input_schema": {"type": "object", "properties": {"a": {"type": "string"}}}}
USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": "x"}}]}


@pytest.mark.parametrize("fields,words", [
    ({"stop_sequences": [""]}, "non-whitespace"),
    ({"stop_sequences": ["  "]}, "non-whitespace"),
    ({"messages": [{"role": "user", "content": ""}]}, "non-empty content"),
    ({"messages": [{"role": "user", "content": []}]}, "non-empty content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, "must be non-empty"),
    ({"messages": [*HI, {"role": "assistant", "content": ""}, *HI]}, "non-empty content"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]},
     "corresponding `tool_use`"),
    ({"messages": [*HI, USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "x"}]}]}, "corresponding `tool_use`"),
    ({"messages": [*HI, USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x", "is_error": "yes"}]}]}, "valid boolean"),
    ({"tools": [dict(TOOL, description=5)]}, "valid string"),
])
def test_messages_refused_as_anthropic_does(claude, fields, words):
    body = {"model": SERVED_NAME, "max_tokens": 4, "messages": HI, **fields}
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(**body)
    error = info.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"], error
    # the tool_use it answers makes the same tool_result fine; a final assistant prefill may be empty
    if "tool_use_id" in json.dumps(fields) and "is_error" not in json.dumps(fields):
        ok = [*HI, USE, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                       "content": "x", "is_error": True}]}]
        assert claude.messages.count_tokens(model=SERVED_NAME, messages=ok, tools=[TOOL]).input_tokens


def test_pattern_that_matches_nothing_is_refused_up_front(client, claude):  # noqa: F811
    dead = {"type": "object", "properties": {"code": {"type": "string", "pattern": "[^\\s\\S]"}}, "required": ["code"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": dead}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=SERVED_NAME, messages=HI, max_tokens=4, tools=tools,
                                           tool_choice=choice)
        assert "matches no string" in info.value.body["message"] and info.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=SERVED_NAME, messages=HI, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": dead}})
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=SERVED_NAME, max_tokens=4, messages=HI, tool_choice={"type": "any"},
                               tools=[{"name": "f", "input_schema": dead}])
    assert "matches no string" in info.value.body["error"]["message"]


INTERNALS = ("Check failed", "validation error for", "EBNF parser error", ".cc:", "pydantic")


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "minLength": -1}}}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 1 << 40}}}}}], "tool_choice": "required"},
    {"structured_outputs": {"regex": "a{5,2}"}},
    {"response_format": {"type": "structural_tag", "format": {"type": "tag", "begin": 3, "end": "x",
                                                                "content": {"type": "any_text"}}}},
])
def test_errors_in_our_words(client, extra):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SERVED_NAME, messages=HI, max_tokens=4, extra_body=extra)
    message = info.value.body["message"]
    assert not any(word in message for word in INTERNALS), message


# ---- no 5xx from the new fields ---------------------------------------------------------------------------------
FUZZ_VALUES = [None, True, False, 0, -1, 1, 3, 1 << 40, 1.5, "", "x", "enabled", "disabled", [], [""], ["x"], {},
               {"type": "enabled"}, {"type": "disabled"}, {"type": "adaptive"}, {"type": 5},
               {"type": "enabled", "budget_tokens": "a"}, {"type": "enabled", "budget_tokens": -3},
               {"effort": "low"}, {"effort": 3}, {"format": {"type": "json_schema", "schema": {"type": "integer"}}},
               {"format": {"type": "json_schema", "schema": 5}}, {"format": 1}, {"x": 1},
               {"type": "structural_tag", "format": {"type": "any_text"}},
               {"type": "structural_tag", "format": {"type": "tag", "begin": "a", "end": "b",
                                                     "content": {"type": "regex", "pattern": "("}}},
               {"type": "structural_tag", "structures": [{"begin": "<", "schema": {"type": "integer"}, "end": ">"}],
                "triggers": ["<"]},
               {"structural_tag": "{"}, {"structural_tag": 5}, {"grammar": 5}, {"grammar": "root ::= "},
               {"grammar": "root ::= [a-z]+"}, {"structural_tag": {"format": {"type": "dispatch", "rules": 5}}}]
CHAT_FIELDS = ["thinking", "include_reasoning", "thinking_token_budget", "return_token_ids", "prompt_logprobs",
               "truncate_prompt_tokens", "priority", "request_id", "echo", "response_format", "structured_outputs",
               "stream", "continue_final_message", "skip_special_tokens"]
MESSAGES_FIELDS = ["thinking", "output_config", "skip_special_tokens", "stop_sequences", "stream"]  # (tools: a
# ~700-token prompt each on the tiny tokenizer, seconds of CPU; test_messages_refused_as_anthropic_does has them)
VALID = {"thinking": [{"type": "enabled"}, {"type": "disabled"}, {"type": "adaptive"}], "include_reasoning": [False],
         "thinking_token_budget": [0, 2], "return_token_ids": [True], "prompt_logprobs": [0, 2],
         "truncate_prompt_tokens": [-1, 3], "priority": [0], "request_id": ["trace-1"], "echo": [True],
         "response_format": [{"type": "json_object"}], "structured_outputs": [{"choice": ["a", "b"]}],
         "stream": [True, False], "continue_final_message": [False], "skip_special_tokens": [True, False],
         "output_config": [{"effort": "low"}, {"format": {"type": "json_schema", "schema": {"type": "object"}}}],
         "stop_sequences": [["x"]]}


def test_fuzz_new_fields_never_5xx(server):  # noqa: F811
    import random

    rng = random.Random(33)
    statuses: dict[int, int] = {}
    with server.http(timeout=60) as http:
        for i in range(60):
            chat = i % 2 == 0
            body = {"model": SERVED_NAME, "messages": HI, "max_tokens": 3}
            for name in rng.sample(CHAT_FIELDS if chat else MESSAGES_FIELDS, 1 if i % 3 else 2):
                body[name] = rng.choice(VALID[name] if rng.random() < 0.5 else FUZZ_VALUES)
            r = http.post("/v1/chat/completions" if chat else "/v1/messages", json=body,
                          headers={"x-api-key": API_KEY})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (body, r.text)
            assert not any(word in r.text for word in (*INTERNALS, "internal", "Traceback")), (body, r.text)
            if r.status_code >= 400:
                error = r.json()
                assert (error["error"]["type"] if chat else error["type"]) in ("invalid_request_error", "error")
    assert statuses.get(200, 0) > 12 and statuses.get(400, 0) > 12, statuses
    assert server.health().status_code == 200
