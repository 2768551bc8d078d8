"""A/B on the H200: packed loop invariants (MatmulConfig.compact) vs the classic four registers per weight.

Checks that both give the same bits, prints registers per variant and times m=1 / m=16 on three pack shapes
(same method as bench/exl3_kernels.py). Writes JSON to argv[1].
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from exl3_kernels import L2_BYTES, make_copies, time_ours  # noqa: E402

from dsv41.kernels import exl3_matmul  # noqa: E402
from dsv41.kernels.exl3_matmul import MatmulConfig, default_config, fused_matmul  # noqa: E402


def main(out: str) -> None:
    rows = []
    for k, n, K in ((5120, 2304, 3), (8192, 5120, 5), (5120, 129280, 6)):
        copies = make_copies(k, n, K, 4 * L2_BYTES)
        base = default_config(copies[0])
        variants = {
            "classic": base,
            "compact": MatmulConfig(base.splits, base.block_k, base.num_warps, compact=True),
            "compact_bk32_w4": MatmulConfig(base.splits, 32, 4, compact=True),
            "compact_bk64_w4": MatmulConfig(base.splits, 64, 4, compact=True),
            "compact_bk32_w8": MatmulConfig(base.splits, 32, 8, compact=True),
        }
        x = torch.randn(16, k, device="cuda").half()
        ref = fused_matmul(x, copies[0], config=base)
        for name, cfg in variants.items():
            try:
                same = torch.equal(fused_matmul(x, copies[0], config=cfg).view(torch.int32), ref.view(torch.int32))
                t1, t16 = time_ours(copies, 1, cfg), time_ours(copies, 16, cfg)
            except Exception as exc:
                print(f"{k}x{n} K={K} {name}: failed {type(exc).__name__}: {exc}", flush=True)
                continue
            regs = [c.n_regs for c in exl3_matmul._exl3_matmul_kernel.device_caches[0][0].values()
                    if c.metadata.num_warps == cfg.num_warps]
            row = {"shape": f"{k}x{n}", "K": K, "variant": name, "config": cfg.__dict__, "same_bits": same,
                   "m1_us": t1, "m16_us": t16, "regs_seen": sorted(set(regs))}
            rows.append(row)
            print(f"{k}x{n} K={K} {name:<16} same={same} m1 {t1:8.1f} us  m16 {t16:8.1f} us  regs {row['regs_seen']}",
                  flush=True)
        del copies
        torch.cuda.empty_cache()
        Path(out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
