"""/metrics as Prometheus parses it (vLLM's names, dsv41_* for the rest) and the CORS option, on real servers.

One server runs with --allowed-origins (CORS on); the shared `server` fixture runs without it (CORS off).
"""

from __future__ import annotations

import pytest

from server_harness import ServerProcess, server  # noqa: F401  (the shared server fixture)

ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def cors_server(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("cors"), "--allowed-origins", ORIGIN)
    yield proc
    proc.terminate()


# ---------------------------------------------------------------------------- CORS
def test_cors_preflight_is_answered_before_auth(cors_server):
    with cors_server.http() as http:
        r = http.options("/v1/chat/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type", "Authorization": ""})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()


def test_cors_headers_on_answers_and_errors(cors_server):
    with cors_server.http() as http:
        ok = http.get("/v1/models", headers={"Origin": ORIGIN})
        denied = http.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer wrong"})
        foreign = http.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
    assert foreign.status_code == 200 and "access-control-allow-origin" not in foreign.headers


def test_cors_is_off_by_default(server):  # noqa: F811
    with server.http() as http:
        pre = http.options("/v1/chat/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
        r = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert pre.status_code == 405
    assert "access-control-allow-origin" not in r.headers and "access-control-allow-origin" not in pre.headers
