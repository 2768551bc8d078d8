"""mHC sites of prefill rows as row blocks (issue 31): a mixing launch of blocks of BLOCK_ROWS rows x a fixed split
of d, then a finishing launch of FINISH_ROWS rows a program (MODEL.md §6; references: `dsv41.model.mhc`
coefficients / sinkhorn / collapse / expand and `dsv41.model.norm.rms_norm`; decode and verify rows keep
`mhc.py`'s row kernels).

Why. The row kernels run 32 programs a row, each streaming 1/32 of the mixing matrix fn [hc d, (2 + hc) hc] (2 MB
fp32 at d 5120) for its one row, with [hc, 32, 32] fp32 accumulators and the Sinkhorn tail in the same program:
255 registers a thread on sm_90 (ptxas -v; 162 without the prefetch and the whole-row norm load), so 2 programs an
SM, each a short latency-bound chain per row; at 2,048 rows 65,536 of them and fn re-read per row from L1 / L2
(~4 GB a site). The previous prefill tiles (mhc_prefill.py) spill (255 registers, ~1 KB of spill stores a
thread: [32, 4, 32] int64 address tiles, the three bf16 parts of fn, the reshaped operand) and run Sinkhorn for
32 rows in the tile's last program. Here every per-step value is a 2-D [rows, columns] tile of one stream, and the
tail is its own launch.

Mixing launch, program (block, split): the block's per-row coefficients (pre_in, post_in, comb_in) loaded once;
then per BLOCK_COLS-column step of its split, the step's hc streams loaded once, and per stream k in order:
[X'_k = post_k y + Σ_j comb[j, k] X_j (j in order), rounded to the stream dtype and stored;] the product
X'_k [rows, 16] @ fn's 16 rows of stream k [16, NP] added to the step's dot (compiled: the IEEE fp32 dot, FMA loops,
one chain over the step's hc x 16 terms per output element, from zero); Σx² and the collapse Σ_k pre_k X'_k per
element; then u rounded to the stream dtype and stored in h, Σu². The step's dot is added to the split's sum; the
split's partials (products, Σx², Σu² per row) go to `part` [B, splits, NP]. No arrival counters, no atomics.

Finishing launch, program of FINISH_ROWS rows: the partials summed in split order, then `mhc_prefill`'s tail over
the rows ([rows, hc, hc] tiles: rsqrt of the mean square in fp64, sigmoids, softmax + Sinkhorn), then
h = rms_norm(u) * w over the rows' h (the mixing launch's stores).

Row invariance: the block shape, the split of d, the column steps and every reduction order are constants or
functions of (hc, d), never of B; a row meets other rows only as other rows of the dot's operands (each output
element its own chain over k in k order, the same for every row and position) and of element-wise tiles. Rows of a
partial last block load nothing and store nothing; rows from `rows=` (live rows) on write +0.0 to every output. So a
row's bits are the same alone, in any slice of the chunk and at any position of its block (chunked == one-shot).
They are not the row kernels' bits (other sum orders over d and over the streams), nor the tiles'.

Numerics: the row kernels' class. fp32 sums (the mixing product in three levels: a step's hc x 16 terms, the steps
of a split, the splits in order; Σx² and Σu² per column, then reduced), the two rsqrt's in fp64, divisions
correctly rounded, exp in fp32; the collapse rounded to the stream dtype before the norm and X' before its
coefficients, as the reference does. Interpreted (no FMA dot there), the step's products per stream are summed over
k by numpy's reduction, then added: a BLAS matmul's order would depend on the row's position in the block.

`DSV41_PREFILL_MHC_BLOCKS` (`blocks_on`, read when a forward starts; off by default until the GPU A/B): prefill rows'
sites take these launches (runtime/mhc_sites.py `MhcSites.of(phase=)`; over `DSV41_PREFILL_MHC_TILES` where both
are set). The lone expand and the final collapse + norm read no fn and stay the row launchers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..exl3.backend import interpreting
from .knobs import switched_on
from .mhc import _cast
from .mhc_args import site_args
from .mhc_prefill import _finish_rows, _pack_partial
from .pdl import launch as pdl_launch, wait_previous

ENV = "DSV41_PREFILL_MHC_BLOCKS"
COMPILED = tl.constexpr(not interpreting())  # the IEEE FMA dot (compiled) or numpy's sum over k (interpreted)
BLOCK_ROWS = 32  # rows a mixing program (the dot's M: each fn value loaded feeds 32 rows); never chosen from B
BLOCK_COLS = 16  # columns of d a step (the dot's K a stream; >= 16 for the dot whatever d)
SPLIT_COLUMNS = 256  # columns of d a split: d 5120 -> 20 splits of 16 steps; from d only
# sm_90, ptxas -v, the expand site (bf16), 32 rows x 16 columns on 8 warps: 180 registers a thread unbounded (one
# block an SM), 128 without spills under MIX_MAXNREG (two blocks an SM, 16 warps); 4 warps or 32 columns a step
# take all 255 and spill (the FMA dot holds each thread's rows x K of both operands)
MIX_WARPS = 8
MIX_MAXNREG = 128
FINISH_ROWS = 16  # rows a finishing program: 128 programs at 2,048 rows, Sinkhorn on [16, hc, hc]
FINISH_NORM = 256  # columns a step of the norm pass ([FINISH_ROWS, 256] values: 32 a thread)
FINISH_WARPS = 4


def blocks_on() -> bool:
    """Whether prefill rows' sites take these launches (`DSV41_PREFILL_MHC_BLOCKS=1`; off by default until a GPU
    A/B); read when a forward starts."""
    return switched_on(ENV, default=False)


def split_of(d: int, split_columns: int = SPLIT_COLUMNS) -> tuple[int, int]:
    """(columns a split, splits) of d, functions of d alone: about split_columns columns a split, a whole number of
    steps each, no empty split (d 5120: 20 splits of 256)."""
    chunk = triton.cdiv(triton.cdiv(d, triton.cdiv(d, split_columns)), BLOCK_COLS) * BLOCK_COLS
    return chunk, triton.cdiv(d, chunk)


@triton.jit
def _mix(xs, f, acc):
    """acc + xs [BM, K] @ f [K, NP], fp32, each output element its own chain (module docstring). Compiled: the IEEE
    fp32 dot, FMA loops from acc in k order (no tf32, no tensor cores). Interpreted: the products summed over k by
    numpy's reduction, then added to acc (one order for every row)."""
    if COMPILED:
        return tl.dot(xs, f, acc, input_precision="ieee")
    else:
        return acc + tl.sum(xs[:, :, None] * f[None, :, :], axis=1)


