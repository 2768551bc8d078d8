"""mHC sites of prefill rows (issue 31): tiles of TILE_ROWS rows x a fixed split of d (MODEL.md §6; references:
`dsv41.model.mhc` coefficients / sinkhorn / collapse / expand and `dsv41.model.norm.rms_norm`; the decode and
verify rows' launches are `mhc.py`'s row kernels).

Why. The row kernels run 32 programs a row, each streaming 1/32 of the mixing matrix fn [hc d, (2 + hc) hc] (2 MB
fp32 at d 5120): a 2,048-row chunk reads fn 2,048 times from L2 (~4 GB a site, ~0.73 ms on an H100). An earlier
try (`mhc_tiles`, reverted: docs/perf/prefill.md) gave one program a tile of 16 rows over the whole d: fn read once
a tile, but only 128 programs, each a long serial fp32 FMA chain: slower (3.8 ms a layer against 1.56). Here a
program owns a tile of rows AND one of `splits` slices of d (SPLIT_COLUMNS columns, the split count from d only):
a 2,048-row chunk is 64 tiles x 20 splits = 1,280 programs (5,120 at 8K), fn read once a tile (128 MB of L2 reads a
site at 2K rows, not 4 GB), each program a short chain.

Program (tile, split), per TILE_BLOCK-column step of its slice: [X' = expand(y, X, post_in, comb_in), stored;] the
mixing product's step, the tile's [rows, hc TILE_BLOCK] streams by fn's [hc TILE_BLOCK, NP] rows (the (2 + hc) hc =
24 columns padded to 32) from zero, added to the split's sum: compiled, on the bf16 tensor cores (`_mix_dot`: fn
as three bf16 parts whose sum is fn exactly, bf16 streams as themselves: every part product exact in fp32, summed
in fp32); Σx²; the collapse u = Σ_c pre_in[c] X[c] rounded to the stream dtype and stored in h; Σu². The split's
partials (products, Σx², Σu² per row) go to `part`; the tile's last program to arrive (an arrival counter per
tile, no float atomics) sums them in split order and finishes the tile's rows: the row kernels' tail vectorised
over the rows (rsqrt of the mean square in fp64, sigmoids, softmax + Sinkhorn on [rows, hc, hc] tiles), then
h = rms_norm(u) * w over the tile's h (its own programs' stores, from L2).

Row invariance: the tile shape, the split of d, the column steps and every reduction order are constants or
functions of (hc, d), never of B; a row meets the other rows of its tile only as another row of the dot's operands
(each output element its own chain over k) and of element-wise tiles. Rows of a partial last tile load nothing and
store nothing; rows from `rows=` (live rows) on write +0.0 to every output, as the row launchers'. So a row's bits
are the same alone, in any slice of the chunk and at any position of its tile (chunked == one-shot). They are not
the row kernels' bits (another sum order over d): prefill rows take these launches, decode and verify rows the row
kernels (docs/ENGINE.md §4-5), as the EXL3 tiles do.

Numerics: the row kernels' class. fp32 sums (the mixing product in three levels: a step's 128 terms (3 x 128
exact part products on the tensor cores), the steps of a split, the splits in order; Σx² and Σu² elementwise per
column, then reduced), the two rsqrt's in fp64, divisions correctly rounded, exp in fp32; the collapse rounded to
the stream dtype before the norm and X' before its coefficients, as the reference does. Tolerances argued in
tests/test_kernels_step_mhc_prefill.py.

`DSV41_PREFILL_MHC_TILES` (`tiles_on`, read when a forward starts; off by default until the GPU A/B): prefill rows'
sites take these launches (runtime/mhc_sites.py `MhcSites.of(phase=)`). The lone expand and the final collapse +
norm read no fn and stay the row launchers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import MMA, _split_dot
from .knobs import switched_on
from .mhc import _COUNTERS, _cast, _rsqrt64, _sigmoid
from .mhc_args import site_args
from .pdl import launch as pdl_launch, wait_previous

ENV = "DSV41_PREFILL_MHC_TILES"
TILE_ROWS = 32  # rows a program (the dot's M); a constant, never chosen from B
TILE_BLOCK = 32  # columns of d a step: the dot's K is hc * TILE_BLOCK (128 at hc 4)
SPLIT_COLUMNS = 256  # columns of d a split: d 5120 -> 20 splits (8 steps each); from d only
TILE_NORM = 256  # columns a step of the last arriver's norm pass ([TILE_ROWS, TILE_NORM] values)
TILE_WARPS = 4


def tiles_on() -> bool:
    """Whether prefill rows' sites take these launches (`DSV41_PREFILL_MHC_TILES=1`; off by default until a GPU
    A/B); read when a forward starts."""
    return switched_on(ENV, default=False)


def splits_of(d: int, split_columns: int = SPLIT_COLUMNS) -> int:
    """The split count of d (a function of d alone): ceil(d / split_columns)."""
    return triton.cdiv(d, split_columns)


@triton.jit
def _div(a, b):
    """a / b correctly rounded, b broadcast to a's shape (`tl.div_rn` takes equal shapes)."""
    return tl.div_rn(a, tl.broadcast_to(b, a.shape))


