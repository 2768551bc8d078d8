"""A/B of the attention core's combine folded into the split launch (kernels/step/attention.py, DSV41_ATTN_FOLD=1)
against the split launch then the combine launch (the default): device time of `attention_pool` at the release's
decode shapes (bench/attention_sweep.py's pool: window 128, index top-k 512, FP8 window rows, FP4 entries), one and
16 rows, 64 (TP=1) and 32 (TP=2) local heads of 512, and whether the two give the same bits.

    python3 bench/attention_fold_ab.py [--out bench/results/attention_fold_ab.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_sweep import build, timed, write_rows  # noqa: E402

from dsv41.kernels.step.attention import FOLD_ENV, attention_pool  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention_fold_ab.json")
    args = p.parse_args()
    rows = []
    for H in (64, 32):
        for B in (1, 16):
            q, sink, kw, _ = build(B, H=H)
            res = {}
            for fold in ("1", "0"):
                os.environ[FOLD_ENV] = fold
                out = attention_pool(q, sink, 512 ** -0.5, **kw)
                us = timed(lambda: attention_pool(q, sink, 512 ** -0.5, **kw))
                res[fold] = (us, out.view(torch.int32).clone())
            same = torch.equal(res["1"][1], res["0"][1])
            rows.append({"H": H, "B": B, "fold_us": res["1"][0], "two_launch_us": res["0"][0], "bitwise": same})
            print(f"H={H} B={B:2d}: folded {res['1'][0]:7.2f} us, two launches {res['0'][0]:7.2f} us, "
                  f"bitwise {same}", flush=True)
    os.environ.pop(FOLD_ENV, None)
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