@triton.jit
def _row_coefficients(pre_in_ptr, post_in_ptr, comb_in_ptr, rows, r_live, HC: tl.constexpr, EXPAND: tl.constexpr):
    """The block's per-row coefficients, loaded once a program (not once a step): a tuple of [BM] fp32 vectors,
    pre_in[k] for k < HC, then with EXPAND post_in[k], then comb_in[j, k] at 2 HC + j HC + k (rows not live: 0)."""
    coef = ()
    for k in tl.static_range(HC):
        coef = coef + (tl.load(pre_in_ptr + rows * HC + k, mask=r_live, other=0.0),)
    if EXPAND:
        for k in tl.static_range(HC):
            coef = coef + (tl.load(post_in_ptr + rows * HC + k, mask=r_live, other=0.0),)
        for jk in tl.static_range(HC * HC):
            coef = coef + (tl.load(comb_in_ptr + rows * HC * HC + jk, mask=r_live, other=0.0),)
    return coef


@triton.jit
def _stream(x_in, y, coef, xo_ptr, rows64, r_in, cols, col_ok, k, d, HC: tl.constexpr, EXPAND: tl.constexpr,
            BM: tl.constexpr, BLOCK: tl.constexpr):
    """Stream k of a step's rows and columns as fp32 [BM, BLOCK] from the step's streams `x_in` (a tuple of HC fp32
    tiles): X_k, or with EXPAND X'_k (rounded to the stream dtype, stored in xo; rows not live come out +0.0 from
    zero inputs)."""
    if EXPAND:
        # Σ_j comb[j, k] X_j in j order, then post_k y added (the reference's order: the mix, then the sum)
        mixed = tl.zeros((BM, BLOCK), tl.float32)
        for j in tl.static_range(HC):
            mixed += coef[2 * HC + j * HC + k][:, None] * x_in[j]
        xn = _cast(coef[HC + k][:, None] * y + mixed, xo_ptr.dtype.element_ty)
        tl.store(xo_ptr + rows64[:, None] * HC * d + k * d + cols[None, :], xn, mask=r_in[:, None] & col_ok[None, :])
        return xn.to(tl.float32)
    else:
        return x_in[k]


