"""The dense prefill projections of one point of a layer as ONE input-rotation launch and ONE GEMM launch (issue 31).

A layer's dense matrices come in sets that read one input (wq_a, wkv and the compressor's wkv / wgate read the normed
x; wq_b and the indexer's wq_b read q_a's norm; the shared expert's w1 and w3 read the FFN's x) or inputs side by side
in one tensor (wo_a's groups: column blocks of o). Each matrix alone is three launches (rotation, decode, GEMM) and
its own partly filled last wave: at 2,048 rows wkv is 16 x 4 = 64 programs on 132 SMs, wq_a 160 (two waves, the
second 28 programs), each wo_a slice 128. Here (`DSV41_PREFILL_DENSE_GROUP`, on by default since its H100 A/B; `=0` one by one):

  1. `_rotate_members_kernel`: every member's xh = rot(fp16(x_m) ⊙ suh_m) in one launch (each matrix has its own
     suh: the magnitudes of its Hessian's grid search live there, spec/EXL3-ENGRAM.md §2.4, so one rotation cannot
     serve two matrices); x read once a member from L2 when the members share it, the member's suh once a program
     (not once a row). `prefill._rotate_block`'s math, the same bits as `prefill._rotate`;
  2. each member decoded into its own region of the rank's workspace (`prefill_dense.decode_into`'s values: one
     reconstruct launch a member, ~0.03-0.05 ms each);
  3. `_gemm_group_kernel`: ONE grid over every member's (row tile, column block), each tile the very arithmetic of
     `prefill_dense._gemm_rotate_kernel` at the same launch shape (`product_tile`, `store_rotated`): the same bits
     as the members one by one, so row invariance is theirs. A member's outputs go to its own contiguous [T, n]
     region of one buffer per output dtype (at most two: the compressor's fp32 beside bf16), or (`concat`) to its
     columns of one [T, Σn] tensor (wo_a's u, whose concatenation launch this saves).

Which tile runs where follows the member table (`DenseGroup`, built once a set of matrices): the grid is the same
for every row count's tiles, only longer; no choice follows the rows.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from dsv41.kernels.exl3.decode import INV_SQRT128, hadamard_signs
from dsv41.kernels.exl3.layout import Exl3Tensor
from dsv41.kernels.exl3.prefill import _row_blocks
from dsv41.kernels.exl3.prefill_dense import (BLOCK_N, GemmConfig, config, hadamard_tile, product_tile, product_tile2,
                                              store_rotated, store_rotated_with, tile_of)
from dsv41.kernels.exl3.reconstruct import reconstruct
from dsv41.kernels.step.knobs import switched_on

GROUP_ENV = "DSV41_PREFILL_DENSE_GROUP"  # a point's dense matrices as one rotation + one GEMM launch (0: one by one)
MAX_MEMBERS = 8
META = 6  # a member's row of the table: first global column block, n, workspace offset, svh offset, out column, out


def group_enabled() -> bool:
    """Whether the runtime's linear groups take this path at prefill (read at each call; on by default since the H100
    run at 92e817f: the same bits as the matrices one by one, its GPU tests and the 16K chunked == one-shot test passed,
    a 2,048-row chunk's dense section 36.3 -> 33.3 ms at 26 layers)."""
    return switched_on(GROUP_ENV, default=True)


@triton.jit(do_not_specialize=["n_rows"])
def _rotate_members_kernel(x_ptr, stride_x, x_step, suh_ptr, had_ptr, xh_ptr, n_rows, k, ROW_BLOCKS: tl.constexpr,
                           ROWS: tl.constexpr = 16):
    """xh[m, i] = fp16(fp16(fp16(x_m[i]) ⊙ suh[m]) · H/√128) for ROW_BLOCKS blocks of ROWS rows, one 128-wide input
    block and member m = program_id(2), whose input starts x_step elements after member m - 1's (0: one shared x).
    `prefill._rotate_block`'s math (the member's suh loaded once as a vector: the same products); ROWS 16 is
    `prefill._rotate_kernel`'s [16, 128] x [128, 128] dot, so its bits; ROWS 64 (the bench's A/B) a dot the tensor
    cores take as one warpgroup product (wgmma on sm_90: the same products, maybe summed in another order)."""
    pb = tl.program_id(0)
    kb = tl.program_id(1)
    m = tl.program_id(2).to(tl.int64)
    cols = tl.arange(0, 128)
    xk = kb * 128 + cols
    h = tl.load(had_ptr + cols[:, None] * 128 + cols[None, :])
    su = tl.load(suh_ptr + m * k + xk).to(tl.float32)
    for i in tl.static_range(ROW_BLOCKS):
        rows = (pb * ROW_BLOCKS + i) * ROWS + tl.arange(0, ROWS)
        ok = rows < n_rows
        r64 = rows.to(tl.int64)
        x = tl.load(x_ptr + m * x_step + r64[:, None] * stride_x + xk[None, :], mask=ok[:, None], other=0.0)
        xs = (x.to(tl.float16).to(tl.float32) * su[None, :]).to(tl.float16)
        xh = (tl.dot(xs, h) * INV_SQRT128).to(tl.float16)
        tl.store(xh_ptr + (m * n_rows + r64)[:, None] * k + xk[None, :], xh, mask=ok[:, None])


