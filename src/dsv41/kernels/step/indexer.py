"""The lightning indexer of step rows: index scores, top-k with the reference's tie rule, candidate blocks.

References (MODEL.md §7.5): `dsv41.model.attention.Attention._index_scores` (scores), `Attention._select` over
`model.topk.topk_lowest_index_ties` (top-k), `Attention._candidate_mask` (the candidate-block pool).

Scores (`index_scores`): one program per (row, block of BLOCK_C entries). Row r reads its quantised index query
q[q_row[r]] [Hi, hd] and head weights w [Hi] (fp32), and the keys of its own sequence, keys[key_off[r] + c] [hd]
(any float dtype, read as fp32, as the reference's `.float()`), and writes
    score[r, c] = sum_h w[h] * relu(q[h] . k_c)      (fp32: a [Hi, hd] x [hd, BLOCK_C] IEEE dot, then the heads)
for c < n_vis[r] (and allow[r, c], the candidate pool, where given), -inf elsewhere up to the launch's column count.
A block wholly past n_vis[r] reads nothing. The reduction order over hd and over the heads is fixed by the
compile-time shapes: a row's bits depend on nothing but that row and its keys.

Scores from the pool (`index_scores_pool`): the same kernel with its PAGED switch, which changes only how the key
block is addressed and loaded: row r's entry c is row c % per_page of page pages[r, c // per_page] of the KV pool's
index-key store (runtime/kv_pool.py), its fp32 values read in place through `codecs.load_values` (bit for bit the
pool's `Codec.decode` to the compute dtype, read back as fp32), and row r's query is q[r]. Everything from the dot
on is the one code path, so the scores are bit for bit `index_scores` over the keys gathered from the pages and
decoded in torch (`KVPool.read_entries`, concatenated, q_row = arange). No host sync and no data-dependent
allocation (CUDA-graph capturable); blocks wholly past n_vis[r] read nothing, so a column bucket much larger than
the live entries costs a store of -inf per block.

Top-k (`topk_select`): one program per row, the reference's rule exactly: the k largest scores, ties to the lower
entry id (a stable descending sort's first k), picks of -inf entries -> -1, the ids sorted ascending (so the -1 come
first). The program finds the k-th largest score's order-preserving int32 key of the fp32 bits (`_keys`) and the
count of entries above it by RADIX SELECT (`_kth_radix`): the key's unsigned image as four 8-bit digits from the
top, one pass over the row a digit, each a 256-bin histogram (`tl.histogram`) of the digit among the entries whose
higher digits match the prefix found so far; the digit where the count from the top reaches the rank still wanted
extends the prefix, and the entries of higher digits (all above the k-th) lower that rank. The first pass also
counts the finite scores: when at most k are, the other passes read nothing (every finite entry is picked). Then
one pass takes every entry above the k-th and the lowest-id entries equal to it and writes them in ascending id
order after the leading -1 (a cumulative count per block: no sort): 5 reads of the row in all. Radix is the default
since a GPU run checked it (H100, 63be457: the same bits as the bisection at a prefill slab and at the decode rows'
shapes; 1.9x at 2,048 x 65,536 entries, 1.4x at 8K entries, even at 300); `DSV41_TOPK_RADIX=0` or
`topk_select(radix=False)` takes the bisection (`_kth_bisect`: one counting pass a
bit, plus a finite count and a count above: 35 reads); both give the one k-th key of the row (the largest key t
with at least k keys >= t) and its exact count above, so the output is the same bits
(tests/test_kernels_step_topk_radix.py). A 128K prompt's chunk of ratio-2 rows is 2,048 rows x ~64K entries
(512 MB of scores, far beyond L2): 18 GB of reads by bisection, 2.7 GB by radix select (docs/perf/prefill.md).
3 passes of 11 bits were not chosen: Triton's histogram is per-warp ballots of the bin bits, so its work per
entry grows with the bins a lane owns (8 at 256 bins, 64 at 2,048), more than the pass it saves. -0.0 counts as
+0.0 (the sort compares them equal); NaN is not an input (a positive NaN would rank above +inf, a negative one
below -inf). Optionally it writes the picked set as a mask instead (the candidate blocks).

Padding: columns past a row's own entries hold -inf and are never picked. With k = min(index_topk, columns) the
ids of a sequence of C entries are the last min(index_topk, C) columns of the row (every column before them -1), so
sequences with different C share one launch and each row's bits are those it gets alone; the same holds for any
column bucket larger than every row's entries (a fixed graph bucket of `index_scores_pool`), and the candidate
pool agrees with the row's own on its first C columns (its last partial block may extend past C: cut to C).

Candidate blocks (`candidate_mask`): the block maxima and the newest block's +inf in torch (no host sync, no
boolean indexing: graph-safe), the top `candidate_topk_blocks` blocks (> -inf) with the top-k kernel in mask mode,
expanded back to entries.
"""