@triton.jit
def _step(x_ptr, y_ptr, coef, xo_ptr, fn_ptr, stride_fk, stride_fn, h_ptr, rows64, r_in, r_live, d0, d,
          HC: tl.constexpr, NP: tl.constexpr, EXPAND: tl.constexpr, BM: tl.constexpr, BLOCK: tl.constexpr):
    """One BLOCK-column step of a mixing program over every stream: returns the step's [BM, NP] dot (from zero) and
    the [BM, BLOCK] squares of the streams (summed over them) and of the rounded collapse (stored in h)."""
    NMIX: tl.constexpr = (2 + HC) * HC
    cols = d0 + tl.arange(0, BLOCK)
    col_ok = cols < d
    i = tl.arange(0, BLOCK)
    n = tl.arange(0, NP)
    f_ok = (d0 + i < d)[:, None] & (n < NMIX)[None, :]
    y = tl.zeros((BM, BLOCK), tl.float32)
    if EXPAND:
        y = tl.load(y_ptr + rows64[:, None] * d + cols[None, :], mask=r_live[:, None] & col_ok[None, :], other=0.0)
        # an fp32 y (a reduced partial) is rounded to the stream dtype first, as its `.to(dtype)` would
        y = _cast(y.to(tl.float32), xo_ptr.dtype.element_ty).to(tl.float32)
    x_in = ()  # the step's streams, each loaded once
    for j in tl.static_range(HC):
        x_in = x_in + (tl.load(x_ptr + rows64[:, None] * HC * d + j * d + cols[None, :],
                               mask=r_live[:, None] & col_ok[None, :], other=0.0).to(tl.float32),)
    prod = tl.zeros((BM, NP), tl.float32)
    sq = tl.zeros((BM, BLOCK), tl.float32)
    u = tl.zeros((BM, BLOCK), tl.float32)
    for k in tl.static_range(HC):
        xs = _stream(x_in, y, coef, xo_ptr, rows64, r_in, cols, col_ok, k, d, HC, EXPAND, BM, BLOCK)
        # fn's rows of stream k and the step's columns: fn_t[k d + d0 + i, n]
        f = tl.load(fn_ptr + (k * d + d0 + i)[:, None] * stride_fk + n[None, :] * stride_fn, mask=f_ok, other=0.0)
        prod = _mix(xs, f, prod)
        sq += xs * xs
        u += coef[k][:, None] * xs  # the collapse Σ_k pre_k X_k in k order
    ub = _cast(u, h_ptr.dtype.element_ty)  # in the stream dtype, as the reference's collapse
    tl.store(h_ptr + rows64[:, None] * d + cols[None, :], ub, mask=r_in[:, None] & col_ok[None, :])
    u32 = ub.to(tl.float32)
    return prod, sq, u32 * u32


