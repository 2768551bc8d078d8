"""The combine of the attention core's split launch (kernels/step/attention.py): each (row, head)'s splits merged in
split order, as its own launch (`_core_combine_kernel`, optionally with o's inverse RoPE) or by the split launch's
last arriver (`_combine_heads`, DSV41_ATTN_FOLD=1): the same operations in the same order, so the same bits."""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import wait_previous
from .rowops import _cast, rope_pairs


@triton.jit(do_not_specialize=["live_rows"])
def _core_combine_kernel(m_ptr, l_ptr, acc_ptr, sink_ptr, out_ptr, pos_ptr, freq_ptr, H, HD, live_rows,
                         NS: tl.constexpr, HDP: tl.constexpr, R: tl.constexpr = 0, OUT: tl.constexpr = tl.float32,
                         PDL: tl.constexpr = False):
    """(row t, head h): the NS splits combined in split order. Both loops unrolled (NS a constexpr), so their loads
    are in flight together: a loop waited for each split's loads in turn (20 splits: 13 µs at one row). R > 0:
    o's inverse RoPE over its last R dims at pos[t] in the same program, o rounded to OUT (`rowops.rope_pairs`:
    the bits of `rope_rows(o, inverse=True, out_dtype=OUT)`); rows t >= live_rows (a bucket's padding) read
    nothing and store zeros, as `rope_rows(rows=)` does."""
    wait_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    live = t < live_rows
    if R > 0:  # the even columns; the odd ones at col + 1: each pair in the program that rotates it
        col = 2 * tl.arange(0, HDP // 2)
    else:
        col = tl.arange(0, HDP)
    col_ok = col < HD
    sink = tl.load(sink_ptr + h)
    big = sink
    for j in tl.static_range(NS):
        big = tl.maximum(big, tl.load(m_ptr + (t * NS + j) * H + h, mask=live, other=0.0))
    den = tl.where(sink == big, 1.0, tl.exp(sink - big))
    num = tl.zeros(col.shape, dtype=tl.float32)
    odd = tl.zeros(col.shape, dtype=tl.float32)
    for j in tl.static_range(NS):
        at = (t * NS + j) * H + h
        mj = tl.load(m_ptr + at, mask=live, other=0.0)
        w = tl.where(mj == big, 1.0, tl.exp(mj - big))
        den = den + tl.load(l_ptr + at, mask=live, other=0.0) * w
        num = num + tl.load(acc_ptr + at * HD + col, mask=col_ok & live, other=0.0) * w
        if R > 0:
            odd = odd + tl.load(acc_ptr + at * HD + col + 1, mask=col_ok & live, other=0.0) * w
    out = tl.math.div_rn(num, tl.zeros(col.shape, dtype=tl.float32) + den)
    dst = out_ptr + (t * H + h) * HD + col
    if R > 0:
        ev, od = rope_pairs(_cast(out, OUT), _cast(tl.math.div_rn(odd, tl.zeros(col.shape, dtype=tl.float32) + den),
                                                   OUT), tl.load(pos_ptr + t, mask=live, other=0), freq_ptr, col,
                            col_ok & live, HD, R, True, OUT)
        tl.store(dst, tl.where(live, ev, 0.0).to(OUT), mask=col_ok)
        tl.store(dst + 1, tl.where(live, od, 0.0).to(OUT), mask=col_ok)
    else:
        tl.store(dst, out, mask=col_ok)


@triton.jit
def _combine_heads(m_ptr, l_ptr, acc_ptr, sink_ptr, out_ptr, t, h, h_ok, col, col_ok, H, HD, n_splits,
                   HB: tl.constexpr, HDP: tl.constexpr):
    """`_core_combine_kernel` for the HB heads h of row t at once, by the last arriver of the split launch: the
    same operations in the same order on each head's values (elementwise over the heads), so the same bits. The
    other programs' partials are read after the acquire of the ticket, past L1 (.cg)."""
    sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0)
    big = sink
    for j in range(n_splits):
        big = tl.maximum(big, tl.load(m_ptr + (t * n_splits + j) * H + h, mask=h_ok, other=0.0, cache_modifier=".cg"))
    den = tl.where(sink == big, 1.0, tl.exp(sink - big))
    num = tl.zeros((HB, HDP), dtype=tl.float32)
    ok = h_ok[:, None] & col_ok[None, :]
    for j in range(n_splits):
        at = (t * n_splits + j) * H + h
        mj = tl.load(m_ptr + at, mask=h_ok, other=0.0, cache_modifier=".cg")
        w = tl.where(mj == big, 1.0, tl.exp(mj - big))
        den = den + tl.load(l_ptr + at, mask=h_ok, other=0.0, cache_modifier=".cg") * w
        a = tl.load(acc_ptr + at[:, None] * HD + col[None, :], mask=ok, other=0.0, cache_modifier=".cg")
        num = num + a * w[:, None]
    out = tl.math.div_rn(num, tl.zeros((HB, HDP), dtype=tl.float32) + den[:, None])
    tl.store(out_ptr + (t * H + h[:, None]) * HD + col[None, :], out, mask=ok)
