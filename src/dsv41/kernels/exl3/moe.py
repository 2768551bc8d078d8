"""Routed-expert MoE on EXL3 experts for decode/verify windows (up to 16 rows), in two launches per layer.

Launch 1 (gate+up): one program per (distinct expert, 128-column block of the intermediate, k slice). It finds
its expert and the rows that picked it from the routing table itself (no host sync, graph-capturable), decodes
the gate and up trellises once for all those rows, and the last program of the k slices applies the output
rotations, clamped SwiGLU (`g = min(g, L)`, `u = clamp(u, -L, L)`, `h = silu(g)·u`) and the routing weight,
writing `h` in fp16 per (row, top-k slot). (The reference model rounds h to bf16; fp16 is what the EXL3 down
product takes anyway, the clamp bounds |h| by 100 so fp16 cannot overflow, and it avoids a bf16-then-fp16
double rounding.)

Launch 2 (down): one program per (distinct expert, 128-column block of the output, k slice) computes `h @ W2`
for the expert's rows; the last program to finish a column block sums every row's top-k contributions in slot
order (0, 1, ..., k-1), so the result is deterministic and a row's bits depend only on that row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv41.kernels.exl3.backend import use_cuda_backend, use_inline_asm
from dsv41.kernels.exl3.cuda import moe_forward_cuda
from dsv41.kernels.exl3.decode import accumulate_kslice, hadamard_signs, rotate_rows_fp32
from dsv41.kernels.exl3.layout import Exl3ExpertStack, check_moe_inputs, moe_out

MAX_ROWS = 16


@dataclass(frozen=True)
class MoeConfig:
    # (block_k, num_warps) = (64, 8): the faster launch shape (docs/perf/exl3.md, "Numbers behind the code").
    splits_gate_up: int = 4
    splits_down: int = 2
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 1


@triton.jit
def _expert_rows(ids_ptr, n_slots, u, SLOTS: tl.constexpr):
    """The u-th distinct expert of the routing table (in order of first appearance) and its rows.

    Returns (n_unique, expert, slot_j[16], row_valid[16]): block row j handles top-k slot slot_j.
    """
    s = tl.arange(0, SLOTS)
    valid = s < n_slots
    ids = tl.load(ids_ptr + s, mask=valid, other=-1)
    earlier_same = (ids[:, None] == ids[None, :]) & (s[None, :] < s[:, None])
    first = valid & (tl.sum(earlier_same.to(tl.int32), axis=1) == 0)
    rank = tl.cumsum(first.to(tl.int32), axis=0) - 1
    n_unique = tl.sum(first.to(tl.int32), axis=0)
    expert = tl.sum(tl.where(first & (rank == u), ids, 0), axis=0)
    member = valid & (ids == expert)
    pos = tl.cumsum(member.to(tl.int32), axis=0) - 1
    j = tl.arange(0, 16)
    pick = member[None, :] & (pos[None, :] == j[:, None])
    slot_j = tl.sum(tl.where(pick, s[None, :], 0), axis=1)
    row_valid = tl.sum(pick.to(tl.int32), axis=1) > 0
    return n_unique, expert, slot_j, row_valid


@triton.jit
def _swiglu_epilogue(acc_g, acc_u, svh1_ptr, svh3_ptr, route_ptr, h_ptr, slot_j, row_valid, cols, n1, had_ptr, LIMIT):
    gate = rotate_rows_fp32(acc_g, had_ptr) * tl.load(svh1_ptr + cols).to(tl.float32)[None, :]
    up = rotate_rows_fp32(acc_u, had_ptr) * tl.load(svh3_ptr + cols).to(tl.float32)[None, :]
    gate = tl.minimum(gate, LIMIT)
    up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    route = tl.load(route_ptr + slot_j, mask=row_valid, other=0.0).to(tl.float32)
    h = gate * tl.sigmoid(gate) * up * route[:, None]
    offsets = slot_j[:, None].to(tl.int64) * n1 + cols[None, :]
    tl.store(h_ptr + offsets, h.to(tl.float16), mask=row_valid[:, None])


@triton.jit(do_not_specialize=["n_slots"])
def _moe_gate_up_kernel(
    x_ptr,
    stride_x,
    ids_ptr,
    route_ptr,
    n_slots,
    w1_ptr,
    suh1_ptr,
    svh1_ptr,
    w3_ptr,
    suh3_ptr,
    svh3_ptr,
    had_ptr,
    h_ptr,
    part_ptr,
    count_ptr,
    k1,
    n1,
    LIMIT,
    TOPK: tl.constexpr,
    SLOTS: tl.constexpr,
    K: tl.constexpr,
    CODEBOOK: tl.constexpr,
    SPLITS: tl.constexpr,
    BK: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    u = tl.program_id(0)
    nb = tl.program_id(1)
    sp = tl.program_id(2)
    n_unique, expert, slot_j, row_valid = _expert_rows(ids_ptr, n_slots, u, SLOTS)
    if u < n_unique:
        col_blocks = n1 // 128
        k_blocks = k1 // 128
        kb_lo = sp * k_blocks // SPLITS
        kb_hi = (sp + 1) * k_blocks // SPLITS
        tiles_n = n1 // 16
        expert_words = expert.to(tl.int64) * (k1 // 16) * tiles_n * (8 * K)
        x_rows = (slot_j // TOPK).to(tl.int64) * stride_x
        col_block_words = nb * 8 * (8 * K)
        acc_g = tl.zeros((16, 128), dtype=tl.float32)
        acc_g = accumulate_kslice(
            acc_g, x_ptr, x_rows, row_valid, suh1_ptr + expert * k1, w1_ptr + expert_words + col_block_words,
            tiles_n, had_ptr, kb_lo, kb_hi, K, CODEBOOK, BK, USE_ASM,
        )
        acc_u = tl.zeros((16, 128), dtype=tl.float32)
        acc_u = accumulate_kslice(
            acc_u, x_ptr, x_rows, row_valid, suh3_ptr + expert * k1, w3_ptr + expert_words + col_block_words,
            tiles_n, had_ptr, kb_lo, kb_hi, K, CODEBOOK, BK, USE_ASM,
        )
        rows = tl.arange(0, 16)
        cols = nb * 128 + tl.arange(0, 128)
        svh1 = svh1_ptr + expert * n1
        svh3 = svh3_ptr + expert * n1
        if SPLITS == 1:
            _swiglu_epilogue(acc_g, acc_u, svh1, svh3, route_ptr, h_ptr, slot_j, row_valid, cols, n1, had_ptr, LIMIT)
        else:
            # part layout [u, split, gate/up, 16, n1]
            part_rows = rows[:, None].to(tl.int64) * n1 + cols[None, :]
            base = part_ptr + (u * SPLITS).to(tl.int64) * 2 * 16 * n1
            tl.store(base + (sp * 2) * 16 * n1 + part_rows, acc_g)
            tl.store(base + (sp * 2 + 1) * 16 * n1 + part_rows, acc_u)
            tl.debug_barrier()
            counter = count_ptr + u * col_blocks + nb
            ticket = tl.atomic_add(counter, 1, sem="acq_rel")
            if ticket == SPLITS - 1:
                total_g = tl.zeros((16, 128), dtype=tl.float32)
                total_u = tl.zeros((16, 128), dtype=tl.float32)
                for s in tl.static_range(SPLITS):
                    total_g += tl.load(base + (s * 2) * 16 * n1 + part_rows, cache_modifier=".cg")
                    total_u += tl.load(base + (s * 2 + 1) * 16 * n1 + part_rows, cache_modifier=".cg")
                tl.atomic_xchg(counter, 0)
                _swiglu_epilogue(
                    total_g, total_u, svh1, svh3, route_ptr, h_ptr, slot_j, row_valid, cols, n1, had_ptr, LIMIT
                )


@triton.jit
def _down_finish(acc, svh_ptr, y_ptr, out_ptr, stride_out, slot_j, row_valid, cols, n2, n_tokens, n_unique,
                 count_ptr, nb, had_ptr, TOPK: tl.constexpr):
    """Store this expert's rows of the down product, then let the last expert of the column block sum rows."""
    y = rotate_rows_fp32(acc, had_ptr) * tl.load(svh_ptr + cols).to(tl.float32)[None, :]
    tl.store(y_ptr + slot_j[:, None].to(tl.int64) * n2 + cols[None, :], y, mask=row_valid[:, None])
    tl.debug_barrier()
    counter = count_ptr + nb
    ticket = tl.atomic_add(counter, 1, sem="acq_rel")
    if ticket == n_unique - 1:
        tokens = tl.arange(0, 16)
        token_ok = tokens < n_tokens
        total = tl.zeros((16, 128), dtype=tl.float32)
        for i in tl.static_range(TOPK):
            slot = tokens * TOPK + i
            total += tl.load(
                y_ptr + slot[:, None].to(tl.int64) * n2 + cols[None, :],
                mask=token_ok[:, None],
                other=0.0,
                cache_modifier=".cg",
            )
        tl.atomic_xchg(counter, 0)
        out_offsets = tokens[:, None].to(tl.int64) * stride_out + cols[None, :]
        tl.store(out_ptr + out_offsets, total.to(out_ptr.dtype.element_ty), mask=token_ok[:, None])


