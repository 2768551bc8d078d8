"""Tokens/s through HTTP streaming vs the engine directly, on the same model and the same request.

    python bench/http_overhead.py [--model DIR] [--tokens 256] [--runs 5] [--cpu-threads 1]

Engine direct: `SerialEngine.submit` in this process, timing submit -> finish event.
HTTP: a real `dsv41 serve` process on loopback, a streaming /v1/completions request read event by event with
httpx, timing request -> [DONE]. Both use ignore_eos and the same prompt/seed, so they produce the same number
of tokens. Prints both rates, the ratio and the overhead (1 - http/engine); the goal is <= 5%.
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


def engine_rates(model_dir: Path, tokens: int, runs: int, threads: int) -> list[float]:
    import torch

    from dsv41.engine import GenerationRequest, SamplingParams, TokenEvent
    from dsv41.engine.serial import SerialEngine
    from dsv41.model.loader import load_model
    from dsv41.tokenizer import Tokenizer

    torch.set_num_threads(threads)
    model = load_model(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    ids = [tokenizer.bos_id] + tokenizer.encode(PROMPT)

    async def main() -> list[float]:
        engine = SerialEngine(model, max_model_len=len(ids) + tokens + 1)
        await engine.start()
        rates = []
        for run in range(runs + 1):  # the first run warms up
            started = time.perf_counter()
            count = 0
            stream = engine.submit(GenerationRequest(prompt_ids=ids, max_tokens=tokens, ignore_eos=True,
                                                     sampling=SamplingParams(seed=1)))
            async for event in stream:
                count += isinstance(event, TokenEvent)
            if run:
                rates.append(count / (time.perf_counter() - started))
        await engine.shutdown()
        return rates

    return asyncio.run(main())


def http_rates(model_dir: Path, tokens: int, runs: int, threads: int) -> list[float]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "dsv41.server", "serve", "--model", str(model_dir), "--port", "0",
                             "--cpu-threads", str(threads)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=REPO)
    url = None
    for line in proc.stdout:
        match = re.search(r"dsv41: serving .* on (http://\S+)", line)
        if match:
            url = match.group(1)
            break
    if url is None:
        raise SystemExit("server did not start")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    body = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "seed": 1, "stream": True}
    rates = []
    try:
        with httpx.Client(base_url=url, timeout=600) as http:
            for run in range(runs + 1):
                started = time.perf_counter()
                count = 0
                with http.stream("POST", "/v1/completions", json=body) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: {"):
                            count += json.loads(line[6:])["choices"][0]["finish_reason"] is None
                elapsed = time.perf_counter() - started
                if count != tokens:
                    raise SystemExit(f"expected {tokens} token events, got {count}")
                if run:
                    rates.append(tokens / elapsed)
    finally:
        proc.terminate()
        proc.wait(60)
    return rates


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
        from dsv41.tiny import default_model_dir

        model_dir = default_model_dir()
    engine = engine_rates(model_dir, args.tokens, args.runs, args.cpu_threads)
    http = http_rates(model_dir, args.tokens, args.runs, args.cpu_threads)
    e, h = statistics.median(engine), statistics.median(http)
    print(f"model {model_dir}  tokens/request {args.tokens}  runs {args.runs}  cpu threads {args.cpu_threads}")
    print(f"engine direct : {e:8.1f} tok/s  (runs: {', '.join(f'{r:.1f}' for r in engine)})")
    print(f"HTTP streaming: {h:8.1f} tok/s  (runs: {', '.join(f'{r:.1f}' for r in http)})")
    print(f"ratio http/engine {h / e:.3f}  overhead {100 * (1 - h / e):.1f}%")


if __name__ == "__main__":
    main()
