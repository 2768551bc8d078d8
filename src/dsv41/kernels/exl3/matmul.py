"""Fused EXL3 matmul for small row counts (decode and verify windows): `y = x @ W_eff` in one launch.

One program = one 128-column block (so the output Hadamard fits in its epilogue) x one slice of the input
dimension (split-K, so a 2304-wide expert still fills 132 SMs) x one block of 16 rows. It rotates its slice of the
input (suh, H), decodes the trellis in registers and accumulates in fp32 on tensor cores. Split-K partials go to a
workspace; the program that arrives last at a per-block counter sums them in split order, applies H and svh and
writes y (no float atomics: the result is deterministic).

Row invariance: the block is always 16 rows and the split and tile shape depend only on the matrix, never on m,
so a row's output bits do not depend on the other rows or on m. Rows beyond 16 run as further 16-row blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv41.kernels.exl3.backend import use_cuda_backend, use_inline_asm
from dsv41.kernels.exl3.cuda import fused_matmul_cuda
from dsv41.kernels.exl3.decode import (
    accumulate_kslice,
    accumulate_kslice_prerotated,
    hadamard_signs,
    rotate_input_kernel,
    rotate_rows_fp32,
)
from dsv41.kernels.exl3.layout import Exl3Tensor

BLOCK_M = 16


@dataclass(frozen=True)
class MatmulConfig:
    """Launch shape for one matrix; must not depend on m (row invariance)."""

    splits: int
    block_k: int = 32
    num_warps: int = 4
    # Software pipelining would stage the gathered trellis words in shared memory (~100 KB per stage).
    num_stages: int = 1
    # Rotate the input in its own small launch and run the k loop on the rotated input (fewer registers; see
    # docs/perf/exl3.md "next steps" — not yet measured on a GPU, so off by default).
    prerotate: bool = False


def default_config(weight: Exl3Tensor, sm_count: int = 132) -> MatmulConfig:
    """Launch shape from the H200 sweep (docs/perf/exl3.md): about one wave of 8-warp programs for narrow
    matrices (split-K makes up the count), 4-warp programs two k-slices deep for wide ones (wq_b, head)."""
    col_blocks = weight.n // 128
    k_blocks = weight.k // 128
    if col_blocks >= sm_count:
        return MatmulConfig(splits=min(2, k_blocks), block_k=32, num_warps=4)
    splits = max(1, min(k_blocks // 2, round(sm_count / col_blocks)))
    return MatmulConfig(splits=splits, block_k=64, num_warps=8)


def launch_grid(weight: Exl3Tensor, m: int, cfg: MatmulConfig) -> tuple[int, int, int]:
    """Programs of one launch: (128-column block, k split, block of BLOCK_M rows). Row r of x is row r % BLOCK_M of
    row block r // BLOCK_M; the column blocks, the k splits and the config do not depend on m (row invariance)."""
    return weight.n // 128, cfg.splits, triton.cdiv(m, BLOCK_M)


