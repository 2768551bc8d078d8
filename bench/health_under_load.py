"""/health latency while maximum-size bodies are parsed, tokenized or detokenized (issue 33, item 10).

    python bench/health_under_load.py [--model DIR] [--seconds 20] [--max-body-bytes N] [-- SERVE FLAGS...]

Starts a real `dsv41 serve` (the tiny model by default, one CPU thread), then for each body shape keeps two
requests of that shape in flight (two loader processes: both preparation threads busy) while this process
probes /health every 10 ms on a kept-alive connection. Prints p50 / p99 / max of the probes per shape, and the requests' own
statuses and times. The goal: /health p99 under 100 ms under every shape (the watchdog's probe).

Shapes (each at the body limit): one long chat message (refused by its size before tokenizing unless it fits
the context); a /tokenize of the longest text; a /detokenize of as many ids as fit; a chat body of thousands of
unknown fields; a chat body of many small messages.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
WORDS = "The lighthouse keeper climbs ninety-one steps, counts the flashes and notes the wind. "


def start_server(model: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "dsv41.server", "serve", "--model", str(model), "--port", "0",
                             "--cpu-threads", "1", *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=REPO)
    for line in proc.stdout:
        match = re.search(r"dsv41: serving .* on (http://\S+)", line)
        if match:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, match.group(1)
    raise SystemExit("the server did not start")


def fill(shape: dict, key_path: list, limit: int, unit: str) -> bytes:
    """`shape` with the string at `key_path` grown by `unit`s until the body is just under `limit` bytes."""
    def body(n: int) -> bytes:
        data = json.loads(json.dumps(shape))
        node = data
        for key in key_path[:-1]:
            node = node[key]
        node[key_path[-1]] = unit * n
        return json.dumps(data).encode()

    low, high = 0, limit
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if len(body(mid)) <= limit else (low, mid - 1)
    return body(low)


def shapes(limit: int, model: str) -> dict[str, tuple[str, bytes]]:
    chat = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": ""}]}
    ids_per_byte = len(json.dumps(list(range(100, 200)))) / 100
    fields = {f"x_{i:07d}": 0 for i in range(int(limit / 17))}
    many = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}] * int(limit / 36)}
    return {
        "chat: one long message": ("/v1/chat/completions", fill(chat, ["messages", 0, "content"], limit, WORDS[:8])),
        "tokenize: the longest text": ("/tokenize", fill({"model": model, "prompt": ""}, ["prompt"], limit, WORDS[:8])),
        "detokenize: the most ids": ("/detokenize", json.dumps(
            {"model": model, "tokens": [100 + i % 300 for i in range(int(limit / ids_per_byte) - 20)]}).encode()),
        "chat: thousands of unknown fields": ("/v1/chat/completions", json.dumps(
            {**chat, "messages": [{"role": "user", "content": "hi"}], **fields}).encode()),
        "chat: many small messages": ("/v1/chat/completions", json.dumps(many).encode()),
    }


LOADER = """
import sys, time, httpx
url, path, body_file = sys.argv[1:4]
body = open(body_file, "rb").read()
with httpx.Client(base_url=url, timeout=600) as http:
    while True:
        t0 = time.perf_counter()
        try:
            status = http.post(path, content=body, headers={"content-type": "application/json"}).status_code
        except httpx.HTTPError:
            status = -1
        print(status, time.perf_counter() - t0, flush=True)
"""


def measure(url: str, path: str, body: bytes, seconds: float, tmp: Path) -> dict:
    """Two loader processes (their own GIL: the probe here measures the server, not this process) keep requests
    of `body` in flight while this process probes /health every 10 ms."""
    body_file = tmp / "body.json"
    body_file.write_bytes(body)
    loaders = [subprocess.Popen([sys.executable, "-c", LOADER, url, path, str(body_file)], stdout=subprocess.PIPE,
                                text=True) for _ in range(2)]
    probes = []
    try:
        with httpx.Client(base_url=url, timeout=30) as probe:
            probe.get("/health")
            time.sleep(0.5)
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                probe.get("/health")
                probes.append(time.perf_counter() - t0)
                time.sleep(0.01)
    finally:
        for loader in loaders:
            loader.terminate()
    statuses = []
    for loader in loaders:
        out, _ = loader.communicate(timeout=60)
        statuses += [(int(s), float(t)) for s, t in (line.split() for line in out.splitlines() if line.strip())]
    probes.sort()
    return {"probes": len(probes), "p50_ms": 1000 * statistics.median(probes),
            "p99_ms": 1000 * probes[int(0.99 * (len(probes) - 1))], "max_ms": 1000 * probes[-1],
            "requests": len(statuses), "statuses": sorted({s for s, _ in statuses}),
            "request_s": statistics.median(t for _, t in statuses) if statuses else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder (default: the built-in tiny model)")
    p.add_argument("--seconds", type=float, default=20.0, help="probing time per shape")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20)
    p.add_argument("--only", help="run the shapes whose name contains this")
    p.add_argument("serve_flags", nargs="*")
    args = p.parse_args()
    if args.model:
        model = Path(args.model)
    else:
        from dsv41.tiny.model import default_model_dir

        model = default_model_dir()
    proc, url = start_server(model, ["--max-body-bytes", str(args.max_body_bytes), "--served-name", "m",
                                     *args.serve_flags])
    results = {}
    tmp = tempfile.mkdtemp(prefix="dsv41-health-")
    try:
        for name, (path, body) in shapes(args.max_body_bytes, "m").items():
            if args.only and args.only not in name:
                continue
            result = measure(url, path, body, args.seconds, Path(tmp))
            results[name] = {"bytes": len(body), **result}
            print(f"{name:36s} {len(body):>9d} B  /health p50 {result['p50_ms']:6.1f} ms  p99 "
                  f"{result['p99_ms']:6.1f} ms  max {result['max_ms']:7.1f} ms  ({result['probes']} probes; "
                  f"{result['requests']} requests {result['statuses']}, {result['request_s'] or 0:.2f} s each)",
                  flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
