"""What a flag hop of the persistent step costs on this GPU (issue 37 item 1): the two inputs bench/persistent_plan.py
predicts with (`--flag-us`, `--item-us`), measured on kernels/step/persistent.py's executor.

A chain of `--hops` one-item ops (each adds the previous op's 16 outputs to a row of its own: every op waits on the
one before) runs three ways, each timed as a CUDA graph replay (events, median): the persistent launch (`programs`
programs: one SM runs each hop's item, the others spin on its flag or wait in the queue), one launch an op, and
one launch an op with the same work in a single launch of one program (`--hops` items in a loop: the item's own
cost without any hop). Per hop: persistent = flag hop + item; launches = kernel boundary + item. Also a wide step
(`--wide` GEMV items of one op beside each other) for the items' throughput with all programs busy, at 1, 2, 4 and 8
programs an SM.

    python3 bench/persistent_hops.py --hops 256 --programs 132 --out bench/results/persistent_hops.json

On the CPU (`--device cpu` under TRITON_INTERPRET=1) it runs the same chain once, untimed: a smoke test of the
script (tests/test_bench_persistent_hops.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from dsv41.kernels.step.persistent import ADD, BLOCK_N, GEMV, PersistentStep, Step  # noqa: E402


def chain(hops: int, device, programs: int) -> PersistentStep:
    """hops ADD ops of one item each: op i writes row i + 1 = row i + its own bias row."""
    rows = hops + 1
    bias = rows * BLOCK_N
    arena = torch.zeros(2 * rows * BLOCK_N, device=device)
    arena[bias:] = 1.0
    steps = [Step(f"hop{i}", ADD, a=i * BLOCK_N, b=bias + i * BLOCK_N, out=(i + 1) * BLOCK_N, n=BLOCK_N,
                  reads=(f"hop{i - 1}",) if i else ()) for i in range(hops)]
    return PersistentStep(steps, arena, programs)


def wide(items: int, k: int, device, programs: int) -> PersistentStep:
    n = items * BLOCK_N
    arena = torch.randn(k + k * n + n, device=device)
    return PersistentStep([Step("w", GEMV, a=0, w=k, out=k + k * n, n=n, k=k)], arena, programs)


def graph_ms(fn, reps: int) -> float:
    """Median ms of one replay of a CUDA graph of fn (`exl3_kernels.graph_time_us`: warmed up, then captured)."""
    from exl3_kernels import graph_time_us

    return graph_time_us([fn], replays=reps) / 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hops", type=int, default=256)
    p.add_argument("--programs", type=int, default=0, help="persistent programs (0: the SM count)")
    p.add_argument("--wide", type=int, default=1056, help="items of the wide GEMV (8 an SM on an H100)")
    p.add_argument("--k", type=int, default=1024, help="the wide GEMV's depth")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type != "cuda":  # the interpreter's smoke run
        step = chain(args.hops, dev, max(args.programs, 2))
        step.run()
        step.check()
        expect = torch.arange(1, args.hops + 1, dtype=torch.float32)
        got = step.arena[BLOCK_N:(args.hops + 1) * BLOCK_N].view(args.hops, BLOCK_N)[:, 0].cpu()
        print(json.dumps({"smoke": bool(torch.equal(got, expect))}))
        return 0 if torch.equal(got, expect) else 1
    programs = args.programs or torch.cuda.get_device_properties(dev).multi_processor_count
    res = {"commit": os.environ.get("BENCH_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip(),
        "gpu": torch.cuda.get_device_name(dev), "hops": args.hops, "programs": programs}
    step = chain(args.hops, dev, programs)
    one = chain(args.hops, dev, 1)  # one program walks the chain: no flag ever waits on another SM
    res["persistent_ms"] = graph_ms(step.run, args.reps)
    res["one_program_ms"] = graph_ms(one.run, args.reps)
    res["launches_ms"] = graph_ms(step.run_launches, args.reps)
    step.check()
    one.check()
    for key in ("persistent", "one_program", "launches"):
        res[f"{key}_us_a_hop"] = res[f"{key}_ms"] * 1e3 / args.hops
    res["flag_hop_us"] = res["persistent_us_a_hop"] - res["one_program_us_a_hop"]
    res["wide"] = {"items": args.wide, "k": args.k}
    for per_sm in (1, 2, 4, 8):  # resident programs an SM: one cannot hide its own items' latency
        w = wide(args.wide, args.k, dev, programs * per_sm)
        res["wide"][f"persistent_ms_{per_sm}_an_sm"] = graph_ms(w.run, args.reps)
        w.check()
    res["wide"]["launch_ms"] = graph_ms(w.run_launches, args.reps)
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
