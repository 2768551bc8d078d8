"""Row ops of the decode step in one launch each: RMSNorm, RoPE and the fake quantisers, one program per (row, head).

References (what each entry point computes, bit for bit where the reference's arithmetic is a fixed sequence of
correctly rounded fp32 operations; see the notes below for where it is not):
- `dsv41.model.norm.rms_norm`: y = x * rsqrt(mean(x²) + eps) in fp32 (rsqrt in fp64, rounded once), times the
  weight, rounded to the chain's dtype.
- `dsv41.model.rope.RopeTable.apply`: the last `rope_dim` dims of each head vector, adjacent pairs (2i, 2i+1)
  rotated by angle = fp32(position) * inv_freq[i] (fp32 product; cos and sin in fp64, rounded once to fp32;
  `inverse` negates sin); a' = a cos - b sin, b' = a sin + b cos in fp32, rounded to the chain's dtype; the other
  dims pass through.
- `dsv41.model.quant`: per block of `block` values of each head vector (skipped, as the reference does, when the
  head dim is not a multiple of the block): "fp8_ue8m0" (e4m3 values, scale 2^ceil(log2(fp32(max(amax, 1e-4) /
  448)))), "fp4_ue8m0" (e2m1 values, scale 2^ceil(log2(fp32(max(amax, 6·2^-126) / 6)))), "fp4_e4m3" (e2m1 values,
  scale e4m3(fp32(max(amax, 6·2^-9) / 6)))); values = round(clamp(v / scale)) * scale, rounded to the chain's dtype.
  e4m3 and e2m1 are rounded by their bits (nearest, ties to even, as torch's float8 cast and
  `formats.nearest_e2m1_code`); e2m1 keeps no negative zero (the reference's code table gives +0).

The chain's dtype is `out_dtype` (default: the input's). Every stage rounds to it as the reference does when its
input has that dtype; an input of another dtype is rounded to it first where the stage does not normalise
(`rope_rows` of the fp32 attention output = the reference's `rope(o.to(dtype))`).

Exactness: every division is IEEE (`div_rn`), nothing is fused (the launches pass enable_fp_fusion=False: a fused
a cos - b sin would round once where the reference rounds twice), bf16 is rounded by its bits (the interpreter
truncates a plain cast), and the per-block work reads only its block. So RoPE and the quantisers give the
reference's bits on the same input. The norm's sum of squares runs in another order than torch's (a fixed tree per
compile shape): its fp32 result can differ by an ulp or two, which moves a bf16 output only where it lies at a
rounding boundary (and a quantised one only where that moves a block's amax or a value across a code boundary).

Row invariance: the grid is (rows, heads); a program reads its own row's vector, the weight and the table, and its
compile shape depends only on the head dim, the rope dim, the block and the flags, never on the row count.
Subnormal corner: an fp4_ue8m0 block whose amax is at most 6·2^-126 (its floor, scale 2^-126) dequantises ±0.5 to
the fp32 subnormal 2^-127; the kernel's plain fp32 multiply keeps it (no .ftz), as torch does. Far below any
activation of the model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch as pdl_launch, wait_previous

from .codecs import CODEC_IDS, codec_id
from .live import live_rows as _live_rows

QUANT_MODES = {None: 0, "fp8_ue8m0": 1, "fp4_ue8m0": 2, "fp4_e4m3": 3}
DEFAULT_BLOCK = {"fp8_ue8m0": 32, "fp4_ue8m0": 32, "fp4_e4m3": 16}
TILE = 32  # values per tile row when no quantiser sets the block
CODEC_BLOCK = {0: 32, 1: 16, 2: 32}  # values per scale of the quantised pool codecs (codecs.FP8_UE8M0, FP4_E4M3, ...)
FP4_UE8M0_FLOOR = tl.constexpr(6.0 * 2.0 ** -126)  # amax floors of the reference (`model.quant`)
FP4_E4M3_FLOOR = tl.constexpr(6.0 * 2.0 ** -9)
_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _cast(v, DT: tl.constexpr):
    """fp32 -> DT rounded to nearest even (bf16 by its bits: the interpreter would truncate), back as fp32."""
    if DT == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return b.to(tl.float32, bitcast=True)
    elif DT == tl.float16:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def _pow2(e):
    """2^e as fp32 for integer e in [-126, 127] (built in the exponent field)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _neg(v):
    """-v by its sign bit (Triton's unary minus is 0 - v, which gives +0 for +0 where torch gives -0)."""
    return (v.to(tl.uint32, bitcast=True) ^ 0x80000000).to(tl.float32, bitcast=True)