@triton.jit
def _coefficients_tile(mix, sq, rows, r_in, r_live, K, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, norm_eps,
                       hc_eps, iters, HC: tl.constexpr, HCP: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr):
    """`mhc._coefficients` for the rows of a tile: mix [BM, NP] (the mixing products, lanes >= (2 + hc) hc
    ignored), sq [BM] (Σx²) -> pre, post, comb stored (rows not live: +0.0; rows past B: nothing)."""
    NMIX: tl.constexpr = (2 + HC) * HC
    n = tl.arange(0, NP)
    inv = _rsqrt64(_div(sq, (K + 0.0).to(tl.float32)) + norm_eps)  # the mean as torch's: IEEE division
    m = mix * inv[:, None]
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    scale = tl.where(n < HC, s0, tl.where(n < 2 * HC, s1, s2))
    z = m * scale[None, :] + tl.load(base_ptr + n, mask=n < NMIX, other=0.0)[None, :]  # [BM, NP]
    sig = _sigmoid(z)
    live = r_live[:, None]
    at = rows[:, None] * HC
    tl.store(pre_ptr + at + n[None, :], tl.where(live, sig + hc_eps, 0.0), mask=r_in[:, None] & (n < HC)[None, :])
    tl.store(post_ptr + at + (n[None, :] - HC), tl.where(live, 2 * sig, 0.0),
             mask=r_in[:, None] & ((n >= HC) & (n < 2 * HC))[None, :])
    # comb logits as [BM, HCP, HCP]: row j selects z[2 hc + j hc + k] (a sum of one term and zeros: exact), one
    # row j at a time ([BM, HCP, NP] values live, not [BM, HCP, HCP, NP])
    j = tl.arange(0, HCP)
    k = tl.arange(0, HCP)
    jk = (j[:, None] < HC) & (k[None, :] < HC)
    logits = tl.zeros((BM, HCP, HCP), tl.float32)
    for jj in tl.static_range(HC):
        pick = (2 * HC + jj * HC + k[:, None]) == n[None, :]  # [k, NP]
        one = tl.sum(tl.where(pick[None, :, :], z[:, None, :], 0.0), axis=2)  # [BM, k]
        logits = tl.where((j == jj)[None, :, None], one[:, None, :], logits)
    # Sinkhorn (model/mhc.py:sinkhorn): softmax over k, + eps, column; then (iters - 1) x {row, column}
    ok = jk[None, :, :]
    logits = tl.where(ok, logits, -1e30)  # finite: a padded row (hc < HCP) stays free of inf - inf
    e = tl.where(ok, tl.exp(logits - tl.max(logits, axis=2)[:, :, None]), 0.0)
    total = tl.where((j < HC)[None, :], tl.sum(e, axis=2), 1.0)
    c = tl.where(ok, _div(e, total[:, :, None]) + hc_eps, 0.0)
    c = _div(c, tl.sum(c, axis=1)[:, None, :] + hc_eps)
    for _ in range(iters - 1):
        c = _div(c, tl.sum(c, axis=2)[:, :, None] + hc_eps)
        c = _div(c, tl.sum(c, axis=1)[:, None, :] + hc_eps)
    tl.store(comb_ptr + rows[:, None, None] * HC * HC + (j[:, None] * HC + k[None, :])[None, :, :],
             tl.where(r_live[:, None, None], c, 0.0), mask=r_in[:, None, None] & ok)


@triton.jit
def _mix_dot(x, f, XP: tl.constexpr):
    """x [BM, K] @ f [K, NP], fp32, from zero. Compiled: on the bf16 tensor cores (attention.py `_split_dot`): x as
    XP bf16 parts (1: bf16 streams, whose values are bf16 ones: x itself), fn as 3 (hi + mid + lo == fn exactly), each
    part product exact in fp32, accumulated in fp32; the terms below 2^-16 relative of fp32 streams' (mid x lo, lo x
    lo) left out. Interpreted (no bf16 dot there): the fp32 products summed over k by numpy's reduction, not a BLAS
    matmul, whose order for a row depends on the row's position in the tile (OpenBLAS's edge kernels at M = 32)."""
    if MMA:
        return _split_dot(x, f, tl.zeros((x.shape[0], f.shape[1]), tl.float32), XP, 3)
    else:
        return tl.sum(x[:, :, None] * f[None, :, :], axis=1)


