"""Deadlines and stopping, on real servers of their own: a half-sent body gets 408 after --body-timeout and never
holds up a drain (SIGTERM exits fast, the stalled client gets 503); a second SIGTERM ends running streams with
an error event and [DONE]; a non-ASCII API key authenticates; --allowed-hosts widens the Host allow-list;
nonsense limits are refused at start in one line; a new request during TP fail-fast's grace gets 503;
`--prompt-special-tokens text` keeps control-token spellings in completion prompts plain text."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_harness import REPO, ServerProcess, model_dir, parse_response, request_bytes

KEY = "clé-ü-🔑-0123456789"  # UTF-8 on the wire, as a client that encodes its header value sends it


def auth() -> dict:
    return {"Authorization": b"Bearer " + KEY.encode("utf-8")}


def half_sent(url: str, key: str | None = KEY) -> socket.socket:
    """A connection that sent its headers and half of a 200-byte body, then stalls."""
    host, port = url.split("//")[1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    body = json.dumps({"prompt": "x" * 150, "max_tokens": 1}).encode()
    data = request_bytes("POST", "/v1/completions", body, api_key=None)
    head, _, rest = data.partition(b"\r\n\r\n")
    if key is not None:
        head += b"\r\nAuthorization: Bearer " + key.encode("utf-8")
    sock.sendall(head + b"\r\n\r\n" + rest[: len(rest) // 2])
    return sock


def read_all(sock: socket.socket) -> tuple[int | None, dict, bytes]:
    received = b""
    with sock:
        while chunk := sock.recv(65536):
            received += chunk
    return parse_response(received)


def stream_events(url: str, out: dict) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", headers=auth(), timeout=120,
                          json={"prompt": "long", "max_tokens": 3000, "ignore_eos": True, "stream": True}) as resp:
            out["status"] = resp.status_code
            out["events"] = []
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    out["events"].append(line[6:])
    except httpx.HTTPError as exc:
        out["transport_error"] = repr(exc)


def test_body_deadline_key_bytes_and_second_sigterm(tmp_path):
    server = ServerProcess(tmp_path, "--body-timeout", "1.5", "--drain-timeout", "30", api_key=KEY)
    try:
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=auth())
        assert ok.status_code == 200, ok.text
        wrong = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                           headers={"Authorization": b"Bearer " + KEY.encode("latin-1", "replace")})
        assert wrong.status_code == 401

        started = time.monotonic()
        status, headers, body = read_all(half_sent(server.url))
        waited = time.monotonic() - started
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout", (status, body)
        assert 1.4 < waited < 6, waited

        stream: dict = {}
        reader = threading.Thread(target=stream_events, args=(server.url, stream))
        reader.start()
        deadline = time.monotonic() + 60
        while not stream.get("events"):
            assert time.monotonic() < deadline and reader.is_alive(), stream
            time.sleep(0.02)
        stalled = half_sent(server.url)
        time.sleep(0.2)
        server.proc.send_signal(signal.SIGTERM)
        first = time.monotonic()
        status, _, body = read_all(stalled)
        assert status == 503 and time.monotonic() - first < 1.5, (status, body)  # not the 1.5 s body deadline
        time.sleep(0.5)
        assert reader.is_alive(), "the stream ended before the second signal (the drain grace is 30 s)"
        server.proc.send_signal(signal.SIGTERM)
        second = time.monotonic()
        reader.join(20)
        assert stream["status"] == 200 and stream["events"][-1] == "[DONE]", stream
        error = json.loads(stream["events"][-2])["error"]
        assert "shutting down" in error["message"]
        assert server.proc.wait(20) == 0
        print(f"\nafter the second SIGTERM: stream ended and exit in {time.monotonic() - second:.2f} s")
        assert time.monotonic() - second < 8
    finally:
        server.kill()
    assert "Traceback" not in server.output(), server.output()[-3000:]


def test_half_sent_body_does_not_hold_the_drain_and_allowed_hosts(tmp_path):
    server = ServerProcess(tmp_path, "--drain-timeout", "20", "--allowed-hosts", "api.example",
                           "--prompt-special-tokens", "text", api_key=None)
    try:
        ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "<｜User｜>hi"}).json()["tokens"]
        user = 449  # the tiny tokenizer's <｜User｜>
        assert ids[0] == 0 and user not in ids and len(ids) > 4, ids  # BOS, then the spelling as plain text
        body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
        for host, expected in (("api.example", 200), ("API.example:443", 200), ("evil.example", 421)):
            reply = httpx.post(f"{server.url}/v1/completions", content=body, timeout=30,
                               headers={"host": host, "content-type": "application/json"})
            assert reply.status_code == expected, (host, reply.text)
        stalled = half_sent(server.url, key=None)
        time.sleep(0.3)
        assert server.health().json()["inflight"] == 1  # it is counted while its body is read ...
        server.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        status, _, _ = read_all(stalled)
        assert status == 503
        assert server.proc.wait(30) == 0
        took = time.monotonic() - started
        print(f"\nSIGTERM with a half-sent body in flight: exit in {took:.2f} s (drain timeout 20 s)")
        assert took < 6  # ... but a drain does not wait for it
    finally:
        server.kill()


def test_nonsense_limits_are_one_line_at_start():
    cases = [("--max-model-len", "-5"), ("--max-model-len", "0"), ("--max-model-len", "100000000"),
             ("--max-body-bytes", "-1"), ("--max-waiting", "0"), ("--body-timeout", "nan"), ("--tp", "0")]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))

    def run(flag_value):
        return subprocess.run([sys.executable, "-m", "dsv41.cli", "serve", "--model", str(model_dir()), *flag_value],
                              capture_output=True, text=True, timeout=120, cwd=REPO, env=env)

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(run, cases))
    for (flag, value), result in zip(cases, results):
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, (flag, value, result.stderr[-2000:])
        assert lines[0].startswith(f"dsv41: error: {flag}"), lines[0]


def test_new_requests_during_failfast_grace_get_503():
    """A TP=2 server whose rank 1 dies: until rank 0 exits 70, new requests get 503 + Retry-After, never 500."""
    cmd = [sys.executable, "-m", "dsv41.server", "serve", "--model", str(model_dir()), "--port", "0",
           "--cpu-threads", "1", "--tp", "2"]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    lines: list[str] = []
    ready = threading.Event()

    def pump():
        for line in proc.stdout:
            lines.append(line)
            if "dsv41: serving" in line:
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(240) and proc.poll() is None, "".join(lines[-40:])
        url = next(line for line in lines if "dsv41: serving" in line).strip().rsplit(" ", 1)[1]
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 1, children
        os.kill(int(children[0]), signal.SIGKILL)
        # a request that reached the engine before the failure was noticed may still end as 500 with the
        # reason; from the moment /health says "failed", every new request must be a 503
        while proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=5).json()["status"] == "failed":
                    break
            except httpx.HTTPError:
                break
            time.sleep(0.01)
        seen = []
        while proc.poll() is None:
            try:
                reply = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=5)
            except httpx.HTTPError:
                break
            seen.append((reply.status_code, reply.headers.get("retry-after")))
            time.sleep(0.02)
        assert proc.wait(30) == 70, "".join(lines[-40:])
        assert seen and all(entry == (503, "10") for entry in seen), seen
    finally:
        if proc.poll() is None:
            proc.kill()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
