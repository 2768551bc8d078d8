"""Prefill path: reconstruct an EXL3 matrix to a dense fp16/bf16 weight, then one cuBLAS GEMM.

`reconstruct(...)` decodes every 128x128 block in registers and, unless `rotate=False`, applies both Hadamard
rotations and the suh/svh scales in the same program (three tensor-core products per block), so W_eff is
written once and never re-read in fp32. `rotate=False` returns the rotated-domain W_q and is what the bit-exact
decode tests compare against the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.kernels.exl3.backend import use_inline_asm
from dsv41.kernels.exl3.decode import decode_words, hadamard_signs, tile_word_offsets
from dsv41.kernels.exl3.layout import Exl3Tensor


@triton.jit
def _reconstruct_kernel(
    trellis_ptr,
    suh_ptr,
    svh_ptr,
    had_f16_ptr,
    out_ptr,
    n,
    K: tl.constexpr,
    CODEBOOK: tl.constexpr,
    ROTATE: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    kb = tl.program_id(0)
    nb = tl.program_id(1)
    tiles_n = n // 16
    idx = tl.arange(0, 128)
    off0, off1, shift = tile_word_offsets(idx[:, None], idx[None, :], tiles_n, K)
    base = trellis_ptr + ((kb * 8).to(tl.int64) * tiles_n + nb * 8) * (8 * K)
    w = decode_words(tl.load(base + off0), tl.load(base + off1), shift, CODEBOOK, USE_ASM)
    out_offsets = (kb * 128 + idx)[:, None].to(tl.int64) * n + (nb * 128 + idx)[None, :]
    if ROTATE:
        h = tl.load(had_f16_ptr + idx[:, None] * 128 + idx[None, :])
        # H·W_q: ±1 times fp16 values, accumulated in fp32.
        left = tl.dot(h, w)
        # (H·W_q)·H: split the fp32 left product into two fp16 parts (hi + lo covers 22 bits) so the second
        # product also runs on tensor cores with exact ±1 multiplies.
        hi = left.to(tl.float16)
        lo = (left - hi.to(tl.float32)).to(tl.float16)
        both = tl.dot(lo, h)
        both = tl.dot(hi, h, both)
        su = tl.load(suh_ptr + kb * 128 + idx).to(tl.float32)
        sv = tl.load(svh_ptr + nb * 128 + idx).to(tl.float32)
        weff = both * (1.0 / 128.0) * su[:, None] * sv[None, :]
        tl.store(out_ptr + out_offsets, weff.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + out_offsets, w)


def reconstruct(weight: Exl3Tensor, dtype: torch.dtype = torch.float16, rotate: bool = True,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense `[k, n]` matrix: W_eff (rotate=True, in `dtype`) or the decoded rotated-domain W_q (fp16).

    `out`: a contiguous `[k, n]` tensor of that dtype to write into (the runtime's reused prefill workspace)."""
    k, n = weight.k, weight.n
    out_dtype = dtype if rotate else torch.float16
    if out is None:
        out = torch.empty((k, n), dtype=out_dtype, device=weight.device)
    elif out.shape != (k, n) or out.dtype != out_dtype or not out.is_contiguous() or out.device != weight.device:
        raise ValueError(f"out must be a contiguous [{k}, {n}] {out_dtype} tensor on {weight.device}, got "
                         f"{list(out.shape)} {out.dtype} on {out.device}")
    grid = (k // 128, n // 128)
    _reconstruct_kernel[grid](
        weight.words,
        weight.suh,
        weight.svh,
        hadamard_signs(weight.device, torch.float16),
        out,
        n,
        K=weight.K,
        CODEBOOK=weight.codebook_id,
        ROTATE=rotate,
        USE_ASM=use_inline_asm(weight.device, weight.codebook),
        num_warps=8,
    )
    return out


def prefill_matmul(x: torch.Tensor, weight: Exl3Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`y = x @ W_eff` for many rows: reconstruct W_eff in fp16 once, one dense GEMM (fp32 accumulation)."""
    w = reconstruct(weight, torch.float16)
    y = torch.matmul(x.to(torch.float16), w)
    return y.to(out_dtype)
