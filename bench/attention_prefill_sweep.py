"""The prefill attention core's tiling on the GPU: `kernels.step.attention.attention_core` over a 256-row block of
gathered key slots at the full shape (32 local heads of 512, 640 slots: the window's 128 + the index top-512),
q fp32 (three bf16 parts), keys bf16 values; per (head_block, key_block, split_keys, num_warps) the median µs and
the largest difference from the current tiling (other tilings sum in other orders: fp32 rounding only).

    python bench/attention_prefill_sweep.py --out bench/results/attention_prefill_sweep.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from dsv41.kernels.step.attention import attention_core  # noqa: E402

CONFIGS = [  # (head_block, key_block, split_keys, num_warps); the first is the tiling before this sweep
    (16, 16, 128, 8), (32, 16, 128, 8), (16, 32, 128, 8), (32, 32, 128, 8), (32, 64, 128, 8), (32, 32, 256, 8),
    (32, 32, 640, 8), (16, 64, 128, 8), (32, 16, 128, 4), (16, 16, 640, 8),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE / "results" / "attention_prefill_sweep.json")
    p.add_argument("--rows", type=int, default=256)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    T, H, hd, S = args.rows, 32, 512, 640
    q = torch.randn(T, H, hd, generator=g, device=dev)
    keys = torch.randn(T, S, hd, generator=g, device=dev).bfloat16() * 0.05
    ok = torch.rand(T, S, generator=g, device=dev) > 0.05
    sink = torch.randn(H, generator=g, device=dev)
    base = None
    rows = []
    for hb, bs, sk, w in CONFIGS:
        def run():
            return attention_core(q, keys, ok, sink, hd ** -0.5, keys_bf16=True, split_keys=sk, key_block=bs,
                                  num_warps=w, head_block=hb)
        try:
            out = run()
            torch.cuda.synchronize()
            times = []
            for _ in range(7):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
            us = sorted(times)[len(times) // 2]
            base = out if base is None else base
            diff = float((out - base).abs().max() / base.abs().max())
            rows.append({"head_block": hb, "key_block": bs, "split_keys": sk, "num_warps": w, "us": us,
                         "us_per_row": us / T, "max_rel_diff_from_first": diff})
        except Exception as e:  # noqa: BLE001 - a tiling that does not compile is a result too
            rows.append({"head_block": hb, "key_block": bs, "split_keys": sk, "num_warps": w, "error": str(e)[:300]})
        print(rows[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": T, "heads": H, "slots": S,
                                    "results": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