from __future__ import annotations

import os
import struct

import torch
import triton
import triton.language as tl

from ..exl3.backend import interpreting
from .knobs import switched_on
from .pdl import launch as pdl_launch, wait_previous

from .codecs import RAW_BF16, RAW_FP16, RAW_FP32, codec_id, load_values

BLOCK_C = 64  # entries per scores program
# entries per step of the top-k passes and warps a program: H100 at 74128c6 (bench/topk_shapes_ab.py, 65,536 entries,
# k 512; bench/results/topk_shapes_ab_74128c6.json): 2,048 rows 3.49 -> 3.23 ms, 16 rows 0.49 -> 0.30 ms against
# 1024 / 4 warps, the same ids (at 16 rows 8192 / 16 warps 0.29, but 4.04 ms at 2,048)
TOPK_BLOCK = 4096
TOPK_WARPS = 8
INTERPRETED_TOPK = (1024, 4)  # Triton's interpreter: its numpy steps cost by width, and the tests' rows are short
RADIX_ENV = "DSV41_TOPK_RADIX"  # 0: the top-k's k-th score by bisection (A/B)
# `DSV41_TOPK_SHAPE=<block>w<warps>` (read at each launch; unset: TOPK_BLOCK / TOPK_WARPS): the top-k program's step
# and warps, for GPU A/B runs (bench/topk_shapes_ab.py). The picks are the same whatever the shape: the k-th key and
# the count above it are exact integer counts, and the ids are written in ascending order with ties taken lowest id
# first, so no shape changes a bit.
SHAPE_ENV = "DSV41_TOPK_SHAPE"
# key(-inf): the order-preserving int32 image of -inf's bits (negative floats: bits ^ 0x7fffffff)
NEG_INF_KEY = struct.unpack("<i", struct.pack("<f", float("-inf")))[0] ^ 0x7FFFFFFF


