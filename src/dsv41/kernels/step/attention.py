"""The attention core of every row: one softmax per (row, head) over the row's key slots, with the sink.

Reference: `dsv41.model.attention.Attention._core` (MODEL.md §7.6). Per row t and head h, over the key slots
keys[t] [S, hd] (window ring rows, then the selected compressed entries; K = V, one latent shared by every head)
that ok[t] marks live: s_j = (q[t, h] . k_j) * hd^-1/2, and
    o[t, h] = sum_j e^(s_j - m) k_j / (sum_j e^(s_j - m) + e^(sink_h - m)),
the sink logit unscaled and in the denominator only; a row with no live slot gives zeros. fp32 throughout (the
reference rounds exp and the log-sum-exp through fp64; here they are fp32: the difference is fp32 rounding).

The split launch: one program per (row, block of HEAD_BLOCK heads, key split of SPLIT_KEYS slots) runs an online softmax
over its split in blocks of KEY_BLOCK slots, in slot order, starting from the sink's logit (m = sink_h, l = 0), and
writes (m, l, acc). Dead slots are not read (zeros), score -inf, weight exactly 0; a block with no live slot leaves
(m, l, acc) bit for bit as they were. The combine launch: one program per (row, head) combines the splits in split
order with the sink term, then divides (IEEE division).

The combine can be folded into the split launch (`DSV41_ATTN_FOLD=1`; why: one launch fewer per layer, 40 a
decode step), as the mHC sites do (kernels/step/mhc.py): each program, its partials stored, takes a ticket on the
arrival counter of its unit (row, head block) (acq_rel atomic add, no float atomics); the one that draws the last
ticket resets the counter to 0 (the next launch or graph replay finds it so) and runs `_combine_heads`, the
combine's operations in its order, elementwise over the block's heads, on the partials read after the ticket's
acquire. Any program may be last (on the GPU; in the interpreter programs run in order, so it is the last split):
the sum is in split order either way, so the bits are those of the two-launch path. The counters (int32, per
device, zero between launches) are mhc's `_COUNTERS` under "attention": regrown by allocating, kept alive by the
CUDA graphs that hold the old ones (runtime/graphs.py `_kernel_buffers`). Two launches on concurrent streams of one
device would share them (as the sites' do): the step runs its kernels on one stream.

It is off by default because it is slower on the H200 (bench/attention_fold_ab.py, attention_pool at the decode
tiling, window 128 + top-k 512, hd 512, PDL on, device time in a CUDA graph): 64 heads 38 -> 66 us at one row,
230 -> 287 us at 16 rows; 32 heads 38 -> 57 us / 133 -> 167 us. The folded combine moves a unit's partials (16
heads x 20 splits x 2 KB = 655 KB) through the one SM of its last arriver, latency-bound at ~25 us, where the
combine launch spreads them over rows x heads programs and, launched early under PDL, costs only 0-6 us (one row)
to 14-24 us (16 rows) over the split launch alone. Prefetching the next split's tile, one load of all the splits'
m, unrolling, or 8 warps did not close the gap (2-4 us at best).

A row's bits depend only on that row: no program reads another row, and the programs' shapes (blocks, splits) are
fixed, so the grid's row count changes nothing. They do not depend on padding S either: extra slots past a row's own
ones (dead) add exact zeros at the end of a block, extra blocks and splits change nothing, so rows of different
sequences padded to one S can share a launch.

`prefill_slots.attention_indexed` (prefill rows, `FastAttention._core_indexed`): the same core with each slot's key row read in
place through an int32 slot index [T, S] into two sources, the window rows [W, hd] (index r < W) and the
compressed entries [C, hd] (index W + entry id), a dead slot -1 (`prefill_slots.prefill_slot_index` builds it
for a segment in one launch). Against the gathered call on keys = cat(window, entries)[index], ok = index >= 0: no
[T, S, hd] copy (1.3 GB at 2,048 rows x 640 slots x 512 bf16), no concatenation of the entries, all the rows in one
launch pair. Bitwise the gathered call for the same reason as `attention_pool` (the constexpr INDEXED picks where a
block's keys and live flags come from; one load of the same row, converted alike) and one more: the live flag is
read as an 8-bit load (the index's sign byte), so the products compile to the gathered core's operand layout
(tests/test_kernels_step_attention_layout.py).

`attention_pool`: the same core with the keys read from the KV pool in place (runtime/kv_pool.py), no gathered
copy. Row b's slots are those `FastAttention._slots` gathers: window slots j = 0..window-1 hold key position
kp = pos[b] - window + 1 + j, live iff kp >= 0, stored in ring row kp % ring_rows of ring slot slot[b]; then (layers
that read a KV source) `width` compressed slots, the top-k ids [B, K] (ascending, -1 first) left-padded with dead
slots to width as `compressed_slots` does: slot c reads ids[b, c - (width - K)] when c >= width - K, and id >= 0
lives in page pages[b, id // per_page], row id % per_page. S = window + width (or window).

Why it is bitwise the gathered call: it is the same `_core_split_kernel` launch (same grid, blocks, splits, S) with
the constexpr POOL choosing only where a block's keys and live flags come from; everything from the scores on is
one code path, and the combine is the same. The keys it loads are the same fp32 values: a live slot's stored
row decoded by `codecs.load_values` is bit for bit `Codec.decode` read back as fp32 (every product is exact in the
compute dtype), a dead slot is 0.0 in both, and a block's window and compressed slots are merged by a select (no
arithmetic on the values, so signed zeros survive). A dead slot's row is never read, and a row's bits still depend
only on that row (its slot, position, ids and pages).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .pdl import launch as pdl_launch, wait_previous

from ..exl3.backend import interpreting
from .codecs import codec_id, load_values
from .attention_args import TILING_ENV  # noqa: F401 - the decode tiling's switch, by FOLD_ENV's side
from .attention_args import check_store, check_tiling, decode_tiling as _tiling, entry_args, int_vector
from .attention_args import core_io, rope_args
from .rowops import _DTYPES
from .attention_combine import _combine_heads, _core_combine_kernel
from .mhc import _COUNTERS

MMA = tl.constexpr(not interpreting())  # the bf16 tensor-core products of `_split_dot` (compiled kernels)
HEAD_BLOCK = 16
KEY_BLOCK = 16
SPLIT_KEYS = 128  # slots per split of a prefill block (8 key blocks): its scratch stays bounded at 256 rows
# Decode and verify rows (attention_pool, and the gathered core of those phases, which must give the same bits):
# smaller splits for parallelism at one row, 4 warps. bench/attention_sweep.py on the H200, 32 heads of 512, 640
# slots: 219 us (1 row) / 499 us (16 rows) with the IEEE FMA dot at 128 / 8 warps; with the bf16 parts 33-40 us /
# 126-145 us at 32-slot splits (docs/perf/decode_step.md).
DECODE_SPLIT_KEYS = 32
DECODE_WARPS = 4  # (the head block: HEAD_BLOCK; another tiling through `decode_tiling`'s TILING_ENV, for GPU A/Bs)
FOLD_ENV = "DSV41_ATTN_FOLD"  # 1 / on: the combine folded into the split launch (`fold_enabled`); default off
# 1 / on: when the window is a whole number of key blocks a pool block reads and decodes one store (the split's
# window-block loop, then its entry-block loop; `aligned_enabled`); on by default since the H100 showed it bitwise
# the gathered core (b4c0e7f; the compiled layout and the interpreter did before: docs/perf/decode_step.md)
ALIGN_ENV = "DSV41_ATTN_ALIGNED"


@triton.jit
def _bf16_parts(x, PARTS: tl.constexpr):
    """fp32 x as bf16 parts: PARTS 1 (x holds bf16 values: itself), 3 (hi + mid + lo == x exactly: each part takes
    the next 8 significant bits, the remainders are exact fp32 differences); 2 takes hi and mid of 3 (lo unused)."""
    hi = x.to(tl.bfloat16)
    if PARTS == 1:
        return hi, hi, hi
    r = x - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _split_dot(a, b, acc, AP: tl.constexpr, BP: tl.constexpr):
    """acc + a @ b for fp32 a, b on the bf16 tensor cores: each operand cut into AP / BP bf16 parts (`_bf16_parts`),
    the part products (each exact in fp32) accumulated in fp32, smallest first; the terms below 2^-16 relative
    (mid x lo, lo x lo) are left out. Against an fp32 FMA dot: the same products up to those terms, another
    summation order (both fp32). (An IEEE fp32 dot of [16, 512] x [512, 16] compiles to FMA loops that spill: 0.2
    ms a call at one row; bench/attention_sweep.py.) Triton's interpreter has no bf16 dot: there the plain fp32
    dot stands in (`MMA` False), the same math up to the summation order."""
    if not MMA:
        return tl.dot(a, b, acc, input_precision="ieee")
    a0, a1, a2 = _bf16_parts(a, AP)
    b0, b1, b2 = _bf16_parts(b, BP)
    if AP == 3 and BP == 3:
        acc = tl.dot(a0, b2, acc)
        acc = tl.dot(a2, b0, acc)
        acc = tl.dot(a1, b1, acc)
    if BP == 3:
        if AP == 1:
            acc = tl.dot(a0, b2, acc)
        acc = tl.dot(a0, b1, acc)
    if AP == 3:
        if BP == 1:
            acc = tl.dot(a2, b0, acc)
        acc = tl.dot(a1, b0, acc)
    if AP == 2:  # hi + mid: a to 16 significant bits (2^-17 relative), for the prefill core's softmax weights
        tl.static_assert(BP == 1, "two parts of a only against one part of b")
        acc = tl.dot(a1, b0, acc)
    return tl.dot(a0, b0, acc)


def _split_scratch(rows: int, S: int, H: int, hd: int, split_keys: int, key_block: int, device):
    """(n_splits, m, l, acc, HDP): the split launch's per-split results, read by the combine launch."""
    if key_block < 16 or split_keys % key_block:
        raise ValueError(f"split_keys {split_keys} must be a multiple of key_block {key_block} (>= 16)")
    n_splits = max(1, triton.cdiv(S, split_keys))
    m = torch.empty(rows, n_splits, H, dtype=torch.float32, device=device)
    acc = torch.empty(rows, n_splits, H, hd, dtype=torch.float32, device=device)
    return n_splits, m, torch.empty_like(m), acc, triton.next_power_of_2(max(hd, 16))


