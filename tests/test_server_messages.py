"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) with the official `anthropic` client
against the real server on the tiny model: same encoder as chat, Anthropic's blocks, events and errors."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from server_harness import API_KEY, SERVED_NAME, server  # noqa: F401  (the shared server fixture)

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def claude(server):  # noqa: F811
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def _tokenize(server, body: dict) -> int:  # noqa: F811
    with server.http() as http:
        r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_message_basic(claude):
    msg = claude.messages.create(model=SERVED_NAME, max_tokens=6, extra_body={"temperature": 0},
                                 messages=[{"role": "user", "content": "Hello"}])
    assert msg.type == "message" and msg.role == "assistant" and msg.model == SERVED_NAME
    assert msg.id.startswith("msg-")
    assert msg.stop_reason in ("end_turn", "max_tokens")
    # the budget spent exactly when it is the reason; an end of turn within it (EOS counted as a token)
    assert msg.usage.output_tokens == 6 if msg.stop_reason == "max_tokens" else 1 <= msg.usage.output_tokens <= 6
    assert all(block.type == "text" for block in msg.content)  # thinking is off unless asked for
    count = claude.messages.count_tokens(model=SERVED_NAME, messages=[{"role": "user", "content": "Hello"}])
    # the prompt: prefilled + resumed from a session entry (an earlier test on the shared server may have sent it)
    assert count.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def test_same_encoder_as_chat(claude, server):  # noqa: F811
    system, question = "You are terse.", "What is 2+2?"
    count = claude.messages.count_tokens(model=SERVED_NAME, system=system,
                                         messages=[{"role": "user", "content": question}])
    chat = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "chat_template_kwargs": {"thinking": False}}
    assert count.input_tokens == _tokenize(server, chat)
    thinking = claude.messages.count_tokens(model=SERVED_NAME, system=system, thinking={"type": "enabled",
                                            "budget_tokens": 1024}, messages=[{"role": "user", "content": question}])
    chat["chat_template_kwargs"] = {"thinking": True}
    assert thinking.input_tokens == _tokenize(server, chat)


def test_tool_history_renders_as_chat_tool_calls(claude, server):  # noqa: F811
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "use the tool", "signature": ""},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "And so?"}]},
    ]
    count = claude.messages.count_tokens(model=SERVED_NAME, tools=[WEATHER], messages=messages)
    chat = {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "use the tool",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": [{"type": "text", "text": "And so?"}]}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                    "parameters": WEATHER["input_schema"]}}],
        "chat_template_kwargs": {"thinking": False}}
    assert count.input_tokens == _tokenize(server, chat)


def test_stream_events_and_final_message(claude):
    kwargs = dict(model=SERVED_NAME, max_tokens=8, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Hi"}])
    with claude.messages.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "message_delta" in events
    if final.content:
        assert "content_block_start" in events and "content_block_stop" in events
    plain = claude.messages.create(**kwargs)
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in plain.content]
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens


def test_thinking_blocks_from_reasoning(claude):
    # adaptive: thinking on without a budget (an enabled one needs max_tokens above its budget of >= 1024,
    # tests/test_server_messages_budget.py)
    msg = claude.messages.create(model=SERVED_NAME, max_tokens=12, extra_body={"temperature": 0},
                                 thinking={"type": "adaptive"},
                                 messages=[{"role": "user", "content": "Think."}])
    assert msg.content, "the tiny model wrote nothing"
    assert msg.content[0].type == "thinking" and msg.content[0].thinking
    with claude.messages.stream(model=SERVED_NAME, max_tokens=12, extra_body={"temperature": 0},
                                thinking={"type": "adaptive"},
                                messages=[{"role": "user", "content": "Think."}]) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas[0] == "thinking_delta"
    assert final.content[0].thinking == msg.content[0].thinking


def test_forced_tool_use(claude):
    msg = claude.messages.create(model=SERVED_NAME, max_tokens=200, extra_body={"temperature": 0}, tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather"},
                                 messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert msg.stop_reason == "tool_use", msg
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and uses[0].input["city"] in ("Paris", "Rome")
    with claude.messages.stream(model=SERVED_NAME, max_tokens=200, extra_body={"temperature": 0}, tools=[WEATHER],
                                tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.input for b in final.content if b.type == "tool_use"][0]["city"] in ("Paris", "Rome")


def test_stop_sequences(claude):
    kwargs = dict(model=SERVED_NAME, max_tokens=24, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Go"}])
    text = "".join(b.text for b in claude.messages.create(**kwargs).content if b.type == "text")
    if len(text) < 4:
        pytest.skip(f"the tiny model wrote too little text: {text!r}")
    stop = text[len(text) // 2:len(text) // 2 + 2]
    msg = claude.messages.create(stop_sequences=[stop], **kwargs)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    got = "".join(b.text for b in msg.content if b.type == "text")
    assert got == text[:text.find(stop)]
    with claude.messages.stream(stop_sequences=[stop], **kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_errors_are_anthropic_objects(claude, server):  # noqa: F811
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=SERVED_NAME, max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=SERVED_NAME, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "image" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=SERVED_NAME, max_tokens=1 << 30, messages=[{"role": "user", "content": "x"}])
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(model=SERVED_NAME, max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=API_KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=SERVED_NAME, messages=[{"role": "user", "content": "x"}]).input_tokens
    r = httpx.post(f"{server.url}/v1/messages", json={"max_tokens": 4},
                   headers={"x-api-key": API_KEY}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_stream_refused_before_headers_and_client_leaving(server):  # noqa: F811
    import json

    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    body = {"model": SERVED_NAME, "max_tokens": 1 << 30, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(f"{server.url}/v1/messages", json=body, headers=headers, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    body["max_tokens"] = 2000
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, headers=headers, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        assert next(lines) == "event: message_start"
        start = json.loads(next(lines)[len("data: "):])
    assert start["message"]["usage"]["output_tokens"] == 0
    server.wait_idle()  # leaving mid-stream freed the engine request
    logged = [json.loads(line) for line in server.request_log.read_text().splitlines()]
    mine = [e for e in logged if e.get("id") == start["message"]["id"]]
    assert mine and mine[-1]["endpoint"] == "messages" and mine[-1]["disconnected"] is True


def test_tool_use_round_trip(claude):
    question = {"role": "user", "content": "Weather in Paris?"}
    first = claude.messages.create(model=SERVED_NAME, max_tokens=200, extra_body={"temperature": 0}, tools=[WEATHER],
                                   tool_choice={"type": "any"}, messages=[question])
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    history = [question, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]}]
    second = claude.messages.create(model=SERVED_NAME, max_tokens=8, extra_body={"temperature": 0}, tools=[WEATHER],
                                    messages=history)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # Anthropic's split: input_tokens are prefilled, cache_read_input_tokens resumed from the first turn's session
    # entry (the history extends the first prompt and its reply); together, the prompt
    prompt = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert prompt > first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens > 0 and second.usage.cache_creation_input_tokens == 0
    counted = claude.messages.count_tokens(model=SERVED_NAME, tools=[WEATHER], messages=history)
    assert counted.input_tokens == prompt
