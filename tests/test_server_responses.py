"""/v1/responses with the official `openai` client (`responses.create`, `create(stream=True)`, `responses.stream`,
`responses.parse`) against the real server on the tiny model: output items, usage, incomplete replies, function
tools over a two-turn loop, structured output, streamed == whole, and the refusals (400 naming the field).

The tiny model is random: thinking rarely ends within a few tokens, so reasoning replies here are cut by
max_output_tokens, and tool calls and JSON are the grammar's doing (tool_choice required, text.format)."""

from __future__ import annotations

import json
import signal
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from server_harness import SERVED_NAME, ALIAS, ServerProcess, client, server  # noqa: F401 (pytest fixtures)

NO_THINKING = {"effort": "none"}
# one parameter with one allowed value: the grammar writes nearly all of the call (each of its tokens still costs a
# forward of the tiny model on the CPU, so the call is kept short)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "wx", "description": "Weather", "parameters": WEATHER, "strict": True}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "wx", "description": "Weather", "parameters": WEATHER,
                                                "strict": True}}]


PARSED = {"parsed_arguments", "parsed", "output_parsed"}  # what the client's parse helpers add


def _plain(dump):
    """A model_dump without the fields the client's parse helpers add to their snapshots."""
    if isinstance(dump, dict):
        return {k: _plain(v) for k, v in dump.items() if k not in PARSED}
    return [_plain(v) for v in dump] if isinstance(dump, list) else dump


def _without_ids(response: dict) -> dict:
    """A response object with what differs between two runs (ids, timestamps, the prompt tokens resumed from a
    session entry: the second run of a prompt resumes from the first's) blanked."""
    out = dict(_plain(response), id=None, created_at=None, completed_at=None)
    if out.get("usage"):
        out["usage"] = dict(out["usage"], input_tokens_details=None)
    out["output"] = [dict(item, id=None, **({"call_id": None} if "call_id" in item else {}))
                     for item in response["output"]]
    return out


