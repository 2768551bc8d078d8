"""The clamped SwiGLU of the shared expert between its matmuls, in one launch (reference: the elementwise middle of
`dsv41.model.moe.swiglu_clamped`: h = silu(min(g, limit)) * clamp(u, -limit, limit), in fp32, rounded once to the
activations' dtype).

On the decode path torch runs this as six launches per layer (two widenings, two clamps, silu, the product and the
narrowing); here it is one, elementwise, so a row's bits are its own inputs' alone. silu is z / (1 + exp(-z)) with
a correctly rounded division and Triton's exp (torch's CUDA expf may round its last bit otherwise: within fp32
rounding of the reference, as METHOD.md's tolerance for the kernels). `rows=` as every step launcher: programs for
the first `rows` rows, +0.0 written to the others (kernels/step/live.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch as pdl_launch, wait_previous

from .live import live_rows as _live_rows
from .mhc import _cast  # fp32 -> the dtype, nearest even (bf16 by its bits)

BLOCK = 1024


@triton.jit(do_not_specialize=["live_rows"])
def _swiglu_kernel(g_ptr, u_ptr, h_ptr, stride_g, stride_u, width, limit, live_rows, BLOCK: tl.constexpr,
                   PDL: tl.constexpr = False):
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    dst = h_ptr + row * width + cols
    if row >= live_rows:
        tl.store(dst, tl.zeros((BLOCK,), dtype=h_ptr.dtype.element_ty), mask=ok)
    else:
        g = tl.minimum(tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32), limit)
        u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        silu = tl.math.div_rn(g, 1.0 + tl.exp(-g))
        tl.store(dst, _cast(silu * u, h_ptr.dtype.element_ty), mask=ok)


def swiglu_rows(g: torch.Tensor, u: torch.Tensor, limit: float, *, rows: int | None = None) -> torch.Tensor:
    """h = silu(min(g, limit)) * clamp(u, ±limit) for g, u [B, width] (bf16 / fp16 / fp32, unit column stride),
    in fp32, returned in g's dtype [B, width]. `rows`: the live rows (rows [rows, B) of h are +0.0)."""
    if g.dim() != 2 or g.shape != u.shape or g.dtype != u.dtype:
        raise ValueError(f"g and u must be one dtype and shape [B, width], got {g.dtype} {list(g.shape)} and "
                         f"{u.dtype} {list(u.shape)}")
    if g.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"g and u must be bf16 / fp16 / fp32, got {g.dtype}")
    if g.stride(1) != 1 or u.stride(1) != 1:
        raise ValueError("g and u need a unit column stride")
    B, width = g.shape
    live = _live_rows(rows, B)
    h = torch.empty(B, width, dtype=g.dtype, device=g.device)
    if B and width:
        block = min(BLOCK, triton.next_power_of_2(width))
        _swiglu_kernel[(B, triton.cdiv(width, block))](g, u, h, g.stride(0), u.stride(0), width, float(limit), live,
                                                       BLOCK=block, num_warps=4, **pdl_launch(g.device))
    return h