@triton.jit
def _tile_step(x_ptr, y_ptr, comb_in_ptr, xo_ptr, fn_ptr, stride_fk, stride_fn, h_ptr, pre_in, post_in, rows, rows64,
               r_in, r_live, d0, d, HC: tl.constexpr, HCP: tl.constexpr, NP: tl.constexpr, EXPAND: tl.constexpr,
               BM: tl.constexpr, BLOCK: tl.constexpr, XP: tl.constexpr):
    """One TILE_BLOCK-column step of a program: [X' stored,] returns the step's [BM, NP] dot (from zero), the
    [BM, BLOCK] sums over the streams of its squares and the squares of the rounded collapse (stored in h)."""
    NMIX: tl.constexpr = (2 + HC) * HC
    KB: tl.constexpr = HCP * BLOCK
    c = tl.arange(0, HCP)
    c_ok = c < HC
    n = tl.arange(0, NP)
    cols = d0 + tl.arange(0, BLOCK)
    col_ok = cols < d
    at = rows64[:, None, None] * HC * d + (c[:, None] * d + cols[None, :])[None, :, :]  # [BM, HCP, BLOCK]
    where = (c_ok[:, None] & col_ok[None, :])[None, :, :]
    live = r_live[:, None, None] & where
    if EXPAND:
        rl = r_live[:, None] & col_ok[None, :]
        y = tl.load(y_ptr + rows64[:, None] * d + cols[None, :], mask=rl, other=0.0)
        # an fp32 y (a reduced partial) is rounded to the stream dtype first, as its `.to(dtype)` would
        y = _cast(y.to(tl.float32), xo_ptr.dtype.element_ty).to(tl.float32)
        # Σ_j comb[j, k] X[j] in j order, one stream j's [BM, BLOCK] at a time (no [BM, j, k, BLOCK] product)
        mixed = tl.zeros((BM, HCP, BLOCK), tl.float32)
        for jj in tl.static_range(HC):
            xj = tl.load(x_ptr + rows64[:, None] * HC * d + jj * d + cols[None, :], mask=rl, other=0.0)
            cj = tl.load(comb_in_ptr + rows[:, None] * HC * HC + jj * HC + c[None, :],
                         mask=r_live[:, None] & c_ok[None, :], other=0.0)
            mixed += cj[:, :, None] * xj.to(tl.float32)[:, None, :]  # [BM, k, BLOCK]
        xn = _cast(post_in[:, :, None] * y[:, None, :] + mixed, xo_ptr.dtype.element_ty)
        xs = tl.where(live, xn.to(tl.float32), 0.0)
        tl.store(xo_ptr + at, xs.to(xo_ptr.dtype.element_ty), mask=r_in[:, None, None] & where)  # dead rows +0.0
    else:
        xs = tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32)
    # fn's rows of the step: the dot's k = c BLOCK + i is fn row c d + d0 + i (the [BM, HCP, BLOCK] tile row-major)
    kk = tl.arange(0, KB)
    kc = kk // BLOCK
    ki = kk % BLOCK
    f = tl.load(fn_ptr + (kc[:, None] * d + d0 + ki[:, None]).to(tl.int64) * stride_fk + n[None, :] * stride_fn,
                mask=((kc < HC) & (d0 + ki < d))[:, None] & (n < NMIX)[None, :], other=0.0)  # [KB, NP]
    prod = _mix_dot(tl.reshape(xs, (BM, KB)), f, XP)
    u = _cast(tl.sum(pre_in[:, :, None] * xs, axis=1), h_ptr.dtype.element_ty)  # collapse, in the stream dtype
    tl.store(h_ptr + rows64[:, None] * d + cols[None, :], u, mask=r_in[:, None] & col_ok[None, :])
    u32 = u.to(tl.float32)
    return prod, tl.sum(xs * xs, axis=1), u32 * u32


