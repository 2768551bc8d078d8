"""A few eager launches of one EXL3 shape for a profiler (ncu --kernel-name ... python3 bench/exl3_profile.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from exl3_kernels import make_copies  # noqa: E402

from dsv41.kernels.exl3.cuda import fused_matmul_cuda  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--k", type=int, default=5120)
parser.add_argument("--n", type=int, default=129280)
parser.add_argument("--K", type=int, default=6)
parser.add_argument("--m", type=int, default=1)
parser.add_argument("--launches", type=int, default=5)
parser.add_argument("--moe", type=int, default=0, help="profile the MoE for this many tokens instead")
args = parser.parse_args()
if args.moe:
    from dsv41.kernels.exl3.cuda import moe_forward_cuda
    from dsv41.kernels.exl3.layout import Exl3ExpertStack

    def stack(k, n, experts=384, K=3):
        trellis = torch.randint(-32768, 32768, (experts, k // 16, n // 16, 16 * K), dtype=torch.int32, device="cuda")
        return Exl3ExpertStack.from_stacked(trellis.to(torch.int16), (torch.randn(experts, k, device="cuda") * 0.02).half(),
                                            torch.randn(experts, n, device="cuda").half(), "mul1")

    w1, w3, w2 = stack(5120, 2304), stack(5120, 2304), stack(2304, 5120)
    x = torch.randn(args.moe, 5120, device="cuda").half()
    ids = torch.randperm(384)[: 6 * args.moe].view(args.moe, 6).cuda()
    for _ in range(args.launches):
        moe_forward_cuda(x, ids, torch.rand(args.moe, 6, device="cuda"), w1, w3, w2)
    torch.cuda.synchronize()
    print("done")
    sys.exit(0)
w = make_copies(args.k, args.n, args.K, 0)[0]
x = torch.randn(args.m, args.k, device="cuda").half()
for _ in range(args.launches):
    fused_matmul_cuda(x, w)
torch.cuda.synchronize()
print("done")
