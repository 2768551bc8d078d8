"""How long a request that is cancelled during its prompt's prefill holds the engine (issue 31, item 7).

    python bench/cancel_prefill.py [--prompt 2048] [--chunk 2048] [--after 0.5] [--model DIR]

The serving engine (AsyncEngine over the batched engine, the built-in model on the CPU unless --model) gets one
prompt of `--prompt` tokens in `--chunk`-row chunks; the stream is cancelled `--after` seconds after it was
submitted (inside the first chunk's forward), and the bench reports the seconds from the cancel to the request's
finish event and to the engine being idle (slot and pages back), beside one whole chunk's seconds measured first.
Results go to bench/results/cancel_prefill.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))


def commit() -> str:
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=HERE).stdout.strip()
    except OSError:
        return "unknown"


async def run(args) -> dict:
    from dsv41.compose.build import build_engine, engine_defaults
    from dsv41.engine import FinishEvent, GenerationRequest, SamplingParams
    from dsv41.model.loader import load_model
    from dsv41.tiny.model import default_model_dir

    model = load_model(args.model or default_model_dir(), dspark=False)
    engine = build_engine(engine_defaults(prefill_chunk=args.chunk, prefill_chunk_alone=0, sessions="off"), model,
                          max_model_len=args.prompt + 64, log=lambda line: None)
    await engine.start()
    vocab = model.cfg.vocab_size
    prompt = lambda k: [0] + [(i * 37 + k) % (vocab - 10) + 5 for i in range(args.prompt - 1)]  # noqa: E731

    started = time.perf_counter()
    whole = [e async for e in engine.submit(GenerationRequest(prompt(1), 1, SamplingParams(temperature=0.0)))]
    whole_s = time.perf_counter() - started
    assert isinstance(whole[-1], FinishEvent)

    stream = engine.submit(GenerationRequest(prompt(2), 4, SamplingParams(temperature=0.0)))
    await asyncio.sleep(args.after)
    cancelled_at = time.perf_counter()
    stream.cancel()
    core = engine.core
    while core.has_work() or engine._step_since is not None:
        await asyncio.sleep(0.005)
    idle_s = time.perf_counter() - cancelled_at
    aborted = getattr(core, "aborted_steps", None)  # (absent before the abort watch)
    await engine.shutdown()
    return {"prompt": args.prompt, "chunk": args.chunk, "cancel_after_s": args.after,
            "whole_prompt_s": round(whole_s, 3), "cancel_to_idle_s": round(idle_s, 3), "aborted_steps": aborted,
            "layers": model.cfg.num_hidden_layers}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--after", type=float, default=0.5)
    p.add_argument("--model", default=None)
    p.add_argument("--out", type=Path, default=HERE / "results" / "cancel_prefill.json")
    args = p.parse_args(argv)
    import torch

    result = asyncio.run(run(args))
    result.update(commit=commit(), device="cpu", threads=torch.get_num_threads())
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
