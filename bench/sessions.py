"""Time to first token of a conversation's next turn: fresh, resumed from the RAM tier, resumed from the NVMe tier
(issue 34), through the batched engine (`LLMEngine`: admission, the Batch's session operations, the forward).

A turn-1 prompt of `--context` tokens is prefilled (the fresh figure) and answered with `--reply` tokens; turn 2 is
that history plus `--new` tokens. Measured, each after the engine is idle:
- `fresh`: turn 2 on an engine with sessions off (the whole prompt prefilled);
- `ram`: turn 2 right after turn 1 (the reply's entry resumed: only the new tokens prefilled);
- `nvme`: every RAM entry parked (`--session-dir`; the write GB/s), the RAM tier emptied, turn 2 again (the
  entry loaded from its file: the read GB/s, then the new tokens prefilled).
Each also checks that turn 2's tokens are the fresh ones (resumed == fresh).

    # GPU, one full-shape synthetic rank (the first N layers on an H100: figures say so):
    python bench/sessions.py --synthetic --layers 26 --context 32768 --out bench/results/sessions.json
    # CPU smoke run on the tiny model:
    python bench/sessions.py --context 200 --reply 8 --new 20 --out /tmp/sessions.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from dsv41.engine import GenerationRequest, SamplingParams, TokenEvent  # noqa: E402
from dsv41.compose.build import build_engine, engine_defaults  # noqa: E402


def commit() -> str:
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=HERE).stdout.strip()
    except OSError:
        return "unknown"


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def turn(engine, prompt: list[int], tokens: int, device) -> tuple[float, list[int], int]:
    """(seconds to the first token, the tokens, cached tokens) of one greedy request on an idle engine."""
    core, events = engine.core, []
    seq = engine.make_sequence(GenerationRequest(prompt, tokens, SamplingParams(temperature=0.0), ignore_eos=True),
                               events.append)
    sync(device)
    start, first = time.perf_counter(), None
    core.add(seq)
    while core.has_work():
        core.step()
        if first is None and any(isinstance(e, TokenEvent) for e in events):
            sync(device)
            first = time.perf_counter() - start
    return first, [e.token_id for e in events if isinstance(e, TokenEvent)], events[-1].cached_tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE / "results" / "sessions.json")
    p.add_argument("--synthetic", action="store_true", help="one full-shape synthetic rank on CUDA")
    p.add_argument("--layers", type=int, default=None, help="with --synthetic: the first N layers")
    p.add_argument("--context", type=int, default=32768, help="turn 1's prompt tokens")
    p.add_argument("--reply", type=int, default=64)
    p.add_argument("--new", type=int, default=256, help="turn 2's new tokens after the history")
    p.add_argument("--session-dir", type=Path, default=None, help="the NVMe tier's folder (default: a temp dir)")
    args = p.parse_args(argv)

    if args.synthetic:
        sys.path.insert(0, str(HERE))
        from decode_step import StubComm

        from dsv41.runtime.synthetic import synthetic_rank

        device = "cuda"
        model = synthetic_rank(None, rank=0, world=2, device=device, dtype=torch.bfloat16, comm=StubComm(),
                               layers=args.layers, dspark=False)
        name = torch.cuda.get_device_name()
    else:
        from dsv41.model.loader import load_model
        from dsv41.tiny.model import default_model_dir

        device = "cpu"
        model = load_model(default_model_dir(), dspark=False)
        name = "cpu"
    vocab = model.cfg.vocab_size
    ids = [0] + [(i * 7919 + 13) % (vocab - 10) + 5 for i in range(args.context - 1)]
    max_len = args.context + args.reply + args.new + 64
    folder = args.session_dir or Path(tempfile.mkdtemp(prefix="dsv41-sessions-"))
    # room for turn 2 beside the entries turn 1 left (a pool of one context would make them yield: a fresh prefill)
    opts = dict(parallel=1, pool_tokens=3 * max_len, session_dir=str(folder), session_disk_min_tokens=1,
                session_disk_gib=1024.0)
    engine = build_engine(engine_defaults(**opts), model, max_model_len=max_len, log=print)
    out = {"commit": commit(), "device": name, "layers": args.layers, "context": args.context,
           "reply": args.reply, "new": args.new}

    t1, reply, _ = turn(engine, ids, args.reply, device)
    out["turn1_ttft_s"] = round(t1, 4)
    second = ids + reply + [(i * 31 + 7) % (vocab - 10) + 5 for i in range(args.new)]
    t_ram, got_ram, cached_ram = turn(engine, second, 4, device)
    out["ram"] = {"ttft_s": round(t_ram, 4), "cached_tokens": cached_ram}

    sessions = engine.core.sessions
    files = sessions.disk
    before = files.stats()["bytes"]
    sync(device)
    start = time.perf_counter()
    sessions.park_all()
    while engine.core.has_work():
        engine.core.step()
    sync(device)
    written = files.stats()["bytes"] - before
    park_s = time.perf_counter() - start
    out["park"] = {"seconds": round(park_s, 4), "bytes": written, "gb_per_s": round(written / park_s / 1e9, 3)}
    before = files.stats()
    t_disk, got_disk, cached_disk = turn(engine, second, 4, device)
    after = files.stats()
    read_bytes, read_s = after["read_bytes"] - before["read_bytes"], (after["read_ns"] - before["read_ns"]) / 1e9
    out["nvme"] = {"ttft_s": round(t_disk, 4), "cached_tokens": cached_disk, "loaded": after["reads"] - before["reads"],
                   "read_bytes": read_bytes, "read_s": round(read_s, 4),
                   "read_gb_per_s": round(read_bytes / read_s / 1e9, 3) if read_s else None}

    fresh = build_engine(engine_defaults(parallel=1, sessions="off"), model, max_model_len=max_len, log=print)
    t_fresh, got_fresh, _ = turn(fresh, second, 4, device)
    out["fresh"] = {"ttft_s": round(t_fresh, 4)}
    out["resumed_equals_fresh"] = got_ram == got_fresh == got_disk
    if args.layers:
        n = args.layers
        out["note"] = f"first {n} of 40 layers; per-layer times scale by 40/{n}"
    print(json.dumps(out, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if out["resumed_equals_fresh"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
