"""mHC sites of prefill rows as three plain launches (issue 31; MODEL.md §6; references: `dsv41.model.mhc`
coefficients / sinkhorn / collapse / expand and `dsv41.model.norm.rms_norm`; decode and verify rows keep `mhc.py`'s
row kernels).

Why. The row kernels run 32 programs a row, each streaming 1/32 of fn [hc d, (2 + hc) hc] (2 MB fp32 at d 5120)
for its one row: fn is re-read from L2 once a row (16 GB of L2 reads a site at 8K rows; a site 0.68 ms at 2K rows
and 2.55 ms at 8K on the H100, against an HBM floor of ~0.1 / ~0.4 ms). The fused prefill tries (mhc_prefill.py's
tiles: spills, Sinkhorn of 32 rows in one last-arriver program; mhc_blocks.py: an IEEE fp32 FMA dot,
instruction-bound) were slower. Here each launch is one well-understood pattern:

A. `_expand_collapse_kernel`, program (row, block of BLOCK_A columns): elementwise in d. The block's loads all issued
   first (STEPS tiles of [hc, BLOCK] a stream, the row kernels' column step), then per step the row kernels' own
   code (`mhc._expanded`, `mhc._collapsed`): [X' = expand(y, X, post_in, comb_in) rounded and stored,] u =
   collapse(X', pre_in) rounded and stored in h; the block's Σx'² and Σu² (summed as a row kernel's split sums its
   own) into `sums` [B, NB, 2].
B. `_mix_kernel`, program (BM rows, split of K = hc d): X' as [B, K] (bf16) times fn as three bf16 parts hi + mid +
   lo == fn exactly ([K, NP] each, lanes >= (2 + hc) hc zero; `mix_parts`, made once a weight), on the tensor cores:
   every part product exact in fp32, accumulated in fp32, smallest part first. Split-K partials [B, S, NP].
C. `_finish_kernel`, program per row: the S partials in split order, Σx² and Σu² over the NB blocks in order, then
   the row kernels' `_coefficients` (rsqrt of the mean square in fp64, sigmoids, softmax + Sinkhorn) and
   `_norm_pass` (h = rms_norm(u) * w in place).

Row invariance: BLOCK_A, the steps, BM, BK, the split of K and every reduction order are constants or functions of
(hc, d), never of B; a row meets other rows only as another row of B's dot operands (each output element its own
accumulation over k, the same for every row position on the tensor cores). So a row's bits are the same alone, in any
slice of the chunk and at any position (chunked == one-shot). Interpreted (no bf16 dot there, and a BLAS matmul's
order may depend on a row's position), B sums the elementwise part products over k (`_part_dot`). Rows from `rows=`
(live rows) on write +0.0 to every output (the row launchers' contract: `mhc.py`'s module docstring).

Bits. X' and u are the row kernels' code on the same [hc, BLOCK] tiles and warps (the same reduction layouts on
sm_90's TTGIR): in the interpreter their bits. Compiled, the H100 rounds ~4e-5 of X's elements the other way than
the row kernels (the same code scheduled into another program: ptxas contracts post·y + Σ comb X otherwise), each
within the reference's bound; the first site's h (no expand) is bitwise theirs (the GPU test). Σx² and Σu² are
summed as a row kernel with `splits = NB` sums them (per column over the steps, then the block, then the blocks in
order), so h is the row kernels' at that split count (the same Σu², the same r); the mixing product is another fp32
sum order (the coefficients within a few fp32 ulp: tests/test_kernels_step_mhc_split.py). Prefill rows' bits are not
decode rows' on the fast path anyway (docs/ENGINE.md §4-5); what holds is row invariance (chunked == one-shot).

H100 (13cd891, `bench/prefill.py --layers 1 --kernels-only`): one layer's two expand sites 1.52 -> 0.62 ms at 2,048
rows, 6.05 -> 1.70 ms at 8,192 (the row kernels -> these); a 26-layer 2K chunk's mHC section 37.9 -> 11.9 ms.

`DSV41_PREFILL_MHC_SPLIT` (`split_on`, read when a forward starts; on by default since that run, `=0` for the row
kernels): prefill rows' sites take these launches (runtime/mhc_sites.py `MhcSites.of(phase=)`; over the tiles and the row blocks). The lone
expand and the final collapse + norm read no fn and stay the row launchers.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from ..exl3.backend import interpreting
from .attention import _bf16_parts
from .knobs import switched_on
from .mhc import (BLOCK_D, BLOCK_H, NUM_WARPS, _coefficients, _collapsed, _expanded, _norm_pass, _row_inputs, _x_block,
                  _y_block)
from .mhc_args import site_args
from .pdl import launch as pdl_launch, wait_previous

ENV = "DSV41_PREFILL_MHC_SPLIT"
MMA = tl.constexpr(not interpreting())  # the bf16 tensor-core dots (compiled) or the summed products (interpreted)
STEPS = 16  # column steps (of mhc.BLOCK_D = 32) a program of A: BLOCK_A = 512, d 5120 -> NB = 10 blocks
MIX_ROWS = 64  # BM: rows a program of B (one warpgroup's wgmma M)
MIX_K = 64  # BK: columns of K = hc d a step of B
MIX_SPLITS = 16  # S: splits of K (d 5120: 16 of 1,280 = 20 steps); 32 x 16 = 512 programs at 2K rows
MIX_WARPS = 4
MIX_STAGES = 3
FINISH_WARPS = 4


def split_on() -> bool:
    """Whether prefill rows' sites take these launches (`DSV41_PREFILL_MHC_SPLIT`, on by default since the H100
    A/B: `=0` for the row kernels); read when a forward starts."""
    return switched_on(ENV, default=True)


def lanes(hc: int) -> int:
    """NP: the mixing product's lanes, (2 + hc) hc padded to a power of two >= 16 (the dot's N)."""
    return max(16, triton.next_power_of_2((2 + hc) * hc))


def blocks_of(d: int, steps: int = STEPS) -> tuple[int, int, int]:
    """(BLOCK, steps, NB) of A, functions of d alone: the row kernels' column step (mhc.BLOCK_D, or d's power of
    two below it), `steps` of them a program (fewer where d is smaller), NB programs a row."""
    block = min(BLOCK_D, triton.next_power_of_2(d))
    steps = max(1, min(steps, triton.cdiv(d, block)))
    return block, steps, triton.cdiv(d, block * steps)


def k_split(K: int, splits: int = MIX_SPLITS, bk: int = MIX_K) -> tuple[int, int]:
    """(columns of K a split, splits) of B, functions of K = hc d alone: a whole number of BK steps a split, no
    empty split (K 20,480: 16 splits of 1,280)."""
    chunk = triton.cdiv(triton.cdiv(K, splits), bk) * bk
    return chunk, triton.cdiv(K, chunk)


class _PartsCache:
    """fn's three bf16 parts per fn tensor (`mix_parts`), made at the first prefill site of a weight and kept while
    the tensor lives (a weak reference: a dropped weight drops its parts; an in-place change of it, seen by torch's
    version counter, remakes them). Keyed by the tensor object, so the runtime's `HC.fn_t` (one view a site, made at
    build) makes them once; 3.9 MB a site at d 5120, only where the knob is on."""

    def __init__(self):
        self._by_id: dict[int, tuple] = {}

    def get(self, fn_t: torch.Tensor, np_: int) -> torch.Tensor:
        have = self._by_id.get(id(fn_t))
        if have is not None and have[0]() is fn_t and have[1] == (fn_t._version, np_):
            return have[2]
        parts = split_parts(fn_t, np_)
        key = id(fn_t)
        self._by_id[key] = (weakref.ref(fn_t, lambda _, k=key, c=self._by_id: c.pop(k, None)), (fn_t._version, np_),
                            parts)
        return parts


_PARTS = _PartsCache()


def split_parts(fn_t: torch.Tensor, np_: int) -> torch.Tensor:
    """fn_t [K, nmix] fp32 as [3, K, np_] bf16: hi, mid, lo with hi + mid + lo == fn exactly (attention.py
    `_bf16_parts`' split: hi the nearest bf16, each remainder an exact fp32 difference whose nearest bf16 is the
    next part; lanes >= nmix zero). Done with torch's round-to-nearest-even cast, the same on the CPU and the GPU."""
    K, nmix = fn_t.shape
    f = torch.zeros(K, np_, dtype=torch.float32, device=fn_t.device)
    f[:, :nmix] = fn_t
    hi = f.to(torch.bfloat16)
    r = f - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return torch.stack([hi, mid, lo]).contiguous()


