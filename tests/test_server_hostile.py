"""The real server against clients that leave at random points, a maximum-size request next to /health, a
browser's reach (content types, Host headers, trailing slashes) and forged turns in message content.

- 520 disconnects at random points (mid-headers, before the body, mid-body, half-closed mid-body, right after
  the body, after a random delay, mid-stream): no error logged, no `status="500"` in the metrics (disconnects
  are 499), nothing in flight afterwards, and the same greedy reply as before.
- A body at `--max-body-bytes` being parsed and tokenized does not hold up /health (< 100 ms each).
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from server_harness import raw_exchange, request_bytes, server, tokenizer  # noqa: F401 (pytest fixtures)

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
DISCONNECTS = 520
GREEDY = {"prompt": "The lighthouse keeper", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def greedy(server) -> str:
    with server.http() as http:
        resp = http.post(COMP, json=GREEDY)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _connect(url: str) -> socket.socket:
    host, port = url.split("//")[1].split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def leave(url: str, rng: random.Random) -> str:
    """One request abandoned at a random point; returns the point's name."""
    stream = rng.random() < 0.5
    if rng.random() < 0.5:
        path, body = COMP, {"prompt": rng.choice(["The", "Ships", "A lighthouse"]), "max_tokens": 8,
                            "ignore_eos": True, "stream": stream}
    else:
        path, body = CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "ignore_eos": True,
                            "stream": stream}
    data = request_bytes("POST", path, json.dumps(body).encode())
    head_len = data.index(b"\r\n\r\n") + 4
    point = rng.choice(["headers", "before-body", "mid-body", "half-closed", "after-body", "delay", "mid-reply"])
    with _connect(url) as sock:
        if point == "headers":
            sock.sendall(data[:rng.randrange(1, head_len - 2)])
        elif point == "before-body":
            sock.sendall(data[:head_len])
        elif point in ("mid-body", "half-closed"):
            sock.sendall(data[:rng.randrange(head_len, len(data))])
            if point == "half-closed":
                sock.shutdown(socket.SHUT_WR)
                sock.recv(65536)  # the 400 incomplete_body
        else:
            sock.sendall(data)
            if point == "delay":
                time.sleep(rng.uniform(0, 0.05))
            elif point == "mid-reply":
                sock.recv(rng.randrange(1, 400))
    return point


def test_random_disconnects_leave_no_error_and_no_trace(server):  # noqa: F811
    reply = greedy(server)
    server.wait_idle()
    log_from = len(server.lines)
    before = httpx.get(f"{server.url}/metrics").text
    rng = random.Random(18)
    seeds = [rng.randrange(1 << 30) for _ in range(DISCONNECTS)]
    started = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        points = list(pool.map(lambda seed: leave(server.url, random.Random(seed)), seeds))
    elapsed = time.monotonic() - started
    health = server.wait_idle(timeout_s=60)
    after = httpx.get(f"{server.url}/metrics").text
    counts = {p: points.count(p) for p in sorted(set(points))}
    print(f"\n{DISCONNECTS} disconnects in {elapsed:.1f} s: {counts}")
    assert len(counts) == 7
    assert metric(after, "dsv41_requests_total", status="500") == metric(before, "dsv41_requests_total", status="500")
    assert metric(after, "dsv41_request_errors_total", status="500") == \
        metric(before, "dsv41_request_errors_total", status="500")
    assert metric(after, "dsv41_requests_total", status="499") > metric(before, "dsv41_requests_total", status="499")
    log = "".join(server.lines[log_from:])
    assert "Traceback" not in log and " ERROR " not in log and "unhandled" not in log, log[-3000:]
    assert health["inflight"] == 0 and health["generations"] == 0 and health["engine"]["live_sequences"] == 0
    assert greedy(server) == reply  # the engine state left behind by the cancelled requests changes nothing


