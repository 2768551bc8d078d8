"""Engram's gate and mix on the gathered rows' projection, in one launch (reference: `dsv41.model.engram.engram_mix`
and `engram_gate`, MODEL.md's Engram section): for streams X [B, hc, d] and kv [B, (hc + 1) d] (hc keys, then the
shared value),

    g_c = sigmoid(copysign(sqrt(max(|s_c|, 1e-6)), s_c)),  s_c = Σ(X_c · q·k weight · key_c) · rstd_c / sqrt(d),
    rstd_c = rsqrt(mean(X_c²) + eps) · rsqrt(mean(key_c²) + eps),    X'_c = X_c + g_c · value  (0 where not live).

One program per row, two passes over d: the three sums of every stream (fixed blocked order, one tree per compile
shape), then X' written. Numerics as the reference: fp32 throughout, the rsqrts and the gate's transcendental
chain in fp64 rounded once (the reference's `f64`), divisions correctly rounded. The sums run in another order than
torch's, so a gate can differ from the reference's by fp32 rounding, and X' (in the streams' dtype) by an ulp where
that moves a rounding. On the decode path this replaces ~20 torch launches an Engram layer. `rows=` as every step
launcher: rows from `rows` on are written +0.0.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .live import live_rows as _live_rows
from .mhc import _cast, _rsqrt64
from .pdl import launch as pdl_launch, wait_previous

BLOCK = 512
GATE_SQRT_FLOOR: tl.constexpr = tl.constexpr(1e-6)  # model.engram.GATE_SQRT_FLOOR (kernels do not import model/)


@triton.jit(do_not_specialize=["live_rows"])
def _engram_kernel(x_ptr, kv_ptr, w_ptr, live_ptr, out_ptr, d, eps, sqrt_d, live_rows, HC: tl.constexpr,
                   HCP: tl.constexpr, HAS_LIVE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, HCP)
    c_ok = c < HC
    if row >= live_rows:
        for d0 in range(0, d, BLOCK):
            cols = d0 + tl.arange(0, BLOCK)
            tl.store(out_ptr + row * HC * d + c[:, None] * d + cols[None, :],
                     tl.zeros((HCP, BLOCK), dtype=out_ptr.dtype.element_ty), mask=c_ok[:, None] & (cols < d)[None, :])
    else:
        sxx = tl.zeros((HCP, BLOCK), tl.float32)
        skk = tl.zeros((HCP, BLOCK), tl.float32)
        sxk = tl.zeros((HCP, BLOCK), tl.float32)
        for d0 in range(0, d, BLOCK):
            cols = d0 + tl.arange(0, BLOCK)
            m = c_ok[:, None] & (cols < d)[None, :]
            at = c[:, None] * d + cols[None, :]
            x = tl.load(x_ptr + row * HC * d + at, mask=m, other=0.0).to(tl.float32)
            key = tl.load(kv_ptr + row * (HC + 1) * d + at, mask=m, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + at, mask=m, other=0.0)
            sxx += x * x
            skk += key * key
            sxk += (x * w) * key
        dd = (d + 0.0).to(tl.float32)
        rstd = _rsqrt64(tl.math.div_rn(tl.sum(sxx, axis=1), tl.zeros((HCP,), tl.float32) + dd) + eps) * \
            _rsqrt64(tl.math.div_rn(tl.sum(skk, axis=1), tl.zeros((HCP,), tl.float32) + dd) + eps)
        z = tl.math.div_rn(tl.sum(sxk, axis=1) * rstd, tl.zeros((HCP,), tl.float32) + sqrt_d).to(tl.float64)
        t = tl.sqrt(tl.maximum(tl.abs(z), tl.full((HCP,), GATE_SQRT_FLOOR, tl.float64)))  # the floor in fp64
        t = tl.where(z.to(tl.int64, bitcast=True) < 0, -t, t)  # copysign: the score's sign bit (also of a zero)
        g = (1.0 / (1.0 + tl.exp(-t))).to(tl.float32)
        if HAS_LIVE:
            g = g * tl.load(live_ptr + row).to(tl.float32)
        for d0 in range(0, d, BLOCK):
            cols = d0 + tl.arange(0, BLOCK)
            m = c_ok[:, None] & (cols < d)[None, :]
            at = c[:, None] * d + cols[None, :]
            x = tl.load(x_ptr + row * HC * d + at, mask=m, other=0.0).to(tl.float32)
            v = tl.load(kv_ptr + row * (HC + 1) * d + HC * d + cols, mask=cols < d, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * HC * d + at, _cast(x + g[:, None] * v[None, :], out_ptr.dtype.element_ty),
                     mask=m)


def gate_weight(q_weight: torch.Tensor, k_weight: torch.Tensor) -> torch.Tensor:
    """The only form of the two weights the gate uses: their fp32 product [hc, d], as the reference forms it (made
    once per layer by the caller, not per step)."""
    return (q_weight.float() * k_weight.float()).contiguous()


def engram_mix_rows(x: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, eps: float,
                    live: torch.Tensor | None = None, *, rows: int | None = None) -> torch.Tensor:
    """`model.engram.engram_mix(x, kv, q_weight, k_weight, eps, live)` with `weight = gate_weight(q_weight,
    k_weight)`: streams x [B, hc, d] (contiguous), kv [B, (hc + 1) d] (any float dtype), live bool [B] or None;
    X' in x's dtype."""
    if x.dim() != 3 or not x.is_contiguous():
        raise ValueError(f"streams must be a contiguous [B, hc, d] tensor, got {list(x.shape)}")
    B, hc, d = x.shape
    if tuple(kv.shape) != (B, (hc + 1) * d):
        raise ValueError(f"Engram kv has shape {list(kv.shape)}, expected {[B, (hc + 1) * d]}")
    if tuple(weight.shape) != (hc, d) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"weight must be the contiguous fp32 [{hc}, {d}] gate_weight, got {weight.dtype} "
                         f"{list(weight.shape)}")
    if live is not None and (live.shape != (B,) or live.dtype != torch.bool):
        raise ValueError(f"live must be bool [{B}], got {live.dtype} {list(live.shape)}")
    n = _live_rows(rows, B)
    out = torch.empty_like(x)
    if B:
        _engram_kernel[(B,)](x, kv.contiguous(), weight, live if live is not None else weight, out, d, float(eps),
                             float(math.sqrt(d)), n, HC=hc, HCP=triton.next_power_of_2(hc), HAS_LIVE=live is not None,
                             BLOCK=min(BLOCK, triton.next_power_of_2(d)), num_warps=4, enable_fp_fusion=False,
                             **pdl_launch(x.device))
    return out
