"""Prefill EXL3 products on tensor cores, each weight tile decoded once per tile of rows (issue 31).

The decode kernels (`matmul.py`, `moe.py`) take 16 rows and split the k loop; a prefill chunk has thousands of
rows, and reconstructing each matrix into a dense workspace (`reconstruct.py` + a GEMM) writes and re-reads a bf16
copy of every weight. Here a program owns a tile of `BM` rows and one 128-column block, runs the WHOLE k loop
(no split: no partials, no counters) decoding the trellis slice by slice in registers and multiplying it on the
tensor cores with every row of its tile, and applies the output rotation and svh in its epilogue. So a weight is
decoded once per row tile: for the routed experts, whose rows are grouped by expert, about once per chunk.

Two backends, the EXL3 kernels' choice (`backend.use_cuda_backend`): on NVIDIA GPUs the CUDA tile kernel
(`prefill_cuda`, `exl3_prefill_r64` / `_r128`: each lane decodes its weights straight into its mma operand
registers, as the decode kernels do, and each fragment feeds the tile's 64 or 128 rows, `DSV41_PREFILL_TILE_ROWS`:
the same bits either way), elsewhere (the interpreter, other GPUs) the Triton
tiles here (`_gate_up_kernel`, `_tile_matmul_kernel`: the same function, decoded through Triton's layouts). The two
give other bits; each is row-invariant.

Routed experts (`prefill_moe`), per layer:
  1. the chunk's (row, slot) pairs sorted by expert on the device (one stable argsort of the flattened ids: an
     expert's pairs stay in (row, slot) order) and cut into tiles of at most BM pairs of one expert (`tile_table`'s
     table, made by `tile_table.route_table` in three launches, no host read: the grid is the static bound
     `pairs // BM + min(E, pairs)`, spare programs exit);
  2. `_rotate_kernel`: each pair's input row rotated with its expert's suh, once for gate and once for up (in the
     CUDA kernel's B-operand order on that backend);
  3. gate and up over each tile, clamped SwiGLU times the routing weight (the decode kernel's epilogue, h rounded
     to fp16), and h rotated at once for the down product (the same 128-column block is the down's 128-row input
     block: `rot(fp16(h) ⊙ suh2)`), so h is never stored unrotated: Triton in one launch (`_gate_up_kernel`); CUDA
     as two tile launches (gate, up: fp32) and `_swiglu_rotate_kernel`;
  4. the down product, each pair's output row stored at its (row, slot) place;
  5. `_slot_sum_kernel`: each row's slots summed in slot order (0 .. k-1), plus the addend (the shared expert).
Dense projections (`prefill_linear`): the input rotated once, then one tiled launch over tiles of consecutive rows;
or (`DSV41_PREFILL_DENSE_GEMM=1`, off by default) the matrix decoded once into a workspace and one tensor-core GEMM
with the same epilogue (`prefill_dense.py`: at 8K rows the tiles decode each weight 128 times).

Row invariance (chunked == one-shot, batched == alone): the tile shape, BK and warps are fixed per kernel, never
chosen from the row count (the rotations' 16-row blocks a program, `_row_blocks`, follow it: each block is the
same fixed dot, so the same bits); every product is a tensor-core dot whose output row depends on its own input row only;
the rotations are per row (`rotate_rows_fp32` scales each row by its own maximum). So a row's bits do not depend
on the other rows of its tile, on its place in it, or on the chunk (tests/test_exl3_prefill.py). The CUDA
kernels' two tile sizes give the same bits (each output element one mma chain over k in the same order), so the
64 / 128 choice is free to follow the device and K (tests/test_exl3_prefill.py's GPU part compares them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv41.kernels.exl3.backend import interpreting, use_cuda_backend, use_inline_asm
from dsv41.kernels.exl3.decode import (
    INV_SQRT128,
    accumulate_kslice_prerotated,
    hadamard_signs,
    rotate_rows_fp32,
)
from dsv41.kernels.exl3.layout import Exl3ExpertStack, Exl3Tensor, check_moe_inputs, moe_out
from dsv41.kernels.exl3 import prefill_cuda, prefill_wgmma
from dsv41.kernels.exl3.prefill_dense import Workspace, dense_gemm_enabled, workspace_matmul
from dsv41.kernels.exl3.prefill_cuda import prefill_tiles_cuda
from dsv41.kernels.exl3.tile_table import route_table


@dataclass(frozen=True)
class PrefillConfig:
    """One launch shape for every prefill product of a kind: fixed, so a row's bits never follow the chunk."""

    block_m: int = 64
    block_k: int = 32
    num_warps: int = 8
    num_stages: int = 1