def mix_parts(fn_t: torch.Tensor, hc: int) -> torch.Tensor:
    """fn_t's bf16 parts for B (`split_parts` at `lanes(hc)`), made once per fn tensor (`_PartsCache`)."""
    return _PARTS.get(fn_t, lanes(hc))


# ---------------------------------------------------------------------------------------------------------------
# A: expand + collapse, elementwise in d
# ---------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["live_rows"])
def _expand_collapse_kernel(x_ptr, y_ptr, post_in_ptr, comb_in_ptr, xo_ptr, pre_in_ptr, h_ptr, sums_ptr, d,
                            live_rows, HC: tl.constexpr, HCP: tl.constexpr, NB: tl.constexpr, EXPAND: tl.constexpr,
                            BLOCK: tl.constexpr, STEPS: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, block): the block's STEPS column steps (module docstring, A). Streams [B, HC, d] contiguous;
    coefficients fp32 contiguous; sums [B, NB, 2] fp32 (Σx'², Σu²). Rows from `live_rows` on: X' +0.0 (h, the
    coefficients: C's)."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    first = blk * (BLOCK * STEPS)
    wait_previous(PDL)
    c = tl.arange(0, HCP)
    c_live = c < HC
    if row >= live_rows:
        if EXPAND:
            for s in tl.static_range(STEPS):
                cols = first + s * BLOCK + tl.arange(0, BLOCK)
                tl.store(xo_ptr + row * HC * d + c[:, None] * d + cols[None, :],
                         tl.zeros((HCP, BLOCK), dtype=xo_ptr.dtype.element_ty),
                         mask=c_live[:, None] & (cols < d)[None, :])
    else:
        pre_in, post_in, comb_in = _row_inputs(pre_in_ptr, post_in_ptr, comb_in_ptr, row, HC, HCP, EXPAND)
        # every step's loads first, in flight together (an elementwise kernel is bound by the bytes in flight)
        xs_in = ()
        ys_in = ()
        for s in tl.static_range(STEPS):
            xs_in = xs_in + (_x_block(x_ptr, row, first + s * BLOCK, d, d, HC, HCP, BLOCK),)
            ys_in = ys_in + (_y_block(y_ptr, row, first + s * BLOCK, d, d, EXPAND, BLOCK),)
        sq = tl.zeros((HCP, BLOCK), tl.float32)
        usq = tl.zeros((BLOCK,), tl.float32)
        for s in tl.static_range(STEPS):  # the row kernels' `_site_block` less the mixing product
            xs = _expanded(xs_in[s], ys_in[s], post_in, comb_in, xo_ptr, row, first + s * BLOCK, d, HC, HCP, EXPAND,
                           BLOCK)
            sq += xs * xs
            u32 = _collapsed(xs, pre_in, h_ptr, row, first + s * BLOCK, d, BLOCK)
            usq += u32 * u32
        # a row kernel's split partial: Σ over the streams of the per-column sums, then Σu² per column
        tl.store(sums_ptr + (row * NB + blk) * 2, tl.sum(tl.sum(sq, axis=1), axis=0))
        tl.store(sums_ptr + (row * NB + blk) * 2 + 1, tl.sum(usq, axis=0))


# ---------------------------------------------------------------------------------------------------------------
# B: the mixing product, split-K, on the bf16 tensor cores
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _part_dot(x, f0, f1, f2, acc, XP: tl.constexpr):
    """acc + x [BM, BK] @ (f0 + f1 + f2) [BK, NP], the parts' products smallest first. Compiled: bf16 tensor-core
    dots, x as XP bf16 parts (1: bf16 streams, themselves; 3: fp32 streams, `_bf16_parts`, the terms below 2^-16
    relative left out as attention.py `_split_dot` does). Interpreted: each part's products summed over k by numpy's
    reduction (one order for every row), then added."""
    if MMA:
        if XP == 1:
            xb = x.to(tl.bfloat16)
            acc = tl.dot(xb, f2, acc)
            acc = tl.dot(xb, f1, acc)
            return tl.dot(xb, f0, acc)
        else:
            x0, x1, x2 = _bf16_parts(x.to(tl.float32), 3)
            acc = tl.dot(x0, f2, acc)
            acc = tl.dot(x2, f0, acc)
            acc = tl.dot(x1, f1, acc)
            acc = tl.dot(x0, f1, acc)
            acc = tl.dot(x1, f0, acc)
            return tl.dot(x0, f0, acc)
    else:
        xs = x.to(tl.float32)
        acc += tl.sum(xs[:, :, None] * f2.to(tl.float32)[None, :, :], axis=1)
        acc += tl.sum(xs[:, :, None] * f1.to(tl.float32)[None, :, :], axis=1)
        return acc + tl.sum(xs[:, :, None] * f0.to(tl.float32)[None, :, :], axis=1)


@triton.jit(do_not_specialize=["B", "live_rows"])
def _mix_kernel(xo_ptr, parts_ptr, mix_ptr, B, K, chunk, live_rows, NP: tl.constexpr, SPLITS: tl.constexpr,
                BM: tl.constexpr, BK: tl.constexpr, XP: tl.constexpr, PDL: tl.constexpr = False):
    """Program (block of BM rows, split): Σ over the split's `chunk` columns of K of X'[row, k] fn[k, :], from zero,
    into mix [B, SPLITS, NP] fp32. X' [B, K] contiguous (the streams flattened); parts [3, K, NP] bf16 contiguous.
    Rows past B load nothing and store nothing; rows from `live_rows` on load nothing (C ignores their partials)."""
    split = tl.program_id(1)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    r_in = rows < B
    r_live = rows < live_rows
    rows64 = rows.to(tl.int64)
    kk = tl.arange(0, BK)
    n = tl.arange(0, NP)
    wait_previous(PDL)
    acc = tl.zeros((BM, NP), tl.float32)
    first = split * chunk
    for k0 in range(first, tl.minimum(first + chunk, K), BK):
        k = k0 + kk
        k_ok = k < K
        x = tl.load(xo_ptr + rows64[:, None] * K + k[None, :], mask=r_live[:, None] & k_ok[None, :], other=0.0)
        at = k[:, None] * NP + n[None, :]
        f0 = tl.load(parts_ptr + at, mask=k_ok[:, None], other=0.0)
        f1 = tl.load(parts_ptr + K * NP + at, mask=k_ok[:, None], other=0.0)
        f2 = tl.load(parts_ptr + 2 * K * NP + at, mask=k_ok[:, None], other=0.0)
        acc = _part_dot(x, f0, f1, f2, acc, XP)
    tl.store(mix_ptr + (rows64[:, None] * SPLITS + split) * NP + n[None, :], acc, mask=r_in[:, None])


# ---------------------------------------------------------------------------------------------------------------
# C: the finish, a program per row
# ---------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["live_rows"])
def _finish_kernel(mix_ptr, sums_ptr, base_ptr, scale_ptr, w_ptr, h_ptr, pre_ptr, post_ptr, comb_ptr, d, norm_eps,
                   hc_eps, rms_eps, iters, live_rows, HC: tl.constexpr, HCP: tl.constexpr, NP: tl.constexpr,
                   SPLITS: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    """Program per row (module docstring, C): the coefficients and h = rms_norm(u) * w in place; rows from
    `live_rows` on write +0.0 to h and the coefficients and read nothing."""
    row = tl.program_id(0)
    wait_previous(PDL)
    if row >= live_rows:
        c = tl.arange(0, HCP)
        c_live = c < HC
        for d0 in range(0, d, BLOCK_N):
            cols = d0 + tl.arange(0, BLOCK_N)
            tl.store(h_ptr + row * d + cols, tl.zeros((BLOCK_N,), dtype=h_ptr.dtype.element_ty), mask=cols < d)
        tl.store(pre_ptr + row * HC + c, tl.zeros((HCP,), tl.float32), mask=c_live)
        tl.store(post_ptr + row * HC + c, tl.zeros((HCP,), tl.float32), mask=c_live)
        tl.store(comb_ptr + row * HC * HC + c[:, None] * HC + c[None, :], tl.zeros((HCP, HCP), tl.float32),
                 mask=c_live[:, None] & c_live[None, :])
    else:
        n = tl.arange(0, NP)
        total = tl.zeros((NP,), tl.float32)
        for t in tl.static_range(SPLITS):  # split order; unrolled, so the loads are in flight together
            total += tl.load(mix_ptr + (row.to(tl.int64) * SPLITS + t) * NP + n)
        # block order, from zero (0 + Σ: the first term exactly): a row kernel's split order at `splits = NB`
        sq = tl.load(sums_ptr + row * NB * 2)
        usq = tl.load(sums_ptr + row * NB * 2 + 1)
        for b in tl.static_range(1, NB):
            sq += tl.load(sums_ptr + (row * NB + b) * 2)
            usq += tl.load(sums_ptr + (row * NB + b) * 2 + 1)
        _coefficients(total, sq, row, HC * d, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, norm_eps, hc_eps,
                      iters, HC, HCP, NP)
        _norm_pass(h_ptr, w_ptr, row, d, usq, rms_eps, BLOCK_N)


# ---------------------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------------------


def _split_site(x, y, post_in, comb_in, fn_t, base, scale, pre_in, norm_weight, norm_eps, hc_eps, iters, rms_eps,
                rows, steps, mix_splits, mix_rows):
    B, hc, d, nmix, rows, expand, y, post_in, comb_in, pre_in, xo, h, pre, post, comb = site_args(
        x, y, post_in, comb_in, fn_t, base, scale, pre_in, norm_weight, iters, rows)
    np_ = lanes(hc)
    block, steps, nb = blocks_of(d, steps)
    K = hc * d
    chunk, splits = k_split(K, mix_splits)
    hcp = triton.next_power_of_2(hc)
    if B:
        pdl = pdl_launch(x.device)
        parts = mix_parts(fn_t, hc)
        sums = torch.empty(B, nb, 2, dtype=torch.float32, device=x.device)
        mix = torch.empty(B, splits, np_, dtype=torch.float32, device=x.device)
        _expand_collapse_kernel[(B, nb)](x, y, post_in, comb_in, xo, pre_in, h, sums, d, rows, HC=hc, HCP=hcp, NB=nb,
                                         EXPAND=expand, BLOCK=block, STEPS=steps, num_warps=NUM_WARPS, **pdl)
        _mix_kernel[(triton.cdiv(B, mix_rows), splits)](xo, parts, mix, B, K, chunk, rows, NP=np_, SPLITS=splits,
                                                        BM=mix_rows, BK=MIX_K, XP=1 if x.dtype == torch.bfloat16 else 3,
                                                        num_warps=MIX_WARPS, num_stages=MIX_STAGES, **pdl)
        _finish_kernel[(B,)](mix, sums, base.float().contiguous(), scale.float().contiguous(),
                             norm_weight.contiguous(), h, pre, post, comb, d, float(norm_eps), float(hc_eps),
                             float(rms_eps), int(iters), rows, HC=hc, HCP=hcp, NP=np_, SPLITS=splits, NB=nb,
                             BLOCK_N=min(BLOCK_H, triton.next_power_of_2(d)), num_warps=FINISH_WARPS, **pdl)
    return (xo, h, pre, post, comb) if expand else (h, pre, post, comb)


def hc_site_split(x, fn_t, base, scale, pre_in, norm_weight, *, norm_eps: float, hc_eps: float, iters: int,
                  rms_eps: float, rows: int | None = None, steps: int = STEPS, mix_splits: int = MIX_SPLITS,
                  mix_rows: int = MIX_ROWS):
    """`mhc.hc_site`'s function and outputs `(h, pre, post, comb)` for prefill rows (module docstring). `steps`
    (column steps a program of A), `mix_splits` (splits of K in B) and `mix_rows` (B's rows a program: >= 16
    compiled, the dot's M; any power of two interpreted): constants of the build, never chosen from B; tests pass
    small ones to get several blocks, splits and row blocks at small shapes."""
    return _split_site(x, None, None, None, fn_t, base, scale, pre_in, norm_weight, norm_eps, hc_eps, iters, rms_eps,
                       rows, steps, mix_splits, mix_rows)


def hc_expand_site_split(y, x, post, comb, fn_t, base, scale, pre_in, norm_weight, *, norm_eps: float,
                         hc_eps: float, iters: int, rms_eps: float, rows: int | None = None, steps: int = STEPS,
                         mix_splits: int = MIX_SPLITS, mix_rows: int = MIX_ROWS):
    """`mhc.hc_expand_site`'s function and outputs `(x', h, pre', post', comb')` for prefill rows (y in x's dtype
    or fp32, rounded to x's dtype in the load)."""
    return _split_site(x, y, post, comb, fn_t, base, scale, pre_in, norm_weight, norm_eps, hc_eps, iters, rms_eps,
                       rows, steps, mix_splits, mix_rows)
