"""Bodies that cost the server more than they should (issue 33, item 10), against the real server: thousands of
unique unknown field names, and a prompt far beyond the context."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx

from dsv41.server import body as body_module
from server_harness import SERVED_NAME, server  # noqa: F401  (the shared server fixture)

NOT_IMPLEMENTED = "accepted but not implemented"


def warnings_about_fields(proc) -> list[str]:
    return [line for line in list(proc.lines) if NOT_IMPLEMENTED in line]


def post(proc, path: str, payload: dict, timeout: float = 120) -> httpx.Response:
    with proc.http(timeout=timeout) as http:
        return http.post(path, json=payload)


def test_thousands_of_unknown_fields_are_one_bounded_line(server):  # noqa: F811
    """Each unknown name was logged on its own line and remembered forever (an 8 MiB body of them froze /health
    for seconds and wrote ~94 MB of warnings). Now: one line per request, bounded, and nothing for names seen."""
    names = {f"x_unknown_{i:05d}_{'q' * 40}": i for i in range(5000)}
    payload = {"model": SERVED_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], **names}
    before = len(warnings_about_fields(server))
    assert post(server, "/v1/chat/completions", payload).status_code == 200
    server.wait_idle()
    time.sleep(0.2)  # the output pump thread
    lines = warnings_about_fields(server)[before:]
    assert len(lines) == 1, lines[:3]
    assert "5000 request fields are" in lines[0] and "(+4992 more)" in lines[0] and len(lines[0]) < 1200
    # the memory is bounded (MAX_REMEMBERED): the same body again is at most one more line ...
    assert post(server, "/v1/chat/completions", payload).status_code == 200
    # ... and names it remembered (the most recent ones) are not logged again
    first = dict(list(names.items())[-100:])
    assert post(server, "/v1/chat/completions", {**payload, **{"x": 0}, **first}).status_code == 200
    few = {"model": SERVED_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], **first}
    assert post(server, "/v1/chat/completions", few).status_code == 200
    server.wait_idle()
    time.sleep(0.2)
    lines = warnings_about_fields(server)[before:]
    assert len(lines) <= 3 and not any("x_unknown_04999" in line for line in lines[1:]), lines


def test_remembered_names_are_bounded():
    body_module.note_unknown_fields("test-endpoint", (f"name{i}" for i in range(3 * body_module.MAX_REMEMBERED)))
    assert len(body_module._remembered) <= body_module.MAX_REMEMBERED
    shown = body_module.note_unknown_fields("test-endpoint2", ["a" * 500, "b"], honoured=["b"])
    assert shown == ["a" * body_module.MAX_NAME_CHARS + "..."]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_a_prompt_1000x_the_context_is_refused_before_tokenizing(server):  # noqa: F811
    """Such a prompt was tokenized in full before its length check (seconds of CPU, GB of RSS). Now its size
    alone refuses it: a 400 context_length_exceeded for a fraction of the CPU one tokenization of it costs
    (~0.7 s of CPU for this prompt on the 2-core CI machine; the refusal costs the JSON parse, ~0.01 s)."""
    with server.http() as http:
        context = http.get("/v1/models").json()["data"][0]["max_model_len"]
    words = "The lighthouse keeper climbs ninety-one steps, counts the flashes and notes the wind. "
    content = (words * (990_000 // len(words)))
    assert len(content) > 100 * context  # ~1,000x for the tiny model's context at ~4 characters per token
    for path, payload in (
            ("/v1/chat/completions", {"model": SERVED_NAME, "max_tokens": 1,
                                      "messages": [{"role": "user", "content": content}]}),
            ("/v1/completions", {"model": SERVED_NAME, "max_tokens": 1, "prompt": content}),
            ("/v1/completions", {"model": SERVED_NAME, "max_tokens": 1, "prompt": list(range(context + 1))})):
        server.wait_idle()
        before = cpu_seconds(server.proc.pid)
        resp = post(server, path, payload)
        spent = cpu_seconds(server.proc.pid) - before
        error = resp.json()["error"]
        assert resp.status_code == 400 and error["code"] == "context_length_exceeded", resp.text[:500]
        assert "refused without tokenizing" in error["message"], error["message"]
        print(f"{path}: refused after {spent:.3f} s of server CPU")
        assert spent < 0.3, spent
    # a prompt that fits is still served, and one just over the context still refused by its token count
    ok = post(server, "/v1/completions", {"model": SERVED_NAME, "max_tokens": 1, "prompt": "hello"})
    assert ok.status_code == 200
    over = post(server, "/v1/completions", {"model": SERVED_NAME, "max_tokens": 1,
                                            "prompt": words * (4 * context // len(words))})  # ~1.7x, by tokens
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"


def test_prompt_size_bound_never_refuses_what_fits():
    """The bound: characters / longest spelling <= tokens, for real text through the real tokenizer."""
    from dsv41.server.context import max_token_chars
    from dsv41.tiny.model import default_model_dir
    from dsv41.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(default_model_dir())
    longest = max_token_chars(tokenizer)
    for text in ("a" * 5000, " " * 5000, "<｜User｜>" * 300, "The lighthouse keeper " * 300, "日本語" * 900,
                 json.dumps({"k": list(range(500))})):
        ids = tokenizer.encode(text)
        assert -(-len(text) // longest) <= len(ids), (text[:30], len(text), len(ids), longest)
        body_module.check_prompt_size({"prompt": text}, len(ids) + 1, longest)  # fits: never refused by size


def test_a_body_of_too_many_members_is_refused_before_parsing(server):  # noqa: F811
    """json.loads holds the GIL for the whole parse: 8 MiB of tiny members held it for most of a second while
    /health waited. Past MAX_OBJECT_KEYS keys (counted in C on the raw bytes) the body is a 400 unparsed; below,
    a key spelled inside a string does not count."""
    limit = body_module.MAX_OBJECT_KEYS
    fields = {f"k{i}": 0 for i in range(limit + 1)}
    resp = post(server, "/v1/chat/completions", {"model": SERVED_NAME, "max_tokens": 1, **fields,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 400 and f"at most {limit} are accepted" in resp.json()["error"]["message"]
    quoted = json.dumps({f"k{i}": 0 for i in range(limit)})  # as text in a message: escaped quotes, no keys
    ok = post(server, "/tokenize", {"model": SERVED_NAME, "prompt": quoted})
    assert ok.status_code == 200, ok.text[:300]


def test_detokenize_takes_at_most_a_context_of_ids(server):  # noqa: F811
    with server.http() as http:
        context = http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert post(server, "/detokenize", {"tokens": [100] * context}).status_code == 200
    for count in (context + 1, 20 * context):  # counted after the parse; far more: by the commas, before it
        resp = post(server, "/detokenize", {"tokens": [100] * count})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "tokens", resp.text[:300]
