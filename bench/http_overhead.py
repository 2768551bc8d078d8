"""Tokens/s through HTTP streaming vs the engine directly, on the same model and the same request.

    python bench/http_overhead.py [--model DIR] [--tokens 256] [--runs 5] [--cpu-threads 1]

Engine direct: `SerialEngine.submit` in this process, timing submit -> finish event.
HTTP: a real `dsv41 serve` process on loopback, a streaming /v1/completions request read event by event with
httpx, timing request -> [DONE]. Both use ignore_eos and the same prompt/seed, so they produce the same number
of tokens; runs alternate between the two so drifting machine load hits both alike (only one runs at a time). Prints both rates, the ratio and the overhead (1 - http/engine); the goal is <= 5%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The lighthouse stood at the end of a narrow spit of rock"


class DirectEngine:
    """The engine in this process, called through its async interface (no HTTP)."""

    def __init__(self, model_dir: Path, threads: int, tokens: int):
        import torch

        from dsv41.engine.serial import SerialEngine
        from dsv41.model.loader import load_model
        from dsv41.tokenizer import Tokenizer

        torch.set_num_threads(threads)
        tokenizer = Tokenizer.from_dir(model_dir)
        self.ids = [tokenizer.bos_id] + tokenizer.encode(PROMPT)
        self.tokens = tokens
        self.loop = asyncio.new_event_loop()
        self.engine = SerialEngine(load_model(model_dir), max_model_len=len(self.ids) + tokens + 1)
        self.loop.run_until_complete(self.engine.start())

    def run(self) -> float:
        from dsv41.engine import GenerationRequest, SamplingParams, TokenEvent

        async def one() -> float:
            started = time.perf_counter()
            count = 0
            stream = self.engine.submit(GenerationRequest(prompt_ids=self.ids, max_tokens=self.tokens,
                                                          ignore_eos=True, sampling=SamplingParams(seed=1)))
            async for event in stream:
                count += isinstance(event, TokenEvent)
            return count / (time.perf_counter() - started)

        return self.loop.run_until_complete(one())

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.shutdown())


class HttpServer:
    """A real `dsv41 serve` process; one streaming /v1/completions request per run."""

    def __init__(self, model_dir: Path, threads: int, tokens: int):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dsv41.server", "serve", "--model", str(model_dir), "--port", "0",
             "--cpu-threads", str(threads)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            cwd=REPO)
        url = None
        for line in self.proc.stdout:
            match = re.search(r"dsv41: serving .* on (http://\S+)", line)
            if match:
                url = match.group(1)
                break
        if url is None:
            raise SystemExit("server did not start")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
        self.http = httpx.Client(base_url=url, timeout=600)
        self.tokens = tokens
        self.body = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "seed": 1, "stream": True,
                     "stream_options": {"include_usage": True}}

    def run(self) -> float:
        started = time.perf_counter()
        count = 0
        with self.http.stream("POST", "/v1/completions", json=self.body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    count = usage["completion_tokens"] if usage else count
        elapsed = time.perf_counter() - started
        if count != self.tokens:
            raise SystemExit(f"expected {self.tokens} tokens, the usage chunk says {count}")
        return count / elapsed

    def close(self) -> None:
        self.http.close()
        self.proc.terminate()
        self.proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder (default: the built-in tiny model)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cpu-threads", type=int, default=1)
    args = parser.parse_args()
    if args.model:
        model_dir = Path(args.model)
    else:
        from dsv41.tiny.model import default_model_dir

        model_dir = default_model_dir()
    server = HttpServer(model_dir, args.cpu_threads, args.tokens)
    direct = DirectEngine(model_dir, args.cpu_threads, args.tokens)
    engine, http = [], []
    try:
        direct.run(), server.run()  # warm-up
        for _ in range(args.runs):  # alternate, so machine load drifts hit both sides alike
            engine.append(direct.run())
            http.append(server.run())
    finally:
        direct.close()
        server.close()
    e, h = statistics.median(engine), statistics.median(http)
    print(f"model {model_dir}  tokens/request {args.tokens}  runs {args.runs}  cpu threads {args.cpu_threads}")
    print(f"engine direct : {e:8.1f} tok/s  (runs: {', '.join(f'{r:.1f}' for r in engine)})")
    print(f"HTTP streaming: {h:8.1f} tok/s  (runs: {', '.join(f'{r:.1f}' for r in http)})")
    print(f"ratio http/engine {h / e:.3f}  overhead {100 * (1 - h / e):.1f}%")


if __name__ == "__main__":
    main()