@triton.jit
def _round_grid(a, EMIN: tl.constexpr, MBITS: tl.constexpr):
    """a >= 0 (fp32, finite) rounded to the float grid with MBITS mantissa bits and minimum normal exponent EMIN
    (subnormals below), nearest, ties to even: y = a / ulp is exact (ulp a power of two), then rounded by its
    integer and fractional parts (exact fp32 operations)."""
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, EMIN)
    y = a * _pow2(MBITS - e)
    t = tl.floor(y)
    frac = y - t
    odd = (t.to(tl.int32) & 1) == 1
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return (t + tl.where(up, 1.0, 0.0)) * _pow2(e - MBITS)


@triton.jit
def _round_e4m3(v):
    """torch's v.clamp(-448, 448).to(float8_e4m3fn).float(): sign kept (also of zero)."""
    r = _round_grid(tl.minimum(tl.abs(v), 448.0), -6, 3)
    sign = (v.to(tl.uint32, bitcast=True) >> 31) << 31
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _round_e2m1(v):
    """`quant.round_e2m1`: clamp to ±6, nearest e2m1 value (ties to the even code), +0 for a zero code."""
    r = _round_grid(tl.minimum(tl.abs(v), 6.0), 0, 1)
    return tl.where((v < 0) & (r > 0), -r, r)


@triton.jit
def _ue8m0(ratio):
    """2^ceil(log2(ratio)) for fp32 ratio > 0, the exponent clamped to [-126, 127] (`power_of_two_scale_byte`)."""
    bits = ratio.to(tl.int32, bitcast=True)
    ex = (bits >> 23) & 0xFF
    c = tl.where(ex == 0, -126, ex - 127 + tl.where((bits & 0x7FFFFF) != 0, 1, 0))
    return _pow2(tl.minimum(tl.maximum(c, -126), 127))


@triton.jit
def _fake_quant(ev, od, QUANT: tl.constexpr):
    """The quantiser on a [blocks, block / 2] pair of tiles (even and odd members of each block)."""
    amax = tl.maximum(tl.max(tl.abs(ev), axis=1), tl.max(tl.abs(od), axis=1))
    if QUANT == 1:
        scale = _ue8m0(tl.math.div_rn(tl.maximum(amax, 1e-4), tl.zeros_like(amax) + 448.0))
    elif QUANT == 2:
        scale = _ue8m0(tl.math.div_rn(tl.maximum(amax, FP4_UE8M0_FLOOR), tl.zeros_like(amax) + 6.0))
    else:
        scale = _round_e4m3(tl.math.div_rn(tl.maximum(amax, FP4_E4M3_FLOOR), tl.zeros_like(amax) + 6.0))
    s = tl.broadcast_to(scale[:, None], ev.shape)
    if QUANT == 1:
        return _round_e4m3(tl.math.div_rn(ev, s)) * s, _round_e4m3(tl.math.div_rn(od, s)) * s
    else:
        return _round_e2m1(tl.math.div_rn(ev, s)) * s, _round_e2m1(tl.math.div_rn(od, s)) * s


@triton.jit
def _e4m3_code(r):
    """The e4m3fn byte of r, an fp32 value already on the e4m3 grid (|r| <= 448), sign of zero kept."""
    bits = r.to(tl.int32, bitcast=True)
    a = tl.abs(r)
    sub = (a * 512.0).to(tl.int32)  # below 2^-6: a multiple of 2^-9, exponent field 0
    norm = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)  # rebias 127 -> 7, top 3 mantissa bits
    return tl.where(a < 0.015625, sub, norm) | (((bits >> 31) & 1) << 7)


