"""CUDA launch of the prefill tile kernel (`exl3_prefill_r64` in cuda/exl3_fused.cu): a tile of up to 64 rows x one
128-column block, the whole k, each decoded weight fragment multiplied with all of the tile's rows.

The input is the rotated input in the kernel's B-operand order (`kernels.exl3.prefill`'s rotate kernels with
`PERMUTE`), with PF_ROWS rows of padding past the last (the kernel reads them for the lanes of rows past a tile's
count; their products are never stored). One cubin per (K, codebook), the decode kernels' (`cuda.kernels_for`).
"""

from __future__ import annotations

import ctypes

import torch

from dsv41.kernels.exl3.cuda import DTYPE_CODES, THREADS, TUNING, YS_STRIDE, _shared_limit, kernels_for

PF_ROWS = 64  # must match PF_ROWS in exl3_fused.cu
PF_XS_STRIDE = 160  # fp16 row stride of a B stage (PF_XS_STRIDE)
KERNEL = "exl3_prefill_r64"
NULL = ctypes.c_void_p(0)


def shared_bytes(K: int) -> int:
    """The block's shared memory: every warp's weight ring, then the B ring (the epilogue's fp32 tile reuses it)."""
    stages = TUNING["EXL3_STAGES"]
    weights = stages * 8 * 8 * 8 * K * 4
    return weights + max(stages * PF_ROWS * PF_XS_STRIDE * 2, PF_ROWS * YS_STRIDE * 4)


def fits(K: int, device: torch.device) -> bool:
    """Whether the kernel's shared memory fits a block on `device` (GB10: 99 KB, so K = 7 and 8 do not; those
    matrices take the Triton tiles there: a choice by device and K, never by the rows)."""
    return shared_bytes(K) <= _shared_limit(device)


def prefill_tiles_cuda(xh: torch.Tensor, words: torch.Tensor, svh: torch.Tensor, K: int, codebook: str, k: int,
                       n: int, out: torch.Tensor, n_rows: int, tiles: int, table: torch.Tensor | None = None,
                       out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """out[dest(i)] = rot(xh[i] @ W_q[e]) ⊙ svh[e] for the rows i of each tile (fp32 / bf16 / fp16 `out`, unit
    column stride). words / svh: one matrix ([k/16, n/16, 8K] / [n]) or a stack ([E, ...]) with `table` [tiles, 3]
    int32 (expert, first row, rows); without a table tile t is rows [t·64, t·64 + 64) of n_rows. `out_rows` [rows]
    int32: each row's output row (else the row itself)."""
    if xh.dtype != torch.float16 or not xh.is_contiguous() or xh.shape[1] != k:
        raise ValueError(f"xh must be contiguous fp16 [rows, {k}], got {xh.dtype} {list(xh.shape)}")
    if out.dtype not in DTYPE_CODES or out.stride(1) != 1 or out.shape[1] != n:
        raise ValueError(f"out must be fp16 / bf16 / fp32 [rows, {n}] with unit column stride")
    if tiles == 0:
        return out
    kernel = kernels_for(xh.device, K, codebook)[KERNEL]
    shared = shared_bytes(K)
    kernel.launch((tiles, n // 128, 1), THREADS, shared,
                  [words, svh, xh, table if table is not None else NULL,
                   out_rows if out_rows is not None else NULL, out, out.stride(0), DTYPE_CODES[out.dtype],
                   n_rows, k, n])
    return out
