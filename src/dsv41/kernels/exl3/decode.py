"""Triton building blocks shared by the EXL3 kernels: in-register trellis decode and the 128-point rotations.

Format (spec/EXL3-ENGRAM.md §1-2): a 16x16 tile is `8K` uint32 words (the int16 trellis words read in pairs as
little-endian uint32); stream position p of a tile is decoded from the 16-bit window that ends at bit (p+1)K of
the MSB-first stream (tail-biting), and holds tile element (r, c) of the tensor-core permutation (§1.4).

Decode strategy here ("gather decode"): every element of a decoded [rows, 128] block knows, from its (row, col)
alone, which two stream words hold its window and how far to shift. Those offsets do not depend on the tile, so
they are computed once per program; inside the k loop each weight is two cached word loads, one 64-bit shift,
the codebook arithmetic and one fp16 rounding. No table lookups, no repack of the stored trellis.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# MUL1 affine map constants: fp16 bit patterns 0x1EEE and 0xC931 (§2.1), exact in fp32.
MUL1_SCALE = tl.constexpr(0.00676727294921875)
MUL1_BIAS = tl.constexpr(-10.3828125)
INV_SQRT128 = tl.constexpr(0.08838834764831845)


_HADAMARD_CACHE: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def hadamard_signs(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Unscaled 128x128 Sylvester Hadamard (entries ±1, exact in fp16/bf16), cached per device and dtype."""
    key = (str(device), dtype)
    h = _HADAMARD_CACHE.get(key)
    if h is None:
        idx = torch.arange(128)
        both = idx[:, None] & idx[None, :]
        parity = torch.zeros_like(both)
        for bit in range(7):
            parity ^= (both >> bit) & 1
        h = (1 - 2 * parity).to(dtype).to(device).contiguous()
        _HADAMARD_CACHE[key] = h
    return h


