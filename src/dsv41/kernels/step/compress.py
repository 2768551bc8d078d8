"""The compressor's ratio-r pooling and its RMSNorm in one launch, one program per group.

Reference (`dsv41.model.attention.Attention._compress`, ratio r > 1): per closed group of r consecutive rows and per
channel, pooled = sum_j softmax_j(s) * v_j over the group's members in fp32, then
latent = rms_norm(pooled.to(dtype), norm, eps) (`dsv41.model.norm.rms_norm`). On the decode path torch runs this as
~15 launches (softmax, product, sum, narrowing, then the norm's widening, square, mean, + eps, fp64 rsqrt and its
two casts, scale, weight, product, narrowing).

Arithmetic (fp32, nothing fused: the launch passes enable_fp_fusion=False): m = max_j s_j, e_j = exp(s_j - m) (Triton's
exp), den = e_0 + e_1 + ... in member order, p_j = e_j / den (IEEE division, `div_rn`), pooled = p_0 v_0 + p_1 v_1
+ ... in member order, rounded to out_dtype (bf16 by its bits: the interpreter truncates a plain cast); then the
norm as `rowops.rms_norm_rows` computes it, on the same tile layout, reduction tree and warp count: for an even
width the latent is `rms_norm_rows(pooled)` bit for bit. Against torch the exp, the softmax's division (torch may
multiply by the reciprocal) and the norm's sum order can each move an fp32 value by an ulp or so, which moves a bf16
output only at a rounding boundary (tests/test_kernels_step_compress.py states the bounds).

Two ways to find a group's members, the same math on the same loaded values (so the same bits):
- `pool_norm_rows`: the members as a [R, r, C] tensor (the load-and-store path's `v.view(groups, r, C)`);
- `close_norm_rows`: the in-place path's gather in the kernel's load: member r - 1 is the row itself, member
  r - 1 - d the step's row `back_row[d - 1]` when >= 0, else row `back_open[d - 1]` of the open-group store
  (runtime/step_tables.py), so the torch index / where / stack launches of each member go too.
`rows=` as every step launcher: programs for the first `rows` rows, +0.0 written to the others (kernels/step/live.py).
Row invariance: a program reads its own group's members and the weight; its compile shape depends on r, the width
and the dtypes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .live import live_rows as _live_rows
from .pdl import launch as pdl_launch, wait_previous
from .rowops import TILE, _DTYPES, _cast, norm_pairs


@triton.jit
def _member(v_ptr, s_ptr, sv_r, sv_m, ss_r, ss_m, o_ptr, so_r, so_k, br_ptr, bo_ptr, sb, row, j, col, mask,
            RATIO: tl.constexpr, GATHER: tl.constexpr):
    """Member j's (value, gate) at columns `col` of group `row`, fp32."""
    if GATHER:
        if j == RATIO - 1:
            v = tl.load(v_ptr + row * sv_r + col, mask=mask, other=0.0)
            s = tl.load(s_ptr + row * ss_r + col, mask=mask, other=0.0)
        else:
            d = RATIO - 1 - j
            here = tl.load(br_ptr + (d - 1) * sb + row).to(tl.int64)
            at = tl.load(bo_ptr + (d - 1) * sb + row).to(tl.int64)
            inside = here >= 0
            orow = o_ptr + at * so_r + col
            v = tl.where(inside, tl.load(v_ptr + here * sv_r + col, mask=mask & inside, other=0.0),
                         tl.load(orow, mask=mask & (here < 0), other=0.0))
            s = tl.where(inside, tl.load(s_ptr + here * ss_r + col, mask=mask & inside, other=0.0),
                         tl.load(orow + so_k, mask=mask & (here < 0), other=0.0))
    else:
        v = tl.load(v_ptr + row * sv_r + j * sv_m + col, mask=mask, other=0.0)
        s = tl.load(s_ptr + row * ss_r + j * ss_m + col, mask=mask, other=0.0)
    return v.to(tl.float32), s.to(tl.float32)


