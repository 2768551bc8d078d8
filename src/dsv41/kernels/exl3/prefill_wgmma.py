"""The prefill tiles on Hopper's warpgroup MMA (`exl3_prefill_wg128` in cuda/exl3_fused.cu, issue 31): the 128-row
tile of `prefill_cuda` (the same table, out_rows and epilogue) with each warpgroup's products of a k step as one
`wgmma.m64nNk16` (A: the warp's decoded fragment in registers; B: the tile's rows from shared memory) instead of
16 `mma.m16n8k16` a warp, each reading its B operand through registers.

Two tile heights, the same code (`wg_body<ROWS>`): `exl3_prefill_wg128` and `exl3_prefill_wg64`, whose 32 accumulators
a thread and half-size B ring fit 64 registers and ~45 KiB at K = 3 (four blocks an SM: twice the warps that hide the
decode's latency where a chunk's experts get few rows each: ~32 at 2,048 rows) against 128 registers, two blocks an
SM. A row's products are the same chain whatever the tile holds, so both give the same bits (the GPU test says so),
and the height may follow the chunk: `DSV41_PREFILL_WG_ROWS` (128, 64 or `auto`: 64 where the chunk's pairs average
at most `AUTO_ROWS` an expert; read at each call; 128 until an H100 A/B says otherwise).

Hopper only (sm_90a: the image is built with `-DEXL3_WGMMA=1` for the device's own architecture); GB10 (sm_121) and
sm_80 keep the portable tiles, which stay the reference twin. The input is the rotation in natural k order (no
PERMUTE) with `prefill_cuda.PAD_ROWS` rows of padding.

The same bits as the portable 128-row tiles (the H100 says so: every output of a full-shape layer's experts at
2,048 and 8,192 rows, skewed routing, bench/results/prefill_tiles_ab_95e36f2.json, and
tests/test_exl3_prefill_wgmma.py), so the switch never changes a reply. Switch `DSV41_PREFILL_WGMMA` (read at each
call; on by default since that run: experts of a layer at 8,192 rows 9.95 -> 7.5 ms, 2,048 rows 4.90 -> 3.97 ms;
`=0` for the mma tiles).
"""

from __future__ import annotations

import os

import torch

from dsv41.kernels.cuda_build import arch_defines, exl3_defines
from dsv41.kernels.cuda_module import load_kernels
from dsv41.kernels.exl3.cuda import SOURCE, TUNING, YS_STRIDE, _shared_limit
from dsv41.kernels.exl3.prefill_cuda import check_tile_io, launch_tiles
from dsv41.kernels.step.knobs import switched_on

ENV = "DSV41_PREFILL_WGMMA"
ROWS_ENV = "DSV41_PREFILL_WG_ROWS"
KERNELS = {128: "exl3_prefill_wg128", 64: "exl3_prefill_wg64"}  # tile rows -> entry of the sm_90a image
ROWS = 128  # the default tile height
AUTO_ROWS = 48  # `auto`: 64-row tiles where the pairs average at most this many an expert
STAGES = 2  # EXL3_WG_STAGES: the k loop's stages of weights and B (exl3_fused.cu)
B_SLOTS = 2  # EXL3_WG_BSLOTS's default: the B ring's slots


def enabled() -> bool:
    """`DSV41_PREFILL_WGMMA` is not 0 (on by default; read at each call: benches flip it in one process)."""
    return switched_on(ENV)


def available(device: torch.device) -> bool:
    """Whether the device runs sm_90a images (Hopper: H100 / H200)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def use_wgmma(device: torch.device, wgmma: bool | None = None) -> bool:
    """The wgmma tiles for this launch: `wgmma` (None: the switch) on a Hopper device."""
    return (enabled() if wgmma is None else wgmma) and available(device)


def tile_rows(pairs: int, experts: int, rows: int | str | None = None) -> int:
    """The tile height of a launch over `pairs` (row, expert) pairs of `experts` experts: `rows` (None:
    `DSV41_PREFILL_WG_ROWS`, 128 when unset); `auto` takes 64 where the pairs average at most `AUTO_ROWS` an expert
    (a 2,048-row chunk: 32; 8,192 rows: 128). Free to follow the chunk: both heights give the same bits."""
    raw = str(os.environ.get(ROWS_ENV, "").strip() or ROWS) if rows is None else str(rows)
    if raw == "auto":
        return 64 if pairs <= AUTO_ROWS * experts else 128
    if raw not in {str(r) for r in KERNELS}:
        raise ValueError(f"{ROWS_ENV}={raw!r}: the wgmma tiles take 64, 128 or auto rows")
    return int(raw)


def shared_bytes(K: int, rows: int = ROWS) -> int:
    """The B ring (`EXL3_WG_BSLOTS` slots, the tuning's or 2, of `rows` rows a stage), every warp's weight ring (as
    r128's), 1 KiB to align the B ring to the swizzle's 1,024-byte atoms; the epilogue's fp32 tile reuses them:
    128 rows 77-97 KiB (K 1-8) with 2 B slots, 32 KiB more with 3; 64 rows 45-65 KiB."""
    stage = rows * 128 * 2  # rows x 128 k fp16
    rings = TUNING.get("EXL3_WG_BSLOTS", B_SLOTS) * stage + STAGES * 8 * 8 * 8 * K * 4
    return 1024 + max(rings, rows * YS_STRIDE * 4)


def kernel_for(device: torch.device, K: int, codebook: str, rows: int = ROWS):
    """The `rows`-row entry of the (K, codebook) sm_90a image (one image holds both heights)."""
    defines = arch_defines(exl3_defines(K, codebook, TUNING), "sm_90a")
    return load_kernels(SOURCE, defines, list(KERNELS.values()), device, arch_suffix="a")[KERNELS[rows]]


def prefill_tiles_wgmma(xh: torch.Tensor, words: torch.Tensor, svh: torch.Tensor, K: int, codebook: str, k: int,
                        n: int, out: torch.Tensor, n_rows: int, tiles: int, table: torch.Tensor | None = None,
                        out_rows: torch.Tensor | None = None, columns_first: bool | None = None,
                        rows: int = ROWS) -> torch.Tensor:
    """`prefill_cuda.prefill_tiles_cuda`'s product (tiles of `rows` rows: the table's) with xh in natural k
    order."""
    shared = shared_bytes(K, rows)
    if shared > _shared_limit(xh.device):
        raise ValueError(f"{KERNELS[rows]} needs {shared} bytes of shared memory a block at K = {K}")
    if tiles == 0:
        check_tile_io(xh, out, k, n)
        return out
    return launch_tiles(kernel_for(xh.device, K, codebook, rows), shared, xh, words, svh, k, n, out, n_rows, tiles,
                        table, out_rows, columns_first)