def test_health_stays_quick_while_a_maximum_size_request_is_processed(server):  # noqa: F811
    """A chat body at the server's limit (1 MB in the harness) is parsed, rendered and tokenized off the event
    loop: /health keeps answering throughout. Work on the loop shows as one probe that waits for most of the
    request (~1 s here when the preparation threads are bypassed); a loaded 2-core machine shows lone scheduling
    stalls of up to ~0.2 s whatever the request does, so the bound is a quarter of the request's own time."""
    limit = 1_000_000
    words = "The lighthouse keeper climbs ninety-one steps, counts the flashes and notes the wind. "
    content = (words * (limit // len(words)))[: limit - 200]
    shape = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
    content += "x" * (limit - len(json.dumps(shape).encode()))
    body = json.dumps({**shape, "messages": [{"role": "user", "content": content}]}).encode()
    assert len(body) == limit
    done = threading.Event()
    result = {}

    def big() -> None:
        with server.http(timeout=300) as http:
            resp = http.post("/tokenize", content=body, headers={"content-type": "application/json"})
        result["status"], result["count"] = resp.status_code, resp.json().get("count")
        done.set()

    server.wait_idle()
    with httpx.Client(base_url=server.url, timeout=30) as probe:
        probe.get("/health")  # the connection is open before the big request starts
        thread = threading.Thread(target=big)
        started = time.perf_counter()
        thread.start()
        latencies = []
        while not done.is_set():
            t0 = time.perf_counter()
            assert probe.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.02)
        elapsed = time.perf_counter() - started
        thread.join()
    assert result["status"] == 200 and result["count"] > 100_000, result
    print(f"\n/health during a {len(body)}-byte request of {elapsed:.2f} s: {len(latencies)} probes, "
          f"max {max(latencies) * 1000:.0f} ms")
    assert len(latencies) >= 5, "the request finished too fast to measure anything"
    assert max(latencies) < 0.25 * elapsed, (elapsed, sorted(latencies)[-5:])


def test_browser_reach_content_type_host_and_slashes(server):  # noqa: F811
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=b", None):
        status, _, payload = raw_exchange(server.url, request_bytes("POST", COMP, body, content_type=ctype))
        assert status == 415, (ctype, status, payload)
        assert json.loads(payload)["error"]["code"] == "unsupported_media_type"
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "[::2]"):
        status, _, payload = raw_exchange(server.url, request_bytes("POST", COMP, body, host=host))
        assert status == 421, (host, status, payload)
        assert json.loads(payload)["error"]["code"] == "misdirected_request"
    port = server.url.rsplit(":", 1)[1]
    for host in ("127.0.0.1", f"127.0.0.1:{port}", f"localhost:{port}", "[::1]", "LOCALHOST"):
        status, _, payload = raw_exchange(server.url, request_bytes("POST", COMP, body, host=host))
        assert status == 200, (host, status, payload)
    status, headers, payload = raw_exchange(server.url, request_bytes("POST", COMP + "/", body, host="evil.example"))
    assert status == 421 and "location" not in headers
    status, headers, payload = raw_exchange(server.url, request_bytes("POST", COMP + "/", body))
    assert status == 200 and "location" not in headers, (status, headers)


def test_forged_turns_through_the_server(server, tokenizer):  # noqa: F811
    """Each control token spelled in user content comes back from /tokenize as plain-text ids; the rendered
    text (decoded) is unchanged."""
    added = {i: t.content for i, t in tokenizer.added_tokens.items()}
    clean = {"messages": [{"role": "user", "content": "hello world"}]}
    with server.http() as http:
        base = http.post("/tokenize", json=clean).json()["tokens"]
        for token_id, text in added.items():
            forged = {"messages": [{"role": "user", "content": f"hello {text} world"}]}
            resp = http.post("/tokenize", json=forged)
            if text == "<｜deepseek_image｜>":  # the encoder refuses a typed image placeholder (image parts only)
                assert resp.status_code == 400
                continue
            ids = resp.json()["tokens"]
            assert [i for i in ids if i in added] == [i for i in base if i in added], text
            assert tokenizer.decode(ids) == tokenizer.decode(base).replace("hello world", f"hello {text} world")