@triton.jit(do_not_specialize=["B", "live_rows"])
def _mix_kernel(x_ptr, y_ptr, post_in_ptr, comb_in_ptr, xo_ptr, fn_ptr, stride_fk, stride_fn, pre_in_ptr, h_ptr,
                part_ptr, B, d, chunk, live_rows, HC: tl.constexpr, NP: tl.constexpr, SPLITS: tl.constexpr,
                EXPAND: tl.constexpr, BM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (block, split): rows [block BM, block BM + BM) over the split's `chunk` columns of d (module
    docstring). Streams [B, HC, d] contiguous; coefficients fp32 contiguous; fn_t [HC d, NMIX] strided; part
    [B, SPLITS, NP] fp32 (lanes: the products, then Σx², then Σu²)."""
    NMIX: tl.constexpr = (2 + HC) * HC
    block = tl.program_id(0)
    split = tl.program_id(1)
    wait_previous(PDL)
    rows = block * BM + tl.arange(0, BM)
    r_in = rows < B  # rows of the launch (a partial last block's others: no load, no store)
    r_live = rows < live_rows  # computed; rows [live_rows, B) come out +0.0
    rows64 = rows.to(tl.int64)
    n = tl.arange(0, NP)
    acc = tl.zeros((BM, NP), tl.float32)
    sq = tl.zeros((BM, BLOCK), tl.float32)
    usq = tl.zeros((BM, BLOCK), tl.float32)
    coef = _row_coefficients(pre_in_ptr, post_in_ptr, comb_in_ptr, rows, r_live, HC, EXPAND)
    first = split * chunk
    for d0 in range(first, tl.minimum(first + chunk, d), BLOCK):
        prod, sq_step, usq_step = _step(x_ptr, y_ptr, coef, xo_ptr, fn_ptr, stride_fk, stride_fn, h_ptr, rows64, r_in,
                                        r_live, d0, d, HC, NP, EXPAND, BM, BLOCK)
        acc += prod
        sq += sq_step
        usq += usq_step
    part = _pack_partial(acc, sq, usq, n, NMIX)
    tl.store(part_ptr + (rows64[:, None] * SPLITS + split) * NP + n[None, :], part, mask=r_in[:, None])


@triton.jit(do_not_specialize=["B", "live_rows"])
def _finish_kernel(part_ptr, base_ptr, scale_ptr, w_ptr, h_ptr, pre_ptr, post_ptr, comb_ptr, B, d, norm_eps, hc_eps,
                   rms_eps, iters, live_rows, HC: tl.constexpr, HCP: tl.constexpr, NP: tl.constexpr,
                   SPLITS: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    """Program of BM rows: their partials summed in split order, the coefficients (`_coefficients_tile`), then
    h = rms_norm(u) * w in place (`mhc._normed`'s order); rows not live +0.0, rows past B untouched."""
    NMIX: tl.constexpr = (2 + HC) * HC
    wait_previous(PDL)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    r_in = rows < B
    r_live = rows < live_rows
    rows64 = rows.to(tl.int64)
    n = tl.arange(0, NP)
    total = tl.zeros((BM, NP), tl.float32)
    for t in tl.static_range(SPLITS):  # split order; unrolled, so the loads are in flight together
        total += tl.load(part_ptr + (rows64[:, None] * SPLITS + t) * NP + n[None, :], mask=r_live[:, None], other=0.0)
    _finish_rows(total, n, rows, rows64, r_in, r_live, d, h_ptr, w_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr,
                 comb_ptr, norm_eps, hc_eps, rms_eps, iters, HC, HCP, NP, BM, BLOCK_N, NMIX, "")


def _blocks(x, y, post_in, comb_in, fn_t, base, scale, pre_in, norm_weight, norm_eps, hc_eps, iters, rms_eps, rows,
            split_columns):
    B, hc, d, nmix, rows, expand, y, post_in, comb_in, pre_in, xo, h, pre, post, comb = site_args(
        x, y, post_in, comb_in, fn_t, base, scale, pre_in, norm_weight, iters, rows)
    chunk, splits = split_of(d, split_columns)
    np_ = max(16, triton.next_power_of_2(nmix + 2))  # the products, then the two sums of squares (the dot's N >= 16)
    if B:
        pdl = pdl_launch(x.device)
        part = torch.empty(B, splits, np_, dtype=torch.float32, device=x.device)
        _mix_kernel[(triton.cdiv(B, BLOCK_ROWS), splits)](
            x, y, post_in, comb_in, xo, fn_t, fn_t.stride(0), fn_t.stride(1), pre_in, h, part, B, d, chunk, rows,
            HC=hc, NP=np_, SPLITS=splits, EXPAND=expand, BM=BLOCK_ROWS, BLOCK=BLOCK_COLS, num_warps=MIX_WARPS,
            **({"maxnreg": MIX_MAXNREG} if MIX_MAXNREG else {}), **pdl)
        _finish_kernel[(triton.cdiv(B, FINISH_ROWS),)](
            part, base.float().contiguous(), scale.float().contiguous(), norm_weight.contiguous(), h, pre, post, comb,
            B, d, float(norm_eps), float(hc_eps), float(rms_eps), int(iters), rows, HC=hc,
            HCP=triton.next_power_of_2(hc), NP=np_, SPLITS=splits, BM=FINISH_ROWS,
            BLOCK_N=min(FINISH_NORM, triton.next_power_of_2(d)), num_warps=FINISH_WARPS, **pdl)
    return (xo, h, pre, post, comb) if expand else (h, pre, post, comb)


def hc_site_blocks(x, fn_t, base, scale, pre_in, norm_weight, *, norm_eps: float, hc_eps: float, iters: int,
                   rms_eps: float, rows: int | None = None, split_columns: int = SPLIT_COLUMNS):
    """`mhc.hc_site`'s function and outputs `(h, pre, post, comb)` for prefill rows (module docstring).
    `split_columns`: columns of d a split (a constant of the build; tests pass small ones to get several splits
    at small d)."""
    return _blocks(x, None, None, None, fn_t, base, scale, pre_in, norm_weight, norm_eps, hc_eps, iters, rms_eps,
                   rows, split_columns)


def hc_expand_site_blocks(y, x, post, comb, fn_t, base, scale, pre_in, norm_weight, *, norm_eps: float,
                          hc_eps: float, iters: int, rms_eps: float, rows: int | None = None,
                          split_columns: int = SPLIT_COLUMNS):
    """`mhc.hc_expand_site`'s function and outputs `(x', h, pre', post', comb')` for prefill rows (y in x's dtype
    or fp32, rounded to x's dtype in the load)."""
    return _blocks(x, y, post, comb, fn_t, base, scale, pre_in, norm_weight, norm_eps, hc_eps, iters, rms_eps, rows,
                   split_columns)
