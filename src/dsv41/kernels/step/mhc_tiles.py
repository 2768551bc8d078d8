"""mHC sites of prefill rows: one program a tile of TILE_ROWS rows, the mixing matrix streamed once per tile
(MODEL.md §6; references: `dsv41.model.mhc` coefficients / sinkhorn / collapse / expand and
`dsv41.model.norm.rms_norm`; the decode rows' launches are `mhc.py`'s).

`mhc.hc_site` / `hc_expand_site` run 32 programs per row, each streaming 1/32 of the mixing matrix fn
[hc * d, (2 + hc) * hc] (2 MB fp32 at d 5120, hc 4): right for a few decode rows, but a 2,048-row prefill chunk reads fn 2,048
times from L2 (~4 GB a site, 38 ms of a 324 ms chunk over 26 layers). Here a program owns TILE_ROWS rows and runs
the whole d loop in TILE_BLOCK-column steps: [X' = expand(y, X, post_in, comb_in), stored;] the mixing product as
one `tl.dot` of the tile's [rows, hc * TILE_BLOCK] streams by fn's [hc * TILE_BLOCK, 32] rows (IEEE fp32:
`input_precision="ieee"`, fn's values are not bf16 ones; the 24 columns padded to 32) added to the sum over the
steps, Σx², the collapse u = Σ_c pre_in[c] X[c] rounded to the stream dtype and stored in h, Σu²; then per row of
the tile the tail of the row kernels: rsqrt of the mean square, sigmoids, softmax + Sinkhorn (all rows of the tile
at once, as [rows, hc, hc] tiles), and h = rms_norm(u) * w over h's columns again (the tile's own stores, from L2).
fn is read once per TILE_ROWS rows (16: 128 tiles and 256 MB of L2 reads a site at 2,048 rows, against 4 GB).

Row invariance: the tile shape, the column steps and the reduction order over d (each step's dot one chain over its
hc * TILE_BLOCK terms, the steps summed in order; the blocked sums of squares) are constants, never chosen from B; a
row's values meet the other rows' only as other rows of the dot's operands (each output element its own accumulation
chain). A partial last tile's rows past B load nothing and store nothing. So a row's bits are the same alone, in any
slice of the chunk and at any position of its tile (chunked == one-shot). They are not bitwise the decode kernels'
(another sum order over d): prefill rows take their own kernels, as the EXL3 tiles do; against the reference the
same tolerances as the row kernels (tests/test_kernels_step_mhc_tiles.py).

`rows=` (the live rows) as the row launchers: rows [rows, B) write +0.0 to every output. The lone expand and the
final collapse + norm read no mixing matrix: their row launchers (`mhc.hc_expand`, `mhc.collapse_norm`) already
stream at bandwidth on prefill rows and stay theirs. `DSV41_MHC_TILES=0` gives prefill rows the row kernels
(A/B; runtime/model.py `MhcSites`).

Numerics as the row kernels: fp32 sums, the two rsqrt's in fp64, divisions correctly rounded, exp in fp32, the
collapse rounded to the stream dtype before the norm and X' before its coefficients.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .knobs import switched_on
from .mhc import _cast, _rsqrt64, _sigmoid, site_args
from .pdl import launch as pdl_launch, wait_previous

TILE_ROWS = 16  # rows a program (the dot's M: 16 at least on the GPU); a constant, never chosen from B
TILE_BLOCK = 32  # columns of d per step: the dot's K is hc * TILE_BLOCK (128 at hc 4)
TILE_NORM = 256  # columns per step of the norm pass ([TILE_ROWS, TILE_NORM] values)
# 2,048 rows are 128 tiles: about one program an SM, so its latency is hidden by its own warps (8: 204 registers a
# thread with the expand at sm_90, no spills; 4 spilled). The fp32 dot runs on the FMA units, a chain per element.
TILE_WARPS = 8


def tiles_on() -> bool:
    """Whether prefill rows take these launches (`DSV41_MHC_TILES=0`: the row kernels, for A/B runs); read when a
    forward starts."""
    return switched_on("DSV41_MHC_TILES")


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
    # row at a time ([BM, HCP, NP] values live, not [BM, HCP, HCP, NP])
    j = tl.arange(0, HCP)
    k = tl.arange(0, HCP)
    jk = (j[:, None] < HC) & (k[None, :] < HC)
    logits = tl.zeros((BM, HCP, HCP), tl.float32)
    for jj in tl.static_range(HC):
        pick = (2 * HC + jj * HC + k[:, None]) == n[None, :]  # [k, NP]
        row = tl.sum(tl.where(pick[None, :, :], z[:, None, :], 0.0), axis=2)  # [BM, k]
        logits = tl.where((j == jj)[None, :, None], row[:, None, :], logits)
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
def _site_tile_kernel(x_ptr, y_ptr, post_in_ptr, comb_in_ptr, xo_ptr, fn_ptr, stride_fk, stride_fn, base_ptr,
                      scale_ptr, pre_in_ptr, w_ptr, h_ptr, pre_ptr, post_ptr, comb_ptr, B, d, norm_eps, hc_eps,
                      rms_eps, iters, live_rows, HC: tl.constexpr, HCP: tl.constexpr, NP: tl.constexpr,
                      EXPAND: tl.constexpr, BM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Program: rows [pid BM, pid BM + BM) over the whole d (module docstring). Streams [B, HC, d] contiguous;
    coefficients fp32 contiguous; fn_t [HC d, NMIX] strided."""
    NMIX: tl.constexpr = (2 + HC) * HC
    KB: tl.constexpr = HCP * BLOCK
    wait_previous(PDL)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    r_in = rows < B  # rows of the launch (a partial last tile's others: no load, no store)
    r_live = rows < live_rows  # computed; rows [live_rows, B) come out +0.0
    rows64 = rows.to(tl.int64)
    c = tl.arange(0, HCP)
    c_ok = c < HC
    n = tl.arange(0, NP)
    rc = r_live[:, None] & c_ok[None, :]
    pre_in = tl.load(pre_in_ptr + rows[:, None] * HC + c[None, :], mask=rc, other=0.0)  # [BM, HCP]
    post_in = pre_in
    if EXPAND:
        post_in = tl.load(post_in_ptr + rows[:, None] * HC + c[None, :], mask=rc, other=0.0)
    # fn's rows of one step: the dot's k = c BLOCK + i is fn row c d + d0 + i (the streams' [BM, HCP, BLOCK] tile
    # reshaped row-major)
    kk = tl.arange(0, KB)
    kc = kk // BLOCK
    ki = kk % BLOCK
    acc = tl.zeros((BM, NP), tl.float32)
    sq = tl.zeros((BM, BLOCK), tl.float32)
    usq = tl.zeros((BM, BLOCK), tl.float32)
    for d0 in range(0, d, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        col_ok = cols < d
        at = rows64[:, None, None] * HC * d + (c[:, None] * d + cols[None, :])[None, :, :]  # [BM, HCP, BLOCK]
        live = r_live[:, None, None] & (c_ok[:, None] & col_ok[None, :])[None, :, :]
        if EXPAND:
            rl = r_live[:, None] & col_ok[None, :]
            y = tl.load(y_ptr + rows64[:, None] * d + cols[None, :], mask=rl, other=0.0)
            # an fp32 y (a reduced partial) is rounded to the stream dtype first, as its `.to(dtype)` would
            y = _cast(y.to(tl.float32), xo_ptr.dtype.element_ty).to(tl.float32)
            # Σ_j comb[j, k] X[j] in j order, one stream j's [BM, BLOCK] at a time (no [BM, j, k, BLOCK] product)
            mixed = tl.zeros((BM, HCP, BLOCK), tl.float32)
            for jj in tl.static_range(HC):
                xj = tl.load(x_ptr + rows64[:, None] * HC * d + jj * d + cols[None, :], mask=rl, other=0.0)
                cj = tl.load(comb_in_ptr + rows[:, None] * HC * HC + jj * HC + c[None, :], mask=rc, other=0.0)
                mixed += cj[:, :, None] * xj.to(tl.float32)[:, None, :]  # [BM, k, BLOCK]
            xn = _cast(post_in[:, :, None] * y[:, None, :] + mixed, xo_ptr.dtype.element_ty)
            xs = tl.where(live, xn.to(tl.float32), 0.0)
            tl.store(xo_ptr + at, xs.to(xo_ptr.dtype.element_ty),  # exact: xs holds xn's values; dead rows +0.0
                     mask=r_in[:, None, None] & (c_ok[:, None] & col_ok[None, :])[None, :, :])
        else:
            xs = tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32)
        f = tl.load(fn_ptr + (kc[:, None] * d + d0 + ki[:, None]).to(tl.int64) * stride_fk + n[None, :] * stride_fn,
                    mask=((kc < HC) & (d0 + ki < d))[:, None] & (n < NMIX)[None, :], other=0.0)  # [KB, NP]
        # a step's hc * BLOCK products in one chain from zero, then added to the sum over the steps: two chains of
        # 128 and d / BLOCK (160) terms, not one of hc * d (20,480): ~6x less fp32 rounding in the mixing product
        acc += tl.dot(tl.reshape(xs, (BM, KB)), f, input_precision="ieee")
        sq += tl.sum(xs * xs, axis=1)
        u = _cast(tl.sum(pre_in[:, :, None] * xs, axis=1), h_ptr.dtype.element_ty)  # collapse, in the stream dtype
        tl.store(h_ptr + rows64[:, None] * d + cols[None, :], u, mask=r_in[:, None] & col_ok[None, :])
        u32 = u.to(tl.float32)
        usq += u32 * u32
    _coefficients_tile(acc, tl.sum(sq, axis=1), rows, r_in, r_live, HC * d, base_ptr, scale_ptr, pre_ptr, post_ptr,
                       comb_ptr, norm_eps, hc_eps, iters, HC, HCP, NP, BM)
    tl.debug_barrier()  # the collapse was stored by other threads of this program
    r = _rsqrt64(_div(tl.sum(usq, axis=1), (d + 0.0).to(tl.float32)) + rms_eps)  # `mhc._rms_inv` per row
    for d0 in range(0, d, BLOCK_N):
        cols = d0 + tl.arange(0, BLOCK_N)
        col_ok = cols < d
        at = rows64[:, None] * d + cols[None, :]
        u = tl.load(h_ptr + at, mask=r_live[:, None] & col_ok[None, :], other=0.0, cache_modifier=".cg")
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        v = _cast((u.to(tl.float32) * r[:, None]) * w[None, :], h_ptr.dtype.element_ty)  # `mhc._normed`'s order
        tl.store(h_ptr + at, tl.where(r_live[:, None], v, 0.0).to(h_ptr.dtype.element_ty),
                 mask=r_in[:, None] & col_ok[None, :])