@triton.jit
def tile_word_offsets(rows, cols, tiles_n, K: tl.constexpr):
    """Word offsets (int32) of the two stream words holding each element's window, and the shift.

    rows: [R, 1] input index inside the decoded block (R a multiple of 16); cols: [1, C] output index inside it.
    Offsets are relative to the block's first tile; `tiles_n` is n/16 (tiles per tile row).
    """
    tr = rows // 16
    r = rows % 16
    tn = cols // 16
    c = cols % 16
    lane = 4 * (c % 8) + (r % 8) // 2
    j = (r % 2) + 2 * (r // 8) + 4 * (c // 8)
    p = 8 * lane + j
    # Window [(p+1)K - 16, (p+1)K) of a 256K-bit ring: the first positions wrap into the stream's end.
    start = ((p + 1) * K + (256 * K - 16)) % (256 * K)
    i0 = start // 32
    i1 = (i0 + 1) % (8 * K)
    tile = tr * tiles_n * (8 * K) + tn * (8 * K)
    shift = 48 - (start % 32)
    return tile + i0, tile + i1, shift.to(tl.uint64)


@triton.jit
def codebook_value(state, CODEBOOK: tl.constexpr, USE_ASM: tl.constexpr):
    """fp16 codebook value of 16-bit states (uint32 tensor), bit-exact with §2.1."""
    if CODEBOOK == 2:
        x = state * tl.full(state.shape, 0x83DCD12D, tl.uint32)
        if USE_ASM:
            # dp4a sums the four bytes straight into the mantissa of fp16 1024.0 (0x6400); one fp16 FMA then
            # does h*scale+bias with a single rounding, as the reference kernel does.
            h = tl.inline_asm_elementwise(
                "{.reg .b32 ones, base; mov.b32 ones, 0x01010101; mov.b32 base, 0x6400;"
                " dp4a.u32.u32 $0, $1, ones, base;}",
                "=r,r",
                [x],
                dtype=tl.uint32,
                is_pure=True,
                pack=1,
            )
            hf = h.to(tl.uint16).to(tl.float16, bitcast=True)
            return tl.fma(hf, tl.full(hf.shape, MUL1_SCALE, tl.float16), tl.full(hf.shape, MUL1_BIAS, tl.float16))
        # Byte sum in two steps: pairwise bytes into 16-bit lanes, then both lanes added by one multiply.
        y = (x & 0x00FF00FF) + ((x >> 8) & 0x00FF00FF)
        total = (y * tl.full(y.shape, 0x00010001, tl.uint32)) >> 16
        # 1024 + total as fp32 bits (exponent of 1024, total in the top mantissa bits): no int->float convert.
        hf = (total * 8192 + 0x44800000).to(tl.float32, bitcast=True)
        # h*scale+bias is exact in fp32 (22 significant bits), so one cast is the single fp16 rounding.
        return (hf * MUL1_SCALE + MUL1_BIAS).to(tl.float16)
    else:
        if CODEBOOK == 0:
            x = state * tl.full(state.shape, 89226354, tl.uint32) + tl.full(state.shape, 64248484, tl.uint32)
        else:
            x = state * tl.full(state.shape, 0xCBAC1FED, tl.uint32)
        x = (x & tl.full(state.shape, 0x8FFF8FFF, tl.uint32)) ^ tl.full(state.shape, 0x3B603B60, tl.uint32)
        lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        # Both halves lie in ±[0.125, 2): their fp32 sum is exact, one cast = one fp16 addition.
        return (lo + hi).to(tl.float16)


@triton.jit
def decode_words(w0, w1, shift, CODEBOOK: tl.constexpr, USE_ASM: tl.constexpr):
    """Values from the two stream words (int32 as loaded) around each window and its shift (uint64)."""
    pair = (w0.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | w1.to(tl.uint32, bitcast=True).to(tl.uint64)
    state = ((pair >> shift) & 0xFFFF).to(tl.uint32)
    return codebook_value(state, CODEBOOK, USE_ASM)


@triton.jit
def hadamard_tile(had_f16_ptr):
    """The [128, 128] ±1 matrix H (fp16) of `hadamard_signs`."""
    idx = tl.arange(0, 128)
    return tl.load(had_f16_ptr + idx[:, None] * 128 + idx[None, :])


@triton.jit
def rotate_rows_fp32(acc, had_f16_ptr):
    """acc [M, 128] fp32 -> acc · H/sqrt(128) with fp32 accuracy, on tensor cores.

    Each row is scaled by a power of two into [1, 2) (exact), split exactly into three fp16 parts, and each
    part multiplied by the ±1 matrix H: every product is exact and only the fp32 accumulation rounds.
    Each row depends on its own values only (row invariance).
    """
    return rotate_rows_fp32_with(acc, hadamard_tile(had_f16_ptr), 3)


@triton.jit
def rotate_rows_fp32_with(acc, h, PARTS: tl.constexpr):
    """`rotate_rows_fp32` with H already loaded (h [128, 128] fp16). PARTS 3: its arithmetic; 2 drops the third fp16
    part (22 of the row-scaled values' bits: other bits, a relative error ~2^-22) for a third less work."""
    row_max = tl.max(tl.abs(acc), axis=1)
    # Biased exponent E of the row maximum: scale 2^(127-E) and back 2^(E-127), both built from bits.
    exponent = tl.minimum((row_max.to(tl.int32, bitcast=True) >> 23) & 0xFF, 253)
    scale = ((254 - exponent) << 23).to(tl.float32, bitcast=True)
    unscale = (exponent << 23).to(tl.float32, bitcast=True)
    scaled = acc * scale[:, None]
    a1 = scaled.to(tl.float16)
    rest = scaled - a1.to(tl.float32)
    a2 = rest.to(tl.float16)
    if PARTS == 3:
        rest = rest - a2.to(tl.float32)
        a3 = rest.to(tl.float16)
        out = tl.dot(a3, h)
        out = tl.dot(a2, h, out)
    else:
        out = tl.dot(a2, h)
    out = tl.dot(a1, h, out)
    return out * (unscale * INV_SQRT128)[:, None]


@triton.jit
def accumulate_kslice(
    acc,
    x_ptr,
    x_row_offsets,
    row_mask,
    suh_ptr,
    trellis_ptr,
    tiles_n,
    had_f16_ptr,
    kb_lo,
    kb_hi,
    K: tl.constexpr,
    CODEBOOK: tl.constexpr,
    BK: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """acc[BM, 128] += rot(x ⊙ suh)[:, k-slice] @ W_q[k-slice, 128-column block], k-slice = 128-blocks [lo, hi).

    x rows are gathered through `x_row_offsets` (element offsets, [BM]); `trellis_ptr` points at the first
    word of the column block's tile in tile row 0 (int32 view). The input rotation is recomputed per program
    (it is a [BM,128]x[128,BK] tensor-core product, small against the decode work) and rounded to fp16 once,
    as in §2.5; the product with the decoded fp16 weights accumulates in fp32.
    """
    cols = tl.arange(0, 128)
    sub_rows = tl.arange(0, BK)
    off0, off1, shift = tile_word_offsets(sub_rows[:, None], cols[None, :], tiles_n, K)
    tile_row_words = tiles_n.to(tl.int64) * (8 * K)
    for kb in range(kb_lo, kb_hi):
        xk = kb * 128 + cols
        x = tl.load(x_ptr + x_row_offsets[:, None] + xk[None, :], mask=row_mask[:, None], other=0.0)
        su = tl.load(suh_ptr + xk).to(tl.float32)
        # fp16 x times fp16 suh: the exact product rounded once, like the reference's fp16 multiply.
        xs = (x.to(tl.float16).to(tl.float32) * su[None, :]).to(tl.float16)
        for sub in tl.static_range(128 // BK):
            h = tl.load(had_f16_ptr + cols[:, None] * 128 + (sub * BK + sub_rows)[None, :])
            xh = (tl.dot(xs, h) * INV_SQRT128).to(tl.float16)
            base = trellis_ptr + (kb * 8 + sub * (BK // 16)) * tile_row_words
            w0 = tl.load(base + off0)
            w1 = tl.load(base + off1)
            w = decode_words(w0, w1, shift, CODEBOOK, USE_ASM)
            acc = tl.dot(xh, w, acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def rotate_input_kernel(x_ptr, suh_ptr, had_f16_ptr, xh_ptr, M, stride_xm, stride_hm):
    """xh = fp16(fp16(x ⊙ suh) · H/sqrt(128)) for a block of 16 rows and one 128-wide input block (§2.5 step 1)."""
    mb = tl.program_id(0)
    kb = tl.program_id(1)
    rows = mb * 16 + tl.arange(0, 16)
    cols = tl.arange(0, 128)
    row_mask = rows < M
    xk = kb * 128 + cols
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + xk[None, :], mask=row_mask[:, None], other=0.0)
    su = tl.load(suh_ptr + xk).to(tl.float32)
    xs = (x.to(tl.float16).to(tl.float32) * su[None, :]).to(tl.float16)
    h = tl.load(had_f16_ptr + cols[:, None] * 128 + cols[None, :])
    xh = (tl.dot(xs, h) * INV_SQRT128).to(tl.float16)
    tl.store(xh_ptr + rows[:, None].to(tl.int64) * stride_hm + xk[None, :], xh, mask=row_mask[:, None])


@triton.jit
def accumulate_kslice_prerotated(
    acc,
    xh_ptr,
    x_row_offsets,
    row_mask,
    trellis_ptr,
    tiles_n,
    kb_lo,
    kb_hi,
    K: tl.constexpr,
    CODEBOOK: tl.constexpr,
    BK: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """accumulate_kslice for an input already rotated (rotate_input_kernel): one dynamic loop over BK-deep slices.

    Nothing but the decode offsets is loop-invariant here, and no sub-block loop is unrolled, so the compiler
    cannot hoist a 128x128 Hadamard tile or several sub-blocks' loads into registers: about half the registers of
    accumulate_kslice (docs/perf/exl3.md, "Numbers behind the code").
    """
    cols = tl.arange(0, 128)
    sub_rows = tl.arange(0, BK)
    off0, off1, shift = tile_word_offsets(sub_rows[:, None], cols[None, :], tiles_n, K)
    slice_words = tiles_n.to(tl.int64) * (8 * K) * (BK // 16)
    for kk in range(kb_lo * (128 // BK), kb_hi * (128 // BK)):
        xh = tl.load(xh_ptr + x_row_offsets[:, None] + (kk * BK + sub_rows)[None, :], mask=row_mask[:, None], other=0.0)
        base = trellis_ptr + kk * slice_words
        w = decode_words(tl.load(base + off0), tl.load(base + off1), shift, CODEBOOK, USE_ASM)
        acc = tl.dot(xh, w, acc)
    return acc