@triton.jit(do_not_specialize=["M"])
def _exl3_matmul_kernel(
    x_ptr,
    suh_ptr,
    svh_ptr,
    trellis_ptr,
    had_f16_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    M,
    k,
    n,
    stride_xm,
    stride_ym,
    SPLITS,
    K: tl.constexpr,
    CODEBOOK: tl.constexpr,
    BK: tl.constexpr,
    USE_ASM: tl.constexpr,
    PREROTATED: tl.constexpr,
):
    # SPLITS is a runtime value (one compiled kernel serves every split count); a split count of 1 skips the
    # workspace round trip.
    nb = tl.program_id(0)
    sp = tl.program_id(1)
    mb = tl.program_id(2)
    col_blocks = n // 128
    k_blocks = k // 128
    kb_lo = sp * k_blocks // SPLITS
    kb_hi = (sp + 1) * k_blocks // SPLITS
    tiles_n = n // 16

    rows = tl.arange(0, 16)
    cols = tl.arange(0, 128)
    row_ids = mb * 16 + rows
    row_mask = row_ids < M
    acc = tl.zeros((16, 128), dtype=tl.float32)
    if PREROTATED:
        # x_ptr holds the rotated fp16 input (rotate_input_kernel); suh is already applied.
        acc = accumulate_kslice_prerotated(
            acc,
            x_ptr,
            row_ids.to(tl.int64) * stride_xm,
            row_mask,
            trellis_ptr + nb * 8 * (8 * K),
            tiles_n,
            kb_lo,
            kb_hi,
            K,
            CODEBOOK,
            BK,
            USE_ASM,
        )
    else:
        acc = accumulate_kslice(
            acc,
            x_ptr,
            row_ids.to(tl.int64) * stride_xm,
            row_mask,
            suh_ptr,
            trellis_ptr + nb * 8 * (8 * K),
            tiles_n,
            had_f16_ptr,
            kb_lo,
            kb_hi,
            K,
            CODEBOOK,
            BK,
            USE_ASM,
        )
    y_offsets = row_ids[:, None].to(tl.int64) * stride_ym + (nb * 128 + cols)[None, :]
    sv = tl.load(svh_ptr + nb * 128 + cols).to(tl.float32)
    if SPLITS == 1:
        out = rotate_rows_fp32(acc, had_f16_ptr) * sv[None, :]
        tl.store(y_ptr + y_offsets, out.to(y_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        n_row_blocks = tl.num_programs(2)
        part_offsets = ((mb * 16 + rows)[:, None].to(tl.int64) * n) + (nb * 128 + cols)[None, :]
        block_stride = n_row_blocks.to(tl.int64) * 16 * n
        tl.store(part_ptr + sp * block_stride + part_offsets, acc)
        # All threads' partial stores are done before the (release) ticket is taken.
        tl.debug_barrier()
        counter = count_ptr + mb * col_blocks + nb
        ticket = tl.atomic_add(counter, 1, sem="acq_rel")
        if ticket == SPLITS - 1:
            total = tl.zeros((16, 128), dtype=tl.float32)
            for s in range(SPLITS):
                # .cg: bypass L1, the other programs wrote these from other SMs.
                total += tl.load(part_ptr + s * block_stride + part_offsets, cache_modifier=".cg")
            tl.atomic_xchg(counter, 0)  # ready for the next launch (graph replays included)
            out = rotate_rows_fp32(total, had_f16_ptr) * sv[None, :]
            tl.store(y_ptr + y_offsets, out.to(y_ptr.dtype.element_ty), mask=row_mask[:, None])


class _Workspace:
    """Split-K partials and arrival counters, kept per (device, shape) so launches allocate nothing."""

    def __init__(self):
        self._parts: dict[tuple, torch.Tensor] = {}
        self._counts: dict[tuple, torch.Tensor] = {}

    def get(self, device: torch.device, splits: int, row_blocks: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (str(device), splits, row_blocks, n)
        if key not in self._parts:
            self._parts[key] = torch.empty((splits, row_blocks * 16, n), dtype=torch.float32, device=device)
            self._counts[key] = torch.zeros((row_blocks * (n // 128),), dtype=torch.int32, device=device)
        return self._parts[key], self._counts[key]


_WORKSPACE = _Workspace()


def fused_matmul(
    x: torch.Tensor,
    weight: Exl3Tensor,
    out_dtype: torch.dtype = torch.float32,
    config: MatmulConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`y = x @ W_eff` for x `[m, k]` (fp16; bf16/fp32 are rounded to fp16 first, as ExLlamaV3 requires).

    Runs the CUDA kernel (exl3/cuda.py) on NVIDIA GPUs unless a Triton `config` is given or
    DSV41_EXL3_BACKEND=triton; the Triton kernel elsewhere (and in the CPU interpreter).
    """
    if config is None and use_cuda_backend(x.device):
        return fused_matmul_cuda(x, weight, out_dtype=out_dtype, out=out)
    if x.dim() != 2 or x.shape[1] != weight.k:
        raise ValueError(f"x must be [m, {weight.k}], got {list(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    cfg = config or default_config(weight)
    if (weight.k // 128) < cfg.splits or 128 % cfg.block_k or cfg.block_k % 16:
        raise ValueError(f"bad config {cfg} for k={weight.k}")
    if out is None:
        out = torch.empty((m, weight.n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    grid = launch_grid(weight, m, cfg)
    row_blocks = grid[2]
    part, count = _WORKSPACE.get(x.device, cfg.splits, row_blocks, weight.n)
    had = hadamard_signs(x.device, torch.float16)
    if cfg.prerotate:
        xh = torch.empty((m, weight.k), dtype=torch.float16, device=x.device)
        rotate_input_kernel[(row_blocks, weight.k // 128)](x, weight.suh, had, xh, m, x.stride(0), xh.stride(0))
        x = xh
    _exl3_matmul_kernel[grid](
        x,
        weight.suh,
        weight.svh,
        weight.words,
        had,
        out,
        part,
        count,
        m,
        weight.k,
        weight.n,
        x.stride(0),
        out.stride(0),
        cfg.splits,
        K=weight.K,
        CODEBOOK=weight.codebook_id,
        BK=cfg.block_k,
        USE_ASM=use_inline_asm(x.device, weight.codebook),
        PREROTATED=cfg.prerotate,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
