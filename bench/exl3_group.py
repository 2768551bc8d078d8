"""Group launches of EXL3 linears on the GPU: one launch against one per member, and the group's slice length.

For each group a rank runs per layer at TP=2 (tests/test_exl3_group.py REAL_GROUPS), with the weights cold (each
captured launch reads its own copy; the copies together exceed the L2 four times): the members launched alone at
their own default split counts, then one group launch for each common k-slice length (`group_splits`' choice
marked). Device time per group, median of CUDA-graph replays (bench/exl3_kernels.py's method).

    python3 bench/exl3_group.py [--rows 1,6] [--out bench/results/exl3_group.json]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from exl3_kernels import graph_time_us, make_copies  # noqa: E402
from test_exl3_group import REAL_GROUPS  # noqa: E402

from dsv41.kernels.exl3.cuda import (  # noqa: E402
    fused_matmul_cuda,
    group_splits,
    linear_group_cuda,
    linear_splits,
)

NAMES = ["x: wq_a wkv cmp.wkv cmp.wgate", "qr: wq_b idx.wq_b", "wo_a x4", "shared w1 w3"]
L2_BYTES = 60 << 20


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,6")
    p.add_argument("--K", type=int, default=5)
    p.add_argument("--out", type=Path, default=HERE / "results" / "exl3_group.json")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    K = args.K
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip() or "unknown"
    results = {"commit": commit, "gpu": torch.cuda.get_device_name(dev), "K": K, "groups": []}
    for name, shapes in zip(NAMES, REAL_GROUPS):
        group_bytes = sum(k * n * K // 8 for k, n in shapes)
        copies = max(1, math.ceil(4 * L2_BYTES / group_bytes))
        # make_copies(k, n, K, 0) is one copy; each captured launch then reads its own
        members = [[make_copies(k, n, K, 0)[0] for _ in range(copies)] for k, n in shapes]
        chosen = group_splits(shapes, K, dev)
        entry = {"name": name, "shapes": shapes, "copies": copies, "chosen_splits": chosen, "rows": {}}
        for m in [int(r) for r in args.rows.split(",")]:
            xs = [torch.randn(m, k, device=dev).bfloat16() for k, _ in shapes]
            outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _, n in shapes]
            alone = [lambda c=c: [fused_matmul_cuda(xs[i], members[i][c], splits=linear_splits(*shapes[i], K, dev),
                                                    out=outs[i]) for i in range(len(shapes))] for c in range(copies)]
            row = {"alone_us": graph_time_us(alone * max(1, 24 // copies)),
                   "alone_splits": [linear_splits(k, n, K, dev) for k, n in shapes], "group": []}
            for length in range(1, 11):
                splits = [min(k // 128, math.ceil((k // 128) / length)) for k, _ in shapes]
                if any(math.ceil((k // 128) / s) > 14 for s, (k, _) in zip(splits, shapes)):
                    continue
                launches = [lambda c=c, s=splits: linear_group_cuda(xs, [mem[c] for mem in members], outs, s)
                            for c in range(copies)]
                blocks = sum(s * (n // 128) for s, (_, n) in zip(splits, shapes))
                row["group"].append({"slice": length, "splits": splits, "blocks": blocks,
                                     "us": graph_time_us(launches * max(1, 24 // copies)),
                                     "chosen": splits == chosen})
            entry["rows"][m] = row
            best = min(row["group"], key=lambda g: g["us"])
            pick = next(g for g in row["group"] if g["chosen"])
            print(f"{name} m={m}: alone {row['alone_us']:.1f} us; group chosen (slice {pick['slice']}, "
                  f"{pick['blocks']} blocks) {pick['us']:.1f} us; best slice {best['slice']} ({best['blocks']} "
                  f"blocks) {best['us']:.1f} us", flush=True)
        results["groups"].append(entry)
        members = None  # (the copies go before the next group)
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
