"""Route-level errors on the Anthropic Messages API's paths take Anthropic's error shape (issue 33 item 10).

A 404 under /v1/messages, a 405 on it and a 421 for a foreign Host header reach the client before any handler
runs; on those paths they are `{"type": "error", "error": {"type", "message"}}` (what the official anthropic client
parses), elsewhere OpenAI's `{"error": {...}}` as before. (A framing 400 precedes the request line's parse, so it
has no path to choose by: it stays OpenAI's.) The real server, the official client.
"""

from __future__ import annotations

import json

import pytest

from server_harness import API_KEY, raw_exchange, request_bytes, server  # noqa: F401 (pytest fixture)

BODY = json.dumps({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}).encode()


def _anthropic(payload: bytes, kind: str) -> dict:
    body = json.loads(payload)
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body


def test_route_errors_under_messages_are_anthropic_shaped(server):  # noqa: F811
    status, _, payload = raw_exchange(server.url, request_bytes("POST", "/v1/messages/nope", BODY))
    assert status == 404
    _anthropic(payload, "not_found_error")
    status, _, payload = raw_exchange(server.url, request_bytes("GET", "/v1/messages"))
    assert status == 405
    _anthropic(payload, "invalid_request_error")
    status, _, payload = raw_exchange(server.url, request_bytes("POST", "/v1/messages", BODY, host="evil.example"))
    assert status == 421
    _anthropic(payload, "invalid_request_error")
    # the OpenAI routes keep OpenAI's shape
    status, _, payload = raw_exchange(server.url, request_bytes("POST", "/v1/nope", BODY))
    assert status == 404 and json.loads(payload)["error"]["code"] == "not_found"
    status, _, payload = raw_exchange(server.url, request_bytes("POST", "/v1/completions", BODY, host="evil.example"))
    assert status == 421 and json.loads(payload)["error"]["code"] == "misdirected_request"


def test_the_anthropic_client_reads_a_route_404(server):  # noqa: F811
    anthropic = pytest.importorskip("anthropic", reason="the official anthropic client is in the lock")
    client = anthropic.Anthropic(base_url=server.url + "/v1/messages/wrong", api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "not_found_error"
