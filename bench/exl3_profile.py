"""A few eager launches of one EXL3 shape for a profiler (ncu --kernel-name ... python3 bench/exl3_profile.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from exl3_kernels import make_copies  # noqa: E402

from dsv41.kernels.exl3_cuda import fused_matmul_cuda  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--k", type=int, default=5120)
parser.add_argument("--n", type=int, default=129280)
parser.add_argument("--K", type=int, default=6)
parser.add_argument("--m", type=int, default=1)
parser.add_argument("--launches", type=int, default=5)
args = parser.parse_args()
w = make_copies(args.k, args.n, args.K, 0)[0]
x = torch.randn(args.m, args.k, device="cuda").half()
for _ in range(args.launches):
    fused_matmul_cuda(x, w)
torch.cuda.synchronize()
print("done")