def codecs_hold_bf16(*codecs) -> bool:
    """Whether every value the pool codecs decode is a bf16 one: a quantised code times its scale always is (at
    most 6 significant bits), raw rows are when they are bf16 rows. (None: a store not read.)"""
    return all(c is None or not c.name.startswith("raw") or c.name == "raw-bfloat16" for c in codecs)


def _parts(dtype_exact: bool) -> int:
    return 1 if dtype_exact else 3


# a prefill chunk's S, window rows, entry width and slot-index stride follow its length and position: not specialised
# (a GPU probe of chunks of 1/7/16/33/300 rows found each toggling Triton's %16 key: a compile mid-request)
@triton.jit(do_not_specialize=["n_pages", "n_ids", "sib", "S", "sot", "window", "width"])
def _core_split_kernel(q_ptr, sqt, sqh, k_ptr, skt, skj, ok_ptr, sot, sink_ptr, m_ptr, l_ptr, acc_ptr,
                       H, S, HD, scale,
                       w_ptr, sws, swr, ring_rows, slot_ptr, pos_ptr, window,
                       e_ptr, sep, ser, pages_ptr, spb, n_pages, per_page, ids_ptr, sib, n_ids, width,
                       out_ptr, count_ptr,
                       HB: tl.constexpr, BS: tl.constexpr, BLOCKS: tl.constexpr, HDP: tl.constexpr,
                       QP: tl.constexpr, KP: tl.constexpr,
                       POOL: tl.constexpr = False, WCODEC: tl.constexpr = 0, ECODEC: tl.constexpr = -1,
                       ALIGNED: tl.constexpr = False, FOLD: tl.constexpr = False, PDL: tl.constexpr = False,
                       INDEXED: tl.constexpr = False):
    """One (row, head block, split) of the core. Where a block's keys and live flags come from: gathered (keys
    [T, S, hd] at k_ptr, ok [T, S] at ok_ptr), POOL (the KV pool in place: `_pool_block`), or INDEXED (`_indexed_block`:
    the int32 slot index [T, S] at ok_ptr into window rows at k_ptr, row stride skj, `window` of them, then the
    entries at e_ptr, row stride ser; `width` = window rows + entries). Everything from the scores on is one code
    path."""
    wait_previous(PDL)
    t = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    n_splits = tl.num_programs(2)
    h = hb * HB + tl.arange(0, HB)
    h_ok = h < H
    col = tl.arange(0, HDP)
    col_ok = col < HD
    t64 = t.to(tl.int64)
    q = tl.load(q_ptr + t64 * sqt + h[:, None].to(tl.int64) * sqh + col[None, :],
                mask=h_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    m = tl.load(sink_ptr + h, mask=h_ok, other=0.0)
    l = tl.zeros((HB,), dtype=tl.float32)
    acc = tl.zeros((HB, HDP), dtype=tl.float32)
    if POOL and ALIGNED and ECODEC >= 0:
        # the window is a whole number of blocks: this split's window blocks, then its entry blocks, each loop
        # reading one store. Two loops, not a branch in one: the products' operand layout (the tensor cores' K
        # order, Triton's kWidth) follows the loads that make the keys, which a branch's result hides from the
        # compiler (kWidth 2 against 4: other bits than the gathered core's on the H200)
        first = sp * BLOCKS
        n_win = tl.minimum(tl.maximum(window // BS - first, 0), BLOCKS)
        for c in range(0, n_win):
            j = (first + c) * BS + tl.arange(0, BS)
            live, k = _window_keys(t64, j, col, col_ok, HD, w_ptr, sws, swr, ring_rows, slot_ptr, pos_ptr, window,
                                   WCODEC)
            m, l, acc = _online_block(q, k, live, m, l, acc, scale, HB, HDP, QP, KP)
        for c in range(n_win, BLOCKS):
            j = (first + c) * BS + tl.arange(0, BS)
            live, k = _entry_keys(t64, j, col, col_ok, HD, window, e_ptr, sep, ser, pages_ptr, spb, n_pages,
                                  per_page, ids_ptr, sib, n_ids, width, ECODEC)
            m, l, acc = _online_block(q, k, live, m, l, acc, scale, HB, HDP, QP, KP)
    else:
        for c in range(BLOCKS):
            j = (sp * BLOCKS + c) * BS + tl.arange(0, BS)
            # the only place the two variants differ: where a block's keys and live flags come from
            if POOL:
                live, k = _pool_block(t64, j, col, col_ok, HD, w_ptr, sws, swr, ring_rows, slot_ptr, pos_ptr,
                                      window, e_ptr, sep, ser, pages_ptr, spb, n_pages, per_page, ids_ptr, sib,
                                      n_ids, width, WCODEC, ECODEC)
            elif INDEXED:
                live, k = _indexed_block(t64, j, col, col_ok, S, ok_ptr, sot, k_ptr, skj, window, e_ptr, ser, width)
            else:
                live = tl.load(ok_ptr + t64 * sot + j, mask=j < S, other=0) != 0
                k = tl.load(k_ptr + t64 * skt + j[:, None].to(tl.int64) * skj + col[None, :],
                            mask=live[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            m, l, acc = _online_block(q, k, live, m, l, acc, scale, HB, HDP, QP, KP)
    at = (t64 * n_splits + sp) * H + h
    tl.store(m_ptr + at, m, mask=h_ok)
    tl.store(l_ptr + at, l, mask=h_ok)
    tl.store(acc_ptr + at[:, None] * HD + col[None, :], acc, mask=h_ok[:, None] & col_ok[None, :])
    if FOLD:
        # the unit (row, head block)'s last program to arrive combines its splits (`_combine_heads`)
        tl.debug_barrier()  # every thread's partials stored before the release of the ticket
        unit = t64 * tl.num_programs(1) + hb
        ticket = tl.atomic_add(count_ptr + unit, 1, sem="acq_rel")
        if ticket == n_splits - 1:
            tl.atomic_xchg(count_ptr + unit, 0)  # ready for the next launch (graph replays included)
            _combine_heads(m_ptr, l_ptr, acc_ptr, sink_ptr, out_ptr, t64, h, h_ok, col, col_ok, H, HD, n_splits,
                           HB, HDP)


@triton.jit
def _online_block(q, k, live, m, l, acc, scale, HB: tl.constexpr, HDP: tl.constexpr, QP: tl.constexpr,
                  KP: tl.constexpr, PP: tl.constexpr = 3):
    """One key block of the online softmax: the running max m, sum l and accumulator acc after keys k [BS, HDP]
    (live [BS]; dead slots 0.0) of the block. PP: the bf16 parts of the softmax weights in their product with the
    keys (3: exact; 2: to 2^-17 relative, the prefill core's `pv_parts`)."""
    s = _split_dot(q, tl.trans(k), tl.zeros((HB, k.shape[0]), dtype=tl.float32), QP, KP) * scale
    s = tl.where(live[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.where(m_new == m, 1.0, tl.exp(m - m_new))
    p = tl.where(live[None, :], tl.exp(s - m_new[:, None]), 0.0)
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _split_dot(p, k, tl.zeros((HB, HDP), dtype=tl.float32), PP, KP)
    return m_new, l, acc


@triton.jit
def _indexed_block(t64, j, col, col_ok, S, idx_ptr, sit, w_ptr, swr, n_win, e_ptr, ser, n_rows):
    """(live [BS], keys [BS, HDP] fp32) of slots j of row t through the slot index: r = idx[t, j] (int32) reads
    window row r when 0 <= r < n_win, entry r - n_win when n_win <= r < n_rows; r < 0 is a dead slot (not read,
    0.0). What the gathered variant loads from keys = cat(window, entries)[idx] and ok = idx >= 0 for the same
    slots: one load of the same row, converted alike. r >= n_rows is dead too (memory safety only: the index
    builder never makes one). The live flag is r's sign read as its own 8-bit load (the int32's high byte,
    little-endian), as the gathered core's comes from its uint8 ok: Triton takes the products' operand layout
    (kWidth) from the narrowest load the keys depend on (8 bits: kWidth 4; int32 and bf16 alone: 2), and another
    layout sums the tensor-core products in another order: other bits (tests/test_kernels_step_attention_layout.py)."""
    at = t64 * sit + j
    r = tl.load(idx_ptr + at, mask=j < S, other=-1)
    sign = tl.load(idx_ptr.to(tl.pointer_type(tl.uint8)) + at * 4 + 3, mask=j < S, other=255)
    live = (sign < 128) & (r < n_rows)
    r = tl.where(live, r, 0).to(tl.int64)
    win = r < n_win
    row = tl.where(win, w_ptr + r * swr, e_ptr + tl.where(win, 0, r - n_win) * ser)
    k = tl.load(row[:, None] + col[None, :], mask=live[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    return live, k


@triton.jit
def _pool_block(t64, j, col, col_ok, HD, w_ptr, sws, swr, ring_rows, slot_ptr, pos_ptr, window,
                e_ptr, sep, ser, pages_ptr, spb, n_pages, per_page, ids_ptr, sib, n_ids, width,
                WCODEC: tl.constexpr, ECODEC: tl.constexpr):
    """(live [BS], keys [BS, HDP] fp32) of slots j of row t read from the pool in place: what the gathered
    variant loads from keys / ok for the same slots (dead slots 0.0, live ones the stored row's decode). A block
    reads both stores and selects (the same values as one store, but both decodes held at once cost the kernel
    registers: the split's ALIGNED loops read one)."""
    live, k = _window_keys(t64, j, col, col_ok, HD, w_ptr, sws, swr, ring_rows, slot_ptr, pos_ptr, window, WCODEC)
    if ECODEC >= 0:
        e_live, ke = _entry_keys(t64, j, col, col_ok, HD, window, e_ptr, sep, ser, pages_ptr, spb, n_pages,
                                 per_page, ids_ptr, sib, n_ids, width, ECODEC)
        k = tl.where(live[:, None], k, ke)
        live = live | e_live
    return live, k


@triton.jit
def _window_keys(t64, j, col, col_ok, HD, w_ptr, sws, swr, ring_rows, slot_ptr, pos_ptr, window,
                 WCODEC: tl.constexpr):
    """Window slots j < window: position kp = pos - window + 1 + j, ring row kp % ring_rows of the row's ring
    slot, live iff kp >= 0 (slots j >= window: dead, 0.0)."""
    pos = tl.load(pos_ptr + t64).to(tl.int64)
    ring = tl.load(slot_ptr + t64).to(tl.int64)
    kp = pos - window + 1 + j
    w_live = (j < window) & (kp >= 0)
    w_row = w_ptr + ring * sws + (tl.where(w_live, kp, 0) % ring_rows) * swr
    return w_live, load_values(w_row[:, None], col[None, :], w_live[:, None] & col_ok[None, :], HD, WCODEC)


@triton.jit
def _entry_keys(t64, j, col, col_ok, HD, window, e_ptr, sep, ser, pages_ptr, spb, n_pages, per_page, ids_ptr, sib,
                n_ids, width, ECODEC: tl.constexpr):
    """Compressed slots: slot c = j - window reads ids[t, c - (width - n_ids)] (left padding dead), id >= 0 lives
    in page pages[t, id // per_page] at row id % per_page (slots j < window: dead, 0.0)."""
    cc = j - window
    at = cc - (width - n_ids)
    has = (cc >= 0) & (cc < width) & (at >= 0)
    eid = tl.load(ids_ptr + t64 * sib + tl.where(has, at, 0), mask=has, other=-1).to(tl.int64)
    e_live = has & (eid >= 0)
    eid = tl.where(e_live, eid, 0)
    pi = eid // per_page
    e_live = e_live & (pi < n_pages)  # memory safety only: a valid id addresses one of the row's pages
    page = tl.load(pages_ptr + t64 * spb + pi, mask=e_live, other=0).to(tl.int64)
    e_row = e_ptr + page * sep + (eid % per_page) * ser
    return e_live, load_values(e_row[:, None], col[None, :], e_live[:, None] & col_ok[None, :], HD, ECODEC)


def decode_tiling() -> dict:
    """split_keys / key_block / num_warps / head_block of decode and verify rows (pool and gathered alike): the
    defaults above, or DSV41_DECODE_CORE_TILING (`attention_args.decode_tiling`)."""
    return _tiling(DECODE_SPLIT_KEYS, KEY_BLOCK, DECODE_WARPS, HEAD_BLOCK)


def fold_enabled() -> bool:
    """Whether the combine runs in the split launch's last arrivers (`FOLD_ENV`=1) or as its own launch (the
    default: faster on the H200, module docstring). Read at each launch, as `pdl.enabled`: the A/B switch needs no
    restart (a captured graph keeps the launches it was captured with)."""
    return _opted_in(FOLD_ENV)


def aligned_enabled() -> bool:
    """Whether a pool block reads one store when the window allows it (`ALIGN_ENV`; on unless set to an off spelling
    since the H100 showed it bitwise the gathered core and the default tiling, b4c0e7f:
    `test_gpu_one_store_blocks_are_the_gathered_core_bitwise`, bench/attention_decode_sweep.py), read at each
    launch as `fold_enabled`."""
    return os.environ.get(ALIGN_ENV, "").strip().lower() not in ("0", "off", "false", "no")


def _opted_in(env: str) -> bool:
    """A default-off switch: on only when set to one of the spellings of on."""
    return os.environ.get(env, "0").strip().lower() in ("1", "on", "true", "yes")


def _launch(grid, args: tuple, kw: dict, m, l, acc, sink, out, H: int, hd: int, n_splits: int, hdp: int,
            rope: tuple | None = None) -> None:
    """The split launch over `grid` (rows, head blocks, splits) with its combine: folded into its last arrivers
    (one launch), or the combine launch after it (`fold_enabled`; always with `rope`: (pos, inv_freq, R), the
    combine's inverse RoPE into out's dtype, out's rows past grid[0] the bucket's padding, stored as zeros)."""
    fold = fold_enabled() and rope is None
    count = _COUNTERS.get(out.device, grid[0] * grid[1], "attention") if fold else out
    # no contraction (enable_fp_fusion=False): which mul + add pairs ptxas fuses into an FMA depends on the code
    # around them, so the folded combine, the combine launch and the row ops' RoPE (rowops.py: fusion off)
    # would round differently; every operation rounded on its own, each pair gives the same bits
    _core_split_kernel[grid](*args, out, count, FOLD=fold, **kw, enable_fp_fusion=False, **pdl_launch(out.device))
    if not fold:
        pos, freq, R = rope if rope is not None else (out, out, 0)
        _core_combine_kernel[(out.shape[0] if rope is not None else grid[0], H)](
            m, l, acc, sink, out, pos, freq, H, hd, grid[0], NS=n_splits, HDP=hdp, R=R, OUT=_DTYPES[out.dtype],
            num_warps=4, enable_fp_fusion=False, **pdl_launch(out.device))


def attention_core(q: torch.Tensor, keys: torch.Tensor, ok: torch.Tensor, sink: torch.Tensor,
                   scale: float, *, keys_bf16: bool | None = None, split_keys: int = SPLIT_KEYS,
                   key_block: int = KEY_BLOCK, num_warps: int = 8, head_block: int = HEAD_BLOCK) -> torch.Tensor:
    """`Attention._core` for rows q [T, H, hd] over keys [T, S, hd] (K = V; bf16 / fp16 / fp32, read as fp32) with
    ok [T, S] bool (live slots) and sink [H] fp32. Returns o [T, H, hd] fp32 on q's device, no host sync.
    `keys_bf16`: the keys' values are bf16 ones (default: keys.dtype is bf16; the caller knows it of fake-quantised
    fp32 keys), so the products take one bf16 part of them (`_split_dot`); `attention_pool` over the same values
    decides alike from its codecs, which keeps the two bitwise equal. `head_block`: heads per program (a power of
    two >= 16; the keys are read once per head block); with split_keys / key_block it fixes the bits, num_warps
    does not."""
    T, H, hd = q.shape
    if keys.dim() != 3 or keys.shape[0] != T or keys.shape[2] != hd:
        raise ValueError(f"keys {list(keys.shape)} do not fit q {list(q.shape)}")
    S = keys.shape[1]
    if ok.shape != (T, S):
        raise ValueError(f"ok {list(ok.shape)} must be [T={T}, S={S}]")
    if keys.stride(2) != 1:
        keys = keys.contiguous()
    if ok.dtype == torch.bool:
        ok = ok.view(torch.uint8)
    if ok.stride(1) != 1:
        ok = ok.contiguous()
    return _rows_launch(q, sink, scale, S, (keys, keys.stride(0), keys.stride(1), ok, ok.stride(0)), _no_pool(ok),
                        {}, keys.dtype == torch.bfloat16 if keys_bf16 is None else keys_bf16, split_keys, key_block,
                        num_warps, head_block, None)


def _rows_launch(q: torch.Tensor, sink: torch.Tensor, scale: float, S: int, keys: tuple, pool: tuple,
                 variant: dict, keys_bf16: bool, split_keys: int, key_block: int, num_warps: int, head_block: int,
                 out: torch.Tensor | None) -> torch.Tensor:
    """The split + combine launches of `attention_core` / `attention_indexed` over q's rows: `keys` (k_ptr, skt,
    skj, ok_ptr, sot) and `pool` (the pool arguments) as the variant reads them."""
    T, H, hd = q.shape
    q, sink, out = core_io(q, sink, out)
    if T == 0:
        return out
    if head_block < 16 or head_block & (head_block - 1):
        raise ValueError(f"head_block must be a power of two >= 16, got {head_block}")
    n_splits, m, l, acc, hdp = _split_scratch(T, S, H, hd, split_keys, key_block, q.device)
    _launch((T, triton.cdiv(H, head_block), n_splits),
            (q, q.stride(0), q.stride(1), *keys, sink, m, l, acc, H, S, hd, float(scale), *pool),
            dict(HB=head_block, BS=key_block, BLOCKS=split_keys // key_block, HDP=hdp,
                 QP=_parts(q.dtype == torch.bfloat16), KP=_parts(bool(keys_bf16)), num_warps=num_warps, **variant),
            m, l, acc, sink, out, H, hd, n_splits, hdp)
    return out


def _no_pool(t: torch.Tensor) -> tuple:
    """The pool arguments of the gathered variant (POOL=False never reads them)."""
    return (t, 0, 0, 1, t, t, 0, t, 0, 0, t, 0, 0, 1, t, 0, 0, 0)


def attention_pool(q: torch.Tensor, sink: torch.Tensor, scale: float, *, window_store: torch.Tensor, window_codec,
                   slot: torch.Tensor, pos: torch.Tensor, window: int, entry_store: torch.Tensor | None = None,
                   entry_codec=None, pages: torch.Tensor | None = None, per_page: int = 0,
                   ids: torch.Tensor | None = None, width: int = 0, split_keys: int | None = None,
                   key_block: int | None = None, num_warps: int | None = None, head_block: int | None = None,
                   out: torch.Tensor | None = None, rope: tuple | None = None) -> torch.Tensor:
    """`attention_core` over the key slots read from the KV pool in place, bit for bit the gathered call (at the
    same `split_keys` / `key_block` / `head_block`: they fix the bits, `num_warps` does not; None: `decode_tiling`).

    q [B, H, hd] (bf16 / fp16 / fp32, read as fp32), sink [H] fp32. Window slots j < window of row b: position
    kp = pos[b] - window + 1 + j, live iff kp >= 0, ring row kp % ring_rows of ring slot slot[b] of
    window_store (uint8 [slots, ring_rows, row_bytes], `window_codec`). With `entry_store` (uint8
    [num_pages, per_page, row_bytes], `entry_codec`) the `width` compressed slots follow: slot c reads
    ids[b, c - (width - K)] (ids [B, K] int64, K <= width, ascending with the -1 first; None: K = 0) when
    c >= width - K, else dead; id >= 0 is live, page pages[b, id // per_page] (pages [B, P]), row id % per_page.
    Returns o [B, H, hd] fp32 (written into `out` when given: contiguous fp32 [B, H, hd], e.g. the real rows of a
    bucket's o, which then needs no copy); no host sync, no data-dependent allocation, one split and one combine
    launch (with DSV41_ATTN_FOLD=1 one launch: the combine folded into the split's).

    `rope=(positions, inv_freq, rope_dim, dtype)`: o's inverse RoPE in the combine launch, o returned in `dtype`:
    the bits of `rowops.rope_rows(o, positions, inv_freq, rope_dim, inverse=True, out_dtype=dtype)` (one launch
    fewer; never folded). `out` may then have more rows than q (a bucket's, q its first B real rows): the others
    are stored as zeros, as `rope_rows(rows=B)` leaves them; positions has at least B rows."""
    if q.dim() != 3 or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q must be bf16/fp16/fp32 [B, H, hd], got {q.dtype} {list(q.shape)}")
    B, H, hd = q.shape
    if sink.shape != (H,):
        raise ValueError(f"sink {list(sink.shape)} must be [H={H}]")
    window = int(window)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    check_store("window_store", window_store, window_codec, hd)
    if window > window_store.shape[1]:
        raise ValueError(f"window {window} is longer than the ring ({window_store.shape[1]} rows)")
    int_vector("slot", slot, B)
    int_vector("pos", pos, B)
    for name, x in (("window_store", window_store), ("slot", slot), ("pos", pos)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}")
    wcodec = codec_id(window_codec)
    sink = sink.float().contiguous()
    if q.stride(2) != 1:
        q = q.contiguous()
    slot, pos = slot.contiguous(), pos.contiguous()
    S, ents, ecodec = entry_args(q, window, pos, entry_store, entry_codec, pages, per_page, ids, width)
    keys_bf16 = codecs_hold_bf16(window_codec, entry_codec)
    combine_rope, dtype, rows = None, torch.float32, B
    if rope is not None:
        combine_rope, dtype = rope_args(rope, B, hd, q.device)
        rows = B if out is None else max(B, out.shape[0])
    if out is None:
        out = torch.empty(B, H, hd, dtype=dtype, device=q.device)
    elif (out.shape[1:] != (H, hd) or out.shape[0] != rows or out.dtype != dtype or not out.is_contiguous()
          or out.device != q.device):
        raise ValueError(f"out must be contiguous {dtype} [{B}{'+' if rope else ''}, {H}, {hd}] on {q.device}, got "
                         f"{out.dtype} {list(out.shape)} on {out.device}")
    if B == 0:
        if rope is not None:
            out.zero_()
        return out
    tiling = {k: v for k, v in dict(split_keys=split_keys, key_block=key_block, num_warps=num_warps,
                                    head_block=head_block).items() if v is not None}
    split_keys, key_block, num_warps, head_block = check_tiling(**{**decode_tiling(), **tiling}).values()
    n_splits, m, l, acc, hdp = _split_scratch(B, S, H, hd, split_keys, key_block, q.device)
    _launch((B, triton.cdiv(H, head_block), n_splits),
            (q, q.stride(0), q.stride(1), q, 0, 0, q, 0, sink, m, l, acc, H, S, hd, float(scale),
             window_store, window_store.stride(0), window_store.stride(1), window_store.shape[1], slot, pos, window,
             *ents),
            dict(HB=head_block, BS=key_block, BLOCKS=split_keys // key_block, HDP=hdp,
                 QP=_parts(q.dtype == torch.bfloat16), KP=_parts(keys_bf16), POOL=True, WCODEC=wcodec,
                 ECODEC=ecodec, ALIGNED=aligned_enabled() and window % key_block == 0, num_warps=num_warps),
            m, l, acc, sink, out, H, hd, n_splits, hdp, combine_rope)
    return out
