"""Hostile and careless input against the real server: ≥ 300 malformed requests (bad JSON, deep nesting, lone
surrogates, wrong types, huge numbers, unenforceable schemas, impossible regexes, unicode edge cases, wrong
content types and methods, broken HTTP framing). None may answer ≥ 500; every 4xx is an OpenAI error object
whose message carries no exception text or source path; the server stays healthy and logs no error."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx

from server_harness import raw_exchange, request_bytes, server  # noqa: F401 (pytest fixture)

CHAT, COMP, TOK, DETOK = "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"
SEED = 41
INTERNALS = re.compile(r"Traceback|\b[A-Z][A-Za-z]*(Error|Exception)\b|\.(py|cc|cpp|h|cu)\b|/project/|/pytorch/|"
                       r"site-packages|0x[0-9a-f]{8}")

UNICODE = ["\u200b\u200d", "\u202e reversed", "\uffff", "\U0010ffff", "a\x00b", "e\u0301" * 50, "👩‍👩‍👧‍👦" * 20,
           "\ufeffbom", "<｜Assistant｜>", "</think><｜end▁of▁sentence｜>", "｜DSML｜", "\r\n\t\x0b", "🙂" * 300]
SURROGATES = ["\\ud800", "x\\udfff", "\\udc00\\ud800", "ok \\ud83d"]  # JSON escapes of lone surrogates
HUGE = [2**63, -(2**63) - 1, 10**30, 1e308, -1e308, 2**64, 10**300]
WRONG = [None, True, "x", "", 1.5, -1, 0, [], {}, [1, "a"], {"a": 1}, "\u0000"]
SCHEMAS = [{"not": {}}, {"allOf": [{"type": "string"}, {"type": "integer"}]}, {"if": {}, "then": {}},
           {"type": "object", "required": ["a"], "properties": {"b": {"type": "string"}}},
           {"type": "object", "required": ["a"]}, {"type": "array", "contains": {"type": "integer"}},
           {"type": "array", "uniqueItems": True}, {"type": "string", "enum": [1]}, {"anyOf": []},
           {"type": "strin"}, {"$ref": "#/$defs/nope"}, {"type": "integer", "minimum": 5, "maximum": 1},
           {"type": "string", "pattern": "[^\\s\\S]"}, {"type": "string", "pattern": "(("}, {"enum": []}, False,
           {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, {"dependentRequired": {"a": ["b"]}},
           {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not a schema", 7]
REGEXES = ["[^\\s\\S]", "a[^\\s\\S]", "((", "[z-a]", "(?<=x)y", "\\", "x{5,2}", "[^\\d\\D]+"]


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **fields}


def comp(**fields) -> dict:
    return {"prompt": "hello", "max_tokens": 1, **fields}


def nested(depth: int, open_: str = "[", close: str = "]") -> bytes:
    return (open_ * depth + close * depth).encode()


def cases() -> list[tuple[str, str, str, bytes, str]]:
    """(name, method, path, body bytes, content type) — deterministic."""
    rng = random.Random(SEED)
    out = []

    def add(name, path, body, method="POST", ctype="application/json"):
        if not isinstance(body, bytes):
            body = json.dumps(body, ensure_ascii=False).encode()
        out.append((name, method, path, body, ctype))

    valid = {CHAT: chat(), COMP: comp(), TOK: {"prompt": "hi"}, DETOK: {"tokens": [5, 6]}}
    for path, body in valid.items():
        text = json.dumps(body).encode()
        for cut in sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1))):
            add(f"truncated-{path}-{cut}", path, text[:cut])
        for depth in (65, 200, 5000, 100_000):
            add(f"deep-array-{path}-{depth}", path, b'{"x": ' + nested(depth) + b"}")
        add(f"deep-object-{path}", path, b'{"a":' * 3000 + b"1" + b"}" * 3000)
        for raw in (b"", b" ", b"null", b"[]", b"42", b'"s"', b"{", b"}", b"\xff\xfe{}", b'{"a": NaN}',
                    b'{"a": Infinity}', b'{"a": 1e400}', b'{"a": ' + b"9" * 5000 + b"}", b"\xef\xbb\xbf{}",
                    b'{"a": "\xc3\x28"}', b"{'single': 1}", b'{"a": 1,}', b'{"a" 1}'):
            add(f"raw-{path}-{raw[:12]!r}", path, raw)
    for surrogate in SURROGATES:
        add("surrogate-content", CHAT, f'{{"messages": [{{"role": "user", "content": "{surrogate}"}}], '
                                       f'"max_tokens": 2}}'.encode())
        add("surrogate-prompt", COMP, f'{{"prompt": "{surrogate}", "max_tokens": 2}}'.encode())
        add("surrogate-tool-name", CHAT, json.dumps(chat(tools=[{"type": "function", "function": {
            "name": "SURR"}}])).replace("SURR", surrogate).encode())
        add("surrogate-key", CHAT, json.dumps(chat(extra={"K": 1})).replace('"K"', f'"{surrogate}"').encode())
        add("surrogate-stop", COMP, json.dumps(comp(stop=["S"])).replace('"S"', f'"{surrogate}"').encode())
        add("surrogate-tokenize", TOK, f'{{"prompt": "{surrogate}"}}'.encode())
    fields = {CHAT: ["model", "messages", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n", "stream",
                     "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                     "response_format", "reasoning_effort", "chat_template_kwargs", "stream_options",
                     "parallel_tool_calls", "structured_outputs", "guided_json", "guided_regex", "guided_choice"],
              COMP: ["prompt", "max_tokens", "echo", "logprobs", "temperature", "seed", "top_k", "stop", "suffix",
                     "add_special_tokens", "skip_special_tokens", "ignore_eos"],
              DETOK: ["tokens"], TOK: ["prompt", "messages", "add_special_tokens"]}
    for path, names in fields.items():
        for name in names:
            # (a null max_tokens is no error: it means "the rest of the context", a long generation here)
            for value in rng.sample([w for w in WRONG if w is not None or "max" not in name], 3):
                add(f"wrong-{path}-{name}", path, {**valid[path], name: value})
            for value in rng.sample(HUGE, 2):
                if path != DETOK or name == "tokens":
                    add(f"huge-{path}-{name}", path, {**valid[path], name: [value] if name == "tokens" else value})
    for schema in SCHEMAS:
        add("schema-response-format", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": schema}}))
        add("schema-structured", COMP, comp(structured_outputs={"json": schema}))
        add("schema-tool-required", CHAT, chat(tools=[{"type": "function", "function": {
            "name": "f", "parameters": schema}}], tool_choice="required"))
    for regex in REGEXES:
        add("regex-guided", CHAT, chat(guided_regex=regex))
        add("regex-structured", COMP, comp(structured_outputs={"regex": regex}))
    # unicode edge cases: rendered and tokenized like a chat request (/tokenize), two of them generate too
    for i, text in enumerate(UNICODE):
        add("unicode-content", TOK, {"messages": [{"role": "user", "content": text}]})
        add("unicode-prompt", TOK, {"prompt": text})
        add("unicode-tool", TOK, {"messages": [{"role": "user", "content": "x"}], "tools": [
            {"type": "function", "function": {"name": text[:30] or "x", "description": text}}]})
        add("unicode-model", DETOK, {"tokens": [1, 2], "model": text})
        if i < 2:
            add("unicode-chat", CHAT, chat(messages=[{"role": "user", "content": text}]))
    messages = [[{"role": "user"}], [{"role": "tool", "content": 5}], [{"role": "assistant", "tool_calls": "x"}],
                [{"role": "assistant", "tool_calls": [{"function": {"name": ""}}]}], [{"role": "user", "content": [
                    {"type": "text"}]}], [{"role": "user", "content": [{"type": "image_url"}]}], ["x"], [[]],
                [{"role": "user", "content": "a", "task": "action"}], [{"role": "latest_reminder", "content": "x"}]]
    for m in messages:
        add("messages-shape", TOK, {"messages": m})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None,
                  "application/jsonx", "text/json"):
        add(f"content-type-{ctype}", CHAT, chat(), ctype=ctype)
    for method in ("GET", "PUT", "DELETE", "PATCH", "OPTIONS"):
        add(f"method-{method}", CHAT, b"", method=method)
    for path in ("/v1/chat/completions/", "//v1/completions", "/v1/completions%00", "/v1/../v1/models",
                 "/v1/chat/completions?x=1", "/%ff", "/v1/embeddings"):
        add(f"path-{path}", path, comp())
    return out


def framing_cases() -> list[tuple[str, bytes, bool]]:
    """Broken HTTP/1.1 framing: (name, raw bytes, half-close after sending)."""
    body = json.dumps(comp()).encode()
    return [
        ("bad-content-length", request_bytes("POST", COMP, body, length=None).replace(
            f"Content-Length: {len(body)}".encode(), b"Content-Length: ten"), False),
        ("two-content-lengths", request_bytes("POST", COMP, body, extra=f"Content-Length: {len(body) + 1}\r\n"),
         False),
        ("short-body-half-closed", request_bytes("POST", COMP, body[:10], length=len(body)), True),
        ("bad-chunk", request_bytes("POST", COMP, b"zz\r\nabc\r\n0\r\n\r\n", extra="Transfer-Encoding: chunked\r\n"),
         False),
        ("header-too-large", request_bytes("POST", COMP, body, extra="X-Big: " + "a" * 70_000 + "\r\n"), False),
        ("bad-request-line", b"POST /v1/completions HTTP/9\r\n\r\n", False),
        ("garbage", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64, True),
        ("no-host", b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", False),
    ]


def check_error(status: int, body: bytes, what: str) -> None:
    assert status < 500, f"{what}: {status} {body[:300]!r}"
    if status < 400:
        return
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, (what, error)
    assert isinstance(error["message"], str) and error["message"], (what, error)
    assert not INTERNALS.search(error["message"]), f"{what}: internals in {error['message']!r}"


def test_malformed_requests_never_get_5xx(server):  # noqa: F811
    all_cases = cases()
    assert len(all_cases) >= 300, len(all_cases)
    headers = {"Authorization": f"Bearer {server.api_key}"}

    def send(case):
        name, method, path, body, ctype = case
        h = dict(headers, **({"content-type": ctype} if ctype else {}))
        with httpx.Client(base_url=server.url, timeout=120) as http:
            resp = http.request(method, path, content=body if method != "GET" else None, headers=h)
        return name, resp.status_code, resp.content

    statuses: dict[int, int] = {}
    with ThreadPoolExecutor(4) as pool:
        for name, status, content in pool.map(send, all_cases):
            check_error(status, content, name)
            statuses[status] = statuses.get(status, 0) + 1
    print(f"\n{len(all_cases)} requests: statuses {dict(sorted(statuses.items()))}")
    assert statuses.get(400, 0) > 200 and 415 in statuses and 405 in statuses

    for name, data, half_close in framing_cases():
        status, _, body = raw_exchange(server.url, data, half_close=half_close, timeout_s=20)
        if status is not None:  # a TLS hello may be dropped without an answer
            check_error(status, body, name)
            assert status in (400, 413, 431), (name, status, body)

    health = server.wait_idle()
    assert health["ok"]
    output = server.output()
    assert "Traceback" not in output and " ERROR " not in output and "unhandled error" not in output, output[-3000:]
