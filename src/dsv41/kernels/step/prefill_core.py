"""The one-pass attention core of prefill rows (`DSV41_PREFILL_CORE_ONEPASS=1`): one program per (row, head block)
walks all of the row's key slots, read in place through the slot index (`prefill_slots.prefill_slot_index`), and
writes o itself: no key splits, no split scratch, no combine launch.

Why: `prefill_slots.attention_indexed` runs the decode core's split launch (kernels/step/attention.py) with 128-slot
splits, so a 2,048-row chunk at 32 heads of 512 writes rows x 5 splits x heads x hd fp32 = 671 MB of partials that
the combine launch reads back (H100: 1.48 ms split + 0.29 ms combine a layer). A prefill chunk has thousands of
rows, so one program per row (per head block) already fills the GPU: the splits buy no parallelism there, only
traffic, a q load and a partial store per split.

The math is the split kernel's on one split covering every slot, with the combine's epilogue folded in: per
(row t, head h) an online softmax in slot order over blocks of KEY_BLOCK slots, starting from the sink's logit
(m = sink_h, l = 0, acc = 0), each block `attention._online_block` (the same products: q and the softmax weights
cut into bf16 parts so that every tensor-core product is exact, `_split_dot`; the keys' bf16 values one part),
each block's keys and live flags `attention._indexed_block` (dead slot -1: not read, weight exactly 0; compiled with
bf16 keys of one part, `_raw_keys`: the same values left in bf16, so the tile streams through shared memory into
the tensor cores, ONEPASS_TILING); then
    o = acc / (l + e^(sink_h - m))        (IEEE division; e^0 taken as 1 exactly, as the combine does)
A row with no live slot ends at m = sink, l = 0, acc = 0: zeros.

Its bits are not the split + combine's (the sum over the splits is another order): prefill rows may differ from
decode rows on the fast path (docs/ENGINE.md §4-5). A row's bits depend only on that row: no program reads another
row, the blocks are fixed (constexprs), the loop is in slot order, and slots past a row's own (dead padding, a
longer S) add exact zeros to l and acc and leave m as it is: a block with no live slot has every score -inf, so
m_new == m, alpha = 1 and p = 0 (acc is never -0.0: it starts +0.0 and each block adds a dot started from +0.0).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .attention import MMA, _indexed_block, _online_block, _parts
from .attention_args import core_io
from .pdl import launch as pdl_launch, wait_previous
from .rowops import _DTYPES, _cast, rope_apply, rope_trig

# The one-pass core's tiling for prefill rows: all 32 local heads of a TP=2 rank per program (the keys read once per
# row; 64 heads: two programs a row), 64-slot blocks, 8 warps, `raw` keys. Compiled for sm_90 (Triton 3.7, ptxas -v;
# no GPU needed): with raw keys each block's [64, 512] bf16 tile goes to shared memory by cp.async, pipelined across
# blocks, and into the tensor cores by ldmatrix (47 cp.async, 120 ldmatrix, 59 shared loads a thread; 255 registers,
# 4 B spilled); through fp32 copies (the split kernel's form) it is loaded to registers, widened, and transposed
# through shared memory (8 cp.async for the index only, 16 ldmatrix, 219 shared loads). 16 heads a program spill at
# 4 warps (~700 B), not at 8 (236 registers: the keys then read twice a row); 32-slot blocks do not spill (247) but
# halve the products' width. bench/prefill.py `onepass_tilings` times these. key_block fixes the bits; head_block and
# num_warps do not change a row's math (heads are independent rows of the products).
# pv_parts: the softmax weights' bf16 parts in their product with the keys (3: exact products; 2: to 2^-17 relative,
# one product of the four a block less). H100 at 1428b9e (bench/onepass_sweep.py, 2,048 rows x 640 slots): 1.163 ->
# 1.088 ms a layer, rel L2 to an fp64 reference 2.5e-7 -> 1.8e-6 (the GPU tests' bound 1e-5); prompts +1.2-1.5%.
# `DSV41_PREFILL_PV_PARTS` (2 or 3, read at each launch) overrides it. num_stages None: Triton's default (2 stages
# timed 1.03 ms alone, but no better in the prompts).
ONEPASS_TILING = dict(head_block=32, key_block=64, num_warps=8, raw=True, pv_parts=2, num_stages=None)
PV_PARTS_ENV = "DSV41_PREFILL_PV_PARTS"


@triton.jit
def _raw_keys(t64, j, col, col_ok, S, idx_ptr, sit, w_ptr, swr, n_win, e_ptr, ser, n_rows):
    """`attention._indexed_block`'s slots with the keys left in the rows' dtype (`RAW`: the products' bf16 operand
    straight from the load, no fp32 copy of the block and no fp32 transpose; the same values)."""
    r = tl.load(idx_ptr + t64 * sit + j, mask=j < S, other=-1)
    live = (r >= 0) & (r < n_rows)
    r = tl.where(live, r, 0).to(tl.int64)
    win = r < n_win
    row = tl.where(win, w_ptr + r * swr, e_ptr + tl.where(win, 0, r - n_win) * ser)
    return live, tl.load(row[:, None] + col[None, :], mask=live[:, None] & col_ok[None, :], other=0.0)


@triton.jit(do_not_specialize=["S", "sit", "n_win", "n_rows"])
def _core_onepass_kernel(q_ptr, sqt, sqh, idx_ptr, sit, w_ptr, swr, n_win, e_ptr, ser, n_rows, sink_ptr, out_ptr,
                         pos_ptr, freq_ptr, H, S, HD, scale,
                         HB: tl.constexpr, BS: tl.constexpr, HDP: tl.constexpr, QP: tl.constexpr, KP: tl.constexpr,
                         RAW: tl.constexpr = False, PDL: tl.constexpr = False, PP: tl.constexpr = 3,
                         R: tl.constexpr = 0, OUT: tl.constexpr = tl.float32):
    """One (row, head block): the online softmax over all S slots of the row in blocks of BS, then o. RAW (compiled
    only, keys of one bf16 part): q and the keys reach the products in their loaded bf16 (`_split_dot` takes them
    as their one part), not through fp32 copies. R > 0: o's inverse RoPE over its last R dims at pos[t], o rounded
    to OUT, in the epilogue: `rowops.rope_trig` / `rope_apply` on the pairs, the bits of `rope_rows(o, inverse=True,
    out_dtype=OUT)` on the fp32 o (as the split core's combine does it)."""
    wait_previous(PDL)
    t64 = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    h_ok = h < H
    col = tl.arange(0, HDP)
    col_ok = col < HD
    ok = h_ok[:, None] & col_ok[None, :]
    q = tl.load(q_ptr + t64 * sqt + h[:, None].to(tl.int64) * sqh + col[None, :], mask=ok, other=0.0)
    if not (RAW and MMA and KP == 1 and QP == 1):
        q = q.to(tl.float32)
    sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0)
    m = sink
    l = tl.zeros((HB,), dtype=tl.float32)
    acc = tl.zeros((HB, HDP), dtype=tl.float32)
    for b in range(0, tl.cdiv(S, BS)):
        j = b * BS + tl.arange(0, BS)
        if RAW and MMA and KP == 1:
            live, k = _raw_keys(t64, j, col, col_ok, S, idx_ptr, sit, w_ptr, swr, n_win, e_ptr, ser, n_rows)
        else:
            live, k = _indexed_block(t64, j, col, col_ok, S, idx_ptr, sit, w_ptr, swr, n_win, e_ptr, ser, n_rows)
        m, l, acc = _online_block(q, k, live, m, l, acc, scale, HB, HDP, QP, KP, PP)
    den = l + tl.where(sink == m, 1.0, tl.exp(sink - m))
    o = tl.math.div_rn(acc, tl.zeros((HB, HDP), dtype=tl.float32) + den[:, None])
    if R > 0:  # the pairs (2i, 2i + 1) apart, rotated, put back in place
        ev, od = tl.split(tl.reshape(o, (HB, HDP // 2, 2)))
        pc = 2 * tl.arange(0, HDP // 2)[None, :]  # the even members' columns; cos and sin once for the row's heads
        rot, c, s = rope_trig(tl.load(pos_ptr + t64), freq_ptr, pc, pc < HD, HD, R, True)
        ev, od = rope_apply(_cast(ev, OUT), _cast(od, OUT), rot, c, s, OUT)
        o = tl.reshape(tl.join(ev, od), (HB, HDP))
    tl.store(out_ptr + (t64 * H + h[:, None]) * HD + col[None, :], o.to(out_ptr.dtype.element_ty), mask=ok)


def attention_onepass(q: torch.Tensor, window_rows: torch.Tensor, entries: torch.Tensor | None,
                      slots: torch.Tensor, sink: torch.Tensor, scale: float, *, keys_bf16: bool | None = None,
                      head_block: int = ONEPASS_TILING["head_block"], key_block: int = ONEPASS_TILING["key_block"],
                      num_warps: int = ONEPASS_TILING["num_warps"], num_stages: int | None = ONEPASS_TILING["num_stages"],
                      raw: bool = ONEPASS_TILING["raw"], pv_parts: int | None = None,
                      out: torch.Tensor | None = None, rope: tuple | None = None) -> torch.Tensor:
    """The core of prefill rows in one launch (module docstring), over the slots `attention_indexed` reads (same
    arguments: q [T, H, hd]; window_rows [W, hd], entries [C, hd] or None, one dtype; slots int32 [T, S], r < W a
    window row, W <= r < W + C entry r - W, r < 0 dead). Within fp32 rounding of `attention_indexed` / the
    reference's `_core`, not its bits. `key_block` (a power of two >= 16) fixes the bits; `head_block` (a power of
    two >= 16), `num_warps` and `num_stages` (None: Triton's default) only the speed; `raw` (the kernel's RAW,
    compiled only: the same products from the loaded bf16, perhaps in another operand layout) may change them, as
    `pv_parts` does (2 or 3, None: `PV_PARTS_ENV` or the tiling's; the softmax weights' bf16 parts against bf16
    keys; fp32 keys take 3; compiled only: the interpreter's dots are fp32). `rope` (positions [T], inv_freq
    [R / 2], R, dtype): o inverse-RoPE'd over its last R dims at each row's position and rounded to dtype in the
    same launch, the bits of `rowops.rope_rows(o, positions, inv_freq, R, inverse=True, out_dtype=dtype)` on the
    fp32 o (the fp32 o is never written).
    Returns o [T, H, hd] fp32, or `rope`'s dtype (written into `out` when given: contiguous, that dtype); no host
    sync, no scratch."""
    from .prefill_slots import indexed_sources

    T, H, hd = q.shape
    window_rows, ents, W, C, slots = indexed_sources(q, window_rows, entries, slots)
    if pv_parts is None:
        pv_parts = os.environ.get(PV_PARTS_ENV, "").strip() or ONEPASS_TILING["pv_parts"]
        if str(pv_parts) not in ("2", "3"):
            raise ValueError(f"{PV_PARTS_ENV} must be 2 or 3, got {pv_parts!r}")
        pv_parts = int(pv_parts)
    if pv_parts not in (2, 3):
        raise ValueError(f"pv_parts must be 2 or 3, got {pv_parts}")
    for name, v in (("head_block", head_block), ("key_block", key_block)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    R, pos, freq, dtype = 0, q, q, torch.float32  # (pos, freq: unread placeholders without rope)
    if rope is not None:
        pos, freq, R, dtype = rope
        if not (0 < R <= hd and R % 2 == 0) or pos.shape != (T,) or freq.shape != (R // 2,) or dtype not in _DTYPES:
            raise ValueError(f"rope must be (positions [{T}], inv_freq [R / 2], even R in (0, {hd}], a float dtype), "
                             f"got positions {list(pos.shape)}, inv_freq {list(freq.shape)}, R {R}, {dtype}")
        pos, freq = pos.contiguous(), freq.to(torch.float32).contiguous()
    q, sink, out = core_io(q, sink, out, dtype)
    if T == 0:
        return out
    exact = window_rows.dtype == torch.bfloat16 if keys_bf16 is None else bool(keys_bf16)
    stages = {} if num_stages is None else {"num_stages": num_stages}
    # no contraction, as the split launch (kernels/step/attention.py `_launch`): each operation rounded on its own
    _core_onepass_kernel[(T, triton.cdiv(H, head_block))](
        q, q.stride(0), q.stride(1), slots, slots.stride(0), window_rows, window_rows.stride(0), W, ents,
        ents.stride(0), W + C, sink, out, pos, freq, H, slots.shape[1], hd, float(scale),
        HB=head_block, BS=key_block, HDP=triton.next_power_of_2(max(hd, 16)), QP=_parts(q.dtype == torch.bfloat16),
        KP=_parts(exact), RAW=bool(raw), PP=pv_parts if exact else 3, R=R, OUT=_DTYPES[dtype], num_warps=num_warps,
        enable_fp_fusion=False, **stages, **pdl_launch(q.device))
    return out
