"""Dense prefill projections as one tensor-core GEMM over a workspace decoded once a call (issue 31, item 2).

The tile path (`prefill.prefill_linear`'s default) decodes a matrix's whole trellis once per 64-row tile: at 8,192
rows every weight of a dense projection is decoded 128 times, and at the tile kernel's ~1.4 T weights/s the 11
dense matrices of a layer took 7.98 ms (113-215 TFLOP/s, bf16 measured 793: docs/perf/prefill.md). A rank's dense
matrices are small (~86 M weights a layer), so here each is decoded ONCE a call into an fp16 workspace [k, n]
(`reconstruct.reconstruct(rotate=False)`: the decoded trellis values W_q, exact in fp16, the very values the tile
kernels multiply) and the product is a plain GEMM on the tensor cores:

    out = rot(xh @ W_q) ⊙ svh,   xh = rot(fp16(x) ⊙ suh)   (the input rotation: the tile path's `_rotate_kernel`)

with the tile path's epilogue (`decode.rotate_rows_fp32`, then svh, rounded once to out's dtype). Same function as
the tile path; other bits (another summation order of the k products).

Row invariance (chunked == one-shot, batched == alone): ONE launch shape per device (`GEMM`; `COMPACT` where a block
has less shared memory, GB10; `INTERPRETED` in Triton's CPU interpreter: BLOCK_M / BLOCK_K / warps / stages fixed,
never chosen from the row count), BLOCK_N = 128 (the output rotation's block), the whole k in one program (no
split-K, no atomics), every product a tensor-core dot whose output row depends on its own input row only; rows past
the chunk are masked loads (zeros) whose outputs are never stored. The programs' order over the tiles (grouped by
GROUP_M row tiles, for L2 reuse of the workspace's column blocks) changes which program computes a tile, never a
tile's arithmetic.

A/B switch (`DSV41_PREFILL_DENSE_GEMM`, read at each launch; on by default since the H100 run at 63be457: 8.61 ms
of tile launches -> 5.53 ms a layer at 8,192 rows, its GPU test passed; `=0` takes the tiles;
`prefill_linear(dense_gemm=...)` beside it for tests and benches). With it off nothing here runs.

The workspace: the runtime passes its one reused buffer (`runtime.layers.linear.PrefillWorkspace.matrix`, sized at
build for the largest matrix that takes a prefill path, wq_b's 1280 x 16384 fp16 = 42 MB on a full-shape rank);
the matrices of a layer run one after another on one stream, so one buffer serves them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from dsv41.kernels.exl3.backend import cuda_path_available, interpreting
from dsv41.kernels.exl3.decode import hadamard_signs, rotate_rows_fp32
from dsv41.kernels.exl3.layout import Exl3Tensor
from dsv41.kernels.exl3.reconstruct import reconstruct
from dsv41.kernels.step.knobs import switched_on

ENV = "DSV41_PREFILL_DENSE_GEMM"  # 1: dense prefill products as decode-once workspace + GEMM (A/B, default off)
BLOCK_N = 128  # the output rotation's 128-column block: a program's columns are exactly one

Workspace = Callable[[int, int], torch.Tensor]  # (k, n) -> a contiguous fp16 [k, n] tensor to decode into


@dataclass(frozen=True)
class GemmConfig:
    """The one launch shape of the workspace GEMM: fixed, so a row's bits never follow the chunk."""

    block_m: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8  # row tiles a group of programs sweeps before the next column block (L2 reuse only)


    shared_kb: int = 128  # its shared memory a block, the most over sm_80 / sm_90 / sm_121 (Triton 3.7's compile)


# Hopper: 128 x 128 x 64 tiles, two warpgroups (wgmma m64 each), 3 stages of A + B in shared memory: 96 KB on sm_90
# (pipelined cp.async, 180 registers, no spills); 128 KB where the dots are mma.sync (the epilogue's [128, 128] fp32
# layout conversions go through shared memory)
GEMM = GemmConfig()
# devices with less shared memory a block (GB10: 99 KB): 64-row tiles, 4 warps, 80 KB on sm_121. A choice by the
# device, never by the rows (each device's bits are its own anyway)
COMPACT = GemmConfig(block_m=64, num_warps=4, shared_kb=80)
# the interpreter runs one program at a time on the CPU: the smallest legal tile (the GPU's claims are the GPU's).
# 16-deep k steps as the tiles' interpreted config: at 32 the interpreted TP=1 fake-quant-off parity test
# (tests/test_runtime_fast.py, switch on) flipped the same index choice (margin 11% of the scale, drift inf: a
# flip upstream of it, likely the candidate pool, which the test does not count) that 128-deep tile steps flip at TP=2
# (docs/perf/prefill.md, "Next" 4); at 16 it passes (prefill logits within 1.9e-3)
INTERPRETED = GemmConfig(block_m=16, block_k=16, num_warps=4, num_stages=1, group_m=1)


