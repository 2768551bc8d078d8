"""Malformed requests get the right 4xx status and an OpenAI error object; the server stays healthy."""

import json

import httpx
import openai
import pytest

from server_harness import SERVED_NAME, client, server  # noqa: F401 (pytest fixtures)

MSG = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "string"}}}}}]
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


def chat(**fields):
    return {"messages": MSG, "max_tokens": 4, **fields}


def comp(**fields):
    return {"prompt": "hello", "max_tokens": 4, **fields}


# (id, path, json body or raw bytes, expected status, expected param or None (not checked), expected code or None)
CASES = [
    ("bad-json", CHAT, b"{not json", 400, None, None),
    ("body-array", CHAT, b"[1, 2]", 400, None, None),
    ("body-string", COMP, b'"hello"', 400, None, None),
    ("empty-body", CHAT, b"", 400, None, None),
    ("no-messages", CHAT, {"max_tokens": 3}, 400, "messages", None),
    ("messages-string", CHAT, {"messages": "hi"}, 400, "messages", None),
    ("messages-empty", CHAT, {"messages": []}, 400, "messages", None),
    ("message-no-role", CHAT, {"messages": [{"content": "x"}]}, 400, "messages[0].role", None),
    ("message-bad-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None),
    ("user-content-null", CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content", None),
    ("content-number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", None),
    ("n-17", CHAT, chat(n=17), 400, None, None),
    ("image-part", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,x"}}]}]},
     400, "messages[0].content[1]", None),
    ("temperature-string", CHAT, chat(temperature="hot"), 400, "temperature", None),
    ("temperature-negative", CHAT, chat(temperature=-1), 400, "temperature", None),
    ("temperature-bool", CHAT, chat(temperature=True), 400, "temperature", None),
    ("top-p-zero", CHAT, chat(top_p=0), 400, "top_p", None),
    ("top-p-above-one", COMP, comp(top_p=1.5), 400, "top_p", None),
    ("top-k-negative", CHAT, chat(top_k=-5), 400, None, None),
    ("min-p-above-one", COMP, comp(min_p=2), 400, "min_p", None),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens", None),
    ("max-tokens-string", COMP, comp(max_tokens="10"), 400, "max_tokens", None),
    ("max-tokens-huge", CHAT, chat(max_tokens=10**9), 400, "max_tokens", "context_length_exceeded"),
    ("max-completion-tokens-huge", CHAT, chat(max_completion_tokens=10**9), 400, "max_completion_tokens",
     "context_length_exceeded"),
    ("seed-string", CHAT, chat(seed="abc"), 400, "seed", None),
    ("stop-number", CHAT, chat(stop=123), 400, "stop", None),
    ("stop-list-int", COMP, comp(stop=["a", 3]), 400, None, None),
    ("stop-too-many", COMP, comp(stop=[f"s{i}" for i in range(17)]), 400, "stop", None),
    ("stop-empty-string", COMP, comp(stop=""), 400, None, None),
    ("stream-string", CHAT, chat(stream="yes"), 400, "stream", None),
    ("stream-options-without-stream", CHAT, chat(stream_options={"include_usage": True}), 400, None, None),
    ("top-logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, None, None),
    ("tools-not-list", CHAT, chat(tools={"a": 1}), 400, "tools", None),
    ("tools-empty", CHAT, chat(tools=[]), 400, None, None),
    ("tool-without-name", CHAT, chat(tools=[{"type": "function", "function": {}}]), 400, "tools[0].function.name",
     None),
    ("tool-choice-unknown-tool", CHAT, chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}),
     400, "tool_choice", None),
    ("tool-choice-bad-word", CHAT, chat(tools=TOOLS, tool_choice="sometimes"), 400, "tool_choice", None),
    ("tool-choice-without-tools", CHAT, chat(tool_choice="required"), 400, None, None),
    ("response-format-xml", CHAT, chat(response_format={"type": "xml"}), 400, "response_format", None),
    ("json-schema-missing", CHAT, chat(response_format={"type": "json_schema"}), 400, "response_format.json_schema",
     None),
    ("json-schema-bad-type", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}), 400, "response_format",
     None),
    ("json-schema-dangling-ref", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/$defs/missing"}}}), 400, "response_format", None),
    ("guided-json-bad-regex", COMP, comp(guided_json={"type": "string", "pattern": "(("}), 400, "guided_json", None),
    ("guided-json-not-json", CHAT, chat(guided_json="{oops"), 400, "guided_json", None),
    ("structured-two-kinds", CHAT, chat(structured_outputs={"json": {"type": "object"}, "regex": "a+"}), 400,
     "structured_outputs", None),
    ("structured-empty-choice", CHAT, chat(structured_outputs={"choice": []}), 400, None, None),
    ("structured-json-object-and-schema", CHAT,
     chat(structured_outputs={"json_object": True, "json": {"type": "object"}}), 400, "structured_outputs", None),
    ("guided-regex-invalid", CHAT, chat(guided_regex="(unclosed"), 400, "guided_regex", None),
    ("named-tool-plus-schema", CHAT, chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}},
                                          response_format={"type": "json_object"}), 400, "tool_choice", None),
    ("effort-word", CHAT, chat(reasoning_effort="ultra"), 400, "reasoning_effort", None),
    ("effort-zero", CHAT, chat(reasoning_effort=0), 400, "reasoning_effort", None),
    ("effort-101", CHAT, chat(chat_template_kwargs={"reasoning_effort": 101}), 400,
     "chat_template_kwargs.reasoning_effort", None),
    ("effort-float", CHAT, chat(reasoning_effort=50.0), 400, "reasoning_effort", None),
    ("template-kwargs-string", CHAT, chat(chat_template_kwargs="x"), 400, "chat_template_kwargs", None),
    ("thinking-not-bool", CHAT, chat(chat_template_kwargs={"thinking": "yes"}), 400, "chat_template_kwargs.thinking",
     None),
    ("continue-without-assistant", CHAT, chat(continue_final_message=True), 400, "continue_final_message", None),
    ("prompt-missing", COMP, {"max_tokens": 3}, 400, "prompt", None),
    ("prompt-list-mixed", COMP, comp(prompt=["a", [1, 2]]), 400, None, None),
    ("prompt-list-empty-inner", COMP, comp(prompt=[[1, 2], []]), 400, None, None),
    ("prompt-token-out-of-range", COMP, comp(prompt=[0, 99999999]), 400, "prompt", None),
    ("prompt-token-negative", COMP, comp(prompt=[0, -1]), 400, "prompt", None),
    ("prompt-empty", COMP, comp(prompt=""), 400, None, None),
    ("prompt-too-long", COMP, comp(prompt=[5] * 9000, max_tokens=1), 400, "prompt", "context_length_exceeded"),
    ("completions-logprobs-21", COMP, comp(logprobs=21), 400, "logprobs", None),
    ("detokenize-out-of-range", "/detokenize", {"tokens": [1, 10**7]}, 400, "tokens", None),
    ("tokenize-both-inputs", "/tokenize", {"prompt": "a", "messages": MSG}, 400, None, None),
    ("tokenize-no-input", "/tokenize", {}, 400, None, None),
    ("unknown-route", "/v1/embeddings", {"input": "x"}, 404, None, None),
]


