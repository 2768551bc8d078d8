"""Split counts of the routed-expert MoE launches at a rank's expert shape (TP=2: gate/up 5120 -> 1152, down
1152 -> 5120), weights cold (384 experts, 16 routings per captured graph): device time of the two launches per
(gate/up splits, down splits), 1 and 6 rows. `default_moe_config`'s choice marked.

    python3 bench/exl3_moe_splits.py [--K 3] [--out bench/results/exl3_moe_splits.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from exl3_kernels import graph_time_us  # noqa: E402

from dsv41.kernels.cuda_build import tuning as configured_tuning  # noqa: E402
from dsv41.kernels.exl3.cuda import MoeCudaConfig, moe_config, moe_forward_cuda  # noqa: E402
from dsv41.kernels.exl3.layout import Exl3ExpertStack  # noqa: E402


def stack(experts: int, k: int, n: int, K: int) -> Exl3ExpertStack:
    trellis = torch.randint(-32768, 32768, (experts, k // 16, n // 16, 16 * K), dtype=torch.int32, device="cuda")
    suh = (torch.randn(experts, k, device="cuda") * 0.02).half()
    svh = torch.randn(experts, n, device="cuda").half()
    return Exl3ExpertStack.from_stacked(trellis.to(torch.int16), suh, svh, "mul1")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--K", type=int, default=3)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--inter", type=int, default=1152)
    p.add_argument("--experts", type=int, default=384)
    p.add_argument("--tuning", default=None, help="JSON defines over the default tuning (e.g. EXL3_MOE_MIN_BLOCKS)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "exl3_moe_splits.json")
    args = p.parse_args(argv)
    d, i, K = args.hidden, args.inter, args.K
    tuning = {**configured_tuning(), **json.loads(args.tuning)} if args.tuning else None
    w1, w3, w2 = stack(args.experts, d, i, K), stack(args.experts, d, i, K), stack(args.experts, i, d, K)
    chosen = moe_config(w1, w2, torch.device("cuda"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip() or "unknown"
    res = {"commit": commit, "gpu": torch.cuda.get_device_name(), "K": K, "tuning": tuning, "hidden": d, "inter": i,
           "chosen": [chosen.splits_gate_up, chosen.splits_down], "rows": {}}
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 6):
        sets = [(torch.randperm(args.experts, generator=gen)[: rows * 6].view(rows, 6).cuda(),
                 torch.rand(rows, 6, generator=gen).cuda()) for _ in range(16)]
        x = torch.randn(rows, d, device="cuda").bfloat16()
        out = torch.empty(rows, d, device="cuda")
        entries = []
        for sa in (3, 4, 5, 6, 8, 10):
            for sb in (1, 2, 3, 5, 9):
                if sb > i // 128 or -(-(d // 128) // sa) > 14:
                    continue
                cfg = MoeCudaConfig(sa, sb)
                t = graph_time_us([lambda ids=ids, w=w: moe_forward_cuda(x, ids, w, w1, w3, w2, config=cfg, out=out,
                                                                   tuning=tuning)
                                   for ids, w in sets])
                entries.append({"splits_gate_up": sa, "splits_down": sb, "us": t,
                                "chosen": (sa, sb) == (chosen.splits_gate_up, chosen.splits_down)})
        best = min(entries, key=lambda e: e["us"])
        pick = next((e for e in entries if e["chosen"]), None)
        shown = pick["us"] if pick else float("nan")
        print(f"MoE K={K} {args.tuning or ''} rows={rows}: chosen {res['chosen']} {shown:.1f} us; best "
              f"({best['splits_gate_up']}, {best['splits_down']}) {best['us']:.1f} us", flush=True)
        res["rows"][rows] = entries
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
