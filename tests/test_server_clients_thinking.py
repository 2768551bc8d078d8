"""Thinking controls as clients send them (issue 33 item 1), with the official `openai` and `anthropic` clients
against the real server on the tiny model: DeepSeek's `thinking` object, vLLM's `include_reasoning` and
`thinking_token_budget`, Anthropic's `output_config.effort` / `.format`, and the one precedence rule
(chat.request_mapping.resolve_thinking, docs/SERVER.md "Thinking controls")."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from dsv41.chat import build_chat_prompt
from dsv41.chat.errors import RequestError
from dsv41.chat.tokens import THINK_END, THINK_START
from dsv41.server.messages_protocol import MessagesRequest, chat_body
from server_harness import API_KEY, SERVED_NAME, client, server, tokenizer  # noqa: F401  (shared fixtures)

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def claude(server):  # noqa: F811
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def _last_prompt_token(server, body: dict, tokenizer) -> str:  # noqa: F811
    with server.http() as http:
        r = http.post("/tokenize", json={"messages": HI, **body})
    assert r.status_code == 200, r.text
    return tokenizer.decode([r.json()["tokens"][-1]])


@pytest.mark.parametrize("body,thinking", [
    ({"thinking": {"type": "disabled"}}, False),
    ({"thinking": {"type": "enabled"}}, True),
    ({"thinking": {"type": "enabled"}, "reasoning_effort": "none"}, True),          # the switch beats the effort
    ({"thinking": {"type": "disabled"}, "reasoning_effort": "max"}, False),
    ({"thinking": {"type": "disabled"}, "chat_template_kwargs": {"thinking": True}}, True),  # kwargs beat it
    ({"thinking": {"type": "enabled"}, "chat_template_kwargs": {"enable_thinking": False}}, False),
    ({"reasoning_effort": "none"}, False),
    ({}, True),
])
def test_one_precedence_rule(server, tokenizer, body, thinking):  # noqa: F811
    """The prompt ends in <think> exactly when the rule says thinking is on (/tokenize renders as chat does)."""
    assert _last_prompt_token(server, body, tokenizer) == (THINK_START if thinking else THINK_END)


def test_thinking_disabled_gives_content_never_null(client):  # noqa: F811
    for stream in (False, True):
        kwargs = dict(model=SERVED_NAME, messages=HI, max_tokens=12, seed=3,
                      extra_body={"thinking": {"type": "disabled"}})
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            assert not any(getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks if c.choices)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            message = client.chat.completions.create(**kwargs).choices[0].message
            assert getattr(message, "reasoning_content", None) is None
            assert isinstance(message.content, str)
            text = message.content
        assert THINK_END not in text
    # nothing written at all (EOS first, forced by the bias): still a string
    message = client.chat.completions.create(model=SERVED_NAME, messages=HI, max_tokens=4, seed=3, extra_body={
        "thinking": {"type": "disabled"}, "logit_bias": {"1": 100}}).choices[0].message
    assert message.content == ""


def test_include_reasoning_false_drops_reasoning(client):  # noqa: F811
    kwargs = dict(model=SERVED_NAME, messages=HI, max_tokens=10, seed=5)
    shown = client.chat.completions.create(**kwargs).choices[0].message
    assert shown.reasoning_content, "the tiny model wrote no reasoning"
    hidden = client.chat.completions.create(extra_body={"include_reasoning": False}, **kwargs).choices[0].message
    assert getattr(hidden, "reasoning_content", None) is None and getattr(hidden, "reasoning", None) is None
    assert isinstance(hidden.content, str)
    chunks = list(client.chat.completions.create(stream=True, extra_body={"include_reasoning": False}, **kwargs))
    assert not any(getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks if c.choices)


def test_thinking_token_budget_is_enforced(client, tokenizer):  # noqa: F811
    end = tokenizer.special(THINK_END)
    for budget, extra in ((0, {"thinking_token_budget": 0}), (3, {"thinking_token_budget": 3}),
                          (2, {"thinking": {"type": "enabled", "budget_tokens": 2}})):
        resp = client.chat.completions.create(model=SERVED_NAME, messages=HI, max_tokens=12, seed=11,
                                              logprobs=True, extra_body=extra)
        tokens = [tokenizer.token_to_id(t.token) if tokenizer.token_to_id(t.token) is not None else -1
                  for t in resp.choices[0].logprobs.content]
        assert end in tokens[:budget + 1], (budget, tokens)  # at most `budget` reasoning tokens, then </think>


def test_anthropic_effort_and_adaptive_map_onto_the_rule():
    def prompt(**fields):
        return build_chat_prompt(chat_body(MessagesRequest.model_validate(
            {"max_tokens": 8, "messages": HI, **fields})))

    assert prompt().thinking_mode == "chat"  # Anthropic's default: no thinking
    assert prompt(output_config={"effort": "max"}).thinking_mode == "chat"  # effort alone does not switch it on
    adaptive = prompt(thinking={"type": "adaptive"}, output_config={"effort": "low"})
    assert (adaptive.thinking_mode, adaptive.reasoning_effort) == ("thinking", 50)
    assert prompt(thinking={"type": "adaptive"}).reasoning_effort == 75  # Anthropic's default effort: high
    assert prompt(thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=2048,
                  output_config={"effort": "max"}).reasoning_effort == 100
    with pytest.raises(Exception, match="output_config.effort"):
        prompt(output_config={"effort": "huge"})
    with pytest.raises(RequestError):
        build_chat_prompt({"messages": HI, "thinking": {"type": "sometimes"}})


def test_anthropic_thinking_disabled_has_no_think_markup(claude):
    for stream in (False, True):
        kwargs = dict(model=SERVED_NAME, max_tokens=40, extra_body={"temperature": 0}, messages=HI,
                      thinking={"type": "disabled"})
        if stream:
            with claude.messages.stream(**kwargs) as s:
                msg = s.get_final_message()
        else:
            msg = claude.messages.create(**kwargs)
        assert all(b.type == "text" for b in msg.content)
        assert not any(marker in b.text for b in msg.content for marker in (THINK_START, THINK_END))


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "word": {"type": "string", "enum": ["a", "b"]}},
          "required": ["n", "word"], "additionalProperties": False}


def test_anthropic_output_config_format_is_enforced(claude):
    kwargs = dict(model=SERVED_NAME, max_tokens=60, extra_body={"temperature": 0}, messages=HI,
                  output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    msg = claude.messages.create(**kwargs)
    assert msg.stop_reason == "end_turn", msg
    jsonschema.validate(json.loads("".join(b.text for b in msg.content if b.type == "text")), SCHEMA)
    with claude.messages.stream(**kwargs) as s:
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(**dict(kwargs, output_config={"format": {"type": "xml"}}))
    assert info.value.body["error"]["type"] == "invalid_request_error"