def dense_gemm_enabled() -> bool:
    """Whether prefill_linear takes this path (read at each launch; on by default
    since a GPU run checked its bits and time: tests/test_exl3_prefill_dense.py's GPU test and
    bench/prefill.py's kernels.dense; `=0` takes the tile kernel)."""
    return switched_on(ENV, default=True)


def config(device: torch.device) -> GemmConfig:
    """The launch shape on `device`: GEMM where its stages fit a block's shared memory (NVIDIA: asked of the
    driver), else COMPACT."""
    if interpreting() or device.type != "cuda":
        return INTERPRETED
    if not cuda_path_available(device):
        return COMPACT
    from dsv41.kernels.cuda_module import shared_memory_limit

    index = device.index if device.index is not None else torch.cuda.current_device()
    return GEMM if GEMM.shared_kb * 1024 <= shared_memory_limit(index) else COMPACT


@triton.jit(do_not_specialize=["n_rows"])
def _gemm_rotate_kernel(xh_ptr, w_ptr, svh_ptr, had_ptr, out_ptr, stride_out, n_rows, k, n,
                        BM: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """out[r, cols] = rot(xh[r] @ W[:, cols]) ⊙ svh[cols] for BM rows r and one 128-column block, the whole k.

    xh [n_rows, k] fp16 (rotated input), W [k, n] fp16 (the decoded W_q), out any float dtype, unit column stride."""
    pid = tl.program_id(0)
    m_blocks = tl.cdiv(n_rows, BM)
    n_blocks = n // 128
    # GROUP_M row tiles x every column block, then the next group: the workspace's column blocks stay in L2
    per_group = GROUP_M * n_blocks
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(m_blocks - first_m, GROUP_M)
    mb = first_m + (pid % per_group) % size_m
    nb = (pid % per_group) // size_m
    rows = mb * BM + tl.arange(0, BM)
    ok = rows < n_rows
    cols = nb * 128 + tl.arange(0, 128)
    kk = tl.arange(0, BK)
    x_ptrs = xh_ptr + rows[:, None].to(tl.int64) * k + kk[None, :]
    w_ptrs = w_ptr + kk[:, None].to(tl.int64) * n + cols[None, :]
    acc = tl.zeros((BM, 128), dtype=tl.float32)
    for _kb in range(0, k // BK):
        a = tl.load(x_ptrs, mask=ok[:, None], other=0.0)
        b = tl.load(w_ptrs)
        acc = tl.dot(a, b, acc)
        x_ptrs += BK
        w_ptrs += BK * n
    # the tile path's epilogue (`_tile_matmul_kernel`): the output rotation at fp32 accuracy, then svh
    y = rotate_rows_fp32(acc, had_ptr) * tl.load(svh_ptr + cols).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=ok[:, None])


def decode_into(weight: Exl3Tensor, workspace: Workspace | None = None) -> torch.Tensor:
    """W_q [k, n] fp16, the matrix's trellis decoded once (no rotation, no scales), into the workspace if given."""
    out = workspace(weight.k, weight.n) if workspace is not None else None
    return reconstruct(weight, torch.float16, rotate=False, out=out)


def gemm_rotated(xh: torch.Tensor, w: torch.Tensor, weight: Exl3Tensor, out: torch.Tensor,
                 cfg: GemmConfig | None = None) -> torch.Tensor:
    """out = rot(xh @ w) ⊙ svh: the rotated input xh [T, k] fp16 times the decoded w [k, n] fp16, one launch."""
    T, k = xh.shape
    n = weight.n
    if xh.dtype != torch.float16 or not xh.is_contiguous() or k != weight.k:
        raise ValueError(f"xh must be contiguous fp16 [rows, {weight.k}], got {xh.dtype} {list(xh.shape)}")
    if w.shape != (k, n) or w.dtype != torch.float16 or not w.is_contiguous():
        raise ValueError(f"w must be contiguous fp16 [{k}, {n}], got {w.dtype} {list(w.shape)}")
    if out.shape != (T, n) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{T}, {n}] with unit column stride, got {list(out.shape)}")
    cfg = cfg or config(xh.device)
    if k % cfg.block_k or n % BLOCK_N:
        raise ValueError(f"[{k}, {n}] is not a whole number of {cfg.block_k} x {BLOCK_N} blocks")
    if T == 0:
        return out
    grid = (triton.cdiv(T, cfg.block_m) * (n // BLOCK_N),)
    _gemm_rotate_kernel[grid](xh, w, weight.svh, hadamard_signs(xh.device, torch.float16), out, out.stride(0), T, k,
                              n, BM=cfg.block_m, BK=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
                              num_stages=cfg.num_stages)
    return out


def workspace_matmul(xh: torch.Tensor, weight: Exl3Tensor, out: torch.Tensor,
                     workspace: Workspace | None = None) -> torch.Tensor:
    """`prefill_linear`'s product on this path, from the rotated input: decode once, then the GEMM + epilogue."""
    return gemm_rotated(xh, decode_into(weight, workspace), weight, out)