def _site_tiles(x, y, post_in, comb_in, fn_t, base, scale, pre_in, norm_weight, norm_eps, hc_eps, iters, rms_eps,
                rows):
    a = site_args(x, y, post_in, comb_in, fn_t, base, scale, pre_in, norm_weight, iters, rows)
    if a.B:
        _site_tile_kernel[(triton.cdiv(a.B, TILE_ROWS),)](
            x, a.y, a.post_in, a.comb_in, a.xo, fn_t, fn_t.stride(0), fn_t.stride(1), base.float().contiguous(),
            scale.float().contiguous(), a.pre_in, norm_weight.contiguous(), a.h, a.pre, a.post, a.comb, a.B, a.d,
            float(norm_eps), float(hc_eps), float(rms_eps), int(iters), a.rows, HC=a.hc,
            HCP=triton.next_power_of_2(a.hc), NP=max(16, triton.next_power_of_2((2 + a.hc) * a.hc)), EXPAND=a.expand,
            BM=TILE_ROWS, BLOCK=min(TILE_BLOCK, triton.next_power_of_2(a.d)),
            BLOCK_N=min(TILE_NORM, triton.next_power_of_2(a.d)), num_warps=TILE_WARPS, **pdl_launch(x.device))
    return a.outputs()


def hc_site_tiles(x, fn_t, base, scale, pre_in, norm_weight, *, norm_eps: float, hc_eps: float, iters: int,
                  rms_eps: float, rows: int | None = None):
    """`mhc.hc_site`'s function and outputs `(h, pre, post, comb)` for prefill rows (module docstring)."""
    return _site_tiles(x, None, None, None, fn_t, base, scale, pre_in, norm_weight, norm_eps, hc_eps, iters, rms_eps,
                       rows)


def hc_expand_site_tiles(y, x, post, comb, fn_t, base, scale, pre_in, norm_weight, *, norm_eps: float,
                         hc_eps: float, iters: int, rms_eps: float, rows: int | None = None):
    """`mhc.hc_expand_site`'s function and outputs `(x', h, pre', post', comb')` for prefill rows (y in x's dtype
    or fp32, rounded to x's dtype in the load)."""
    return _site_tiles(x, y, post, comb, fn_t, base, scale, pre_in, norm_weight, norm_eps, hc_eps, iters, rms_eps,
                       rows)
