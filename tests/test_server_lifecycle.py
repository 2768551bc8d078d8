"""Process lifecycle of `dsv41 serve`: SIGTERM drains (503 for new work, a grace period for running requests,
then an error event and [DONE]), the process exits cleanly, and start-up refuses bad arguments in one line."""

import json
import signal
import subprocess
import sys
import threading
import time

import httpx

from server_harness import REPO, ServerProcess

# The tiny model decodes ~11 tok/s on one CPU thread, ~3 tok/s per stream under CI load: the short request's
# 20 tokens fit the grace period with room, the long one's 8000 never do.
GRACE_S = 15.0


def _read_stream(url: str, key: str, body: dict, out: dict) -> None:
    try:
        _read_events(url, key, body, out)
    except httpx.HTTPError as exc:  # the server was killed under it: the test looks at `out`
        out["transport_error"] = exc


def _read_events(url: str, key: str, body: dict, out: dict) -> None:
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {key}"}, timeout=120) as resp:
        out["status"] = resp.status_code
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                out.setdefault("first_event_at", time.monotonic())
    out["events"] = events


def test_sigterm_drains_then_ends_streams_with_an_error(tmp_path):
    server = ServerProcess(tmp_path, "--drain-timeout", str(GRACE_S))
    try:
        short, long = {}, {}
        t_short = threading.Thread(target=_read_stream, args=(server.url, server.api_key, {
            "prompt": "short", "max_tokens": 20, "ignore_eos": True}, short))
        t_long = threading.Thread(target=_read_stream, args=(server.url, server.api_key, {
            "prompt": "long", "max_tokens": 8000, "ignore_eos": True}, long))
        t_short.start()
        while "first_event_at" not in short:
            time.sleep(0.01)
        t_long.start()
        deadline = time.monotonic() + 30
        while server.health().json()["generations"] < 2:  # both requests are in the server
            assert time.monotonic() < deadline and t_short.is_alive(), "the short request ended too early"
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)
        health = server.health()
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "new", "max_tokens": 2},
                             headers={"Authorization": f"Bearer {server.api_key}"}, timeout=30)
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        assert refused.json()["error"]["type"] == "server_error"
        t_short.join(60)
        t_long.join(60)
        # the short request finished normally inside the grace period
        assert short["events"][-1] == "[DONE]"
        finals = [json.loads(e) for e in short["events"][:-1]]
        assert finals[-1]["choices"][0]["finish_reason"] == "length"
        assert not any("error" in e for e in finals)
        # the long one was ended after the grace period: an error event, then [DONE]
        assert long["status"] == 200 and long["events"][-1] == "[DONE]"
        error = json.loads(long["events"][-2])["error"]
        assert error["type"] == "server_error" and "shutting down" in error["message"]
        rc = server.proc.wait(60)
        assert rc == 0, server.output()
        assert time.monotonic() - signalled >= GRACE_S  # the grace period was honoured
    finally:
        server.kill()
    records = [json.loads(line) for line in server.request_log.read_text().splitlines()]
    assert {r["status"] for r in records if r["endpoint"] == "completions"} >= {200, 503}


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv41.server", "serve", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_startup_refuses_bad_arguments_in_one_line(tmp_path):
    missing = _serve("--model", str(tmp_path / "nowhere"), "--port", "0")
    assert missing.returncode == 2
    assert "nowhere" in missing.stderr and "Traceback" not in missing.stderr
    empty_key = tmp_path / "key"
    empty_key.write_text("\n")
    bad_key = _serve("--model", str(tmp_path), "--api-key-file", str(empty_key), "--port", "0")
    assert bad_key.returncode == 2 and "is empty" in bad_key.stderr and "Traceback" not in bad_key.stderr


def test_full_queue_answers_429_with_retry_after(tmp_path):
    server = ServerProcess(tmp_path, "--max-waiting", "1", "--parallel", "1")  # one slot: the second request waits
    try:
        running, waiting = {}, {}
        body = {"prompt": "busy", "max_tokens": 8000, "ignore_eos": True}
        threads = [threading.Thread(target=_read_stream, args=(server.url, server.api_key, body, out), daemon=True)
                   for out in (running, waiting)]
        threads[0].start()
        while "first_event_at" not in running:
            time.sleep(0.01)
        threads[1].start()
        deadline = time.monotonic() + 30
        while server.health().json()["engine"]["waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": "one more", "max_tokens": 2},
                          headers={"Authorization": f"Bearer {server.api_key}"}, timeout=30)
        assert resp.status_code == 429 and int(resp.headers["Retry-After"]) >= 1
        assert resp.json()["error"]["type"] == "rate_limit_error"
    finally:
        server.kill()
