"""CUDA launch of the prefill tile kernels (`exl3_prefill_r64` / `exl3_prefill_r128` in cuda/exl3_fused.cu): a tile
of up to 64 or 128 rows x one 128-column block, the whole k, each decoded weight fragment multiplied with all of the
tile's rows.

The input is the rotated input in the kernel's B-operand order (`kernels.exl3.prefill`'s rotate kernels with
`PERMUTE`), with `rows` rows of padding past the last (the kernel reads them for the lanes of rows past a tile's
count; their products are never stored). One cubin per (K, codebook), the decode kernels' (`cuda.kernels_for`):
both tile sizes are entries of the same image.

Tile rows (`DSV41_PREFILL_TILE_ROWS`, 64 or 128, read once): a 128-row tile decodes each weight fragment once for
twice the rows (at 8,192 rows an expert gets ~128 rows: the 64-row tiles decode its trellis ~2.5 times). The two
kernels give the SAME bits: a row's output element is one mma chain over k in the same order from the same decoded
fragment and its own B column in both; the tile's size only says which rows share a decode. So the choice may
follow the device and K without breaking row invariance. r128 runs a 2-stage pipeline over an unpadded, swizzled
B ring (96 KiB at most): two blocks an SM on Hopper, and it fits GB10.

Launch order (`DSV41_PREFILL_TILE_ORDER`, `tiles` or `columns`, read once): the grid (tiles, n/128) runs every tile of
one column block before the next column block, so each column block re-reads the whole input (xh: 0.5 GB for the
experts' gate at 8,192 rows) from HBM; `columns` launches (n/128, tiles): a tile's column blocks run side by side,
its B rows come from L2 after the first read. Same bits either way.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from dsv41.kernels.exl3.cuda import DTYPE_CODES, THREADS, TUNING, YS_STRIDE, _shared_limit, kernels_for

TILE_ROWS = (64, 128)  # the kernels' tile sizes (one `exl3_prefill_r<rows>` entry each)
PAD_ROWS = max(TILE_ROWS)  # rows of padding past an input's last row: enough for either kernel
PF_XS_STRIDE = 160  # fp16 row stride of r64's padded B stage (PF_XS_STRIDE)
PF128_STAGES = 2  # r128's pipeline stages unless the tuning says EXL3_PF128_STAGES (exl3_fused.cu's default)
ROWS_ENV = "DSV41_PREFILL_TILE_ROWS"
ORDER_ENV = "DSV41_PREFILL_TILE_ORDER"
ORDERS = ("tiles", "columns")
NULL = ctypes.c_void_p(0)


def kernel_name(rows: int) -> str:
    if rows not in TILE_ROWS:
        raise ValueError(f"prefill tiles have {' or '.join(map(str, TILE_ROWS))} rows, not {rows}")
    return f"exl3_prefill_r{rows}"


@functools.cache
def configured_rows() -> int:
    """`DSV41_PREFILL_TILE_ROWS` (128 when unset: bench/results/prefill_tiles128_4ac1be8.json), read once per
    process."""
    raw = os.environ.get(ROWS_ENV, "").strip() or "128"
    if raw not in {str(r) for r in TILE_ROWS}:
        raise ValueError(f"{ROWS_ENV}={raw!r}: the prefill tile kernels take {' or '.join(map(str, TILE_ROWS))} rows")
    return int(raw)


@functools.cache
def configured_columns_first() -> bool:
    """`DSV41_PREFILL_TILE_ORDER` (`columns` when unset) == `columns`, read once per process."""
    raw = os.environ.get(ORDER_ENV, "").strip() or "columns"
    if raw not in ORDERS:
        raise ValueError(f"{ORDER_ENV}={raw!r}: the launch order is one of {', '.join(ORDERS)}")
    return raw == "columns"


def _rings(rows: int) -> tuple[int, int]:
    """(stages, fp16 row stride of a B stage) of the kernel of `rows` rows: r64 the image's EXL3_STAGES with padded
    rows, r128 EXL3_PF128_STAGES (2) with unpadded, swizzled rows (cuda/exl3_fused.cu, "prefill")."""
    kernel_name(rows)
    if rows == 64:
        return TUNING["EXL3_STAGES"], PF_XS_STRIDE
    return TUNING.get("EXL3_PF128_STAGES", PF128_STAGES), 128


def shared_bytes(K: int, rows: int = 64) -> int:
    """The block's shared memory: every warp's weight ring, then the B ring; the epilogue's fp32 tile reuses both.
    64 rows: 66-108 KiB (K 1-8); 128 rows: 68-96 KiB. Two blocks an SM on Hopper either way; GB10 (99 KiB a
    block) holds 64 rows up to K = 6 and 128 rows at every K."""
    stages, stride = _rings(rows)
    weights = stages * 8 * 8 * 8 * K * 4
    return max(weights + stages * rows * stride * 2, rows * YS_STRIDE * 4)


def fits(K: int, device: torch.device, rows: int = 64) -> bool:
    """Whether the kernel's shared memory fits a block on `device` (GB10: 99 KB, so the 64-row kernel up to K = 6;
    the K = 7, 8 matrices take the Triton tiles there unless 128-row tiles are on: a choice by device and K, never by
    the rows)."""
    return shared_bytes(K, rows) <= _shared_limit(device)


def tile_rows(device: torch.device, Ks: tuple[int, ...], rows: int | None = None) -> int:
    """The tile rows of a product of these K on `device`: `rows` (None: `DSV41_PREFILL_TILE_ROWS`) where that
    kernel fits, else 64 (the same bits: the module docstring; `prefill._cuda_rows` takes the Triton tiles where
    neither fits)."""
    rows = configured_rows() if rows is None else rows
    kernel_name(rows)
    return rows if all(fits(K, device, rows) for K in Ks) else min(TILE_ROWS)


def prefill_tiles_cuda(xh: torch.Tensor, words: torch.Tensor, svh: torch.Tensor, K: int, codebook: str, k: int,
                       n: int, out: torch.Tensor, n_rows: int, tiles: int, table: torch.Tensor | None = None,
                       out_rows: torch.Tensor | None = None, rows: int = 64,
                       columns_first: bool | None = None) -> torch.Tensor:
    """out[dest(i)] = rot(xh[i] @ W_q[e]) ⊙ svh[e] for the rows i of each tile (fp32 / bf16 / fp16 `out`, unit
    column stride). words / svh: one matrix ([k/16, n/16, 8K] / [n]) or a stack ([E, ...]) with `table` [tiles, 3]
    int32 (expert, first row, rows <= `rows`); without a table tile t is rows [t·rows, t·rows + rows) of n_rows.
    `out_rows` [rows] int32: each row's output row (else the row itself). `columns_first` (None:
    `DSV41_PREFILL_TILE_ORDER`): the launch order (module docstring)."""
    if tiles == 0:
        check_tile_io(xh, out, k, n)
        return out
    return launch_tiles(kernels_for(xh.device, K, codebook)[kernel_name(rows)], shared_bytes(K, rows), xh, words, svh,
                        k, n, out, n_rows, tiles, table, out_rows, columns_first)


def check_tile_io(xh: torch.Tensor, out: torch.Tensor, k: int, n: int) -> None:
    if xh.dtype != torch.float16 or not xh.is_contiguous() or xh.shape[1] != k:
        raise ValueError(f"xh must be contiguous fp16 [rows, {k}], got {xh.dtype} {list(xh.shape)}")
    if out.dtype not in DTYPE_CODES or out.stride(1) != 1 or out.shape[1] != n:
        raise ValueError(f"out must be fp16 / bf16 / fp32 [rows, {n}] with unit column stride")


def launch_tiles(kernel, shared: int, xh: torch.Tensor, words: torch.Tensor, svh: torch.Tensor, k: int, n: int,
                 out: torch.Tensor, n_rows: int, tiles: int, table: torch.Tensor | None, out_rows: torch.Tensor | None,
                 columns_first: bool | None) -> torch.Tensor:
    """One launch of a prefill tile kernel (the arguments of `PREFILL_ARGS`, cuda/exl3_fused.cu): the checks, the
    grid in the launch order (`columns_first`, None: `DSV41_PREFILL_TILE_ORDER`)."""
    check_tile_io(xh, out, k, n)
    cols_first = configured_columns_first() if columns_first is None else columns_first
    cols_first = cols_first and tiles <= 65535  # the grid's y limit (the order never changes the bits)
    grid = (n // 128, tiles, 1) if cols_first else (tiles, n // 128, 1)
    kernel.launch(grid, THREADS, shared,
                  [words, svh, xh, table if table is not None else NULL,
                   out_rows if out_rows is not None else NULL, out, out.stride(0), DTYPE_CODES[out.dtype],
                   n_rows, k, n, int(cols_first)])
    return out