@triton.jit
def _e2m1_code(v):
    """`nearest_e2m1_code(v.clamp(-6, 6))`: 0..15, sign in bit 3 only for a non-zero magnitude."""
    r = _round_e2m1(v)
    a = tl.abs(r)
    bits = a.to(tl.int32, bitcast=True)
    norm = ((((bits >> 23) & 0xFF) - 126) << 1) | ((bits >> 22) & 1)  # 1.0 -> 2, 1.5 -> 3, ..., 6.0 -> 7
    return tl.where(a < 1.0, (a * 2.0).to(tl.int32), norm) | tl.where(r < 0, 8, 0)


@triton.jit
def encode_pairs(row, ev, od, col, ok, blk, blk_ok, DIM, CODEC: tl.constexpr):
    """A row's bytes in the pool codec CODEC (codecs.FP8_UE8M0, FP4_E4M3, FP4_UE8M0), `Codec.encode`'s op for op,
    written at `row` (uint8 pointer): the values held as [NB, HB] tiles of the even (`ev`, columns `col`) and odd
    members of each block of 2 * HB values (the codec's block); `ok` the values to write, `blk` the block ids,
    `blk_ok` the scale bytes to write. (kernels/step/cache.py says why these bits.)"""
    amax = tl.maximum(tl.max(tl.abs(ev), axis=1), tl.max(tl.abs(od), axis=1))
    if CODEC == 0:
        scale = _ue8m0(tl.math.div_rn(tl.maximum(amax, 1e-4), tl.zeros_like(amax) + 448.0))
        sbyte = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
    elif CODEC == 1:
        scale = _round_e4m3(tl.math.div_rn(tl.maximum(amax, FP4_E4M3_FLOOR), tl.zeros_like(amax) + 6.0))
        sbyte = _e4m3_code(scale)
    else:
        scale = _ue8m0(tl.math.div_rn(tl.maximum(amax, FP4_UE8M0_FLOOR), tl.zeros_like(amax) + 6.0))
        sbyte = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
    s = tl.broadcast_to(scale[:, None], ev.shape)
    if CODEC == 0:
        tl.store(row + col, _e4m3_code(_round_e4m3(tl.math.div_rn(ev, s))).to(tl.uint8), mask=ok)
        tl.store(row + col + 1, _e4m3_code(_round_e4m3(tl.math.div_rn(od, s))).to(tl.uint8), mask=ok)
        scale_row = row + DIM
    else:
        pair = _e2m1_code(tl.math.div_rn(ev, s)) | (_e2m1_code(tl.math.div_rn(od, s)) << 4)
        tl.store(row + col // 2, pair.to(tl.uint8), mask=ok)
        scale_row = row + DIM // 2
    tl.store(scale_row + blk, sbyte.to(tl.uint8), mask=blk_ok)


@triton.jit
def norm_pairs(ev, od, w_ptr, col, live_e, live_o, D, eps, OUT: tl.constexpr):
    """RMSNorm of a vector held as its even and odd members ([NB, HB] tiles at columns col and col + 1): the sum
    of squares in this fixed tree, rsqrt in fp64 rounded once, times the weight, each rounded to OUT. Shared with
    the compressor's kernel (kernels/step/compress.py), so the two norms are one reduction tree."""
    sq = tl.sum(tl.sum(ev * ev + od * od, axis=1), axis=0)
    ms = tl.math.div_rn(sq, (D + 0.0).to(tl.float32)) + eps
    r = (1.0 / tl.sqrt(ms.to(tl.float64))).to(tl.float32)
    we = tl.load(w_ptr + col, mask=live_e, other=0.0).to(tl.float32)
    wo = tl.load(w_ptr + col + 1, mask=live_o, other=0.0).to(tl.float32)
    return _cast((ev * r) * we, OUT), _cast((od * r) * wo, OUT)


@triton.jit(do_not_specialize=["live_rows"])
def _rowops_kernel(x_ptr, stride_xr, stride_xh, out_ptr, w_ptr, pos_ptr, freq_ptr, eps, D, live_rows,
                   store_ptr, dest_ptr, row_bytes,
                   NORM: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr, INVERSE: tl.constexpr,
                   QUANT: tl.constexpr, NB: tl.constexpr, HB: tl.constexpr, OUT: tl.constexpr,
                   STORE: tl.constexpr = -1, PDL: tl.constexpr = False):
    """Program (row, head): the head vector x[row, head, :D] as two [NB, HB] tiles (block b's values 2k and 2k + 1),
    through [norm] -> [rope] -> [quantiser], each stage rounded to OUT; written to out [rows, heads, D], and (STORE,
    a codec id; one head) encoded into row dest[row] of the store (none for dest < 0). Rows from `live_rows` on (a
    bucket's padding) read nothing, write +0.0 and store nothing."""
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    nh = tl.num_programs(1)
    b = tl.arange(0, NB)[:, None]
    k = tl.arange(0, HB)[None, :]
    col = b * (2 * HB) + 2 * k  # the even member's column
    live = col < D
    dst = out_ptr + (row * nh + head) * D + col
    if row >= live_rows:
        zero = tl.zeros((NB, HB), dtype=out_ptr.dtype.element_ty)
        tl.store(dst, zero, mask=live)
        tl.store(dst + 1, zero, mask=live)
    else:
        ev, od = _rowops_row(x_ptr, stride_xr, stride_xh, dst, w_ptr, pos_ptr, freq_ptr, eps, D, row, head, col,
                             live, NORM, ROPE, R, INVERSE, QUANT, OUT)
        if STORE >= 0:
            d = tl.load(dest_ptr + row).to(tl.int64)
            keep = d >= 0
            blk = tl.arange(0, NB)
            encode_pairs(store_ptr + tl.maximum(d, 0) * row_bytes, ev, od, col, live & keep, blk,
                         (blk < D // (2 * HB)) & keep, D, STORE)


@triton.jit
def rope_pairs(ev, od, pos, freq_ptr, col, live, D, R: tl.constexpr, INVERSE: tl.constexpr, OUT: tl.constexpr):
    """The pairs (ev, od) at even columns `col` of a D-dim vector (fp32 holding OUT values) at position `pos`
    rotated where they lie in the last R dims, each result rounded to OUT; the others passed through. Shared with
    the attention combine (its inverse RoPE of o), so both give these bits; their launches pass
    enable_fp_fusion=False (module docstring)."""
    rot, c, s = rope_trig(pos, freq_ptr, col, live, D, R, INVERSE)
    return rope_apply(ev, od, rot, c, s, OUT)


@triton.jit
def rope_trig(pos, freq_ptr, col, live, D, R: tl.constexpr, INVERSE: tl.constexpr):
    """`rope_pairs`' (rotated?, cos, sin) at even columns `col`: the position's only (a row's heads share it)."""
    j = col // 2 - (D - R) // 2  # frequency index of the pair; < 0 outside the rotated tail
    rot = live & (j >= 0)
    f = tl.load(freq_ptr + j, mask=rot, other=0.0)
    ang = (pos.to(tl.float32) * f).to(tl.float64)
    c = tl.cos(ang).to(tl.float32)
    s = tl.sin(ang).to(tl.float32)
    if INVERSE:
        s = _neg(s)
    return rot, c, s


@triton.jit
def rope_apply(ev, od, rot, c, s, OUT: tl.constexpr):
    """`rope_pairs`' rotation with `rope_trig`'s cos and sin, each result rounded to OUT."""
    ra = _cast(ev * c - od * s, OUT)
    rb = _cast(ev * s + od * c, OUT)
    return tl.where(rot, ra, ev), tl.where(rot, rb, od)


@triton.jit(do_not_specialize=["live_rows"])
def _rowops_heads_kernel(x_ptr, stride_xr, stride_xh, out_ptr, pos_ptr, freq_ptr, D, H, live_rows,
                         ROPE: tl.constexpr, R: tl.constexpr, INVERSE: tl.constexpr, QUANT: tl.constexpr,
                         NB: tl.constexpr, HB: tl.constexpr, OUT: tl.constexpr, HP: tl.constexpr,
                         PDL: tl.constexpr = False):
    """`_rowops_kernel` with no norm and no store (RoPE and / or a quantiser) for HP heads of one row: the cos and
    sin made once for the row, not once a head (fp64, the old launch's main cost at prefill). Each head is the same
    [NB, HB] tiles through the same per-element operations and block maxima, so the old launch's bits."""
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    head0 = tl.program_id(1) * HP
    b = tl.arange(0, NB)[:, None]
    k = tl.arange(0, HB)[None, :]
    col = b * (2 * HB) + 2 * k  # the even member's column
    live = col < D
    if row >= live_rows:
        zero = tl.zeros((NB, HB), dtype=out_ptr.dtype.element_ty)
        for i in tl.static_range(HP):
            dst = out_ptr + (row * H + head0 + i) * D + col
            tl.store(dst, zero, mask=live & (head0 + i < H))
            tl.store(dst + 1, zero, mask=live & (head0 + i < H))
    else:
        if ROPE:
            rot, c, s = rope_trig(tl.load(pos_ptr + row), freq_ptr, col, live, D, R, INVERSE)
        for i in tl.static_range(HP):
            ok = live & (head0 + i < H)
            src = x_ptr + row * stride_xr + (head0 + i) * stride_xh + col
            ev = _cast(tl.load(src, mask=ok, other=0.0).to(tl.float32), OUT)
            od = _cast(tl.load(src + 1, mask=ok, other=0.0).to(tl.float32), OUT)
            if ROPE:
                ev, od = rope_apply(ev, od, rot, c, s, OUT)
            if QUANT != 0:
                ev, od = _fake_quant(ev, od, QUANT)
                ev = _cast(ev, OUT)
                od = _cast(od, OUT)
            dst = out_ptr + (row * H + head0 + i) * D + col
            tl.store(dst, ev.to(dst.dtype.element_ty), mask=ok)
            tl.store(dst + 1, od.to(dst.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["live_rows"])
def _rope_tail_kernel(x_ptr, stride_xr, stride_xh, pos_ptr, freq_ptr, D, H, live_rows, R: tl.constexpr,
                      HP: tl.constexpr, INVERSE: tl.constexpr, OUT: tl.constexpr, ZB: tl.constexpr,
                      PDL: tl.constexpr = False):
    """`rope_rows(inplace=True)`: program (row, HP heads) rotates the last R dims of its heads in x, cos and sin made
    once for the row; the other dims stay (with no norm, no quantiser and x's dtype the old launch writes them back
    unchanged: `_cast` of a value of OUT is itself). Each rotated value is `rope_pairs`' arithmetic (per element,
    unfused): its bits. A padding row (>= live_rows) is zeroed whole, as `_rowops_kernel` writes it."""
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HP + tl.arange(0, HP)
    hok = (heads < H)[:, None]
    base = x_ptr + row * stride_xr + heads.to(tl.int64)[:, None] * stride_xh
    if row >= live_rows:
        zero = tl.zeros((HP, ZB), dtype=x_ptr.dtype.element_ty)
        for c0 in range(0, D, ZB):
            c = c0 + tl.arange(0, ZB)[None, :]
            tl.store(base + c, zero, mask=hok & (c < D))
    else:
        j = tl.arange(0, R // 2)
        f = tl.load(freq_ptr + j)
        ang = (tl.load(pos_ptr + row).to(tl.float32) * f).to(tl.float64)
        c = tl.cos(ang).to(tl.float32)[None, :]
        s = tl.sin(ang).to(tl.float32)
        if INVERSE:
            s = _neg(s)
        s = s[None, :]
        at = base + (D - R + 2 * j)[None, :]
        ev = tl.load(at, mask=hok, other=0.0).to(tl.float32)
        od = tl.load(at + 1, mask=hok, other=0.0).to(tl.float32)
        tl.store(at, _cast(ev * c - od * s, OUT).to(x_ptr.dtype.element_ty), mask=hok)
        tl.store(at + 1, _cast(ev * s + od * c, OUT).to(x_ptr.dtype.element_ty), mask=hok)


@triton.jit
def _rowops_row(x_ptr, stride_xr, stride_xh, dst, w_ptr, pos_ptr, freq_ptr, eps, D, row, head, col, live,
                NORM: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr, INVERSE: tl.constexpr, QUANT: tl.constexpr,
                OUT: tl.constexpr):
    src = x_ptr + row * stride_xr + head * stride_xh + col
    ev = tl.load(src, mask=live, other=0.0).to(tl.float32)
    od = tl.load(src + 1, mask=live, other=0.0).to(tl.float32)
    if NORM:
        ev, od = norm_pairs(ev, od, w_ptr, col, live, live, D, eps, OUT)
    else:
        ev = _cast(ev, OUT)
        od = _cast(od, OUT)
    if ROPE:
        ev, od = rope_pairs(ev, od, tl.load(pos_ptr + row), freq_ptr, col, live, D, R, INVERSE, OUT)
    if QUANT != 0:
        ev, od = _fake_quant(ev, od, QUANT)
        ev = _cast(ev, OUT)
        od = _cast(od, OUT)
    tl.store(dst, ev.to(dst.dtype.element_ty), mask=live)
    tl.store(dst + 1, od.to(dst.dtype.element_ty), mask=live)
    return ev, od


def encodes(codec) -> bool:
    """Whether the row ops can store into a pool of this codec (`store=`): the quantised ones."""
    return CODEC_IDS.get(codec.name) in CODEC_BLOCK


def _store_args(store, x: torch.Tensor, blk: int, fixed_tile: bool, live: int) -> tuple:
    """(store bytes, dest, row_bytes, codec id, tile block) of a launcher's `store=(store, dest, codec)`: the
    window KV's ring (FP8 / ue8m0 per 32), or a compressed source's entries / index keys (FP4)."""
    st, dest, codec = store
    cid = codec_id(codec)
    if cid not in CODEC_BLOCK:
        raise ValueError(f"store: the row ops encode the quantised codecs only, not {codec.name!r}")
    if x.dim() == 3 and x.shape[1] != 1:
        raise ValueError(f"store: one vector a row (a head), got {x.shape[1]} heads")
    if codec.dim != x.shape[-1]:
        raise ValueError(f"store: codec {codec.name!r} holds {codec.dim} values, the rows have {x.shape[-1]}")
    if fixed_tile and blk != CODEC_BLOCK[cid]:
        raise ValueError(f"store: the codec's blocks of {CODEC_BLOCK[cid]} are not the row ops' {blk}")
    if not st.is_contiguous() or (st.numel() * st.element_size()) % codec.row_bytes:
        raise ValueError(f"store must be contiguous whole rows of {codec.row_bytes} bytes")
    if dest.dim() != 1 or dest.dtype not in (torch.int32, torch.int64) or dest.shape[0] < live:
        raise ValueError(f"store: dest must be int32/int64 [>= {live}], got {dest.dtype} {list(dest.shape)}")
    if st.device != x.device or dest.device != x.device:
        raise ValueError(f"store, dest and x must share a device, got {st.device}, {dest.device}, {x.device}")
    return st.view(torch.uint8).view(-1), dest.contiguous(), codec.row_bytes, cid, CODEC_BLOCK[cid]


def _launch(x: torch.Tensor, *, weight=None, eps: float = 0.0, positions=None, inv_freq=None, rope_dim: int = 0,
            inverse: bool = False, quant: str | None = None, block: int | None = None, out_dtype=None, rows=None,
            store=None, inplace: bool = False, heads_per_program: int | None = None):
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [rows, dim] or [rows, heads, dim], got {list(x.shape)}")
    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {list(QUANT_MODES)}, got {quant!r}")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in _DTYPES or x.dtype not in _DTYPES:
        raise ValueError(f"dtypes must be bf16 / fp16 / fp32, got {x.dtype} -> {out_dtype}")
    B, D = x.shape[0], x.shape[-1]
    H = x.shape[1] if x.dim() == 3 else 1
    if D % 2:
        raise ValueError(f"head dim must be even, got {D}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    stride_h = x.stride(1) if x.dim() == 3 else 0
    dev = x.device
    if weight is not None:
        if weight.shape != (D,):
            raise ValueError(f"weight must be [{D}], got {list(weight.shape)}")
        weight = weight.contiguous()
    rope = positions is not None
    if rope:
        if not (0 < rope_dim <= D and rope_dim % 2 == 0):
            raise ValueError(f"rope_dim must be even and in (0, {D}], got {rope_dim}")
        if positions.shape != (B,):
            raise ValueError(f"positions must be [{B}], got {list(positions.shape)}")
        if inv_freq is None or inv_freq.shape != (rope_dim // 2,):
            raise ValueError(f"inv_freq must be [{rope_dim // 2}]")
        positions = positions.to(dev).contiguous()
        inv_freq = inv_freq.to(device=dev, dtype=torch.float32).contiguous()
    mode = QUANT_MODES[quant]
    blk = TILE
    if quant is not None:
        blk = block or DEFAULT_BLOCK[quant]
        if blk < 2 or blk & (blk - 1):
            raise ValueError(f"block must be a power of two, got {blk}")
        if D % blk:
            mode = 0  # the reference skips a quantiser whose block does not divide the vector (MODEL.md §15b.6)
    live = _live_rows(rows, B)
    if inplace:
        return _rope_in_place(x, positions, inv_freq, rope_dim, inverse, live, B, H, D, stride_h) if B * H else x
    sargs, scid = (x, x, 0), -1
    if store is not None:
        # the tile block fixes the norm's reduction tree and the quantiser's blocks; without either it is free
        *sargs, scid, blk = _store_args(store, x, blk, weight is not None or mode != 0, live)
    out = torch.empty(x.shape, dtype=out_dtype, device=dev)
    if B == 0 or H == 0:
        return out
    nb = triton.next_power_of_2(triton.cdiv(D, blk))
    hb = blk // 2
    dummy = x
    hp = heads_per_program or min(triton.next_power_of_2(H), 8)
    if weight is None and store is None and hp > 1:
        # several heads a program (no norm: its reduction tree stays the one-head launch's): the same bits
        _rowops_heads_kernel[(B, triton.cdiv(H, hp))](
            x, x.stride(0), stride_h, out, positions if rope else dummy, inv_freq if rope else dummy, D, H, live,
            ROPE=rope, R=rope_dim if rope else 0, INVERSE=bool(inverse), QUANT=mode, NB=nb, HB=hb,
            OUT=_DTYPES[out_dtype], HP=hp, num_warps=1 if nb * hb <= 256 else 4, enable_fp_fusion=False,
            **pdl_launch(dev))
        return out
    _rowops_kernel[(B, H)](  # the padding rows' programs write zeros: no memset launch beside the kernel
        x, x.stride(0), stride_h, out, weight if weight is not None else dummy,
        positions if rope else dummy, inv_freq if rope else dummy, float(eps), D, live, *sargs,
        NORM=weight is not None, ROPE=rope, R=rope_dim if rope else 0, INVERSE=bool(inverse), QUANT=mode,
        NB=nb, HB=hb, OUT=_DTYPES[out_dtype], STORE=scid, num_warps=1 if nb * hb <= 256 else 4,
        enable_fp_fusion=False,
        **pdl_launch(dev))
    return out


def _rope_in_place(x, positions, inv_freq, rope_dim, inverse, live, B, H, D, stride_h):
    """`_launch`'s in-place RoPE (`_rope_tail_kernel`): x itself (made contiguous first if its last dim is not)."""
    hp = min(triton.next_power_of_2(H), 8)  # the heads are independent, each element's arithmetic its own
    _rope_tail_kernel[(B, triton.cdiv(H, hp))](
        x, x.stride(0), stride_h, positions, inv_freq, D, H, live, R=rope_dim, HP=hp, INVERSE=bool(inverse),
        OUT=_DTYPES[x.dtype], ZB=128, num_warps=1 if hp * rope_dim <= 256 else 2, enable_fp_fusion=False,
        **pdl_launch(x.device))
    return x


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None, *,
                  rows: int | None = None):
    """`rms_norm(x, weight, eps)` for x [rows, n] (or [rows, heads, n], each head normalised on its own), one
    program per row (and head). Replaces the q_norm (qa -> qr, n = q_lora_rank) and the compressor's latent norms.
    `rows` (every launcher): programs for the first `rows` rows only, the others' output zero (a bucket's padding
    rows cost nothing; None: all)."""
    return _launch(x, weight=weight, eps=eps, out_dtype=out_dtype, rows=rows)


def rope_rows(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int, *,
              inverse: bool = False, quant: str | None = None, block: int | None = None,
              out_dtype: torch.dtype | None = None, rows: int | None = None, store=None, inplace: bool = False):
    """`quant(RopeTable(inv_freq).apply(x.to(out_dtype), positions, rope_dim, inverse))` for x [rows, heads, dim]
    (or [rows, dim]), positions [rows] (any integer dtype), inv_freq the table's fp32 [rope_dim / 2]; quant None,
    "fp8_ue8m0", "fp4_ue8m0" or "fp4_e4m3" (`block` defaults to 32 / 32 / 16). Replaces the q RoPE, the output's
    inverse RoPE (x the fp32 o, out_dtype the activations'), the index queries' RoPE + FP4 and the compressed
    entries' RoPE + FP4 (e4m3 scales / 16). `store=(store, dest, codec)` (one vector a row, a quantised pool codec
    over its whole dim): also row dest[r] of the store := `codec.encode(out[r])` (`cache.store_rows`' bytes; dest
    < 0 writes nothing), in the same launch. `inplace` (no quant, no store, out_dtype None or x's, rope_dim / 2 a
    power of two): the same values written into x (returned; a copy first if its last dim is strided) by a launch
    that reads and writes the rotated tail only (the prefill queries: 1/8 of the bytes at head_dim 512)."""
    if inplace and (quant is not None or store is not None or out_dtype not in (None, x.dtype)
                    or rope_dim < 2 or rope_dim & (rope_dim - 1)):
        raise ValueError("rope_rows(inplace=True) takes no quant, no store, x's dtype and a power-of-two rope_dim")
    return _launch(x, positions=positions, inv_freq=inv_freq, rope_dim=rope_dim, inverse=inverse, quant=quant,
                   block=block, out_dtype=out_dtype, rows=rows, store=store, inplace=inplace)


def norm_rope_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                   inv_freq: torch.Tensor, rope_dim: int, *, quant: str | None = None, block: int | None = None,
                   out_dtype: torch.dtype | None = None, rows: int | None = None, store=None):
    """`quant(rope(rms_norm(x, weight, eps)))` over each row's (and head's) last dim, in one launch. Replaces the
    window KV (kv_norm -> RoPE -> FP8 ue8m0 / 32) and the index keys (k_norm -> RoPE -> FP4 ue8m0 / 32).
    `store`: as `rope_rows` (the window KV written into its ring row by the launch that makes it)."""
    return _launch(x, weight=weight, eps=eps, positions=positions, inv_freq=inv_freq, rope_dim=rope_dim,
                   quant=quant, block=block, out_dtype=out_dtype, rows=rows, store=store)


def fake_quant_rows(x: torch.Tensor, quant: str, block: int | None = None, out_dtype: torch.dtype | None = None, *,
                    rows: int | None = None):
    """`model.quant`'s quantiser `quant` on x.to(out_dtype) [rows, heads, dim] (or [rows, dim]), blocks along the
    last dim: for a call site that keeps its RoPE elsewhere (the index queries' FP4 in `attend` today)."""
    if quant is None:
        raise ValueError("fake_quant_rows needs a quantiser")
    return _launch(x, quant=quant, block=block, out_dtype=out_dtype, rows=rows)


__all__ = ["rms_norm_rows", "rope_rows", "norm_rope_rows", "fake_quant_rows", "encodes", "QUANT_MODES",
           "DEFAULT_BLOCK"]
