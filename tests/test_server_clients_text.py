"""Clean text everywhere and cut tool calls (issue 33 items 3 and 4), with the official `openai` and `anthropic`
clients against the real server on the tiny model (random weights: it writes special tokens freely at
temperature 0, so a leak shows at once).

- One detokenisation rule (server/reply_text.py) for chat, completions and messages: no special token in any
  text field unless `skip_special_tokens: false`; `</think>` never in content.
- A tool call cut by max_tokens is never delivered: chat `finish_reason: "length"` without a call whose
  arguments are unfinished, messages `stop_reason: "max_tokens"` without a tool_use of half an input or a text
  block of raw DSML; streamed and whole replies agree.
"""

from __future__ import annotations

import anthropic
import pytest

from dsv41.chat.tokens import THINK_END, THINK_START
from server_harness import API_KEY, SERVED_NAME, client, server, tokenizer  # noqa: F401  (shared fixtures)

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def claude(server):  # noqa: F811
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def specials(tokenizer):  # noqa: F811
    return [tok.content for i, tok in tokenizer.added_tokens.items() if tok.special]


def _leaks(text: str, specials) -> list[str]:
    return [s for s in specials if s in text]


def test_the_rule(tokenizer):  # noqa: F811
    from dsv41.server.reply_text import hidden_ids

    eos, pad = tokenizer.eos_id, tokenizer.special("<｜▁pad▁｜>")
    think_end = tokenizer.special(THINK_END)
    parsed = hidden_ids(tokenizer, parsed=True)
    assert pad in parsed and eos not in parsed and think_end not in parsed  # the parser needs EOS and markup
    assert eos in hidden_ids(tokenizer, parsed=False) and think_end not in hidden_ids(tokenizer, parsed=False)
    assert pad not in hidden_ids(tokenizer, parsed=True, skip_special_tokens=False)
    assert 7 in hidden_ids(tokenizer, parsed=True, stop_token_ids={7})
    assert 7 not in hidden_ids(tokenizer, parsed=True, stop_token_ids={7}, include_stop_str_in_output=True)


def _message_text(msg) -> str:
    return "".join(getattr(b, "text", "") or getattr(b, "thinking", "") for b in msg.content)


def test_messages_text_has_no_special_tokens(claude, specials):
    for thinking in ({"type": "disabled"}, {"type": "adaptive"}):
        kwargs = dict(model=SERVED_NAME, max_tokens=48, extra_body={"temperature": 0}, messages=HI, thinking=thinking)
        msg = claude.messages.create(**kwargs)
        text = _message_text(msg)
        assert not _leaks(text, specials), text
        assert not any(b.type == "text" and (THINK_END in b.text or THINK_START in b.text) for b in msg.content)
        with claude.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
    # asked for: the client gets them (the tiny model writes some within 48 tokens at temperature 0)
    raw = claude.messages.create(model=SERVED_NAME, max_tokens=48, messages=HI,
                                 extra_body={"temperature": 0, "skip_special_tokens": False})
    assert _leaks(_message_text(raw), specials)


def test_chat_and_completions_text_has_no_special_tokens(client, specials, tokenizer):  # noqa: F811
    pad = str(tokenizer.special("<｜▁pad▁｜>"))
    bias = {pad: 8, str(tokenizer.special(THINK_END)): 8, str(tokenizer.special(THINK_START)): 8}
    for thinking in ({"type": "disabled"}, {"type": "enabled"}):
        kwargs = dict(model=SERVED_NAME, messages=HI, max_tokens=24, seed=1, logit_bias=bias,
                      extra_body={"thinking": thinking})
        message = client.chat.completions.create(**kwargs).choices[0].message
        for field in (message.content or "", message.reasoning_content or ""):
            assert not _leaks(field, specials), field
        assert THINK_END not in (message.content or "") and THINK_START not in (message.content or "")
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == (message.content or "")
    raw = client.chat.completions.create(model=SERVED_NAME, messages=HI, max_tokens=24, seed=1, logit_bias=bias,
                                         extra_body={"thinking": {"type": "disabled"}, "skip_special_tokens": False})
    assert "<｜▁pad▁｜>" in raw.choices[0].message.content
    text = client.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=24, seed=1,
                                     logit_bias=bias).choices[0].text
    assert not _leaks(text, specials), text


# the tiny tokenizer spells the forced DSML in many tokens: a whole call takes ~120, so 40 cuts it inside the
# parameters (the parser's own test cuts a call at every character: test_chat_stream_parser.py)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}
ASK = [{"role": "user", "content": "Weather in Paris for two days?"}]
CUT = 40


def _chat_stream_calls(chunks) -> tuple[dict, str, str]:
    calls, content, finish = {}, "", None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            slot = calls.setdefault(call.index, {"name": None, "arguments": ""})
            if call.function.name:
                slot["name"] = call.function.name
            slot["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return calls, content, finish


def test_chat_tool_call_cut_by_max_tokens(client):  # noqa: F811
    kwargs = dict(model=SERVED_NAME, messages=ASK, tools=[TOOL], tool_choice="required", max_tokens=CUT, seed=2,
                  reasoning_effort="none")
    resp = client.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    # the grammar makes the reply a call from its first token: CUT tokens end inside it
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == CUT
    assert not choice.message.tool_calls  # the cut call is not delivered (no "" or unfinished arguments)
    assert choice.message.content in (None, "")  # nor as text: nothing came before it
    calls, content, finish = _chat_stream_calls(client.chat.completions.create(stream=True, **kwargs))
    assert (calls, content, finish) == ({}, "", "length")


def test_messages_tool_call_cut_by_max_tokens(claude):
    tool = {"name": "get_weather", "description": "Weather", "input_schema": WEATHER}
    kwargs = dict(model=SERVED_NAME, max_tokens=CUT, extra_body={"temperature": 0}, tools=[tool],
                  tool_choice={"type": "any"}, messages=ASK)
    msg = claude.messages.create(**kwargs)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == CUT
    assert msg.content == [], msg.content  # neither a tool_use with half its input nor a text block of raw DSML
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.content == [] and final.stop_reason == "max_tokens"
