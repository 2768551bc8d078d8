"""The host's part of a decode step, serial against overlapped, on the CPU (docs/perf/decode_step.md, "The host
off the critical path"): the prediction for the GPU.

The engine over the fast forward (the tiny model, the step kernels' interpreter) with the step's graph stubbed (a
zero logits bucket: no kernel runs), so every microsecond measured is the host's: the engine's plan, the runner,
the forward's tables, Engram hash and rows, the copies, the Python. Per step, median of `--steps`:
- `serial_ms`: a serial step's host work, all of it between step k's ids in hand and step k + 1's launch (the
  GPU idles for it);
- `overlapped_ms`: an overlapped step's host work in all (the GPU idles only where it exceeds the device's step);
- `critical_ms`: the part of it between step k's ids in hand (`Handoff.host_ids` / `device_ids` returning) and
  step k + 1's graph launch: what still idles the GPU each step. With Engram the ids are read before the hash, so
  the hash, the rows' reads, the tables' copy and the launch stay on it; without Engram (`--no-engram`) the ids
  stay on the device and only the gather and the launch remain.

    TRITON_INTERPRET=1 python bench/overlap_host.py [--rows 1,16] [--steps 40] [--no-engram] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))


def measure(fast, rows: int, steps: int, overlap: bool) -> dict:
    from dsv41.compose.build import build_engine, engine_defaults
    from dsv41.engine import GenerationRequest, SamplingParams
    from dsv41.runtime.graphs import PieceGraphs
    from dsv41.runtime.step_handoff import Handoff

    marks: dict[str, float] = {}
    vocab = fast.vocab_end - fast.vocab_start

    def stub_run(self, name, phase, n, fn, *args, tracing=False, warmup=None):
        marks["launch"] = time.perf_counter()
        return torch.zeros(n, vocab)

    def timed(method):
        def wrapper(self, *a):
            out = method(self, *a)
            marks["ids"] = time.perf_counter()
            return out
        return wrapper

    saved = PieceGraphs.run, Handoff.host_ids, Handoff.device_ids
    PieceGraphs.run, Handoff.host_ids, Handoff.device_ids = stub_run, timed(saved[1]), timed(saved[2])
    try:
        engine = build_engine(engine_defaults(forward="fast", overlap="on" if overlap else "off", parallel=rows,
                                              sessions="off"), fast, max_model_len=512, log=lambda line: None)
        core = engine.core
        for i in range(rows):
            core.add(engine.make_sequence(GenerationRequest([0, 5 + i, 9, 13], steps + 20,
                                                            SamplingParams(temperature=0.0)), lambda e: None))
        for _ in range(8):  # prefill, then decode in steady state
            core.step()
        walls, critical = [], []
        for _ in range(steps):
            marks.clear()
            t0 = time.perf_counter()
            core.step()
            walls.append((time.perf_counter() - t0) * 1e3)
            if "ids" in marks and marks["launch"] >= marks["ids"]:
                critical.append((marks["launch"] - marks["ids"]) * 1e3)
        return {"host_ms": statistics.median(walls),
                "critical_ms": statistics.median(critical) if critical else None,
                "overlapped_steps": core.stats()["overlap"]["steps"]}
    finally:
        PieceGraphs.run, Handoff.host_ids, Handoff.device_ids = saved


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--model", default=None, help="model folder (default: the tests' tiny model, EXL3)")
    p.add_argument("--no-engram", action="store_true", help="drop the Engram layers: the ids stay on the device")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        p.error("set TRITON_INTERPRET=1 (the fast forward's step runs over the pool only where its kernels run)")
    torch.set_num_threads(1)
    from dsv41.runtime.build import build_fast_model
    from dsv41.tiny.model import default_model_dir

    fast = build_fast_model(args.model or default_model_dir(), "cpu", torch.float32, fake_quant=False)
    if args.no_engram:
        fast.engram, fast.engram_hasher = {}, None
    out = {"engram": not args.no_engram, "rows": []}
    for n in [int(r) for r in args.rows.split(",")]:
        serial = measure(fast, n, args.steps, overlap=False)
        over = measure(fast, n, args.steps, overlap=True)
        row = {"rows": n, "serial_ms": serial["host_ms"], "overlapped_ms": over["host_ms"],
               "critical_ms": over["critical_ms"], "overlapped_steps": over["overlapped_steps"]}
        print(f"rows={n}: serial step's host {row['serial_ms']:.3f} ms (all on the critical path); overlapped "
              f"{row['overlapped_ms']:.3f} ms, of which {row['critical_ms']:.3f} ms between the ids and the launch "
              f"({'Engram hashed on the host' if out['engram'] else 'ids on the device'})", flush=True)
        out["rows"].append(row)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
