"""The prefill tiles on Hopper's warpgroup MMA (`exl3_prefill_wg128` in cuda/exl3_fused.cu, issue 31): the 128-row
tile of `prefill_cuda` (the same table, out_rows and epilogue) with each warpgroup's products of a k step as one
`wgmma.m64nNk16` (A: the warp's decoded fragment in registers; B: the tile's rows from shared memory) instead of
16 `mma.m16n8k16` a warp, each reading its B operand through registers.

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

import torch

from dsv41.kernels.cuda_build import arch_defines, exl3_defines
from dsv41.kernels.cuda_module import load_kernels
from dsv41.kernels.exl3.cuda import SOURCE, TUNING, YS_STRIDE, _shared_limit
from dsv41.kernels.exl3.prefill_cuda import check_tile_io, launch_tiles
from dsv41.kernels.step.knobs import switched_on

ENV = "DSV41_PREFILL_WGMMA"
KERNEL = "exl3_prefill_wg128"
ROWS = 128
STAGES = 2  # EXL3_WG_STAGES: the k loop's stages of weights and B (exl3_fused.cu)
B_STAGE_BYTES = ROWS * 128 * 2  # 128 rows x 128 k fp16 a stage
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


def shared_bytes(K: int) -> int:
    """The B ring (`EXL3_WG_BSLOTS` slots, the tuning's or 2), every warp's weight ring (as r128's), 1 KiB to align
    the B ring to the swizzle's 1,024-byte atoms; the epilogue's fp32 tile reuses them: 77-97 KiB (K 1-8) with 2
    B slots, 32 KiB more with 3."""
    rings = TUNING.get("EXL3_WG_BSLOTS", B_SLOTS) * B_STAGE_BYTES + STAGES * 8 * 8 * 8 * K * 4
    return 1024 + max(rings, ROWS * YS_STRIDE * 4)


def kernel_for(device: torch.device, K: int, codebook: str):
    defines = arch_defines(exl3_defines(K, codebook, TUNING), "sm_90a")
    return load_kernels(SOURCE, defines, [KERNEL], device, arch_suffix="a")[KERNEL]


def prefill_tiles_wgmma(xh: torch.Tensor, words: torch.Tensor, svh: torch.Tensor, K: int, codebook: str, k: int,
                        n: int, out: torch.Tensor, n_rows: int, tiles: int, table: torch.Tensor | None = None,
                        out_rows: torch.Tensor | None = None, columns_first: bool | None = None) -> torch.Tensor:
    """`prefill_cuda.prefill_tiles_cuda`'s product (128-row tiles) with xh in natural k order."""
    shared = shared_bytes(K)
    if shared > _shared_limit(xh.device):
        raise ValueError(f"exl3_prefill_wg128 needs {shared} bytes of shared memory a block at K = {K}")
    if tiles == 0:
        check_tile_io(xh, out, k, n)
        return out
    return launch_tiles(kernel_for(xh.device, K, codebook), shared, xh, words, svh, k, n, out, n_rows, tiles, table,
                        out_rows, columns_first)