@triton.jit
def _store(acc, h, svh, had_ptr, out_ptrs, ok, H_EARLY: tl.constexpr, PARTS: tl.constexpr):
    if H_EARLY or PARTS != 3:
        store_rotated_with(acc, h, svh, out_ptrs, ok, PARTS)
    else:
        store_rotated(acc, svh, had_ptr, out_ptrs, ok)


@triton.jit
def _member_store(acc, h, meta, cols, rows, ok, n_rows, n, svh_ptr, had_ptr, out_a_ptr, out_b_ptr, stride_a,
                  CONCAT: tl.constexpr, TWO: tl.constexpr, H_EARLY: tl.constexpr, PARTS: tl.constexpr):
    """One 128-column block's epilogue into the member's output (table row `meta`): out buffer a or b, its region
    ([T, n] at column offset · T) or its columns of the [T, Σn] tensor (CONCAT)."""
    col0 = tl.multiple_of(tl.load(meta + 4), 128)
    r64 = rows[:, None].to(tl.int64)
    if CONCAT:
        at = r64 * stride_a + col0 + cols[None, :]
    else:
        at = col0 * n_rows + r64 * n + cols[None, :]
    svh = svh_ptr + tl.load(meta + 3) + cols
    if TWO:
        if tl.load(meta + 5) == 0:
            _store(acc, h, svh, had_ptr, out_a_ptr + at, ok, H_EARLY, PARTS)
        else:
            _store(acc, h, svh, had_ptr, out_b_ptr + at, ok, H_EARLY, PARTS)
    else:
        _store(acc, h, svh, had_ptr, out_a_ptr + at, ok, H_EARLY, PARTS)


@triton.jit(do_not_specialize=["n_rows"])
def _gemm_group_kernel(xh_ptr, w_ptr, svh_ptr, had_ptr, out_a_ptr, out_b_ptr, meta_ptr, stride_a, n_rows, k,
                       n_blocks, MEMBERS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                       BN: tl.constexpr, CONCAT: tl.constexpr, TWO: tl.constexpr, H_EARLY: tl.constexpr = False,
                       PARTS: tl.constexpr = 3):
    """`_gemm_rotate_kernel`'s tile for global column block gb of the members' blocks side by side: member m (the
    table's rows: first block, n, ...) from xh[m] [n_rows, k] and its W at its workspace offset."""
    mb, gb = tile_of(tl.program_id(0), tl.cdiv(n_rows, BM), n_blocks, GROUP_M)
    m = gb * 0
    for j in tl.static_range(1, MEMBERS):
        m += (gb >= tl.load(meta_ptr + j * 6)).to(m.dtype)
    meta = meta_ptr + m * 6
    n = tl.multiple_of(tl.load(meta + 1), 128)
    w_off = tl.multiple_of(tl.load(meta + 2), 128)
    nb = gb - tl.load(meta)
    rows = mb * BM + tl.arange(0, BM)
    ok = rows < n_rows
    cols = nb * BN + tl.arange(0, 128)
    kk = tl.arange(0, BK)
    x_ptrs = xh_ptr + m.to(tl.int64) * n_rows * k + rows[:, None].to(tl.int64) * k + kk[None, :]
    w_ptrs = w_ptr + w_off + kk[:, None].to(tl.int64) * n + cols[None, :]
    h = hadamard_tile(had_ptr) if H_EARLY or PARTS != 3 else had_ptr  # loaded here: before the k loop
    args = (svh_ptr, had_ptr, out_a_ptr, out_b_ptr, stride_a)
    if BN == 128:
        acc = product_tile(x_ptrs, ok, w_ptrs, k, n, BM, BK)
        _member_store(acc, h, meta, cols, rows, ok, n_rows, n, *args, CONCAT, TWO, H_EARLY, PARTS)
    else:
        n_ok1 = nb * BN + 128 < n
        acc0, acc1 = product_tile2(x_ptrs, ok, w_ptrs, n_ok1, k, n, BM, BK)
        _member_store(acc0, h, meta, cols, rows, ok, n_rows, n, *args, CONCAT, TWO, H_EARLY, PARTS)
        if n_ok1:
            _member_store(acc1, h, meta, cols + 128, rows, ok, n_rows, n, *args, CONCAT, TWO, H_EARLY, PARTS)