@pytest.mark.parametrize("name,path,body,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_malformed_request(server, name, path, body, status, param, code):
    with server.http() as http:
        if isinstance(body, bytes):
            resp = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            resp = http.post(path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def test_enough_cases():
    assert len(CASES) >= 40


def test_limits_auth_and_methods(server):
    url = server.url
    auth = {"Authorization": f"Bearer {server.api_key}"}
    big = json.dumps({"prompt": "x" * 2_000_000, "max_tokens": 1})
    resp = httpx.post(f"{url}{COMP}", content=big, headers={**auth, "content-type": "application/json"}, timeout=60)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    resp = httpx.post(f"{url}{COMP}", json=comp())
    assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    resp = httpx.post(f"{url}{COMP}", json=comp(), headers={"Authorization": "Bearer nope"})
    assert resp.status_code == 401
    resp = httpx.get(f"{url}{CHAT}", headers=auth)
    assert resp.status_code == 405 and "error" in resp.json()


def test_official_client_sees_typed_errors_and_server_stays_healthy(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=SERVED_NAME, messages=MSG, n=17)
    assert err.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=SERVED_NAME, input="x")
    health = server.wait_idle()
    assert health["ok"] and health["errors_total"] >= 2
    ok = client.chat.completions.create(model=SERVED_NAME, messages=MSG, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_a_grammar_dead_end_is_the_requests_400_and_spares_the_server(server):
    """`(a|b[^\\s\\S])` passes the schema checks, but a reply that starts with "b" reaches a state that allows no
    token: the request's own dead end, answered 400 `grammar_dead_end` (a stream ends with that error event), never
    a 500; replies that take the "a" path are unaffected."""
    body = {"model": SERVED_NAME, "prompt": "pick", "max_tokens": 4, "temperature": 2.0,
            "structured_outputs": {"regex": "(a|b[^\\s\\S])"}}
    outcomes = []
    with server.http() as http:
        for seed in range(16):
            r = http.post("/v1/completions", json={**body, "seed": seed})
            if r.status_code == 200:
                assert r.json()["choices"][0]["text"] == "a", r.text
                outcomes.append("a")
            else:
                assert r.status_code == 400, r.text
                assert r.json()["error"]["code"] == "grammar_dead_end", r.text
                outcomes.append(("dead", seed))
        dead = [o for o in outcomes if o != "a"]
        assert dead, "no seed took the dead-end path; the test shows nothing"
        with http.stream("POST", "/v1/completions", json={**body, "seed": dead[0][1], "stream": True}) as r:
            text = "".join(r.iter_text())
        assert r.status_code == 200 and "grammar_dead_end" in text and text.rstrip().endswith("data: [DONE]")
    assert server.health().status_code == 200
