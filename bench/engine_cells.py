"""The recipe's m2bench cells in the engine: a code prompt, a prose prompt and counting 1-200; N concurrent
streams (1, 2, 4) of `--tokens` (384) each; T = 0 and 0.7; the median of `--reps` repetitions per cell.

    python bench/engine_cells.py [--model DIR] [--tokens 384] [--streams 1 2 4] [--temps 0 0.7] [--reps 3]
                                 [--engine batched|reference] [--http] [--device cpu] [--out FILE]

In-engine: the engine `dsv41 serve` would build (compose/build.py), driven through its async interface in this
process. `--http` adds the same cells through a real `dsv41 serve` on loopback (streaming /v1/completions, one
client thread per stream). Per cell: aggregate and per-stream tokens/s, time to first token, and (in-engine,
batched) rows per round and mean round time — on a GPU, rows per round and round time are what the fast path
is judged by. Every stream runs with ignore_eos, so each produces exactly `--tokens` tokens. JSON to
bench/results/engine_cells_<host>.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = {
    "code": "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n    out = []\n",
    "prose": "The lighthouse keeper climbed the spiral stairs each evening, counting the steps as the fog came in",
    "count": "Count from 1 to 200, separated by commas: 1, 2, 3,",
}


def cell_summary(walls, ttfts, tokens, streams, rounds=None) -> dict:
    wall = statistics.median(walls)
    out = {"streams": streams, "tokens_per_stream": tokens, "wall_s": round(wall, 4),
           "tokens_per_s": round(streams * tokens / wall, 2), "per_stream_tokens_per_s": round(tokens / wall, 2),
           "ttft_s": round(statistics.median(ttfts), 4)}
    if rounds:
        out.update(rounds)
    return out


class InEngine:
    def __init__(self, args):
        import torch

        from dsv41.compose.build import build_engine, engine_defaults
        from dsv41.model.loader import load_model
        from dsv41.tokenizer import Tokenizer

        torch.set_num_threads(args.cpu_threads)
        self.tokenizer = Tokenizer.from_dir(args.model)
        self.model = load_model(args.model, device=args.device, dspark=False)
        self.max_len = max(len(self.ids(p)) for p in PROMPTS.values()) + args.tokens + 1
        opts = engine_defaults(engine=args.engine, parallel=max(args.streams))
        self.engine = build_engine(opts, self.model, max_model_len=self.max_len, log=lambda line: None)
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.engine.start())

    def ids(self, text: str) -> list[int]:
        return [self.tokenizer.bos_id] + self.tokenizer.encode(text)

    def run(self, prompt: str, streams: int, temperature: float, tokens: int):
        from dsv41.engine import GenerationRequest, SamplingParams, TokenEvent

        core = getattr(self.engine, "core", None)
        before = (core.step_no, core.round_seconds_total, core.prefill_rows_total + core.decode_rows_total) \
            if core else None

        async def one(k: int, started: float):
            first = None
            req = GenerationRequest(self.ids(prompt), tokens, SamplingParams(temperature=temperature, seed=k),
                                    ignore_eos=True)
            count = 0
            async for event in self.engine.submit(req):
                if isinstance(event, TokenEvent):
                    count += 1
                    first = first or time.perf_counter() - started
            assert count == tokens, count
            return first

        async def all_streams():
            started = time.perf_counter()
            ttfts = await asyncio.gather(*[one(k, started) for k in range(streams)])
            return time.perf_counter() - started, statistics.median(ttfts)

        wall, ttft = self.loop.run_until_complete(all_streams())
        rounds = None
        if core:
            n, secs, rows = (a - b for a, b in zip((core.step_no, core.round_seconds_total,
                                                     core.prefill_rows_total + core.decode_rows_total), before))
            rounds = {"rounds": n, "rows_per_round": round(rows / max(n, 1), 2),
                      "round_ms": round(1000 * secs / max(n, 1), 3)}
        return wall, ttft, rounds


class OverHTTP:
    def __init__(self, args, max_len: int):
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(args.cpu_threads))
        env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "dsv41.server", "serve", "--model", str(args.model), "--port", "0",
               "--cpu-threads", str(args.cpu_threads), "--engine", args.engine, "--parallel", str(max(args.streams)),
               "--max-model-len", str(max_len), "--device", args.device]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.url = None
        for line in self.proc.stdout:
            match = re.search(r"serving .* on (http://\S+)", line)
            if match:
                self.url = match.group(1)
                break
        if self.url is None:
            raise RuntimeError("the server did not start")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def run(self, prompt: str, streams: int, temperature: float, tokens: int):
        import httpx

        ttfts, errors = [None] * streams, []
        started = time.perf_counter()

        def one(k: int):
            body = {"prompt": prompt, "max_tokens": tokens, "temperature": temperature, "seed": k,
                    "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=3600) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: {") and ttfts[k] is None:
                            ttfts[k] = time.perf_counter() - started
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(k,)) for k in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return time.perf_counter() - started, statistics.median(ttfts), None

    def close(self):
        self.proc.terminate()
        self.proc.wait(60)


def replay_agreement(model, lengths=(24, 48, 96, 192), follow: int = 32) -> list[dict]:
    """Top-1 agreement of CED bounded replay with full prefill (MODEL.md §11): the full model's greedy text after
    each prompt, teacher-forced through both; the share of positions (the prompt's last row onward) where both
    forwards' argmax agree."""
    import torch

    from dsv41.engine.batch import Row
    from dsv41.runtime.kv_pool import pool_for_model
    from dsv41.runtime.pool_forward import PoolForward

    out = []
    for n in lengths:
        ids = [0] + [(i * 29) % 500 + 5 for i in range(n - 1)]
        state = model.new_state()
        row = model.forward(state, torch.tensor(ids), last_only=True)[-1]
        text = []
        for _ in range(follow):
            text.append(int(torch.argmax(row)))
            row = model.forward(state, torch.tensor(text[-1:]))[-1]
        argmax = {}
        for replay in (False, True):
            pool = pool_for_model(model, num_slots=1, num_pages=1, page_tokens=n + follow + 2)
            forward = PoolForward(model, replay=replay)
            start = max(0, n - model.cfg.sliding_window) if replay else 0
            seq = ids + text
            first = Row(0, 0, ids, 0, [0], "prefill", [], None, [(n - 1, 0, 0)], start)
            rest = Row(0, 0, text, n, [0], "prefill", seq[n - 3:n], None, [(j, 0, 0) for j in range(follow)], start)
            logits = torch.cat([forward.execute([first], pool)[0], forward.execute([rest], pool)[0]])
            argmax[replay] = logits.argmax(dim=-1)
        agree = float((argmax[True] == argmax[False]).float().mean())
        out.append({"prompt_tokens": n, "positions": follow + 1, "top1_agreement": round(agree, 4)})
    return out


def sweep(runner, args, log) -> list[dict]:
    cells = []
    for name in args.prompts:
        for temperature in args.temps:
            for streams in args.streams:
                results = [runner.run(PROMPTS[name], streams, temperature, args.tokens) for _ in range(args.reps)]
                walls, ttfts = [r[0] for r in results], [r[1] for r in results]
                cell = {"prompt": name, "temperature": temperature,
                        **cell_summary(walls, ttfts, args.tokens, streams, results[len(results) // 2][2])}
                log(json.dumps(cell))
                cells.append(cell)
    return cells


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--tokens", type=int, default=384)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--temps", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--prompts", nargs="+", choices=list(PROMPTS), default=list(PROMPTS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--engine", choices=("batched", "reference"), default="batched")
    p.add_argument("--http", action="store_true", help="also run every cell through a real server")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.model is None:
        from dsv41.tiny.model import default_model_dir

        args.model = default_model_dir()
    log = lambda line: print(line, flush=True)  # noqa: E731
    engine = InEngine(args)
    result = {"host": socket.gethostname(), "model": str(args.model), "engine": args.engine, "device": args.device,
              "cpu_threads": args.cpu_threads, "reps": args.reps, "in_engine": sweep(engine, args, log)}
    if args.engine == "batched":
        result["replay_top1_vs_full"] = replay_agreement(engine.model)
        log(json.dumps(result["replay_top1_vs_full"]))
    if args.http:
        server = OverHTTP(args, engine.max_len)
        try:
            result["http"] = sweep(server, args, log)
        finally:
            server.close()
    out = args.out or REPO / "bench" / "results" / f"engine_cells_{socket.gethostname()}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