class DenseGroup:
    """Matrices of one k run as one rotation + one GEMM launch: their stacked suh, concatenated svh and the member
    table per launch shape, made once (build-time sized, a few KB)."""

    def __init__(self, weights: Sequence[Exl3Tensor]):
        self.weights = list(weights)
        if not 1 <= len(self.weights) <= MAX_MEMBERS:
            raise ValueError(f"a dense group holds 1..{MAX_MEMBERS} matrices, got {len(self.weights)}")
        self.k = self.weights[0].k
        if any(w.k != self.k or w.n % BLOCK_N for w in self.weights):
            raise ValueError(f"a dense group's matrices share k and have whole 128-column blocks: "
                             f"{[(w.k, w.n) for w in self.weights]}")
        self.numel = sum(w.k * w.n for w in self.weights)  # the workspace it decodes into
        self.suh = torch.stack([w.suh.reshape(-1) for w in self.weights]).contiguous()
        self.svh = torch.cat([w.svh.reshape(-1) for w in self.weights]).contiguous()
        self._meta: dict[tuple, torch.Tensor] = {}

    def meta(self, block_n: int, sel: tuple[int, ...], concat: bool) -> tuple[torch.Tensor, int]:
        """The member table [members, META] int64 on the device and the global column blocks, for this shape."""
        key = (block_n, sel, concat)
        if key not in self._meta:
            rows, first, w_off, svh_off, cols = [], 0, 0, 0, [0, 0]
            for w, s in zip(self.weights, sel):
                rows.append([first, w.n, w_off, svh_off, cols[0] if concat else cols[s], s])
                first += triton.cdiv(w.n, block_n)
                w_off += w.k * w.n
                svh_off += w.n
                cols[0 if concat else s] += w.n
            self._meta[key] = (torch.tensor(rows, dtype=torch.int64, device=self.suh.device), first)
        return self._meta[key]

    def rotate(self, xs: Sequence[torch.Tensor], row_blocks: int | None = None, rows: int = 16) -> torch.Tensor:
        """xh [members, T, k] fp16: one launch where the inputs are one tensor or side by side at one step (same
        dtype and row stride), else one launch a member (the same kernel, the same bits). rows: the dot's rows
        (16: `prefill._rotate`'s bits; 64: the bench's A/B)."""
        T, k, M = xs[0].shape[0], self.k, len(xs)
        xh = torch.empty(M, T, k, dtype=torch.float16, device=xs[0].device)
        if T == 0:
            return xh
        rb = row_blocks or max(1, _row_blocks(T * M, k // 128) * 16 // rows)
        had = hadamard_signs(xs[0].device, torch.float16)
        size = xs[0].element_size()
        base, stride = xs[0], xs[0].stride(0)
        step = (xs[1].data_ptr() - base.data_ptr()) // size if M > 1 else 0
        if all(x.dtype == base.dtype and x.stride(0) == stride and x.stride(-1) == 1 and x.shape == (T, k)
               and x.data_ptr() == base.data_ptr() + m * step * size for m, x in enumerate(xs)) and step >= 0:
            _rotate_members_kernel[(triton.cdiv(T, rows * rb), k // 128, M)](
                base, stride, step, self.suh, had, xh, T, k, ROW_BLOCKS=rb, ROWS=rows)
            return xh
        for m, x in enumerate(xs):
            x = x if x.stride(-1) == 1 else x.contiguous()
            _rotate_members_kernel[(triton.cdiv(T, rows * rb), k // 128, 1)](
                x, x.stride(0), 0, self.suh[m], had, xh[m], T, k, ROW_BLOCKS=rb, ROWS=rows)
        return xh

    def decode(self, workspace: torch.Tensor | None = None) -> torch.Tensor:
        """Every member's W_q [k, n] fp16 one after another in `workspace` (flat, >= numel values; None: fresh)."""
        dev = self.suh.device
        flat = torch.empty(self.numel, dtype=torch.float16, device=dev) if workspace is None else workspace.view(-1)
        if flat.numel() < self.numel or flat.dtype != torch.float16:
            raise ValueError(f"the workspace holds {flat.numel()} {flat.dtype} values, the group needs {self.numel}")
        at = 0
        for w in self.weights:
            reconstruct(w, torch.float16, rotate=False, out=flat[at:at + w.k * w.n].view(w.k, w.n))
            at += w.k * w.n
        return flat

    def __call__(self, xs: Sequence[torch.Tensor], out_dtypes: Sequence[torch.dtype],
                 workspace: torch.Tensor | None = None, concat: bool = False, cfg: GemmConfig | None = None):
        """Each member's x_m @ W_eff: a list of [T, n_m] tensors (out_dtypes: at most two distinct), or with
        `concat` one [T, Σn] tensor of out_dtypes[0]."""
        M = len(self.weights)
        if len(xs) != M or len(out_dtypes) != M:
            raise ValueError(f"a group of {M} matrices takes {M} inputs and dtypes, got {len(xs)}, {len(out_dtypes)}")
        T, dev = xs[0].shape[0], xs[0].device
        kinds = list(dict.fromkeys(out_dtypes))
        if len(kinds) > 2 or (concat and len(kinds) > 1):
            raise ValueError(f"a group launch writes at most two output dtypes (one with concat), got {kinds}")
        if any(x.shape != (T, self.k) for x in xs):
            raise ValueError(f"every input must be [{T}, {self.k}], got {[list(x.shape) for x in xs]}")
        sel = tuple(kinds.index(d) for d in out_dtypes)
        widths = [sum(w.n for w, s in zip(self.weights, sel) if s == i) for i in range(len(kinds))]
        if concat:
            out = torch.empty(T, widths[0], dtype=kinds[0], device=dev)
            bufs = [out, out]
        else:
            bufs = [torch.empty(T * wd, dtype=d, device=dev) for wd, d in zip(widths, kinds)]
            bufs = bufs + bufs[:1] if len(bufs) == 1 else bufs
        if T:
            cfg = cfg or config(dev)
            if self.k % cfg.block_k:
                raise ValueError(f"k {self.k} is not a whole number of {cfg.block_k}-deep steps")
            if cfg.tma or cfg.persistent:  # the members' tiles by pointers, a program a tile: the same arithmetic
                from dataclasses import replace

                cfg = replace(cfg, tma=False, persistent=0, h_early=cfg.h_early or bool(cfg.persistent))
            xh = self.rotate(xs)
            w = self.decode(workspace)
            meta, n_blocks = self.meta(cfg.block_n, sel, concat)
            _gemm_group_kernel[(triton.cdiv(T, cfg.block_m) * n_blocks,)](
                xh, w, self.svh, hadamard_signs(dev, torch.float16), bufs[0], bufs[1], meta,
                bufs[0].stride(0) if concat else 0, T, self.k, n_blocks, MEMBERS=M, BM=cfg.block_m, BK=cfg.block_k,
                GROUP_M=cfg.group_m, BN=cfg.block_n, CONCAT=concat, TWO=len(kinds) == 2, H_EARLY=cfg.h_early,
                PARTS=cfg.rotate_parts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if concat:
            return bufs[0]
        outs, at = [], [0, 0]
        for wt, s in zip(self.weights, sel):
            outs.append(bufs[s][at[s]:at[s] + T * wt.n].view(T, wt.n))
            at[s] += T * wt.n
        return outs


def prefill_linear_group(xs: Sequence[torch.Tensor], weights: Sequence[Exl3Tensor],
                         out_dtypes: Sequence[torch.dtype] | None = None, workspace: torch.Tensor | None = None,
                         concat: bool = False, cfg: GemmConfig | None = None):
    """`[prefill_linear(x, w, dense_gemm=True) for x, w in zip(xs, weights)]` (the same bits) as one rotation and one
    GEMM launch (plus a decode a member); a DenseGroup made for the call (the runtime keeps its own)."""
    out_dtypes = list(out_dtypes or [x.dtype for x in xs])
    return DenseGroup(weights)(xs, out_dtypes, workspace, concat, cfg)