@triton.jit(do_not_specialize=["n_slots", "n_tokens"])
def _moe_down_kernel(
    h_ptr,
    ids_ptr,
    n_slots,
    n_tokens,
    w2_ptr,
    suh2_ptr,
    svh2_ptr,
    had_ptr,
    y_ptr,
    out_ptr,
    stride_out,
    part_ptr,
    count_ptr,
    count_out_ptr,
    k2,
    n2,
    TOPK: tl.constexpr,
    SLOTS: tl.constexpr,
    K: tl.constexpr,
    CODEBOOK: tl.constexpr,
    SPLITS: tl.constexpr,
    BK: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    u = tl.program_id(0)
    nb = tl.program_id(1)
    sp = tl.program_id(2)
    n_unique, expert, slot_j, row_valid = _expert_rows(ids_ptr, n_slots, u, SLOTS)
    if u < n_unique:
        col_blocks = n2 // 128
        k_blocks = k2 // 128
        kb_lo = sp * k_blocks // SPLITS
        kb_hi = (sp + 1) * k_blocks // SPLITS
        tiles_n = n2 // 16
        expert_words = expert.to(tl.int64) * (k2 // 16) * tiles_n * (8 * K)
        acc = tl.zeros((16, 128), dtype=tl.float32)
        acc = accumulate_kslice(
            acc, h_ptr, slot_j.to(tl.int64) * k2, row_valid, suh2_ptr + expert * k2,
            w2_ptr + expert_words + nb * 8 * (8 * K), tiles_n, had_ptr, kb_lo, kb_hi, K, CODEBOOK, BK, USE_ASM,
        )
        rows = tl.arange(0, 16)
        cols = nb * 128 + tl.arange(0, 128)
        svh = svh2_ptr + expert * n2
        if SPLITS == 1:
            _down_finish(acc, svh, y_ptr, out_ptr, stride_out, slot_j, row_valid, cols, n2, n_tokens, n_unique,
                         count_out_ptr, nb, had_ptr, TOPK)
        else:
            part_offsets = rows[:, None].to(tl.int64) * n2 + cols[None, :]
            base = part_ptr + (u * SPLITS).to(tl.int64) * 16 * n2
            tl.store(base + sp * 16 * n2 + part_offsets, acc)
            tl.debug_barrier()
            counter = count_ptr + u * col_blocks + nb
            ticket = tl.atomic_add(counter, 1, sem="acq_rel")
            if ticket == SPLITS - 1:
                total = tl.zeros((16, 128), dtype=tl.float32)
                for s in tl.static_range(SPLITS):
                    total += tl.load(base + s * 16 * n2 + part_offsets, cache_modifier=".cg")
                tl.atomic_xchg(counter, 0)
                _down_finish(total, svh, y_ptr, out_ptr, stride_out, slot_j, row_valid, cols, n2, n_tokens,
                             n_unique, count_out_ptr, nb, had_ptr, TOPK)


class _MoeWorkspace:
    def __init__(self):
        self._cache: dict[tuple, dict[str, torch.Tensor]] = {}

    def get(self, device, slots, n1, n2, cfg: MoeConfig) -> dict[str, torch.Tensor]:
        key = (str(device), slots, n1, n2, cfg)
        ws = self._cache.get(key)
        if ws is None:
            f32 = dict(dtype=torch.float32, device=device)
            i32 = dict(dtype=torch.int32, device=device)
            ws = {
                "h": torch.empty((slots, n1), dtype=torch.float16, device=device),
                "y": torch.empty((slots, n2), **f32),
                "part_a": torch.empty((slots, cfg.splits_gate_up, 2, 16, n1), **f32),
                "part_b": torch.empty((slots, cfg.splits_down, 16, n2), **f32),
                "count_a": torch.zeros((slots * (n1 // 128),), **i32),
                "count_b": torch.zeros((slots * (n2 // 128),), **i32),
                "count_out": torch.zeros((n2 // 128,), **i32),
            }
            self._cache[key] = ws
        return ws


_WORKSPACE = _MoeWorkspace()


def moe_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: Exl3ExpertStack,
    w3: Exl3ExpertStack,
    w2: Exl3ExpertStack,
    swiglu_limit: float = 10.0,
    out_dtype: torch.dtype = torch.float32,
    config: MoeConfig | None = None,
    out: torch.Tensor | None = None,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_i w_i · (clamped SwiGLU(x W1_e, x W3_e) @ W2_e) per row, e = topk_ids[row, i], slots summed in order i.

    x `[T, hidden]` (rounded to fp16 at the input rotation), topk_ids `[T, topk]` int, topk_weights `[T, topk]`.
    Windows of more than 16 rows run as consecutive 16-row windows (same bits per row). `addend` [T, hidden]: added
    to the sum (one add in the output's precision; the CUDA kernel does it in its epilogue, the same bits).
    """
    if config is None and use_cuda_backend(x.device):
        return moe_forward_cuda(x, topk_ids, topk_weights, w1, w3, w2, swiglu_limit, out_dtype, out=out,
                                addend=addend)
    check_moe_inputs(x, topk_ids, topk_weights, w1, w3, w2)
    cfg = config or MoeConfig()
    T, hidden = x.shape
    out = moe_out(out, T, hidden, out_dtype, x.device)
    for start in range(0, T, MAX_ROWS):
        stop = min(T, start + MAX_ROWS)
        _moe_window(x[start:stop], topk_ids[start:stop], topk_weights[start:stop], w1, w3, w2,
                    swiglu_limit, out[start:stop], cfg)
    if addend is not None:
        out.add_(addend)
    return out


def launch_grids(w1: Exl3ExpertStack, w2: Exl3ExpertStack, n_slots: int, cfg: MoeConfig) -> tuple[tuple, tuple]:
    """Grids of the gate/up and down launches: (expert program, 128-column block, k split). Only the number of
    expert programs follows the window (at most one per distinct expert of its slots; each finds its expert in the
    routing table); the column blocks, the k splits and the config depend on the matrices alone."""
    programs = min(n_slots, w1.experts)
    return (programs, w1.n // 128, cfg.splits_gate_up), (programs, w2.n // 128, cfg.splits_down)


def _moe_window(x, topk_ids, topk_weights, w1, w3, w2, limit, out, cfg: MoeConfig) -> None:
    T, topk = topk_ids.shape
    n_slots = T * topk
    slots_pow2 = triton.next_power_of_2(max(n_slots, 16))
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    route = topk_weights.reshape(-1).to(torch.float32).contiguous()
    ws = _WORKSPACE.get(x.device, n_slots, w1.n, w2.n, cfg)
    had = hadamard_signs(x.device, torch.float16)
    use_asm = use_inline_asm(x.device, w1.codebook)
    grid_gate_up, grid_down = launch_grids(w1, w2, n_slots, cfg)
    _moe_gate_up_kernel[grid_gate_up](
        x, x.stride(0), ids, route, n_slots,
        w1.words, w1.suh, w1.svh, w3.words, w3.suh, w3.svh, had,
        ws["h"], ws["part_a"], ws["count_a"], w1.k, w1.n, float(limit),
        TOPK=topk, SLOTS=slots_pow2, K=w1.K, CODEBOOK=w1.codebook_id,
        SPLITS=cfg.splits_gate_up, BK=cfg.block_k, USE_ASM=use_asm, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    use_asm = use_inline_asm(x.device, w2.codebook)
    _moe_down_kernel[grid_down](
        ws["h"], ids, n_slots, T,
        w2.words, w2.suh, w2.svh, had,
        ws["y"], out, out.stride(0), ws["part_b"], ws["count_b"], ws["count_out"], w2.k, w2.n,
        TOPK=topk, SLOTS=slots_pow2, K=w2.K, CODEBOOK=w2.codebook_id,
        SPLITS=cfg.splits_down, BK=cfg.block_k, USE_ASM=use_asm, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
