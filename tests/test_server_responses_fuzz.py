"""Hundreds of malformed /v1/responses bodies against the real server: every one gets a 4xx with OpenAI's error
object (never a 5xx), and the server stays healthy and idle. Each case breaks the request in a way that is wrong
on its own (a wrong type, an unknown item or part type, a huge or out-of-range value, a missing field, a field
this server refuses, broken JSON), so every combination of cases is malformed too."""

from __future__ import annotations

import json
import random

from server_harness import SERVED_NAME, server  # noqa: F401 (the shared server fixture)

BASE = {"model": SERVED_NAME, "input": "Hi", "max_output_tokens": 1, "reasoning": {"effort": "none"}}
GOOD_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}

# (field, bad value): each alone makes the body invalid
FIELDS = [
    ("input", 5), ("input", []), ("input", {}), ("input", True), ("input", None), ("input", ""),
    ("input", [5]), ("input", [[]]), ("input", [{}]), ("input", [{"type": "telepathy"}]),
    ("input", [{"role": "robot", "content": "x"}]), ("input", [{"role": "user", "content": 5}]),
    ("input", [{"role": "user", "content": [{"type": "input_video", "url": "x"}]}]),
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]),
    ("input", [{"role": "user", "content": [{"type": "input_text"}]}]),
    ("input", [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]),
    ("input", [{"role": "user", "content": [5]}]),
    ("input", [{"type": "message", "content": "x"}]),
    ("input", [{"type": "function_call", "name": "f", "arguments": "{}"}]),
    ("input", [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]),
    ("input", [{"type": "function_call", "call_id": "c", "name": "", "arguments": "{}"}]),
    ("input", [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]),
    ("input", [{"type": "function_call_output", "call_id": "nope", "output": "x"}]),
    ("input", [{"type": "function_call_output", "output": "x"}]),
    ("input", [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c", "output": 7}]),
    ("input", [{"type": "item_reference", "id": "msg_1"}]),
    ("input", [{"type": "reasoning", "id": "rs", "summary": "text"}]),
    ("input", [{"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text"}]}]),
    ("input", [{"type": "web_search_call", "id": "ws", "status": "completed"}]),
    ("input", "x" * 60_000),  # far past the tiny model's context
    ("instructions", 5), ("instructions", ["a"]),
    ("max_output_tokens", 0), ("max_output_tokens", -3), ("max_output_tokens", "5"), ("max_output_tokens", 1.5),
    ("max_output_tokens", True), ("max_output_tokens", 10**30), ("max_output_tokens", 10**7),
    ("temperature", -1), ("temperature", 2.5), ("temperature", "hot"), ("temperature", [1]),
    ("top_p", 0), ("top_p", 1.5), ("top_p", "x"),
    ("tools", "x"), ("tools", [1]), ("tools", [{"type": "web_search"}]), ("tools", [{"type": "mcp"}]),
    ("tools", [{"type": "function"}]), ("tools", [{"type": "function", "name": 5}]),
    ("tools", [{"type": "function", "name": "f", "parameters": "x"}]),
    ("tools", [{"type": "function", "name": "f", "description": 5}]), ("tools", [GOOD_TOOL, GOOD_TOOL]),
    ("tool_choice", 5), ("tool_choice", "sometimes"), ("tool_choice", {"type": "mcp"}),
    ("tool_choice", {"type": "function"}), ("tool_choice", "required"), ("tool_choice", {"type": "allowed_tools"}),
    ("tool_choice", {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "zz"}]}),
    ("parallel_tool_calls", "yes"),
    ("reasoning", "high"), ("reasoning", {"effort": "ultra"}), ("reasoning", {"effort": 500}),
    ("reasoning", {"effort": True}), ("reasoning", {"depth": 3}), ("reasoning", {"summary": "long"}),
    ("text", "json"), ("text", {"format": {"type": "xml"}}), ("text", {"format": {"type": "json_schema"}}),
    ("text", {"format": {"type": "json_schema", "name": "x"}}),
    ("text", {"format": {"type": "json_schema", "name": "bad name!", "schema": {}}}),
    ("text", {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "not": {}}}}),
    ("text", {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "pattern": "(?!"}}}),
    ("text", {"verbosity": "loud"}), ("text", {"format": 5}),
    ("metadata", {f"k{i}": "v" for i in range(17)}), ("metadata", {"k": 5}), ("metadata", {"k": "v" * 513}),
    ("metadata", "x"),
    ("store", "yes"), ("stream", 1), ("stream", "true"), ("background", True), ("background", "no"),
    ("previous_response_id", "resp_1"), ("conversation", "conv_1"), ("prompt", {"id": "p"}),
    ("include", ["everything"]), ("include", "x"), ("include", ["message.output_text.logprobs", 5]),
    ("top_logprobs", -1), ("top_logprobs", 99), ("top_logprobs", "2"), ("truncation", "auto"), ("truncation", "some"),
    ("stream_options", {"include_obfuscation": False}), ("service_tier", "gold"), ("user", 5),
    ("model", 5), ("model", "no-such-model"), ("frobnicate", 1), ("x" * 300, 1),
]
# bodies that are not even a request
RAW = [b"", b"{", b"[]", b'"x"', b"null", b'{"input": "Hi",}', b'{"input": NaN}', b'{"input": "\\ud800"}',
       b"\xff\xfe", b'{"input": "Hi"} trailing', b"[" * 100 + b"]" * 100,
       json.dumps({"input": [{"a": [[[[[[[[[[]]]]]]]]]]} for _ in range(3)]}).encode(),
       b'{"input": ' + b"[" * 70 + b"]" * 70 + b"}"]


def _body(rng: random.Random) -> bytes:
    body = dict(BASE)
    for field, value in rng.sample(FIELDS, rng.choice((1, 1, 2, 3))):
        if field == "input" and body["input"] != BASE["input"]:
            continue  # one broken input at a time; still broken
        body[field] = value
    if "max_output_tokens" not in body or body["max_output_tokens"] is None:
        body["max_output_tokens"] = 1
    return json.dumps(body).encode()


def test_malformed_bodies_get_4xx_and_the_server_stays_healthy(server):  # noqa: F811
    rng = random.Random(33)
    cases = [json.dumps(dict(BASE, **{field: value})).encode() for field, value in FIELDS]
    cases += [json.dumps({k: v for k, v in BASE.items() if k != "input"}).encode()]  # no input at all
    cases += RAW + [_body(rng) for _ in range(200)]
    assert len(cases) > 300
    statuses = {}
    with server.http() as http:
        for i, raw in enumerate(cases):
            r = http.post("/v1/responses", content=raw, headers={"Content-Type": "application/json"})
            assert 400 <= r.status_code < 500, (raw[:300], r.status_code, r.text[:300])
            error = r.json()["error"]
            assert isinstance(error["message"], str) and error["message"], raw[:300]
            assert set(error) == {"message", "type", "param", "code"} and error["type"].endswith("_error")
            assert "Traceback" not in error["message"] and "pydantic" not in error["message"].lower()
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if i % 50 == 0:
                assert server.health().status_code == 200
    assert set(statuses) <= {400, 404, 413}, statuses
    server.wait_idle()
    assert server.health().json()["ok"] is True