@triton.jit
def _pooled(v_ptr, s_ptr, sv_r, sv_m, ss_r, ss_m, o_ptr, so_r, so_k, br_ptr, bo_ptr, sb, row, col, mask,
            RATIO: tl.constexpr, GATHER: tl.constexpr):
    """sum_j softmax_j(s) v_j at columns `col`, fp32, members in order (re-read per pass: cached loads)."""
    _, m = _member(v_ptr, s_ptr, sv_r, sv_m, ss_r, ss_m, o_ptr, so_r, so_k, br_ptr, bo_ptr, sb, row, 0, col, mask,
                   RATIO, GATHER)
    for j in tl.static_range(1, RATIO):
        _, s = _member(v_ptr, s_ptr, sv_r, sv_m, ss_r, ss_m, o_ptr, so_r, so_k, br_ptr, bo_ptr, sb, row, j, col,
                       mask, RATIO, GATHER)
        m = tl.maximum(m, s)
    _, s = _member(v_ptr, s_ptr, sv_r, sv_m, ss_r, ss_m, o_ptr, so_r, so_k, br_ptr, bo_ptr, sb, row, 0, col, mask,
                   RATIO, GATHER)
    den = tl.exp(s - m)
    for j in tl.static_range(1, RATIO):
        _, s = _member(v_ptr, s_ptr, sv_r, sv_m, ss_r, ss_m, o_ptr, so_r, so_k, br_ptr, bo_ptr, sb, row, j, col,
                       mask, RATIO, GATHER)
        den = den + tl.exp(s - m)
    v, s = _member(v_ptr, s_ptr, sv_r, sv_m, ss_r, ss_m, o_ptr, so_r, so_k, br_ptr, bo_ptr, sb, row, 0, col, mask,
                   RATIO, GATHER)
    acc = tl.math.div_rn(tl.exp(s - m), den) * v  # the first product as it is (no 0 + p v: -0 stays -0)
    for j in tl.static_range(1, RATIO):
        v, s = _member(v_ptr, s_ptr, sv_r, sv_m, ss_r, ss_m, o_ptr, so_r, so_k, br_ptr, bo_ptr, sb, row, j, col,
                       mask, RATIO, GATHER)
        acc = acc + tl.math.div_rn(tl.exp(s - m), den) * v
    return acc


@triton.jit(do_not_specialize=["live_rows"])
def _pool_norm_kernel(v_ptr, s_ptr, sv_r, sv_m, ss_r, ss_m, o_ptr, so_r, so_k, br_ptr, bo_ptr, sb, out_ptr, w_ptr,
                      eps, C, live_rows, RATIO: tl.constexpr, GATHER: tl.constexpr, NORM: tl.constexpr,
                      NB: tl.constexpr, HB: tl.constexpr, OUT: tl.constexpr, PDL: tl.constexpr = False):
    """Program `row`: its group's latent as two [NB, HB] tiles (block b's columns 2k and 2k + 1: rowops' layout,
    so the norm's reduction tree is rowops'). Rows from `live_rows` on write +0.0."""
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, NB)[:, None]
    k = tl.arange(0, HB)[None, :]
    col = b * (2 * HB) + 2 * k  # the even member's column
    le, lo = col < C, col + 1 < C
    dst = out_ptr + row * C + col
    if row >= live_rows:
        zero = tl.zeros((NB, HB), dtype=out_ptr.dtype.element_ty)
        tl.store(dst, zero, mask=le)
        tl.store(dst + 1, zero, mask=lo)
    else:
        ev = _cast(_pooled(v_ptr, s_ptr, sv_r, sv_m, ss_r, ss_m, o_ptr, so_r, so_k, br_ptr, bo_ptr, sb, row, col, le,
                           RATIO, GATHER), OUT)
        od = _cast(_pooled(v_ptr, s_ptr, sv_r, sv_m, ss_r, ss_m, o_ptr, so_r, so_k, br_ptr, bo_ptr, sb, row, col + 1,
                           lo, RATIO, GATHER), OUT)
        if NORM:  # rowops' norm itself (one reduction tree)
            ev, od = norm_pairs(ev, od, w_ptr, col, le, lo, C, eps, OUT)
        tl.store(dst, ev.to(out_ptr.dtype.element_ty), mask=le)
        tl.store(dst + 1, od.to(out_ptr.dtype.element_ty), mask=lo)


def _check_common(R: int, C: int, dtype, norm_weight, out_dtype):
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"gv and gs must be bf16 / fp16 / fp32, got {dtype}")
    if out_dtype not in _DTYPES:
        raise ValueError(f"out_dtype must be bf16 / fp16 / fp32, got {out_dtype}")
    if norm_weight is not None and tuple(norm_weight.shape) != (C,):
        raise ValueError(f"norm_weight must be [{C}], got {list(norm_weight.shape)}")