EXPERTS = PrefillConfig()
DENSE = PrefillConfig(block_m=64)
# the interpreter runs one program at a time on the CPU: the smallest legal tiles (a row's bits never depend on the
# tile, so the tests' claims are the GPU's). 128-deep k steps ran the interpreted tests 2-3x faster but moved one
# index choice of tests/test_runtime_fast_tp.py's fake-quant-off TP=2 case past its near-tie bound (margin 11% of
# the scale): not understood yet, so 16 stays (docs/perf/prefill.md, "Next")
INTERPRETED = PrefillConfig(block_m=16, block_k=16, num_warps=4)


def _config(cfg: PrefillConfig) -> PrefillConfig:
    return INTERPRETED if interpreting() else cfg


@triton.jit
def _tile(table_ptr, t, BM: tl.constexpr):
    """(expert, first pair, pairs) of tile t of the table [tiles, 3] int32; pairs 0: a spare program."""
    e = tl.load(table_ptr + t * 3)
    first = tl.load(table_ptr + t * 3 + 1)
    count = tl.load(table_ptr + t * 3 + 2)
    return e, first, count


@triton.jit
def _b_operand_columns(cols):
    """Where the CUDA tile kernel reads natural column c of a 128-block (its B-operand order, `b_word_pos` in
    cuda/exl3_fused.cu): fp16 pair w = c // 2 of tile row r = w // 8, half h = (w // 4) % 2, lane t = w % 4 goes to
    pair 16(r // 2) + 4t + 2(r % 2) + h."""
    w = cols // 2
    r = w // 8
    pos = 16 * (r // 2) + 4 * (w % 4) + 2 * (r % 2) + (w // 4) % 2
    return 2 * pos + cols % 2


@triton.jit
def _rotate_block(v, su_ptrs, ok, h):
    """fp16(fp16(v ⊙ su) · H/√128) of a [16, 128] block: v fp16 values held as fp32, su loaded at su_ptrs (the
    rows `ok`), h the ±1 Hadamard (`rotate_input_kernel`'s math)."""
    su = tl.load(su_ptrs, mask=ok[:, None], other=0.0).to(tl.float32)
    return (tl.dot((v * su).to(tl.float16), h) * INV_SQRT128).to(tl.float16)


@triton.jit
def _block_offsets(rows, width, kb, PERMUTE: tl.constexpr):
    """Element offsets of 128-block kb of `rows` in a [*, width] fp16 tensor, in the CUDA tile kernel's B-operand
    order when PERMUTE (else natural)."""
    cols = tl.arange(0, 128)
    if PERMUTE:
        cols = _b_operand_columns(cols)
    return rows[:, None].to(tl.int64) * width + (kb * 128 + cols)[None, :]


@triton.jit(do_not_specialize=["n_rows"])
def _rotate_kernel(x_ptr, stride_x, src_ptr, pair_e_ptr, suh_a_ptr, suh_b_ptr, had_ptr, xa_ptr, xb_ptr, n_rows, k,
                   GATHER: tl.constexpr, PER_EXPERT: tl.constexpr, TWO: tl.constexpr, PERMUTE: tl.constexpr,
                   ROW_BLOCKS: tl.constexpr = 1):
    """xa[i] = fp16(fp16(fp16(x[row_i]) ⊙ suh_a[e_i]) · H/√128) for ROW_BLOCKS blocks of 16 rows and one 128-wide
    input block (`rotate_input_kernel`'s math), and xb with suh_b when TWO. GATHER: row_i = src[i] (else i);
    PER_EXPERT: the signs of expert e_i = pair_e[i] (else the one matrix's); PERMUTE: each 128-block stored in the
    CUDA tile kernel's B-operand order. ROW_BLOCKS (`_row_blocks`): the 32 KB Hadamard is loaded once for them all
    (with one block a program it was re-read for every 4 KB of rows); each block is the same [16, 128] x
    [128, 128] dot as with one, so the same bits whatever ROW_BLOCKS is."""
    pb = tl.program_id(0)
    kb = tl.program_id(1)
    cols = tl.arange(0, 128)
    xk = kb * 128 + cols
    h = tl.load(had_ptr + cols[:, None] * 128 + cols[None, :])
    for i in tl.static_range(ROW_BLOCKS):
        rows = (pb * ROW_BLOCKS + i) * 16 + tl.arange(0, 16)
        ok = rows < n_rows
        if GATHER:
            src = tl.load(src_ptr + rows, mask=ok, other=0).to(tl.int64)
        else:
            src = rows.to(tl.int64)
        if PER_EXPERT:
            e = tl.load(pair_e_ptr + rows, mask=ok, other=0).to(tl.int64)
        else:
            e = rows.to(tl.int64) * 0
        x = tl.load(x_ptr + src[:, None] * stride_x + xk[None, :], mask=ok[:, None], other=0.0)
        x16 = x.to(tl.float16).to(tl.float32)
        out = _block_offsets(rows, k, kb, PERMUTE)
        tl.store(xa_ptr + out, _rotate_block(x16, suh_a_ptr + e[:, None] * k + xk[None, :], ok, h),
                 mask=ok[:, None])
        if TWO:
            tl.store(xb_ptr + out, _rotate_block(x16, suh_b_ptr + e[:, None] * k + xk[None, :], ok, h),
                     mask=ok[:, None])


@triton.jit(do_not_specialize=["n_pairs"])
def _swiglu_rotate_kernel(gate_ptr, up_ptr, route_ptr, pair_e_ptr, suh2_ptr, had_ptr, hh_ptr, n_pairs, n1, LIMIT,
                          PERMUTE: tl.constexpr, ROW_BLOCKS: tl.constexpr = 1):
    """The CUDA path's gate/up epilogue for ROW_BLOCKS blocks of 16 pairs and one 128-column block: clamped SwiGLU
    of the rotated gate and up (fp32) times the routing weight, rounded to fp16, rotated with the down matrix's suh
    (`_gate_up_kernel`'s epilogue, the same math). ROW_BLOCKS: as `_rotate_kernel` (the same bits)."""
    pb = tl.program_id(0)
    nb = tl.program_id(1)
    idx = tl.arange(0, 128)
    cols = nb * 128 + idx
    had = tl.load(had_ptr + idx[:, None] * 128 + idx[None, :])
    for i in tl.static_range(ROW_BLOCKS):
        pairs = (pb * ROW_BLOCKS + i) * 16 + tl.arange(0, 16)
        ok = pairs < n_pairs
        at = pairs[:, None].to(tl.int64) * n1 + cols[None, :]
        gate = tl.minimum(tl.load(gate_ptr + at, mask=ok[:, None], other=0.0), LIMIT)
        up = tl.load(up_ptr + at, mask=ok[:, None], other=0.0)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        route = tl.load(route_ptr + pairs, mask=ok, other=0.0).to(tl.float32)
        h16 = (gate * tl.sigmoid(gate) * up * route[:, None]).to(tl.float16)
        e = tl.load(pair_e_ptr + pairs, mask=ok, other=0).to(tl.int64)
        hh = _rotate_block(h16.to(tl.float32), suh2_ptr + e[:, None] * n1 + cols[None, :], ok, had)
        tl.store(hh_ptr + _block_offsets(pairs, n1, nb, PERMUTE), hh, mask=ok[:, None])


@triton.jit
def _gate_up_kernel(table_ptr, xg_ptr, xu_ptr, route_ptr, w1_ptr, svh1_ptr, w3_ptr, svh3_ptr, suh2_ptr, had_ptr,
                    hh_ptr, k1, n1, LIMIT, K: tl.constexpr, CODEBOOK: tl.constexpr, BM: tl.constexpr,
                    BK: tl.constexpr, USE_ASM: tl.constexpr):
    """One tile of one expert's pairs x one 128-column block of the intermediate: gate and up over the whole k,
    rotated back, clamped SwiGLU times the routing weight, rounded to fp16 (the decode kernel's h), then rotated
    with the down matrix's suh into the down product's input hh (fp16)."""
    t = tl.program_id(0)
    nb = tl.program_id(1)
    e, first, count = _tile(table_ptr, t, BM)
    if count > 0:
        e64 = e.to(tl.int64)
        pairs = first + tl.arange(0, BM)
        ok = tl.arange(0, BM) < count
        x_rows = pairs.to(tl.int64) * k1
        tiles_n = n1 // 16
        expert_words = e64 * (k1 // 16) * tiles_n * (8 * K)
        col_words = nb * 8 * (8 * K)
        k_blocks = k1 // 128
        acc_g = tl.zeros((BM, 128), dtype=tl.float32)
        acc_g = accumulate_kslice_prerotated(acc_g, xg_ptr, x_rows, ok, w1_ptr + expert_words + col_words, tiles_n,
                                             0, k_blocks, K, CODEBOOK, BK, USE_ASM)
        acc_u = tl.zeros((BM, 128), dtype=tl.float32)
        acc_u = accumulate_kslice_prerotated(acc_u, xu_ptr, x_rows, ok, w3_ptr + expert_words + col_words, tiles_n,
                                             0, k_blocks, K, CODEBOOK, BK, USE_ASM)
        cols = nb * 128 + tl.arange(0, 128)
        gate = rotate_rows_fp32(acc_g, had_ptr) * tl.load(svh1_ptr + e64 * n1 + cols).to(tl.float32)[None, :]
        up = rotate_rows_fp32(acc_u, had_ptr) * tl.load(svh3_ptr + e64 * n1 + cols).to(tl.float32)[None, :]
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        route = tl.load(route_ptr + pairs, mask=ok, other=0.0).to(tl.float32)
        h16 = (gate * tl.sigmoid(gate) * up * route[:, None]).to(tl.float16)
        # the down product's input rotation of this 128-block (rotate_input_kernel's math on the fp16 h)
        su = tl.load(suh2_ptr + e64 * n1 + cols).to(tl.float32)
        hs = (h16.to(tl.float32) * su[None, :]).to(tl.float16)
        idx = tl.arange(0, 128)
        had = tl.load(had_ptr + idx[:, None] * 128 + idx[None, :])
        hh = (tl.dot(hs, had) * INV_SQRT128).to(tl.float16)
        tl.store(hh_ptr + pairs[:, None].to(tl.int64) * n1 + cols[None, :], hh, mask=ok[:, None])


@triton.jit(do_not_specialize=["n_rows"])
def _tile_matmul_kernel(table_ptr, xh_ptr, out_rows_ptr, w_ptr, svh_ptr, had_ptr, out_ptr, stride_out, n_rows, k, n,
                        K: tl.constexpr, CODEBOOK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                        GROUPED: tl.constexpr, USE_ASM: tl.constexpr):
    """out[row] = rot(xh[i] @ W_q[e]) ⊙ svh[e] for the BM rows i of one tile and one 128-column block, the whole k.

    GROUPED: tiles from the table (expert, first, count), output row out_rows[i]; else one matrix (e = 0), tile t
    the rows [t·BM, t·BM + BM) of n_rows, output row i."""
    t = tl.program_id(0)
    nb = tl.program_id(1)
    if GROUPED:
        e, first, count = _tile(table_ptr, t, BM)
    else:
        e = t * 0
        first = t * BM
        count = tl.minimum(n_rows - first, BM)
    if count > 0:
        e64 = e.to(tl.int64)
        rows = first + tl.arange(0, BM)
        ok = tl.arange(0, BM) < count
        tiles_n = n // 16
        words = e64 * (k // 16) * tiles_n * (8 * K) + nb * 8 * (8 * K)
        acc = tl.zeros((BM, 128), dtype=tl.float32)
        acc = accumulate_kslice_prerotated(acc, xh_ptr, rows.to(tl.int64) * k, ok, w_ptr + words, tiles_n, 0,
                                           k // 128, K, CODEBOOK, BK, USE_ASM)
        cols = nb * 128 + tl.arange(0, 128)
        y = rotate_rows_fp32(acc, had_ptr) * tl.load(svh_ptr + e64 * n + cols).to(tl.float32)[None, :]
        if GROUPED:
            dest = tl.load(out_rows_ptr + rows, mask=ok, other=0).to(tl.int64)
        else:
            dest = rows.to(tl.int64)
        tl.store(out_ptr + dest[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=ok[:, None])


@triton.jit(do_not_specialize=["n_rows"])
def _slot_sum_kernel(y_ptr, addend_ptr, out_ptr, stride_out, stride_add, n_rows, n, TOPK: tl.constexpr,
                     ADD: tl.constexpr):
    """out[r] = ((y[r·k] + y[r·k + 1]) + ...) + addend[r]: a row's slots in slot order (the decode kernel's sum)."""
    rb = tl.program_id(0)
    nb = tl.program_id(1)
    rows = rb * 16 + tl.arange(0, 16)
    ok = rows < n_rows
    cols = nb * 128 + tl.arange(0, 128)
    total = tl.zeros((16, 128), dtype=tl.float32)
    for s in tl.static_range(TOPK):
        slot = rows.to(tl.int64) * TOPK + s
        total += tl.load(y_ptr + slot[:, None] * n + cols[None, :], mask=ok[:, None], other=0.0)
    if ADD:
        total += tl.load(addend_ptr + rows[:, None].to(tl.int64) * stride_add + cols[None, :], mask=ok[:, None],
                         other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], total.to(out_ptr.dtype.element_ty),
             mask=ok[:, None])


def max_tiles(pairs: int, experts: int, block_m: int) -> int:
    """The most tiles `pairs` (row, slot) pairs over `experts` experts can need: Σ_e ceil(c_e / BM) with Σ c_e =
    pairs is at most pairs // BM plus one per expert that has any pair."""
    return pairs // block_m + min(experts, pairs)


def tile_table(flat_ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, pair_expert, table) of the flattened routing ids [pairs], all on the device, no host read.

    order: the pairs (flat index row·k + slot) sorted by expert, stably (an expert's pairs in (row, slot) order);
    pair_expert: each sorted pair's expert; table [max_tiles, 3] int32: per tile its expert, first sorted pair and
    pair count (at most block_m; 0 for the spare tiles past the last)."""
    flat = flat_ids.reshape(-1).long()
    pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    # not torch.bincount: on CUDA it reads the largest id back to size its output (a host sync each layer, which
    # left the GPU idle while the host launched the rest of the layer: ~35 ms of a 2,048-row chunk at 26 layers)
    counts = torch.zeros(experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(counts, 0) - counts
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    t = torch.arange(max_tiles(pairs, experts, block_m), device=flat.device)
    e = torch.searchsorted(tile_end, t, right=True).clamp_(max=experts - 1)
    within = t - (tile_end[e] - tiles[e])
    first = starts[e] + within * block_m
    count = (counts[e] - within * block_m).clamp_(min=0, max=block_m)
    count = torch.where(t < tile_end[-1], count, torch.zeros_like(count))
    table = torch.stack((e, first, count), dim=1).to(torch.int32).contiguous()
    return order, flat[order].to(torch.int32).contiguous(), table


def _cuda_rows(device: torch.device, Ks: tuple[int, ...], tile_rows: int | None) -> int | None:
    """The CUDA tile kernel's rows (`prefill_cuda.tile_rows`: 64 or 128) where the EXL3 CUDA kernels run and its
    shared memory fits for these K; None: the Triton tiles here."""
    if not use_cuda_backend(device):
        return None
    rows = prefill_cuda.tile_rows(device, Ks, tile_rows)
    return rows if all(prefill_cuda.fits(K, device, rows) for K in Ks) else None


def _row_blocks(rows: int, col_blocks: int) -> int:
    """Blocks of 16 rows per program of the rotation kernels: up to 8 while that leaves at least ~1,024 programs
    (an H100's 132 SMs kept busy). Free to follow the row count: each 16-row block is the same dot and the same
    per-element epilogue whatever the program holds, so the bits do not depend on it (tests/test_prefill_rowops)."""
    units = triton.cdiv(rows, 16) * col_blocks
    blocks = 1
    while blocks < 8 and units // (2 * blocks) >= 1024:
        blocks *= 2
    return blocks


def _rotate(x, suh_a, k, *, src=None, pair_e=None, suh_b=None, rows=None, permute=False, row_blocks=None,
            padded=None):
    """The rotated input(s) of `rows` rows (fp16 [rows (+ the CUDA tiles' padding when `padded`, None: when
    permuted), k]). row_blocks (None: `_row_blocks`): 16-row blocks per program, for the tests and the bench's A/B."""
    rows = x.shape[0] if rows is None else rows
    pad = prefill_cuda.PAD_ROWS if (permute if padded is None else padded) else 0
    xa = torch.empty(rows + pad, k, dtype=torch.float16, device=x.device)
    xb = torch.empty_like(xa) if suh_b is not None else xa
    if rows:
        rb = row_blocks or _row_blocks(rows, k // 128)
        _rotate_kernel[(triton.cdiv(rows, 16 * rb), k // 128)](
            x, x.stride(0), src if src is not None else xa, pair_e if pair_e is not None else xa, suh_a,
            suh_b if suh_b is not None else suh_a, hadamard_signs(x.device, torch.float16), xa, xb, rows, k,
            GATHER=src is not None, PER_EXPERT=pair_e is not None, TWO=suh_b is not None, PERMUTE=permute,
            ROW_BLOCKS=rb)
    return xa, xb


def swiglu_rotate(gate, up, route, pair_e, suh2, hh, pairs, inter, limit, *, permute=True, row_blocks=None):
    """`_swiglu_rotate_kernel` over `pairs` pairs into hh (row_blocks: as `_rotate`)."""
    rb = row_blocks or _row_blocks(pairs, inter // 128)
    _swiglu_rotate_kernel[(triton.cdiv(pairs, 16 * rb), inter // 128)](
        gate, up, route, pair_e, suh2, hadamard_signs(gate.device, torch.float16), hh, pairs, inter, float(limit),
        PERMUTE=permute, ROW_BLOCKS=rb)
    return hh


def prefill_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: Exl3ExpertStack,
                w3: Exl3ExpertStack, w2: Exl3ExpertStack, swiglu_limit: float = 10.0,
                out_dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
                addend: torch.Tensor | None = None, config: PrefillConfig | None = None,
                tile_rows: int | None = None, columns_first: bool | None = None,
                wgmma: bool | None = None) -> torch.Tensor:
    """Σ_i w_i · (clamped SwiGLU(x W1_e, x W3_e) @ W2_e) per row, e = topk_ids[row, i], slots summed in order i,
    plus `addend` [T, hidden] when given: `moe.moe_forward`'s function for a prefill chunk of any length.

    tile_rows / columns_first (None: `DSV41_PREFILL_TILE_ROWS` / `_ORDER`): the CUDA tiles' rows (64, 128) and
    launch order (`prefill_cuda`); the same bits whatever they are. wgmma (None: `DSV41_PREFILL_WGMMA`): on a
    Hopper GPU the 128-row tiles on warpgroup MMA (`prefill_wgmma`), fed the rotation in natural k order."""
    check_moe_inputs(x, topk_ids, topk_weights, w1, w3, w2)
    T, hidden = x.shape
    out = moe_out(out, T, hidden, out_dtype, x.device)
    if T == 0:
        return out
    if addend is not None and (addend.shape != (T, hidden) or addend.stride(-1) != 1):
        raise ValueError(f"addend must be [{T}, {hidden}] with unit column stride, got {list(addend.shape)}")
    dev = x.device
    cuda_rows = _cuda_rows(dev, (w1.K, w2.K), tile_rows)
    cuda = cuda_rows is not None
    wg = cuda and prefill_wgmma.use_wgmma(dev, wgmma)
    cfg = _config(config or EXPERTS)
    block_m = prefill_wgmma.ROWS if wg else cuda_rows if cuda else cfg.block_m
    topk = topk_ids.shape[1]
    pairs = T * topk
    inter = w1.n
    x = x if x.stride(-1) == 1 else x.contiguous()
    # the table, each sorted pair's row, weight and place: `tile_table`'s and the gathers' values in 3 launches
    order, pair_e, table, src, route, out_rows = route_table(topk_ids, w1.experts, block_m,
                                                             max_tiles(pairs, w1.experts, block_m),
                                                             weights=topk_weights, topk=topk)
    had = hadamard_signs(dev, torch.float16)
    tiles = table.shape[0]
    xg, xu = _rotate(x, w1.suh, hidden, src=src, pair_e=pair_e, suh_b=w3.suh, rows=pairs, permute=cuda and not wg,
                     padded=cuda)
    hh = torch.empty(pairs + (prefill_cuda.PAD_ROWS if cuda else 0), inter, dtype=torch.float16, device=dev)
    if wg:
        tiles_of = functools.partial(prefill_wgmma.prefill_tiles_wgmma, columns_first=columns_first)
    else:
        tiles_of = functools.partial(prefill_tiles_cuda, rows=block_m, columns_first=columns_first)
    if cuda:
        gate = torch.empty(pairs, inter, dtype=torch.float32, device=dev)
        up = torch.empty_like(gate)
        tiles_of(xg, w1.words, w1.svh, w1.K, w1.codebook, hidden, inter, gate, pairs, tiles, table=table)
        tiles_of(xu, w3.words, w3.svh, w3.K, w3.codebook, hidden, inter, up, pairs, tiles, table=table)
        del xg, xu
        swiglu_rotate(gate, up, route, pair_e, w2.suh, hh, pairs, inter, swiglu_limit, permute=not wg)
        del gate, up
    else:
        _gate_up_kernel[(tiles, inter // 128)](
            table, xg, xu, route, w1.words, w1.svh, w3.words, w3.svh, w2.suh, had, hh, hidden, inter,
            float(swiglu_limit), K=w1.K, CODEBOOK=w1.codebook_id, BM=cfg.block_m, BK=cfg.block_k,
            USE_ASM=use_inline_asm(dev, w1.codebook), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        del xg, xu
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=dev)
    if cuda:
        tiles_of(hh, w2.words, w2.svh, w2.K, w2.codebook, inter, hidden, y, pairs, tiles, table=table,
                 out_rows=out_rows)
    else:
        _tile_matmul_kernel[(tiles, hidden // 128)](
            table, hh, out_rows, w2.words, w2.svh, had, y, y.stride(0), pairs, inter, hidden,
            K=w2.K, CODEBOOK=w2.codebook_id, BM=cfg.block_m, BK=cfg.block_k, GROUPED=True,
            USE_ASM=use_inline_asm(dev, w2.codebook), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    add = addend if addend is not None else y
    _slot_sum_kernel[(triton.cdiv(T, 16), hidden // 128)](
        y, add, out, out.stride(0), add.stride(0), T, hidden, TOPK=topk, ADD=addend is not None)
    return out


def prefill_linear(x: torch.Tensor, weight: Exl3Tensor, out_dtype: torch.dtype | None = None,
                   out: torch.Tensor | None = None, config: PrefillConfig | None = None,
                   workspace: Workspace | None = None, dense_gemm: bool | None = None, tile_rows: int | None = None,
                   columns_first: bool | None = None) -> torch.Tensor:
    """`x @ W_eff` for a prefill chunk [T, k]: the input rotated once, then one tiled launch (module docstring).

    dense_gemm (None: the `DSV41_PREFILL_DENSE_GEMM` switch, read here at each launch): the matrix decoded once into
    `workspace(k, n)` (a fresh tensor without one) and one tensor-core GEMM instead (`prefill_dense`). tile_rows /
    columns_first: the CUDA tiles' shape and order, as in `prefill_moe`."""
    T, k = x.shape
    if k != weight.k:
        raise ValueError(f"x has {k} columns, the matrix {weight.k} rows")
    out_dtype = out_dtype or x.dtype
    if out is None:
        out = torch.empty(T, weight.n, dtype=out_dtype, device=x.device)
    elif out.shape != (T, weight.n) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{T}, {weight.n}] with unit column stride, got {list(out.shape)}")
    if T == 0:
        return out
    dev = x.device
    if dense_gemm_enabled() if dense_gemm is None else dense_gemm:
        xh, _ = _rotate(x, weight.suh, k)
        return workspace_matmul(xh, weight, out, workspace)
    rows = _cuda_rows(dev, (weight.K,), tile_rows)
    if rows is not None:
        xh, _ = _rotate(x, weight.suh, k, permute=True)
        return prefill_tiles_cuda(xh, weight.words, weight.svh, weight.K, weight.codebook, k, weight.n, out, T,
                                  triton.cdiv(T, rows), rows=rows, columns_first=columns_first)
    cfg = _config(config or DENSE)
    xh, _ = _rotate(x, weight.suh, k)
    _tile_matmul_kernel[(triton.cdiv(T, cfg.block_m), weight.n // 128)](
        xh, xh, xh, weight.words, weight.svh, hadamard_signs(dev, torch.float16), out, out.stride(0), T, k, weight.n,
        K=weight.K, CODEBOOK=weight.codebook_id, BM=cfg.block_m, BK=cfg.block_k, GROUPED=False,
        USE_ASM=use_inline_asm(dev, weight.codebook), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