@triton.jit(do_not_specialize=["ncols", "sat", "sot"])
def _scores_kernel(q_ptr, sqt, sqh, w_ptr, swt, k_ptr, skc, qrow_ptr, koff_ptr, nvis_ptr, allow_ptr, sat,
                   out_ptr, sot, H, HD, ncols, pg_ptr, spg, per_page, skp, wa, wb,
                   HP: tl.constexpr, HDP: tl.constexpr, BC: tl.constexpr, HAS_ALLOW: tl.constexpr,
                   PAGED: tl.constexpr, CODEC: tl.constexpr, PDL: tl.constexpr = False):
    wait_previous(PDL)
    # PAGED: the keys are pool rows in place (k_ptr the uint8 store, skp / skc its page / row strides in bytes,
    # pg_ptr the rows' page tables [R, P] of row stride spg, q row = r, CODEC the store's codecs.codec_id);
    # otherwise a concatenated key tensor (k_ptr, row stride skc) at key_off[r], q row q_row[r]. Only the key
    # block's addressing and load differ: everything from the dot on is one code path.
    r = tl.program_id(0)
    cb = tl.program_id(1)
    r64 = r.to(tl.int64)
    c = cb * BC + tl.arange(0, BC)
    nvis = tl.load(nvis_ptr + r).to(tl.int32)
    live = c < nvis
    if HAS_ALLOW:
        live = live & (tl.load(allow_ptr + r64 * sat + c, mask=live, other=0) != 0)
    score = tl.full((BC,), float("-inf"), dtype=tl.float32)
    if cb * BC < nvis:
        if PAGED:
            qr = r64
        else:
            qr = tl.load(qrow_ptr + r).to(tl.int64)
        h = tl.arange(0, HP)
        h_ok = h < H
        d = tl.arange(0, HDP)
        d_ok = d < HD
        q = tl.load(q_ptr + qr * sqt + h[:, None].to(tl.int64) * sqh + d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        # the head weights' two scales (weights_proj's raw output in; 1.0 and 1.0 for weights already scaled):
        # fp32 products in the reference's order, exactly `w.float() * wa * wb`
        w = (tl.load(w_ptr + qr * swt + h, mask=h_ok, other=0.0).to(tl.float32) * wa) * wb
        if PAGED:
            page = tl.load(pg_ptr + r64 * spg + c // per_page, mask=live, other=0).to(tl.int64)
            row = k_ptr + page * skp + (c % per_page).to(tl.int64) * skc  # [BC] uint8 pointers
            k = load_values(row[:, None], d[None, :], live[:, None] & d_ok[None, :], HD, CODEC)
        else:
            koff = tl.load(koff_ptr + r).to(tl.int64)
            k = tl.load(k_ptr + (koff + c[:, None].to(tl.int64)) * skc + d[None, :],
                        mask=live[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        per_head = tl.maximum(tl.dot(q, tl.trans(k), input_precision="ieee"), 0.0)  # [HP, BC]
        score = tl.where(live, tl.sum(w[:, None] * per_head, axis=0), score)
    tl.store(out_ptr + r64 * sot + c, score, mask=c < ncols)


@triton.jit
def _keys(s_ptr, c, ncols):
    """Order-preserving int32 keys of the fp32 scores at c (past ncols: key(-inf)); -0.0 -> +0.0."""
    s = tl.load(s_ptr + c, mask=c < ncols, other=float("-inf"))
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _kth_bisect(row, ncols, k, offs, NEG: tl.constexpr, BLOCK: tl.constexpr):
    """(k-th largest key, entries above it) by bisection: n_fin in one pass, then (when more than k are finite) the
    key bit by bit on its unsigned image (key + 2^31), one counting pass a bit, and a pass counting those above it:
    ~35 reads of the row. The A/B path of `_kth_radix` (DSV41_TOPK_RADIX=0)."""
    n_fin = 0
    for start in range(0, ncols, BLOCK):
        n_fin += tl.sum((_keys(row, start + offs, ncols) > NEG).to(tl.int32), axis=0)
    steps = tl.where(n_fin > k, 32, 0)
    prefix = tl.zeros((), dtype=tl.int64)
    bit = tl.full((), 2147483648, tl.int64)
    for _ in range(steps):
        cand = prefix | bit
        bit = bit >> 1
        thr = (cand - 2147483648).to(tl.int32)
        cnt = 0
        for start in range(0, ncols, BLOCK):
            cnt += tl.sum((_keys(row, start + offs, ncols) >= thr).to(tl.int32), axis=0)
        prefix = tl.where(cnt >= k, cand, prefix)
    kth = tl.where(n_fin > k, (prefix - 2147483648).to(tl.int32), NEG)
    n_gt = 0
    for start in range(0, ncols, BLOCK):
        n_gt += tl.sum((_keys(row, start + offs, ncols) > kth).to(tl.int32), axis=0)
    return kth, n_gt


@triton.jit
def _kth_radix(row, ncols, k, offs, NEG: tl.constexpr, BLOCK: tl.constexpr):
    """(k-th largest key, entries above it) by radix select: the unsigned image u = key ^ 2^31 (key + 2^31 mod 2^32)
    four 8-bit digits from the top, one pass each: a 256-bin histogram of the digit over the entries whose higher
    digits are the prefix found so far, then the digit where the count from the top reaches the rank still wanted
    (those above it are above the k-th: the rank drops by them). The first pass also counts the finite scores; when
    at most k are, the other passes read nothing and the k-th is key(-inf) (every finite entry picked), as the
    bisection's skip. 4 reads of the row; the same k-th key and count above it as `_kth_bisect`."""
    bins = tl.arange(0, 256)
    n_fin = 0
    hist = tl.zeros((256,), dtype=tl.int32)
    for start in range(0, ncols, BLOCK):
        c = start + offs
        key = _keys(row, c, ncols)
        n_fin += tl.sum((key > NEG).to(tl.int32), axis=0)
        hist += tl.histogram(((key ^ -2147483648) >> 24) & 0xFF, 256, mask=c < ncols)
    todo = tl.where(n_fin > k, ncols, 0)
    want = k  # the k-th's rank among the entries that match the prefix
    prefix = tl.zeros((), dtype=tl.int32)  # u's digits found so far (the rest 0)
    for p in tl.static_range(4):
        SHIFT = 24 - 8 * p  # constexpr: the pass is unrolled
        if p > 0:
            hist = tl.zeros((256,), dtype=tl.int32)
            for start in range(0, todo, BLOCK):
                c = start + offs
                u = _keys(row, c, ncols) ^ -2147483648
                match = (((u ^ prefix) >> (SHIFT + 8)) == 0) & (c < ncols)
                hist += tl.histogram((u >> SHIFT) & 0xFF, 256, mask=match)
        at_least = tl.cumsum(hist, axis=0, reverse=True)  # entries whose digit is >= the bin's
        digit = tl.sum((at_least >= want).to(tl.int32), axis=0) - 1
        here = bins == digit
        want -= tl.sum(tl.where(here, at_least - hist, 0), axis=0)  # minus those above the digit
        prefix = prefix | (digit << SHIFT)
    kth = tl.where(n_fin > k, prefix ^ -2147483648, NEG)
    return kth, tl.where(n_fin > k, k - want, n_fin)


@triton.jit(do_not_specialize=["ncols", "k", "sst", "smt"])
def _topk_kernel(s_ptr, sst, ids_ptr, mask_ptr, smt, ncols, k,
                 NEG: tl.constexpr, BLOCK: tl.constexpr, WRITE_IDS: tl.constexpr, WRITE_MASK: tl.constexpr,
                 RADIX: tl.constexpr = True, PDL: tl.constexpr = False):
    wait_previous(PDL)
    r = tl.program_id(0).to(tl.int64)
    row = s_ptr + r * sst
    offs = tl.arange(0, BLOCK)
    # the k-th largest key (key(-inf) when at most k scores are finite) and the count of entries above it
    if RADIX:
        kth, n_gt = _kth_radix(row, ncols, k, offs, NEG, BLOCK)
    else:
        kth, n_gt = _kth_bisect(row, ncols, k, offs, NEG, BLOCK)
    ties = tl.where(kth == NEG, 0, k - n_gt)  # entries equal to the k-th taken, lowest ids first
    lead = k - n_gt - ties  # picks of -inf entries: -1, first after the ascending sort
    if WRITE_IDS:
        for start in range(0, k, BLOCK):
            j = start + offs
            tl.store(ids_ptr + r * k + j, tl.full((BLOCK,), -1, tl.int64), mask=j < lead)
    taken = 0
    seen = 0
    for start in range(0, ncols, BLOCK):
        c = start + offs
        key = _keys(row, c, ncols)
        eq = ((key == kth) & (c < ncols)).to(tl.int32)
        sel = (key > kth) | ((eq != 0) & (seen + tl.cumsum(eq, axis=0) - eq < ties))
        sel_i = sel.to(tl.int32)
        if WRITE_IDS:
            at = lead + taken + tl.cumsum(sel_i, axis=0) - sel_i
            tl.store(ids_ptr + r * k + at, c.to(tl.int64), mask=sel)
        if WRITE_MASK:
            tl.store(mask_ptr + r * smt + c, sel_i.to(tl.int8), mask=c < ncols)
        taken += tl.sum(sel_i, axis=0)
        seen += tl.sum(eq, axis=0)


def score_operands(q, w, keys, allow, R: int, ncols: int):
    """The score kernels' operands as they load them: q [., Hi, hd], w [., Hi] and keys [., hd] with unit strides in
    their last dim, the candidate pool `allow` (bool [R, ncols] or None) as contiguous bytes."""
    if q.stride(2) != 1:
        q = q.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    if keys.stride(1) != 1:
        keys = keys.contiguous()
    if allow is not None:
        if allow.shape != (R, ncols):
            raise ValueError(f"allow {list(allow.shape)} must be [R={R}, ncols={ncols}]")
        allow = (allow.view(torch.uint8) if allow.dtype == torch.bool else allow).contiguous()
    return q, w, keys, allow


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, q_row: torch.Tensor, key_off: torch.Tensor,
                 n_vis: torch.Tensor, ncols: int, allow: torch.Tensor | None = None,
                 w_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Index scores [R, ncols] fp32 of R rows: row r from q[q_row[r]] [Hi, hd] (quantised), w[q_row[r]] [Hi]
    (`w.float() * w_scales[0] * w_scales[1]` in the load: weights_proj's output as it comes, no scaling launches)
    and keys[key_off[r] : key_off[r] + n_vis[r]] [hd]; -inf at c >= n_vis[r], where allow[r, c] (bool [R, ncols],
    optional) is False, and past the row's entries. q_row / key_off / n_vis: int [R] on q's device. No host sync."""
    R = q_row.shape[0]
    _, H, hd = q.shape
    if w.shape[1] != H or keys.shape[1] != hd or key_off.shape != (R,) or n_vis.shape != (R,):
        raise ValueError(f"shapes do not fit: q {list(q.shape)} w {list(w.shape)} keys {list(keys.shape)} R={R}")
    q, w, keys, allow = score_operands(q, w, keys, allow, R, ncols)
    out = torch.empty(R, ncols, dtype=torch.float32, device=q.device)
    if R == 0 or ncols == 0:
        return out
    a = allow if allow is not None else out
    _scores_kernel[(R, triton.cdiv(ncols, BLOCK_C))](
        q, q.stride(0), q.stride(1), w, w.stride(0), keys, keys.stride(0), q_row, key_off, n_vis, a, a.stride(0),
        out, out.stride(0), H, hd, ncols, n_vis, 0, 1, 0, float(w_scales[0]), float(w_scales[1]),
        HP=max(16, triton.next_power_of_2(H)),
        HDP=max(16, triton.next_power_of_2(hd)), BC=BLOCK_C, HAS_ALLOW=allow is not None, PAGED=False, CODEC=0,
        num_warps=4, **pdl_launch(q.device))
    return out


def index_scores_pool(q: torch.Tensor, w: torch.Tensor, key_store: torch.Tensor, key_codec, pages: torch.Tensor,
                      per_page: int, n_vis: torch.Tensor, ncols: int,
                      allow: torch.Tensor | None = None, w_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Index scores [B, ncols] fp32 reading the keys from the KV pool's pages in place: row r from q[r] [Hi, hd]
    (quantised, any float dtype), w[r] [Hi] (scaled in the load as `index_scores` does) and entries c < n_vis[r]
    of its sequence, row c % per_page of page pages[r, c // per_page] of key_store (uint8 [num_pages, per_page,
    row_bytes], `kv_pool.Codec` key_codec, read through `codecs.load_values`). pages: int32 / int64 [B, P], one
    page table per row (rows of one sequence repeat it; entries past n_vis[r] are never read, so their padding may
    hold anything); n_vis: int [B]. -inf at c >= n_vis[r], where allow[r, c] (bool [B, ncols], optional) is
    False, and past n_vis. Bit for bit `index_scores(q, w, keys, arange(B), key_off, n_vis, ncols, allow)` over
    the keys gathered and decoded in torch (`KVPool.read_entries`). No host sync, no data-dependent allocation, one
    launch. The caller keeps n_vis[r] <= P * per_page and the pages it reaches valid (they are not checked: that
    would read the device)."""
    if q.dim() != 3 or not q.is_floating_point():
        raise ValueError(f"q must be a float [B, Hi, hd] tensor, got {q.dtype} {list(q.shape)}")
    B, H, hd = q.shape
    dev = q.device
    if w.shape != (B, H) or not w.is_floating_point():
        raise ValueError(f"w must be a float [B={B}, Hi={H}] tensor, got {w.dtype} {list(w.shape)}")
    cid = codec_id(key_codec)
    if key_codec.dim != hd:
        raise ValueError(f"the key codec stores {key_codec.dim} values a row, the queries have hd={hd}")
    if per_page < 1:
        raise ValueError(f"per_page must be >= 1, got {per_page}")
    if (key_store.dtype != torch.uint8 or key_store.dim() != 3 or key_store.shape[1] != per_page
            or key_store.shape[2] != key_codec.row_bytes):
        raise ValueError(f"key_store must be uint8 [num_pages, per_page={per_page}, row_bytes="
                         f"{key_codec.row_bytes}], got {key_store.dtype} {list(key_store.shape)}")
    if key_store.stride(2) != 1:
        raise ValueError("key_store's rows must be contiguous bytes (stride 1 in the last dim)")
    if cid in (RAW_BF16, RAW_FP16, RAW_FP32):  # the raw rows are read as their dtype: element-aligned
        size = key_codec.row_bytes // key_codec.dim
        if (key_store.storage_offset() % size or key_store.stride(0) % size or key_store.stride(1) % size
                or key_store.data_ptr() % size):
            raise ValueError(f"key_store's rows are not aligned to {key_codec.name}'s {size}-byte values")
    if pages.dim() != 2 or pages.shape[0] != B or pages.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"pages must be int32 / int64 [B={B}, P], got {pages.dtype} {list(pages.shape)}")
    if n_vis.shape != (B,) or n_vis.dtype.is_floating_point or n_vis.dtype == torch.bool:
        raise ValueError(f"n_vis must be an integer [B={B}] tensor, got {n_vis.dtype} {list(n_vis.shape)}")
    if ncols < 0:
        raise ValueError(f"ncols must be >= 0, got {ncols}")
    for name, t in (("w", w), ("key_store", key_store), ("pages", pages), ("n_vis", n_vis)):
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, q on {dev}")
    if q.stride(2) != 1:
        q = q.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    if pages.stride(1) != 1:
        pages = pages.contiguous()
    n_vis = n_vis.contiguous()
    out = torch.empty(B, ncols, dtype=torch.float32, device=dev)
    if allow is not None:
        if allow.shape != (B, ncols) or allow.dtype not in (torch.bool, torch.uint8):
            raise ValueError(f"allow must be bool [B={B}, ncols={ncols}], got {allow.dtype} {list(allow.shape)}")
        if allow.device != dev:
            raise ValueError(f"allow is on {allow.device}, q on {dev}")
        allow = (allow.view(torch.uint8) if allow.dtype == torch.bool else allow).contiguous()
    if B == 0 or ncols == 0:
        return out
    a = allow if allow is not None else out
    _scores_kernel[(B, triton.cdiv(ncols, BLOCK_C))](
        q, q.stride(0), q.stride(1), w, w.stride(0), key_store, key_store.stride(1), n_vis, n_vis, n_vis, a,
        a.stride(0), out, out.stride(0), H, hd, ncols, pages, pages.stride(0), per_page, key_store.stride(0),
        float(w_scales[0]), float(w_scales[1]), HP=max(16, triton.next_power_of_2(H)),
        HDP=max(16, triton.next_power_of_2(hd)), BC=BLOCK_C,
        HAS_ALLOW=allow is not None, PAGED=True, CODEC=cid, num_warps=4, **pdl_launch(q.device))
    return out


def radix_on() -> bool:
    """Whether the top-k finds its k-th score by radix select (read at each launch; `DSV41_TOPK_RADIX=1` turns it
    on by default:
checked on a GPU; `DSV41_TOPK_RADIX=0` takes the bisection). The same bits either way. A switch, so that a whole prefill's launches (inside the
    model, in captured graphs) flip without a code change, like the other kernel A/B switches; `topk_select`'s
    `radix` argument beside it lets the tests and the bench run both in one process."""
    # on since the GPU run at 63be457 (H100): tests/test_kernels_step_topk_radix.py's GPU tests (a prefill slab and
    # the decode rows' shapes: same bits) and their timings (radix <= bisection at every shape, 2x at 64K entries)
    return switched_on(RADIX_ENV, default=True)


def topk_shape(name: str | None = None) -> tuple[int, int]:
    """(step entries, warps) of the top-k program: `name` (None: `DSV41_TOPK_SHAPE`) as "<block>w<warps>", e.g.
    "2048w8"; empty: (TOPK_BLOCK, TOPK_WARPS), or INTERPRETED_TOPK under Triton's interpreter (the same ids)."""
    name = (os.environ.get(SHAPE_ENV, "") if name is None else name).strip()
    if not name:
        return INTERPRETED_TOPK if interpreting() else (TOPK_BLOCK, TOPK_WARPS)
    block, _, warps = name.partition("w")
    ok = block.isdigit() and warps.isdigit()
    block_n, warps_n = (int(block), int(warps)) if ok else (0, 0)
    if not ok or block_n < 128 or block_n & (block_n - 1) or warps_n not in (1, 2, 4, 8, 16):
        raise ValueError(f"{SHAPE_ENV}={name!r}: expected <block>w<warps>, a power-of-two block >= 128 and 1-16 warps")
    return block_n, warps_n


def topk_select(scores: torch.Tensor, k: int, *, mask: bool = False, radix: bool | None = None,
                shape: str | None = None) -> torch.Tensor:
    """`Attention._select(scores, k)` for scores [R, N] fp32: ids [R, k] int64 (ascending, -1 for picks of -inf
    entries, first). With mask=True, the picked set as a bool mask [R, N] instead (-inf entries never in it).
    radix: how the k-th score is found (radix select, or the bisection: the same bits); None = `radix_on()`.
    shape: the program's step and warps (`topk_shape`; None = `DSV41_TOPK_SHAPE`): the same bits whatever it is."""
    R, N = scores.shape
    if not 0 <= k <= N:
        raise ValueError(f"top-k {k} out of range for {N} entries")
    if scores.dtype != torch.float32:
        raise ValueError(f"scores must be fp32, got {scores.dtype}")
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    dev = scores.device
    ids = torch.empty(R, 0 if mask else k, dtype=torch.int64, device=dev)
    keep = torch.empty(R, N if mask else 0, dtype=torch.int8, device=dev)
    if R and N and (k or mask):
        if k == 0:
            keep.zero_()
        else:
            block, warps = topk_shape(shape)
            _topk_kernel[(R,)](scores, scores.stride(0), ids, keep, max(keep.stride(0), 1), N, k, NEG=NEG_INF_KEY,
                               BLOCK=block, WRITE_IDS=not mask, WRITE_MASK=mask,
                               RADIX=radix_on() if radix is None else bool(radix), num_warps=warps,
                               **pdl_launch(scores.device))
    return keep.view(torch.bool) if mask else ids


def candidate_mask(scores: torch.Tensor, n_vis: torch.Tensor, block: int, topk_blocks: int) -> torch.Tensor:
    """`Attention._candidate_mask(scores, n_vis)` for scores [R, N] (columns past a row's entries -inf): blocks of
    `block` entries scored by their max, the block of the newest visible entry +inf, the top `topk_blocks` blocks
    (ties to the lower block, never a -inf block) kept. Returns the entries' mask [R, N] bool. No host sync."""
    R, N = scores.shape
    n_blocks = -(-N // block)
    padded = torch.full((R, n_blocks * block), float("-inf"), dtype=torch.float32, device=scores.device)
    padded[:, :N] = scores
    bmax = padded.view(R, n_blocks, block).amax(dim=-1)
    newest = ((n_vis.long() - 1) // block).clamp(min=0)[:, None]
    pinned = torch.where(n_vis[:, None] > 0, torch.full_like(newest, 0, dtype=torch.float32) + float("inf"),
                         bmax.gather(1, newest))
    bmax.scatter_(1, newest, pinned)
    keep = topk_select(bmax, min(topk_blocks, n_blocks), mask=True)
    return keep.repeat_interleave(block, dim=1)[:, :N]
