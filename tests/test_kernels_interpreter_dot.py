"""The interpreter's row-wise `tl.dot` (src/dsv41/kernels/interpreter_dot.py): a row's bits do not depend on where
the row sits in the tile, on any CPU's BLAS. Run in a child with TRITON_INTERPRET=1 (the kernels are decorated as
interpreted functions at import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
import numpy as np
import torch
import triton
import triton.language as tl
import dsv41.kernels  # installs the row-wise dot
from dsv41.kernels.interpreter_dot import install
from triton.runtime import interpreter as it

@triton.jit
def dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    m, k, n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    acc = tl.full((M, N), 0.25, tl.float32)
    tl.store(out_ptr + m[:, None] * N + n[None, :], tl.dot(a, b, acc))

g = torch.Generator().manual_seed(7)
M, K, N = 32, 64, 32
res = {"marked": getattr(it.InterpreterBuilder.create_dot, "_dsv41_rowwise", False), "again": install()}
for dt in (torch.float16, torch.float32):
    rows = torch.randn(2 * M, K, generator=g).to(dt)
    b = torch.randn(K, N, generator=g).to(dt)
    outs = {}
    for shift in range(0, M + 1, 3):  # the same rows at every offset in the tile
        a = rows[shift:shift + M].contiguous()
        out = torch.empty(M, N)
        dot_kernel[(1,)](a, b, out, M=M, K=K, N=N)
        for i in range(M):
            outs.setdefault(shift + i, []).append(out[i].clone())
    same = all(all(torch.equal(v[0], w) for w in v[1:]) for v in outs.values())
    want = rows[:M].double() @ b.double() + 0.25
    got = torch.stack([outs[i][0] for i in range(M)]).double()
    res[str(dt)] = {"same_bits_at_every_offset": same, "rel": float((got - want).norm() / want.norm()),
                    "compared_offsets": max(len(v) for v in outs.values())}
print(json.dumps(res))
"""


def test_interpreted_dot_rows_keep_their_bits_at_every_offset_in_the_tile():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["marked"] and res["again"], res
    for dt in ("torch.float16", "torch.float32"):
        r = res[dt]
        assert r["compared_offsets"] > 1, r
        assert r["same_bits_at_every_offset"], r
        assert r["rel"] < 1e-6, r  # fp32 sums of exact fp32 products of K = 64 terms