def _unit_cols(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(R, C, ratio, v, s, sv, ss, opn, so, br, bo, sb, norm_weight, eps, out_dtype, rows, gather):
    live = _live_rows(rows, R)
    out = torch.empty(R, C, dtype=out_dtype, device=v.device)
    if R == 0 or C == 0:
        return out
    w = norm_weight.contiguous() if norm_weight is not None else out
    nb, hb = triton.next_power_of_2(triton.cdiv(C, TILE)), TILE // 2
    _pool_norm_kernel[(R,)](  # the padding rows' programs write zeros: no memset launch beside the kernel
        v, s, sv[0], sv[1], ss[0], ss[1], opn, so[0], so[1], br, bo, sb, out, w, float(eps), C, live,
        RATIO=ratio, GATHER=gather, NORM=norm_weight is not None, NB=nb, HB=hb, OUT=_DTYPES[out_dtype],
        num_warps=1 if nb * hb <= 256 else 4, enable_fp_fusion=False, **pdl_launch(v.device))
    return out


def pool_norm_rows(gv: torch.Tensor, gs: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                   out_dtype: torch.dtype, *, rows: int | None = None) -> torch.Tensor:
    """latent [R, C] (out_dtype) = rms_norm((softmax(gs, dim=1) * gv).sum(1).to(out_dtype), norm_weight, eps) for
    the members gv, gs [R, r, C] (one dtype, bf16 / fp16 / fp32; any strides but the channels'), in one launch.
    norm_weight None: the pooled values rounded to out_dtype, no norm (what the tests check the pooling on)."""
    if gv.dim() != 3 or gv.shape != gs.shape or gv.dtype != gs.dtype:
        raise ValueError(f"gv and gs must be one dtype and shape [R, r, C], got {gv.dtype} {list(gv.shape)} and "
                         f"{gs.dtype} {list(gs.shape)}")
    R, ratio, C = gv.shape
    if ratio < 1:
        raise ValueError(f"gv and gs need at least one member a group (r >= 1), got r = {ratio}")
    _check_common(R, C, gv.dtype, norm_weight, out_dtype)
    gv, gs = _unit_cols(gv), _unit_cols(gs)
    return _launch(R, C, ratio, gv, gs, gv.stride()[:2], gs.stride()[:2], gv, (0, 0), gv, gv, 0, norm_weight, eps,
                   out_dtype, rows, False)


def close_norm_rows(v: torch.Tensor, s: torch.Tensor, open_store: torch.Tensor, back_row: torch.Tensor,
                    back_open: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype, *,
                    rows: int | None = None) -> torch.Tensor:
    """`pool_norm_rows` of the groups that rows v, s [R, C] (the step's values and gates, one dtype) close, the
    members gathered in the kernel's load: row i's member r - 1 - d (d = 1 .. r - 1) is row back_row[d - 1, i] of
    v, s when >= 0, else the (value, gate) pair open_store[back_open[d - 1, i]] ([rows, 2, C], or a store
    [slots, r - 1, 2, C] flattened so); back_row, back_open [r - 1, >= R] (integer). The bits are
    `pool_norm_rows` on the gathered [R, r, C] members (the same program). A row whose tables point nowhere real
    computes a value nobody should read; an index out of range of v or open_store is the caller's bug."""
    if v.dim() != 2 or v.shape != s.shape or v.dtype != s.dtype:
        raise ValueError(f"v and s must be one dtype and shape [R, C], got {v.dtype} {list(v.shape)} and "
                         f"{s.dtype} {list(s.shape)}")
    R, C = v.shape
    if open_store.dim() == 4:
        open_store = open_store.reshape(-1, *open_store.shape[2:])
    if open_store.dim() != 3 or open_store.shape[1:] != (2, C) or open_store.dtype != v.dtype:
        raise ValueError(f"open_store must be {v.dtype} [rows, 2, {C}] (or [slots, r - 1, 2, {C}]), got "
                         f"{open_store.dtype} {list(open_store.shape)}")
    if (back_row.dim() != 2 or back_open.shape != back_row.shape or back_row.shape[1] < R
            or back_row.dtype.is_floating_point or back_open.dtype.is_floating_point):
        raise ValueError(f"back_row and back_open must be integer [r - 1, >= {R}] alike, got "
                         f"{back_row.dtype} {list(back_row.shape)} and {back_open.dtype} {list(back_open.shape)}")
    _check_common(R, C, v.dtype, norm_weight, out_dtype)
    if back_row.stride(1) != 1 or back_open.stride() != back_row.stride():
        back_row, back_open = back_row.contiguous(), back_open.contiguous()
    v, s, open_store = _unit_cols(v), _unit_cols(s), _unit_cols(open_store)
    return _launch(R, C, back_row.shape[0] + 1, v, s, (v.stride(0), 0), (s.stride(0), 0), open_store,
                   open_store.stride()[:2], back_row, back_open, back_row.stride(0), norm_weight, eps, out_dtype,
                   rows, True)


__all__ = ["pool_norm_rows", "close_norm_rows"]