@triton.jit(do_not_specialize=["B", "live_rows"])
def _tile_kernel(x_ptr, y_ptr, post_in_ptr, comb_in_ptr, xo_ptr, fn_ptr, stride_fk, stride_fn, base_ptr, scale_ptr,
                 pre_in_ptr, w_ptr, h_ptr, pre_ptr, post_ptr, comb_ptr, part_ptr, count_ptr, B, d, chunk, norm_eps,
                 hc_eps, rms_eps, iters, live_rows, HC: tl.constexpr, HCP: tl.constexpr, NP: tl.constexpr,
                 SPLITS: tl.constexpr, EXPAND: tl.constexpr, BM: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_N: tl.constexpr, XP: tl.constexpr, PDL: tl.constexpr = False):
    """Program (tile, split): rows [tile BM, tile BM + BM) over the split's `chunk` columns of d (module
    docstring). Streams [B, HC, d] contiguous; coefficients fp32 contiguous; fn_t [HC d, NMIX] strided; part
    [tiles, SPLITS, BM, NP] fp32 (lanes: the products, then Σx², then Σu²)."""
    NMIX: tl.constexpr = (2 + HC) * HC
    tile = tl.program_id(0)
    split = tl.program_id(1)
    wait_previous(PDL)
    rows = tile * BM + tl.arange(0, BM)
    r_in = rows < B  # rows of the launch (a partial last tile's others: no load, no store)
    r_live = rows < live_rows  # computed; rows [live_rows, B) come out +0.0
    rows64 = rows.to(tl.int64)
    c = tl.arange(0, HCP)
    rc = r_live[:, None] & (c < HC)[None, :]
    n = tl.arange(0, NP)
    pre_in = tl.load(pre_in_ptr + rows[:, None] * HC + c[None, :], mask=rc, other=0.0)  # [BM, HCP]
    post_in = pre_in
    if EXPAND:
        post_in = tl.load(post_in_ptr + rows[:, None] * HC + c[None, :], mask=rc, other=0.0)
    acc = tl.zeros((BM, NP), tl.float32)
    sq = tl.zeros((BM, BLOCK), tl.float32)
    usq = tl.zeros((BM, BLOCK), tl.float32)
    first = split * chunk
    for d0 in range(first, tl.minimum(first + chunk, d), BLOCK):
        # each step's dot is one chain of hc BLOCK terms from zero, added to the split's sum (three short chains
        # over hc d, not one of 20,480 terms)
        prod, sq_step, usq_step = _tile_step(x_ptr, y_ptr, comb_in_ptr, xo_ptr, fn_ptr, stride_fk, stride_fn, h_ptr,
                                             pre_in, post_in, rows, rows64, r_in, r_live, d0, d, HC, HCP, NP, EXPAND,
                                             BM, BLOCK, XP)
        acc += prod
        sq += sq_step
        usq += usq_step
    part = _pack_partial(acc, sq, usq, n, NMIX)
    tile_part = part_ptr + tile.to(tl.int64) * SPLITS * BM * NP
    slot = tl.arange(0, BM)[:, None] * NP + n[None, :]
    tl.store(tile_part + split * BM * NP + slot, part)
    tl.debug_barrier()  # every thread's stores (xo, h, part) before the release of the ticket
    ticket = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
    if ticket == SPLITS - 1:
        total = tl.zeros((BM, NP), tl.float32)
        for t in tl.static_range(SPLITS):  # split order: the same sum whichever program finishes
            total += tl.load(tile_part + t * BM * NP + slot, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch
        _finish_rows(total, n, rows, rows64, r_in, r_live, d, h_ptr, w_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr,
                     comb_ptr, norm_eps, hc_eps, rms_eps, iters, HC, HCP, NP, BM, BLOCK_N, NMIX, ".cg")


@triton.jit
def _pack_partial(acc, sq, usq, n, NMIX: tl.constexpr):
    """A split's partial of its rows: the mixing products, then the two sums of squares (x's, u's) as columns NMIX
    and NMIX + 1."""
    part = tl.where((n < NMIX)[None, :], acc, 0.0)
    part = tl.where((n == NMIX)[None, :], tl.sum(sq, axis=1)[:, None], part)
    return tl.where((n == NMIX + 1)[None, :], tl.sum(usq, axis=1)[:, None], part)


@triton.jit
def _finish_rows(total, n, rows, rows64, r_in, r_live, d, h_ptr, w_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr,
                 comb_ptr, norm_eps, hc_eps, rms_eps, iters, HC: tl.constexpr, HCP: tl.constexpr, NP: tl.constexpr,
                 BM: tl.constexpr, BLOCK_N: tl.constexpr, NMIX: tl.constexpr, CACHE: tl.constexpr):
    """The rows' finish from their summed partials `total`: the coefficients (`_coefficients_tile`), then
    h = rms_norm(u) * w in place (`mhc._normed`'s order; u read with the cache modifier CACHE); rows not live +0.0,
    rows past B untouched."""
    sq_all = tl.sum(tl.where((n == NMIX)[None, :], total, 0.0), axis=1)  # one term and zeros: exact
    usq_all = tl.sum(tl.where((n == NMIX + 1)[None, :], total, 0.0), axis=1)
    _coefficients_tile(total, sq_all, rows, r_in, r_live, HC * d, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr,
                       norm_eps, hc_eps, iters, HC, HCP, NP, BM)
    r = _rsqrt64(_div(usq_all, (d + 0.0).to(tl.float32)) + rms_eps)  # `mhc._rms_inv` per row
    for d0 in range(0, d, BLOCK_N):
        cols = d0 + tl.arange(0, BLOCK_N)
        col_ok = cols < d
        at = rows64[:, None] * d + cols[None, :]
        u = tl.load(h_ptr + at, mask=r_live[:, None] & col_ok[None, :], other=0.0, cache_modifier=CACHE)
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        v = _cast((u.to(tl.float32) * r[:, None]) * w[None, :], h_ptr.dtype.element_ty)  # `mhc._normed`'s order
        tl.store(h_ptr + at, tl.where(r_live[:, None], v, 0.0).to(h_ptr.dtype.element_ty),
                 mask=r_in[:, None] & col_ok[None, :])


def _tiles(x, y, post_in, comb_in, fn_t, base, scale, pre_in, norm_weight, norm_eps, hc_eps, iters, rms_eps, rows,
           split_columns):
    B, hc, d, nmix, rows, expand, y, post_in, comb_in, pre_in, xo, h, pre, post, comb = site_args(
        x, y, post_in, comb_in, fn_t, base, scale, pre_in, norm_weight, iters, rows)
    block = min(TILE_BLOCK, triton.next_power_of_2(d))
    splits = splits_of(d, split_columns)
    chunk = triton.cdiv(triton.cdiv(d, splits), block) * block  # a whole number of steps a split
    splits = triton.cdiv(d, chunk)  # no empty split
    np_ = max(16, triton.next_power_of_2(nmix + 2))  # the products, then the two sums of squares (the dot's N >= 16)
    tiles = triton.cdiv(B, TILE_ROWS)
    if B:
        part = torch.empty(tiles, splits, TILE_ROWS, np_, dtype=torch.float32, device=x.device)
        _tile_kernel[(tiles, splits)](
            x, y, post_in, comb_in, xo, fn_t, fn_t.stride(0), fn_t.stride(1), base.float().contiguous(),
            scale.float().contiguous(), pre_in, norm_weight.contiguous(), h, pre, post, comb, part,
            _COUNTERS.get(x.device, tiles, kernel="mhc_prefill"), B, d, chunk, float(norm_eps), float(hc_eps),
            float(rms_eps), int(iters), rows, HC=hc, HCP=triton.next_power_of_2(hc), NP=np_, SPLITS=splits,
            EXPAND=expand, BM=TILE_ROWS, BLOCK=block, BLOCK_N=min(TILE_NORM, triton.next_power_of_2(d)),
            XP=1 if x.dtype == torch.bfloat16 else 3, num_warps=TILE_WARPS, **pdl_launch(x.device))
    return (xo, h, pre, post, comb) if expand else (h, pre, post, comb)


def hc_site_tiles(x, fn_t, base, scale, pre_in, norm_weight, *, norm_eps: float, hc_eps: float, iters: int,
                  rms_eps: float, rows: int | None = None, split_columns: int = SPLIT_COLUMNS):
    """`mhc.hc_site`'s function and outputs `(h, pre, post, comb)` for prefill rows (module docstring).
    `split_columns`: columns of d a split (a constant of the build; tests pass small ones to get several splits
    at small d)."""
    return _tiles(x, None, None, None, fn_t, base, scale, pre_in, norm_weight, norm_eps, hc_eps, iters, rms_eps, rows,
                  split_columns)


def hc_expand_site_tiles(y, x, post, comb, fn_t, base, scale, pre_in, norm_weight, *, norm_eps: float,
                         hc_eps: float, iters: int, rms_eps: float, rows: int | None = None,
                         split_columns: int = SPLIT_COLUMNS):
    """`mhc.hc_expand_site`'s function and outputs `(x', h, pre', post', comb')` for prefill rows (y in x's dtype
    or fp32, rounded to x's dtype in the load)."""
    return _tiles(x, y, post, comb, fn_t, base, scale, pre_in, norm_weight, norm_eps, hc_eps, iters, rms_eps, rows,
                  split_columns)
