"""mHC sites in one launch each (MODEL.md §6; references: `dsv41.model.mhc` coefficients / sinkhorn / collapse /
expand and `dsv41.model.norm.rms_norm`).

Row invariance: a site launch runs `splits` programs per row (token), each over a fixed slice of d (the mixing
product streams all of fn, 2 MB at d = 5120: split so that one row does not wait on one SM's bandwidth); the row's
last program to arrive (an arrival counter, no float atomics) sums the partials in split order and finishes the
row. Tiles, loop bounds, splits and reduction order depend on hc and d only, never on B: a row's bits are its own
inputs' alone. Plain Triton, no tensor-core or Hopper-only instruction (atomics and barriers are sm_70+), so it
compiles for sm_80..sm_121 and runs in Triton's interpreter.

- `hc_site`: the coefficients H(X) of the streams (mixing product, rsqrt of the mean square, sigmoids, softmax +
  Sinkhorn) and h = rms_norm(collapse(X, pre_in)) of the sublayer input (single-pass schedule: the site collapses
  with the pre carried in, not with the pre it computes).
- `hc_expand_site`: X' = expand(y, X, post, comb) then the next site on X' (the attention site's expand and the FFN
  site in one pass: X' is written once and never read back).
- `hc_expand`: X' alone (the FFN site's expand); `collapse_norm`: the final collapse + norm.

Live rows (`rows=`, every launcher): the decode path lays its rows out in a fixed bucket (runtime/model.py, BUCKET),
real rows first, the rest padding. With `rows=k` the programs of rows [k, B) skip the work (Sinkhorn included)
and write +0.0 to every output of their row, in the same launch (no memset beside it, no host sync, no
data-dependent shape: CUDA-graph capturable). Zero padding rows keep every later row-wise op finite (RMSNorm of a
zero row is zero). One program (set) per row either way: a live row's bits do not depend on `rows`; `rows=None`
(= B) is the full launch.

Numerics: fp32 throughout, sums in a fixed blocked order; the two rsqrt's in fp64 (IEEE sqrt and division, then one
rounding, as the reference's `f64`), divisions correctly rounded (`div_rn`, as the reference's fp32 ones); exp in
fp32 (the reference's is fp64 rounded to fp32: a few fp32 ulp apart). The collapse is rounded to the stream dtype
before the norm, and X' before its coefficients, as the reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .knobs import switched_on
from .pdl import launch as pdl_launch, wait_previous

from .live import live_rows as _live_rows
from .mhc_args import _coeff, _streams, site_args

BLOCK_D = 32  # columns of d per step of the mixing loop: the [hc, BLOCK_D, (2 + hc) * hc] product tile
BLOCK_H = 1024  # columns per step of the norm pass
BLOCK_E = 256  # columns per program of a lone expand (its [hc, hc, BLOCK_E] product: 128 registers at 1024)
NUM_WARPS = 4
MAX_SPLITS = 32  # programs per row of a site launch (each streams 1/splits of fn): from d only, never from B
# d = 5120: 32 splits of 160 columns, the fastest over 1 and 16 rows with cold weights on the H200
# (bench/results/step_kernel_sweep.json: the expand + site 14.1 + 13.6 us at one row against 20.5 + 18.5 at 16)
SPLIT_COLUMNS = 160
NORM_ALL_MAX = 8192  # the widest row whose collapse and norm weight the last arriver loads as one block


def pipelined() -> bool:
    """Whether a site prefetches (read at each launch; `DSV41_MHC_PIPELINE=0` for A/B runs). On: a split's next
    column block is loaded while the current one is summed (its first block before the PDL wait: the mixing matrix is
    a weight no kernel writes), and the last arriver loads the row's whole collapse and norm weight at once, before
    Sinkhorn, instead of one block after another behind it. Off: one block's loads at a time. The same arithmetic in
    the same order either way, so the same bits."""
    return switched_on("DSV41_MHC_PIPELINE")


def default_splits(d: int) -> int:
    """Programs per row: about SPLIT_COLUMNS columns each, at most MAX_SPLITS (d = 5120: 32 of 160 columns)."""
    return max(1, min(MAX_SPLITS, triton.cdiv(d, SPLIT_COLUMNS)))


class _Counters:
    """Arrival counters of the step kernels whose last arriving program finishes a unit: the site launches' per
    row, the attention core's per (row, head block) (kernels/step/attention.py, `kernel="attention"`). Zero between
    launches (the last arriver resets its unit's), kept per (kernel, device) so that a launch allocates nothing it
    must clear. Regrown by allocating: runtime/graphs.py keeps every buffer here alive with the graphs that hold it
    (`_kernel_buffers`)."""

    def __init__(self):
        self._by_device: dict[str, torch.Tensor] = {}  # "device" (the sites) or "kernel@device" -> int32 counters

    def get(self, device: torch.device, rows: int, kernel: str = "") -> torch.Tensor:
        key = f"{kernel}@{device}" if kernel else str(device)
        have = self._by_device.get(key)
        if have is None or have.numel() < rows:
            have = torch.zeros(max(rows, 64), dtype=torch.int32, device=device)
            self._by_device[key] = have
        return have


_COUNTERS = _Counters()


@triton.jit
def _rsqrt64(v):
    """1 / sqrt(v) in fp64 (IEEE sqrt and division), rounded once to fp32: the reference's `f64(torch.rsqrt, v)`."""
    v64 = v.to(tl.float64)
    return (1.0 / tl.sqrt(v64)).to(tl.float32)


@triton.jit
def _cast(v, DT: tl.constexpr):
    """fp32 -> the stream dtype, rounded to nearest even. bf16 by its bits (what the GPU's cvt.rn does; Triton's
    interpreter would truncate a plain cast); other dtypes by a plain cast."""
    if DT == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(DT)


@triton.jit
def _sigmoid(z):
    return tl.div_rn(tl.zeros_like(z) + 1.0, 1.0 + tl.exp(-z))


@triton.jit
def _coefficients(mix, sq, row, K, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, norm_eps, hc_eps, iters,
                  HC: tl.constexpr, HCP: tl.constexpr, NP: tl.constexpr):
    """From the row's mixing product (mix [NP], lanes >= (2 + hc) hc ignored) and sum of x² (sq): pre, post, comb."""
    NMIX: tl.constexpr = (2 + HC) * HC
    n = tl.arange(0, NP)
    m = mix * _rsqrt64(tl.div_rn(sq, (K + 0.0).to(tl.float32)) + norm_eps)  # the mean as torch's: IEEE division
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    scale = tl.where(n < HC, s0, tl.where(n < 2 * HC, s1, s2))
    z = m * scale + tl.load(base_ptr + n, mask=n < NMIX, other=0.0)
    sig = _sigmoid(z)
    tl.store(pre_ptr + row * HC + n, sig + hc_eps, mask=n < HC)
    tl.store(post_ptr + row * HC + (n - HC), 2 * sig, mask=(n >= HC) & (n < 2 * HC))
    # comb logits as a [HCP, HCP] tile: select z[2 hc + j hc + k] (a sum of one term and zeros: exact)
    j = tl.arange(0, HCP)
    k = tl.arange(0, HCP)
    live = (j[:, None] < HC) & (k[None, :] < HC)
    at = 2 * HC + j[:, None] * HC + k[None, :]
    pick = at[:, :, None] == n[None, None, :]
    logits = tl.sum(tl.where(pick, z[None, None, :], 0.0), axis=2)
    # Sinkhorn (model/mhc.py:sinkhorn): softmax over k, + eps, column; then (iters - 1) x {row, column}
    logits = tl.where(live, logits, -1e30)  # finite: a padded row (hc < HCP) stays free of inf - inf
    e = tl.where(live, tl.exp(logits - tl.max(logits, axis=1)[:, None]), 0.0)
    total = tl.where(j < HC, tl.sum(e, axis=1), 1.0)
    c = tl.where(live, tl.div_rn(e, tl.broadcast_to(total[:, None], e.shape)) + hc_eps, 0.0)
    c = tl.div_rn(c, tl.broadcast_to(tl.sum(c, axis=0)[None, :] + hc_eps, c.shape))
    for _ in range(iters - 1):
        c = tl.div_rn(c, tl.broadcast_to(tl.sum(c, axis=1)[:, None] + hc_eps, c.shape))
        c = tl.div_rn(c, tl.broadcast_to(tl.sum(c, axis=0)[None, :] + hc_eps, c.shape))
    tl.store(comb_ptr + row * HC * HC + j[:, None] * HC + k[None, :], c, mask=live)


@triton.jit
def _norm_pass(h_ptr, w_ptr, row, d, usq, rms_eps, BLOCK: tl.constexpr):
    """h holds the row's collapse (rounded to the stream dtype; usq: the sum of its squares), stored by other threads
    or programs before a barrier / the arrival ticket: h <- rms_norm(h) * w. L1 bypassed (.cg) for those stores."""
    r = _rms_inv(usq, d, rms_eps)
    for d0 in range(0, d, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        live = cols < d
        u = tl.load(h_ptr + row * d + cols, mask=live, other=0.0, cache_modifier=".cg")
        w = tl.load(w_ptr + cols, mask=live, other=0.0)
        tl.store(h_ptr + row * d + cols, _normed(u, w, r, h_ptr.dtype.element_ty), mask=live)


@triton.jit
def _rms_inv(usq, d, rms_eps):
    """1 / rms of a row of d values whose squares sum to usq (the mean by IEEE division, as torch's)."""
    return _rsqrt64(tl.div_rn(usq, (d + 0.0).to(tl.float32)) + rms_eps)


@triton.jit
def _normed(u, w, r, out_ty: tl.constexpr):
    """rms_norm(u) * w from r = `_rms_inv`, in the reference's order, rounded to out_ty."""
    return _cast((u.to(tl.float32) * r) * w.to(tl.float32), out_ty)


@triton.jit(do_not_specialize=["live_rows"])
def _site_kernel(x_ptr, y_ptr, post_in_ptr, comb_in_ptr, xo_ptr, fn_ptr, stride_fk, stride_fn, base_ptr, scale_ptr,
                 pre_in_ptr, w_ptr, h_ptr, pre_ptr, post_ptr, comb_ptr, part_ptr, count_ptr, d, chunk, norm_eps, hc_eps,
                 rms_eps, iters, live_rows, HC: tl.constexpr, HCP: tl.constexpr, NP: tl.constexpr,
                 SPLITS: tl.constexpr, EXPAND: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                 PDL: tl.constexpr = False, PIPELINE: tl.constexpr = False, NORM_ALL: tl.constexpr = 0):
    """Program (row, split): over the split's `chunk` columns of d, [X' = expand(y, X, post_in, comb_in), written to
    xo;] the partial mixing product and sum of squares of X (or X'), and u = collapse(X (or X'), pre_in) rounded to
    the stream dtype, into h. Partials go to part [B, SPLITS, NP] (lanes: the (2 + hc) hc products, then Σx², then
    Σu²); the row's last program to arrive sums them in split order and finishes: coefficients, h = rms_norm(u) * w.
    Streams [B, HC, d] contiguous; coefficients fp32 contiguous; fn_t [HC*d, NMIX] strided. Rows from `live_rows`
    on (a bucket's padding) write +0.0 to every output (`_zero_row`) and read nothing. PIPELINE / NORM_ALL:
    `pipelined()` (NORM_ALL: the row's columns as one block, a power of two >= d; 0: the norm pass in blocks)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    f0 = _fn_block(fn_ptr, stride_fk, stride_fn, split * chunk, d, d, (row < live_rows) & PIPELINE, HC, HCP, NP,
                   BLOCK)  # a weight: loaded before the wait (all masked off, no load, without PIPELINE)
    wait_previous(PDL)
    if row >= live_rows:
        _zero_row(xo_ptr, h_ptr, pre_ptr, post_ptr, comb_ptr, row, split, d, chunk, HC, HCP, EXPAND, BLOCK)
    else:
        _site_row(x_ptr, y_ptr, post_in_ptr, comb_in_ptr, xo_ptr, fn_ptr, stride_fk, stride_fn, base_ptr, scale_ptr,
                  pre_in_ptr, w_ptr, h_ptr, pre_ptr, post_ptr, comb_ptr, part_ptr, count_ptr, d, chunk, norm_eps,
                  hc_eps, rms_eps, iters, row, split, f0, HC, HCP, NP, SPLITS, EXPAND, BLOCK, BLOCK_N, PIPELINE,
                  NORM_ALL)


@triton.jit
def _fn_block(fn_ptr, stride_fk, stride_fn, d0, d, lim, on, HC: tl.constexpr, HCP: tl.constexpr, NP: tl.constexpr,
              BLOCK: tl.constexpr):
    """The mixing matrix's [HCP, BLOCK, NP] tile of columns d0.. (those < lim; none unless `on`), fp32."""
    c = tl.arange(0, HCP)
    n = tl.arange(0, NP)
    cols = d0 + tl.arange(0, BLOCK)
    live = (c < HC)[:, None] & (cols < lim)[None, :] & on
    return tl.load(fn_ptr + (c[:, None, None] * d + cols[None, :, None]) * stride_fk + n[None, None, :] * stride_fn,
                   mask=live[:, :, None] & (n < (2 + HC) * HC)[None, None, :], other=0.0)


@triton.jit
def _x_block(x_ptr, row, d0, d, lim, HC: tl.constexpr, HCP: tl.constexpr, BLOCK: tl.constexpr):
    """The row's streams' [HCP, BLOCK] tile of columns d0.. (those < lim), as stored."""
    c = tl.arange(0, HCP)
    cols = d0 + tl.arange(0, BLOCK)
    live = (c < HC)[:, None] & (cols < lim)[None, :]
    return tl.load(x_ptr + row * HC * d + c[:, None] * d + cols[None, :], mask=live, other=0.0)


@triton.jit
def _y_block(y_ptr, row, d0, d, lim, EXPAND: tl.constexpr, BLOCK: tl.constexpr):
    """The sublayer output's columns d0.. (those < lim) as stored; zeros without EXPAND (y unused)."""
    cols = d0 + tl.arange(0, BLOCK)
    if EXPAND:
        return tl.load(y_ptr + row * d + cols, mask=cols < lim, other=0.0)
    else:
        return tl.zeros((BLOCK,), tl.float32)


@triton.jit
def _site_block(x_raw, y_raw, f, acc, sq, usq, pre_in, post_in, comb_in, xo_ptr, h_ptr, row, d0, d,
                HC: tl.constexpr, HCP: tl.constexpr, EXPAND: tl.constexpr, BLOCK: tl.constexpr):
    """One column block of a split: [X' stored,] the mixing product, Σx², the collapse u stored in h, Σu²."""
    xs = _expanded(x_raw, y_raw, post_in, comb_in, xo_ptr, row, d0, d, HC, HCP, EXPAND, BLOCK)
    acc += xs[:, :, None] * f
    sq += xs * xs
    u32 = _collapsed(xs, pre_in, h_ptr, row, d0, d, BLOCK)
    usq += u32 * u32
    return acc, sq, usq


@triton.jit
def _row_inputs(pre_in_ptr, post_in_ptr, comb_in_ptr, row, HC: tl.constexpr, HCP: tl.constexpr, EXPAND: tl.constexpr):
    """The row's coefficients carried in: pre_in [HCP], and with EXPAND post_in [HCP] and comb_in [j, k] (without:
    pre_in and zeros, unused), lanes >= hc zero."""
    c = tl.arange(0, HCP)
    c_live = c < HC
    pre_in = tl.load(pre_in_ptr + row * HC + c, mask=c_live, other=0.0)
    post_in = pre_in
    comb_in = tl.zeros((HCP, HCP), tl.float32)
    if EXPAND:
        post_in = tl.load(post_in_ptr + row * HC + c, mask=c_live, other=0.0)
        comb_in = tl.load(comb_in_ptr + row * HC * HC + c[:, None] * HC + c[None, :],
                          mask=c_live[:, None] & c_live[None, :], other=0.0)  # [j, k]
    return pre_in, post_in, comb_in


@triton.jit
def _expanded(x_raw, y_raw, post_in, comb_in, xo_ptr, row, d0, d, HC: tl.constexpr, HCP: tl.constexpr,
              EXPAND: tl.constexpr, BLOCK: tl.constexpr):
    """A column block's streams as fp32 [HCP, BLOCK]: X, or with EXPAND X' = expand(y, X, post_in, comb_in) (stored
    in xo, rounded to the stream dtype; columns past d 0). Shared with the prefill split (mhc_split.py), whose X' is
    these bits."""
    c = tl.arange(0, HCP)
    cols = d0 + tl.arange(0, BLOCK)
    live = (c < HC)[:, None] & (cols < d)[None, :]
    xs = x_raw.to(tl.float32)  # [HCP, BLOCK]
    if EXPAND:
        # an fp32 y (a reduced partial) is rounded to the stream dtype first, as its `.to(dtype)` would
        y = _cast(y_raw.to(tl.float32), xo_ptr.dtype.element_ty).to(tl.float32)
        mixed = tl.sum(comb_in[:, :, None] * xs[:, None, :], axis=0)  # Σ_j comb[j, k] X[j]: [k, BLOCK]
        xn = _cast(post_in[:, None] * y[None, :] + mixed, xo_ptr.dtype.element_ty)
        tl.store(xo_ptr + row * HC * d + c[:, None] * d + cols[None, :], xn, mask=live)
        xs = tl.where(live, xn.to(tl.float32), 0.0)
    return xs


@triton.jit
def _collapsed(xs, pre_in, h_ptr, row, d0, d, BLOCK: tl.constexpr):
    """u = collapse(xs, pre_in) of a column block rounded to the stream dtype, stored in h's row; returned as fp32.
    Shared with the prefill split (mhc_split.py)."""
    cols = d0 + tl.arange(0, BLOCK)
    u = _cast(tl.sum(pre_in[:, None] * xs, axis=0), h_ptr.dtype.element_ty)  # collapse, in the stream dtype
    tl.store(h_ptr + row * d + cols, u, mask=cols < d)
    return u.to(tl.float32)


@triton.jit
def _zero_row(xo_ptr, h_ptr, pre_ptr, post_ptr, comb_ptr, row, split, d, chunk, HC: tl.constexpr, HCP: tl.constexpr,
              EXPAND: tl.constexpr, BLOCK: tl.constexpr):
    """A padding row's share of a site's outputs as +0.0: its split's columns of h (and X'), the coefficients by
    split 0."""
    c = tl.arange(0, HCP)
    c_live = c < HC
    for d0 in range(split * chunk, split * chunk + chunk, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        if EXPAND:
            tl.store(xo_ptr + row * HC * d + c[:, None] * d + cols[None, :],
                     tl.zeros((HCP, BLOCK), dtype=xo_ptr.dtype.element_ty), mask=c_live[:, None] & (cols < d)[None, :])
        tl.store(h_ptr + row * d + cols, tl.zeros((BLOCK,), dtype=h_ptr.dtype.element_ty), mask=cols < d)
    if split == 0:
        tl.store(pre_ptr + row * HC + c, tl.zeros((HCP,), tl.float32), mask=c_live)
        tl.store(post_ptr + row * HC + c, tl.zeros((HCP,), tl.float32), mask=c_live)
        tl.store(comb_ptr + row * HC * HC + c[:, None] * HC + c[None, :], tl.zeros((HCP, HCP), tl.float32),
                 mask=c_live[:, None] & c_live[None, :])


@triton.jit
def _site_row(x_ptr, y_ptr, post_in_ptr, comb_in_ptr, xo_ptr, fn_ptr, stride_fk, stride_fn, base_ptr, scale_ptr,
              pre_in_ptr, w_ptr, h_ptr, pre_ptr, post_ptr, comb_ptr, part_ptr, count_ptr, d, chunk, norm_eps, hc_eps,
              rms_eps, iters, row, split, f0, HC: tl.constexpr, HCP: tl.constexpr, NP: tl.constexpr,
              SPLITS: tl.constexpr, EXPAND: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
              PIPELINE: tl.constexpr, NORM_ALL: tl.constexpr):
    NMIX: tl.constexpr = (2 + HC) * HC
    n = tl.arange(0, NP)
    pre_in, post_in, comb_in = _row_inputs(pre_in_ptr, post_in_ptr, comb_in_ptr, row, HC, HCP, EXPAND)
    acc = tl.zeros((HCP, BLOCK, NP), tl.float32)
    sq = tl.zeros((HCP, BLOCK), tl.float32)
    usq = tl.zeros((BLOCK,), tl.float32)
    first = split * chunk
    end = first + chunk
    if PIPELINE:  # block k + 1's loads issued before block k's sums (the loop's stores keep them from moving up)
        lim = tl.minimum(end, d)
        f = f0
        x_raw = _x_block(x_ptr, row, first, d, d, HC, HCP, BLOCK)
        y_raw = _y_block(y_ptr, row, first, d, d, EXPAND, BLOCK)
        for d0 in range(first, end, BLOCK):
            f_cur, x_cur, y_cur = f, x_raw, y_raw
            f = _fn_block(fn_ptr, stride_fk, stride_fn, d0 + BLOCK, d, lim, True, HC, HCP, NP, BLOCK)
            x_raw = _x_block(x_ptr, row, d0 + BLOCK, d, lim, HC, HCP, BLOCK)
            y_raw = _y_block(y_ptr, row, d0 + BLOCK, d, lim, EXPAND, BLOCK)
            acc, sq, usq = _site_block(x_cur, y_cur, f_cur, acc, sq, usq, pre_in, post_in, comb_in, xo_ptr, h_ptr,
                                       row, d0, d, HC, HCP, EXPAND, BLOCK)
    else:
        for d0 in range(first, end, BLOCK):
            acc, sq, usq = _site_block(_x_block(x_ptr, row, d0, d, d, HC, HCP, BLOCK),
                                       _y_block(y_ptr, row, d0, d, d, EXPAND, BLOCK),
                                       _fn_block(fn_ptr, stride_fk, stride_fn, d0, d, d, True, HC, HCP, NP, BLOCK),
                                       acc, sq, usq, pre_in, post_in, comb_in, xo_ptr, h_ptr, row, d0, d, HC, HCP,
                                       EXPAND, BLOCK)
    part = tl.sum(tl.sum(acc, axis=1), axis=0)
    part = tl.where(n == NMIX, tl.sum(tl.sum(sq, axis=1), axis=0), part)
    part = tl.where(n == NMIX + 1, tl.sum(usq, axis=0), part)
    tl.store(part_ptr + (row * SPLITS + split) * NP + n, part)
    tl.debug_barrier()  # every thread's stores (xo, h, part) before the release of the ticket
    ticket = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
    if ticket == SPLITS - 1:
        total = tl.zeros((NP,), tl.float32)
        # split order: the same sum whichever program finishes; unrolled, so the SPLITS loads are in flight
        # together (a loop waited for each one: ~0.3 µs of L2 latency each, most of the site's 18 µs at one row)
        for t in tl.static_range(SPLITS):
            total += tl.load(part_ptr + (row * SPLITS + t) * NP + n, cache_modifier=".cg")
        if NORM_ALL:  # the row's collapse and norm weight in flight with the partials, used after Sinkhorn
            cols = tl.arange(0, NORM_ALL)
            u_all = tl.load(h_ptr + row * d + cols, mask=cols < d, other=0.0, cache_modifier=".cg")
            w_all = tl.load(w_ptr + cols, mask=cols < d, other=0.0)
        tl.atomic_xchg(count_ptr + row, 0)  # ready for the next launch (graph replays included)
        sq_all = tl.sum(tl.where(n == NMIX, total, 0.0), axis=0)  # one term and zeros: exact
        usq_all = tl.sum(tl.where(n == NMIX + 1, total, 0.0), axis=0)
        _coefficients(total, sq_all, row, HC * d, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, norm_eps, hc_eps,
                      iters, HC, HCP, NP)
        if NORM_ALL:
            tl.store(h_ptr + row * d + cols, _normed(u_all, w_all, _rms_inv(usq_all, d, rms_eps),
                                                     h_ptr.dtype.element_ty), mask=cols < d)
        else:
            _norm_pass(h_ptr, w_ptr, row, d, usq_all, rms_eps, BLOCK_N)


@triton.jit(do_not_specialize=["live_rows"])
def _expand_kernel(y_ptr, x_ptr, post_ptr, comb_ptr, xo_ptr, d, live_rows, HC: tl.constexpr, HCP: tl.constexpr,
                   BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """X'[k] = post_k y + Σ_j comb[j, k] X[j] for one row and one block of d (elementwise in d: no reduction);
    +0.0 for rows from `live_rows` on."""
    wait_previous(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, HCP)
    c_live = c < HC
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = c_live[:, None] & (cols < d)[None, :]
    at = row * HC * d + c[:, None] * d + cols[None, :]
    if row >= live_rows:
        tl.store(xo_ptr + at, tl.zeros((HCP, BLOCK), dtype=xo_ptr.dtype.element_ty), mask=live)
    else:
        _expand_row(y_ptr, x_ptr, post_ptr, comb_ptr, xo_ptr, d, row, c, c_live, cols, live, at, HC, HCP)


@triton.jit
def _expand_row(y_ptr, x_ptr, post_ptr, comb_ptr, xo_ptr, d, row, c, c_live, cols, live, at, HC: tl.constexpr,
                HCP: tl.constexpr):
    post = tl.load(post_ptr + row * HC + c, mask=c_live, other=0.0)
    comb = tl.load(comb_ptr + row * HC * HC + c[:, None] * HC + c[None, :], mask=c_live[:, None] & c_live[None, :],
                   other=0.0)
    xs = tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32)
    y = _cast(tl.load(y_ptr + row * d + cols, mask=cols < d, other=0.0).to(tl.float32),
              xo_ptr.dtype.element_ty).to(tl.float32)  # an fp32 y rounded to the stream dtype first
    mixed = tl.sum(comb[:, :, None] * xs[:, None, :], axis=0)
    tl.store(xo_ptr + at, _cast(post[:, None] * y[None, :] + mixed, xo_ptr.dtype.element_ty), mask=live)


@triton.jit(do_not_specialize=["live_rows"])
def _collapse_norm_kernel(x_ptr, pre_ptr, w_ptr, h_ptr, d, rms_eps, live_rows, HC: tl.constexpr, HCP: tl.constexpr,
                          BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    wait_previous(PDL)
    row = tl.program_id(0)
    if row >= live_rows:
        for d0 in range(0, d, BLOCK_N):
            cols = d0 + tl.arange(0, BLOCK_N)
            tl.store(h_ptr + row * d + cols, tl.zeros((BLOCK_N,), dtype=h_ptr.dtype.element_ty), mask=cols < d)
    else:
        _collapse_norm_row(x_ptr, pre_ptr, w_ptr, h_ptr, d, rms_eps, row, HC, HCP, BLOCK, BLOCK_N)


@triton.jit
def _collapse_norm_row(x_ptr, pre_ptr, w_ptr, h_ptr, d, rms_eps, row, HC: tl.constexpr, HCP: tl.constexpr,
                       BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    c = tl.arange(0, HCP)
    c_live = c < HC
    pre = tl.load(pre_ptr + row * HC + c, mask=c_live, other=0.0)
    usq = tl.zeros((BLOCK,), tl.float32)
    for d0 in range(0, d, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        live = c_live[:, None] & (cols < d)[None, :]
        xs = tl.load(x_ptr + row * HC * d + c[:, None] * d + cols[None, :], mask=live, other=0.0).to(tl.float32)
        u = _cast(tl.sum(pre[:, None] * xs, axis=0), h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * d + cols, u, mask=cols < d)
        u32 = u.to(tl.float32)
        usq += u32 * u32
    tl.debug_barrier()  # the collapse was stored by other threads of this program
    _norm_pass(h_ptr, w_ptr, row, d, tl.sum(usq, axis=0), rms_eps, BLOCK_N)


# ---------------------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------------------


def _site(x, y, post_in, comb_in, fn_t, base, scale, pre_in, norm_weight, norm_eps, hc_eps, iters, rms_eps,
          splits, rows, num_warps=None):
    B, hc, d, nmix, rows, expand, y, post_in, comb_in, pre_in, xo, h, pre, post, comb = site_args(
        x, y, post_in, comb_in, fn_t, base, scale, pre_in, norm_weight, iters, rows)
    splits = default_splits(d) if splits is None else int(splits)
    block = min(BLOCK_D, triton.next_power_of_2(d))
    chunk = triton.cdiv(triton.cdiv(d, splits), block) * block
    np_ = triton.next_power_of_2(nmix + 2)  # the products, then the two sums of squares
    pipe = pipelined()
    if B:  # the padding rows' programs write the zeros: no memset launches beside the kernel
        part = torch.empty(max(rows, 1), splits, np_, dtype=torch.float32, device=x.device)
        _site_kernel[(B, splits)](
            x, y, post_in, comb_in, xo, fn_t, fn_t.stride(0), fn_t.stride(1), base.float().contiguous(),
            scale.float().contiguous(), pre_in, norm_weight.contiguous(), h, pre, post, comb, part,
            _COUNTERS.get(x.device, rows), d, chunk, float(norm_eps), float(hc_eps), float(rms_eps), int(iters), rows,
            HC=hc,
            HCP=triton.next_power_of_2(hc), NP=np_, SPLITS=splits, EXPAND=expand, BLOCK=block,
            BLOCK_N=min(BLOCK_H, triton.next_power_of_2(d)), num_warps=num_warps or NUM_WARPS,
            PIPELINE=pipe, NORM_ALL=triton.next_power_of_2(d) if pipe and d <= NORM_ALL_MAX else 0,
            **pdl_launch(x.device))
    return (xo, h, pre, post, comb) if expand else (h, pre, post, comb)


def hc_site(x, fn_t, base, scale, pre_in, norm_weight, *, norm_eps: float, hc_eps: float, iters: int,
            rms_eps: float, splits: int | None = None, rows: int | None = None, num_warps: int | None = None):
    """One mHC site: `(h, pre, post, comb)` with h = rms_norm(collapse(x, pre_in), norm_weight, rms_eps) [B, d] in
    x's dtype and pre, post [B, hc], comb [B, hc, hc] fp32 = `mhc.coefficients(x, (fn_t.T, base, scale), ...)`.
    `splits`: programs per row (default from d: `default_splits`). `rows`: the live rows (module docstring): only
    rows [0, rows) are computed, rows [rows, B) of h, pre, post and comb are zero; None = all B. `num_warps` (default
    NUM_WARPS) sets how a program's sums are laid out, so their bits: like `splits`, never a function of B."""
    return _site(x, None, None, None, fn_t, base, scale, pre_in, norm_weight, norm_eps, hc_eps, iters, rms_eps,
                 splits, rows, num_warps)


def hc_expand_site(y, x, post, comb, fn_t, base, scale, pre_in, norm_weight, *, norm_eps: float, hc_eps: float,
                   iters: int, rms_eps: float, splits: int | None = None, rows: int | None = None,
                   num_warps: int | None = None):
    """`x' = mhc.expand(y, x, post, comb)`, then `hc_site(x', ...)`: returns `(x', h, pre', post', comb')`.
    y [B, d] in x's dtype, or fp32 (a reduced partial: rounded to x's dtype in the kernel, the bits of
    `y.to(x.dtype)`, without that launch). `rows`: the live rows (module docstring): rows [rows, B) of all five
    outputs (x' included) are zero."""
    return _site(x, y, post, comb, fn_t, base, scale, pre_in, norm_weight, norm_eps, hc_eps, iters, rms_eps, splits,
                 rows, num_warps)


def hc_expand(y, x, post, comb, *, rows: int | None = None) -> torch.Tensor:
    """`mhc.expand(y, x, post, comb)`: [B, hc, d] in x's dtype (y in x's dtype or fp32, as `hc_expand_site`).
    `rows`: the live rows (module docstring): rows [rows, B) of the result are zero; None = all B."""
    B, hc, d = _streams(x)
    rows = _live_rows(rows, B)
    if tuple(y.shape) != (B, d) or y.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"y must be [{B}, {d}] {x.dtype} or fp32, got {y.dtype} {list(y.shape)}")
    post, comb = _coeff(post, (B, hc), "post"), _coeff(comb, (B, hc, hc), "comb")
    out = torch.empty_like(x)
    block = min(BLOCK_E, triton.next_power_of_2(d))
    if B:
        _expand_kernel[(B, triton.cdiv(d, block))](y.contiguous(), x, post, comb, out, d, rows, HC=hc,
                                                   HCP=triton.next_power_of_2(hc), BLOCK=block, num_warps=NUM_WARPS,
                                                   **pdl_launch(x.device))
    return out


def collapse_norm(x, pre, norm_weight, *, rms_eps: float, rows: int | None = None) -> torch.Tensor:
    """`rms_norm(mhc.collapse(x, pre), norm_weight, rms_eps)`: [B, d] in x's dtype. `rows`: the live rows (module
    docstring): rows [rows, B) of the result are zero; None = all B."""
    B, hc, d = _streams(x)
    rows = _live_rows(rows, B)
    pre = _coeff(pre, (B, hc), "pre")
    if norm_weight.numel() != d:
        raise ValueError(f"norm_weight must have {d} elements, got {norm_weight.numel()}")
    h = torch.empty(B, d, dtype=x.dtype, device=x.device)
    if B:
        _collapse_norm_kernel[(B,)](x, pre, norm_weight.contiguous(), h, d, float(rms_eps), rows, HC=hc,
                                    HCP=triton.next_power_of_2(hc), BLOCK=min(BLOCK_H, triton.next_power_of_2(d)),
                                    BLOCK_N=min(BLOCK_H, triton.next_power_of_2(d)), num_warps=NUM_WARPS,
                                    **pdl_launch(x.device))
    return h
