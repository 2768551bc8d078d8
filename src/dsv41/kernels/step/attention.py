"""The attention core of decode / verify rows: one softmax per (row, head) over the row's key slots, with the sink.

Reference: `dsv41.model.attention.Attention._core` (MODEL.md §7.6). Per row t and head h, over the key slots
keys[t] [S, hd] (window ring rows, then the selected compressed entries; K = V, one latent shared by every head)
that ok[t] marks live: s_j = (q[t, h] . k_j) * hd^-1/2, and
    o[t, h] = sum_j e^(s_j - m) k_j / (sum_j e^(s_j - m) + e^(sink_h - m)),
the sink logit unscaled and in the denominator only; a row with no live slot gives zeros. fp32 throughout (the
reference rounds exp and the log-sum-exp through fp64; here they are fp32: the difference is fp32 rounding).

Launch 1: one program per (row, block of HEAD_BLOCK heads, key split of SPLIT_KEYS slots) runs an online softmax
over its split in blocks of KEY_BLOCK slots, in slot order, starting from the sink's logit (m = sink_h, l = 0), and
writes (m, l, acc). Dead slots are not read (zeros), score -inf, weight exactly 0; a block with no live slot leaves
(m, l, acc) bit for bit as they were. Launch 2: one program per (row, head) combines the splits in split order with
the sink term and divides (IEEE division).

A row's bits depend only on that row: no program reads another row, and the programs' shapes (blocks, splits) are
fixed, so the grid's row count changes nothing. They do not depend on padding S either: extra slots past a row's own
ones (dead) add exact zeros at the end of a block, extra blocks and splits change nothing, so rows of different
sequences padded to one S can share a launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

HEAD_BLOCK = 16
KEY_BLOCK = 16
SPLIT_KEYS = 128  # slots per split (8 key blocks): parallelism for one row; the split boundaries never move


@triton.jit
def _core_split_kernel(q_ptr, sqt, sqh, k_ptr, skt, skj, ok_ptr, sot, sink_ptr, m_ptr, l_ptr, acc_ptr,
                       H, S, HD, scale,
                       HB: tl.constexpr, BS: tl.constexpr, BLOCKS: tl.constexpr, HDP: tl.constexpr):
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
    for c in range(BLOCKS):
        j = (sp * BLOCKS + c) * BS + tl.arange(0, BS)
        live = tl.load(ok_ptr + t64 * sot + j, mask=j < S, other=0) != 0
        k = tl.load(k_ptr + t64 * skt + j[:, None].to(tl.int64) * skj + col[None, :],
                    mask=live[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.where(m_new == m, 1.0, tl.exp(m - m_new))
        p = tl.where(live[None, :], tl.exp(s - m_new[:, None]), 0.0)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, k, input_precision="ieee")
        m = m_new
    at = (t64 * n_splits + sp) * H + h
    tl.store(m_ptr + at, m, mask=h_ok)
    tl.store(l_ptr + at, l, mask=h_ok)
    tl.store(acc_ptr + at[:, None] * HD + col[None, :], acc, mask=h_ok[:, None] & col_ok[None, :])


@triton.jit
def _core_combine_kernel(m_ptr, l_ptr, acc_ptr, sink_ptr, out_ptr, H, HD, n_splits, HDP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    col = tl.arange(0, HDP)
    col_ok = col < HD
    sink = tl.load(sink_ptr + h)
    big = sink
    for j in range(n_splits):
        big = tl.maximum(big, tl.load(m_ptr + (t * n_splits + j) * H + h))
    den = tl.where(sink == big, 1.0, tl.exp(sink - big))
    num = tl.zeros((HDP,), dtype=tl.float32)
    for j in range(n_splits):
        at = (t * n_splits + j) * H + h
        mj = tl.load(m_ptr + at)
        w = tl.where(mj == big, 1.0, tl.exp(mj - big))
        den = den + tl.load(l_ptr + at) * w
        num = num + tl.load(acc_ptr + at * HD + col, mask=col_ok, other=0.0) * w
    out = tl.math.div_rn(num, tl.zeros((HDP,), dtype=tl.float32) + den)
    tl.store(out_ptr + (t * H + h) * HD + col, out, mask=col_ok)


def attention_core(q: torch.Tensor, keys: torch.Tensor, ok: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """`Attention._core` for rows q [T, H, hd] over keys [T, S, hd] (K = V; bf16 / fp16 / fp32, read as fp32) with
    ok [T, S] bool (live slots) and sink [H] fp32. Returns o [T, H, hd] fp32 on q's device, no host sync."""
    T, H, hd = q.shape
    if keys.dim() != 3 or keys.shape[0] != T or keys.shape[2] != hd:
        raise ValueError(f"keys {list(keys.shape)} do not fit q {list(q.shape)}")
    S = keys.shape[1]
    if ok.shape != (T, S):
        raise ValueError(f"ok {list(ok.shape)} must be [T={T}, S={S}]")
    if sink.shape != (H,):
        raise ValueError(f"sink {list(sink.shape)} must be [H={H}]")
    sink = sink.float().contiguous()
    if q.stride(2) != 1:
        q = q.contiguous()
    if keys.stride(2) != 1:
        keys = keys.contiguous()
    if ok.dtype == torch.bool:
        ok = ok.view(torch.uint8)
    if ok.stride(1) != 1:
        ok = ok.contiguous()
    out = torch.empty(T, H, hd, dtype=torch.float32, device=q.device)
    if T == 0:
        return out
    n_splits = max(1, triton.cdiv(S, SPLIT_KEYS))
    m = torch.empty(T, n_splits, H, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(T, n_splits, H, hd, dtype=torch.float32, device=q.device)
    hdp = triton.next_power_of_2(max(hd, 16))
    _core_split_kernel[(T, triton.cdiv(H, HEAD_BLOCK), n_splits)](
        q, q.stride(0), q.stride(1), keys, keys.stride(0), keys.stride(1), ok, ok.stride(0), sink, m, l, acc,
        H, S, hd, float(scale), HB=HEAD_BLOCK, BS=KEY_BLOCK, BLOCKS=SPLIT_KEYS // KEY_BLOCK, HDP=hdp, num_warps=8)
    _core_combine_kernel[(T, H)](m, l, acc, sink, out, H, hd, n_splits, HDP=hdp, num_warps=4)
    return out