def _check_event_grammar(events) -> dict:
    """Sequence numbers 0..n-1; created, in_progress first; items opened and closed in order; deltas rebuild the
    done texts; the last event carries the final response. Returns the final response as a dict."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    final = last.response
    assert last.type == f"response.{final.status}"
    texts: dict[int, str] = {}
    opened: list[int] = []
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert e.output_index == len(opened)
            opened.append(e.output_index)
        elif e.type in ("response.output_text.delta", "response.reasoning_summary_text.delta",
                        "response.function_call_arguments.delta"):
            assert e.output_index == opened[-1]
            texts[e.output_index] = texts.get(e.output_index, "") + e.delta
        elif e.type in ("response.output_text.done", "response.reasoning_summary_text.done"):
            assert e.text == texts.get(e.output_index, "")
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == texts.get(e.output_index, "")
        elif e.type == "response.output_item.done":
            assert _plain(e.item.model_dump()) == _plain(final.output[e.output_index].model_dump())
    assert len(opened) == len(final.output)
    return _plain(final.model_dump(mode="json"))


def _same_streamed_and_whole(client, **kwargs):  # noqa: F811
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    final = _check_event_grammar(events)
    assert _without_ids(final) == _without_ids(whole.model_dump(mode="json"))
    return whole, events


def test_text_reply_and_usage(client):  # noqa: F811
    resp = client.responses.create(model=SERVED_NAME, input="Hello there", max_output_tokens=6, temperature=0,
                                   reasoning=NO_THINKING, instructions="Answer briefly.", metadata={"run": "t1"})
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == SERVED_NAME
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in resp.output] == ["message"]
    message = resp.output[0]
    assert message.role == "assistant" and message.status == "incomplete" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and resp.output_text == message.content[0].text
    assert resp.usage.output_tokens == 6 and resp.usage.output_tokens_details.reasoning_tokens == 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + 6
    assert resp.instructions == "Answer briefly." and resp.metadata == {"run": "t1"}
    assert resp.max_output_tokens == 6 and resp.temperature == 0


def test_same_prompt_as_chat(client, server):  # noqa: F811
    """The Responses request renders exactly the chat request it maps to (the same encoder)."""
    resp = client.responses.create(model=ALIAS, instructions="Be brief.", max_output_tokens=1, reasoning={"effort": "low"},
                                   input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                                          {"type": "reasoning", "id": "rs_1", "summary": [
                                              {"type": "summary_text", "text": "A greeting."}]},
                                          {"type": "message", "id": "msg_1", "role": "assistant", "status":
                                           "completed", "content": [{"type": "output_text", "text": "Hello!",
                                                                     "annotations": []}]},
                                          {"role": "developer", "content": "Stay brief."},
                                          {"role": "user", "content": "And now?"}])
    assert resp.model == ALIAS
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
                         {"role": "system", "content": "Stay brief."}, {"role": "user", "content": "And now?"}],
            "reasoning_effort": "low"}
    with server.http() as http:
        count = http.post("/tokenize", json=chat).json()["count"]
    assert resp.usage.input_tokens == count


def test_reasoning_item_when_thinking(client):  # noqa: F811
    resp = client.responses.create(model=SERVED_NAME, input="Think about it.", max_output_tokens=6, temperature=0,
                                   reasoning={"effort": "high", "summary": "auto"})
    assert resp.status == "incomplete"
    reasoning = resp.output[0]
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.status == "incomplete"
    assert reasoning.summary[0].type == "summary_text" and reasoning.summary[0].text
    assert reasoning.content[0].text == reasoning.summary[0].text
    # the random model has not closed its reasoning within 6 tokens: all of them are reasoning tokens
    if len(resp.output) == 1:
        assert resp.usage.output_tokens_details.reasoning_tokens == resp.usage.output_tokens == 6
    assert resp.reasoning.effort == "high"


def test_streamed_equals_whole_text_and_reasoning(client):  # noqa: F811
    for reasoning in (NO_THINKING, {"effort": "medium"}):
        whole, events = _same_streamed_and_whole(client, model=SERVED_NAME, input="Tell me a story.",
                                                 max_output_tokens=10, temperature=0, reasoning=reasoning)
        kinds = {e.type for e in events}
        if reasoning is NO_THINKING:
            assert {"response.content_part.added", "response.output_text.delta", "response.content_part.done"} <= kinds
        else:
            assert {"response.reasoning_summary_part.added", "response.reasoning_summary_text.delta"} <= kinds
        assert events[-1].type == "response.incomplete"


def test_function_call_streamed_and_whole_then_tool_output(client, server):  # noqa: F811
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=SERVED_NAME, input=ask, tools=TOOLS, tool_choice={"type": "function", "name": "wx"},
                  parallel_tool_calls=False, max_output_tokens=120, temperature=0, reasoning=NO_THINKING)
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed", whole
    assert [item.type for item in whole.output] == ["function_call"]
    call = whole.output[0]
    assert call.name == "wx" and call.call_id.startswith("call_") and call.status == "completed"
    assert call.id.startswith("fc_") and json.loads(call.arguments) == {"city": "paris"}
    with client.responses.stream(**kwargs) as stream:  # the official streaming helper
        events = list(stream)
        final = stream.get_final_response()
    streamed = _check_event_grammar(events)
    assert "response.function_call_arguments.delta" in {e.type for e in events}
    assert final.output[0].parsed_arguments == {"city": "paris"}
    assert _without_ids(streamed) == _without_ids(whole.model_dump(mode="json"))
    # the tool loop as agent SDKs run it: the reply's output items and the call's output go back as input,
    # rendered as the equivalent chat request would be
    follow = ask + [item.model_dump(mode="json") for item in whole.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    second = client.responses.create(model=SERVED_NAME, input=follow, tools=TOOLS, max_output_tokens=2,
                                     temperature=0, reasoning=NO_THINKING)
    assert second.output and second.usage.output_tokens <= 2
    chat = {"messages": ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}],
        "tools": CHAT_TOOLS, "reasoning_effort": "none"}
    with server.http() as http:
        assert second.usage.input_tokens == http.post("/tokenize", json=chat).json()["count"]


class Point(pydantic.BaseModel):
    x: Literal[1, 2]


def test_structured_output(client):  # noqa: F811
    kwargs = dict(model=SERVED_NAME, input="A point, please.", text_format=Point, max_output_tokens=40,
                  temperature=0, reasoning=NO_THINKING)
    parsed = client.responses.parse(**kwargs)
    assert parsed.status == "completed", parsed
    assert isinstance(parsed.output_parsed, Point) and parsed.text.format.type == "json_schema"
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    _check_event_grammar(events)
    assert final.output_parsed == parsed.output_parsed and final.output_text == parsed.output_text


def test_logprobs_of_the_answer_text(client):  # noqa: F811
    kwargs = dict(model=SERVED_NAME, input="Count with me.", max_output_tokens=5, temperature=0,
                  reasoning=NO_THINKING, include=["message.output_text.logprobs"], top_logprobs=2)
    whole, events = _same_streamed_and_whole(client, **kwargs)
    part = whole.output[0].content[0]
    assert 0 < len(part.logprobs) <= whole.usage.output_tokens == 5
    for entry in part.logprobs:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
    streamed = [entry for e in events if e.type == "response.output_text.delta" for entry in e.logprobs]
    assert [entry.model_dump() for entry in streamed] == [entry.model_dump() for entry in part.logprobs]
    plain = client.responses.create(**dict(kwargs, include=None, top_logprobs=None))
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == whole.output_text


@pytest.mark.parametrize("kwargs, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search_preview"}, "tools": TOOLS}, "tool_choice.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"extra_body": {"conversation": "conv_1"}}, "conversation"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"reasoning": {"effort": "ultra"}}, "reasoning.effort"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"max_output_tokens": 10**7}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object", "not": {}}}}},
     "text.format"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["everything"]}, "include[0]"),
    ({"top_logprobs": 21}, "top_logprobs"),
])
def test_refused_with_the_field_named(client, kwargs, param):  # noqa: F811
    body = dict(model=SERVED_NAME, input="Hi", max_output_tokens=4, reasoning=NO_THINKING)
    body.update(kwargs)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**body)
    error = info.value.body
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] is not None and error["param"].startswith(param), error


def test_unknown_model_is_404(client):  # noqa: F811
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="no-such-model", input="Hi", max_output_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def test_stream_left_early_frees_the_engine(server):  # noqa: F811
    body = {"model": SERVED_NAME, "input": "Go on and on.", "max_output_tokens": 400, "stream": True,
            "reasoning": NO_THINKING}
    with server.http() as http, http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        assert next(lines) == "event: response.created"
    server.wait_idle()
    with server.http() as http:  # store is accepted (nothing is kept), refused bodies never stream
        r = http.post("/v1/responses", json={"input": "Hi", "stream": True, "background": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "background"
        r = http.post("/v1/responses", json={"input": "Hi", "store": True, "max_output_tokens": 1})
        assert r.status_code == 200 and r.json()["store"] is False
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_failure_past_the_headers_is_an_error_event(tmp_path):
    """A stream ended by the drain (SIGTERM, grace over) ends with an `error` event the official client raises."""
    own = ServerProcess(tmp_path, "--drain-timeout", "0.5")
    try:
        # greedy: a sampled reply of the tiny model may end (its stop token) before the drain's grace is over
        stream = own.client().responses.create(model=SERVED_NAME, input="Go on.", max_output_tokens=4000,
                                                stream=True, reasoning=NO_THINKING, temperature=0)
        seen = []
        with pytest.raises(openai.APIError) as info:
            for event in stream:
                seen.append(event.type)
                if event.type == "response.output_text.delta" and len(seen) == 5:
                    own.proc.send_signal(signal.SIGTERM)
        assert seen[:2] == ["response.created", "response.in_progress"] and "response.completed" not in seen
        assert "shutting down" in info.value.message and info.value.body["type"] == "server_error"
        assert own.proc.wait(60) == 0
    finally:
        own.kill()
