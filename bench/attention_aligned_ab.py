"""A/B of the one-store pool blocks (DSV41_ATTN_ALIGNED, kernels/step/attention.py's split loops) on a GPU, in one
call: at the release's decode shapes (32 and 64 local heads of 512, window 128, top-k 512, FP8 window rows and FP4
entries) whether attention_pool with them has the gathered core's bits and the default path's, and the device µs
of both at 1, 6 and 16 rows (`attention_sweep.timed`: calls replayed in a CUDA graph).

    PYTHONPATH=src:tests:bench python3 bench/attention_aligned_ab.py [--out bench/results/attention_aligned_ab.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from functools import partial
from pathlib import Path

import torch

from attention_sweep import build, timed
from dsv41.kernels.step.attention import ALIGN_ENV, attention_pool
from test_kernels_step_attention import _switched

_with_aligned = partial(_switched, ALIGN_ENV)  # (on, fn): fn() with the switch on / off, the environment restored


def bits_checks() -> dict:
    """Rows whose bits differ (of 16): aligned pool vs gathered core, aligned vs default pool, default vs core."""
    from test_kernels_step_attention import _bits, _pool_results
    from test_kernels_step_attention_gpu import _gpu_pool_case

    out = {}
    for H in (32, 64):
        case = _gpu_pool_case(H, True)
        plain = _pool_results(case, alone=False)
        aligned = _with_aligned(True, lambda: _pool_results(case, alone=False))
        torch.cuda.synchronize()
        differ = lambda a, b: int((_bits(a) != _bits(b)).flatten(1).any(1).sum())  # noqa: E731
        out[H] = {"aligned_vs_core": differ(aligned["pool"], aligned["core"]),
                  "aligned_vs_default": differ(aligned["pool"], plain["pool"]),
                  "default_vs_core": differ(plain["pool"], plain["core"])}
        print(f"H={H}: rows differing {out[H]}", flush=True)
    return out


def timings() -> list:
    rows = []
    for H in (32, 64):
        for B in (1, 6, 16):
            q, sink, kw, _ = build(B, H=H)
            us = {on: _with_aligned(on, lambda: timed(lambda: attention_pool(q, sink, 512 ** -0.5, **kw)))
                  for on in (False, True)}
            rows.append({"H": H, "B": B, "default_us": us[False], "aligned_us": us[True]})
            print(f"H={H} B={B:2d}: default {us[False]:7.1f} us, one-store blocks {us[True]:7.1f} us", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention_aligned_ab.json")
    args = p.parse_args()
    commit = os.environ.get("BENCH_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                              capture_output=True, text=True).stdout.strip()
    result = {"commit": commit, "gpu": torch.cuda.get_device_name()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result["bits"] = bits_checks()
    args.out.write_text(json.dumps(result, indent=1))
    result["timings"] = timings()
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
