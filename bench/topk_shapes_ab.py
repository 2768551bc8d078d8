"""The indexer top-k's launch shapes (`kernels/step/indexer.py` `DSV41_TOPK_SHAPE`: entries a step, warps a
program) at a long prompt's late chunk and at a few decode rows: ms a launch and each shape's ids against the
default's (they must be equal: the picks are exact counts, written in ascending order).

    python3 bench/topk_shapes_ab.py --rows 2048,16 --entries 65536 --out bench/results/topk_shapes_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

SHAPES = ("", "1024w8", "2048w4", "2048w8", "4096w8", "4096w16", "8192w16", "512w4")


def main(argv=None) -> int:
    from prefill_kernels import cuda_ms

    from dsv41.kernels.step.indexer import topk_select

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="2048,16")
    p.add_argument("--entries", type=int, default=65536)
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--out", type=Path, default=HERE / "results" / "topk_shapes_ab.json")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    res = {"commit": os.environ.get("BENCH_COMMIT", "unknown"), "gpu": torch.cuda.get_device_name(),
           "entries": args.entries, "k": args.k, "runs": []}
    for rows in [int(v) for v in args.rows.split(",") if v]:
        g = torch.Generator(device=dev).manual_seed(rows)
        s = torch.randn(rows, args.entries, generator=g, device=dev)
        vis = args.entries - (rows - 1 - torch.arange(rows, device=dev)) // 2  # a causal chunk of ratio-2 rows
        s[torch.arange(args.entries, device=dev)[None, :] >= vis[:, None]] = float("-inf")
        base = topk_select(s, args.k, shape="")
        run = {"rows": rows, "shapes": {}}
        for shape in SHAPES:
            ms = cuda_ms(lambda: topk_select(s, args.k, shape=shape), reps=5)
            same = bool(torch.equal(topk_select(s, args.k, shape=shape), base))
            run["shapes"][shape or "default"] = {"ms": ms, "same_ids": same}
            print(f"top-k {rows} x {args.entries}, k {args.k}, shape {shape or 'default'}: {ms:.3f} ms, same ids {same}")
        res["runs"].append(run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0 if all(v["same_ids"] for r in res["runs"] for v in r["shapes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
