"""Tokens/s through HTTP streaming vs the same engine directly, on the same model and the same request.

    python bench/http_overhead.py [--model DIR] [--tokens 256] [--runs 5] [--cpu-threads 1] [-- SERVE FLAGS...]

Both sides build the engine exactly as `dsv41 serve` does, from the same serve flags (the serve parser, `Startup`,
`load_serving_model`, `build_server`: the batched engine by default, or whatever `--engine`/`--parallel`/... the
extra flags say), so the difference is HTTP alone (an earlier version compared the serial engine with the
server's batched one).
Engine direct: `ctx.engine.submit` in this process, timing submit -> finish event.
HTTP: a real `dsv41 serve` process on loopback, a streaming /v1/completions request of the same token ids read
event by event with httpx, timing request -> [DONE]. Both use ignore_eos and the same ids/seed, so they produce the
same number of tokens; runs alternate between the two so drifting machine load hits both alike (only one runs at a
time). Prints both rates, the ratio and the overhead (1 - http/engine); the goal is <= 5%.
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
    """The engine `dsv41 serve` builds from `serve_flags`, in this process, called without HTTP."""

    def __init__(self, serve_flags: list[str], tokens: int):
        from dsv41.cli import build_parser
        from dsv41.server.cli import Startup, build_server, load_serving_model

        args = build_parser().parse_args(["serve", *serve_flags])
        startup = Startup.check(args)
        model = load_serving_model(args, startup, progress=lambda done, total, what: None)
        self.ctx = build_server(args, startup, model)
        tokenizer = self.ctx.tokenizer
        self.ids = [tokenizer.bos_id] + tokenizer.encode(PROMPT)
        self.tokens = tokens
        self.engine_name = type(self.ctx.engine).__name__
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.ctx.engine.start())

    def run(self) -> float:
        from dsv41.engine import GenerationRequest, SamplingParams, TokenEvent

        async def one() -> float:
            started = time.perf_counter()
            count = 0
            stream = self.ctx.engine.submit(GenerationRequest(prompt_ids=self.ids, max_tokens=self.tokens,
                                                              ignore_eos=True, sampling=SamplingParams(seed=1)))
            async for event in stream:
                count += isinstance(event, TokenEvent)
            if count != self.tokens:
                raise SystemExit(f"expected {self.tokens} tokens from the engine, got {count}")
            return count / (time.perf_counter() - started)

        return self.loop.run_until_complete(one())

    def close(self) -> None:
        self.loop.run_until_complete(self.ctx.engine.shutdown())
        self.ctx.close()


class HttpServer:
    """A real `dsv41 serve` process; one streaming /v1/completions request per run."""

    def __init__(self, serve_flags: list[str], ids: list[int], tokens: int):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dsv41.server", "serve", *serve_flags, "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
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
        self.body = {"prompt": ids, "max_tokens": tokens, "ignore_eos": True, "seed": 1, "stream": True,
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
    parser.add_argument("serve_flags", nargs="*", help="more `dsv41 serve` flags, after --, for both sides")
    args = parser.parse_args()
    if args.model:
        model_dir = Path(args.model)
    else:
        from dsv41.tiny.model import default_model_dir

        model_dir = default_model_dir()
    serve_flags = ["--model", str(model_dir), "--cpu-threads", str(args.cpu_threads), *args.serve_flags]
    direct = DirectEngine(serve_flags, args.tokens)
    server = HttpServer(serve_flags, direct.ids, args.tokens)
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
    print(f"model {model_dir}  engine {direct.engine_name} (serve {' '.join(serve_flags[2:])})  "
          f"tokens/request {args.tokens}  runs {args.runs}")
    print(f"engine direct : {e:8.1f} tok/s  (runs: {', '.join(f'{r:.1f}' for r in engine)})")
    print(f"HTTP streaming: {h:8.1f} tok/s  (runs: {', '.join(f'{r:.1f}' for r in http)})")
    print(f"ratio http/engine {h / e:.3f}  overhead {100 * (1 - h / e):.1f}%")


if __name__ == "__main__":
    main()
