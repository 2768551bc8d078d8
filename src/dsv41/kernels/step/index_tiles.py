"""Index scores of prefill rows on the tensor cores: a tile of rows x a block of entries per program (issue 31).

`kernels.step.indexer.index_scores` gives each row its own programs and an IEEE fp32 dot on the CUDA cores: fine
for a decode step, but a prefill chunk at a long position scores thousands of rows against tens of thousands of
entries (2,048 rows x 16,384 entries x 32 heads x 128 at 32K tokens: 274 GFLOP a layer), which took ~430 ms a
layer on the H100. Here one program takes BR rows of ONE sequence (its keys shared) and BC entries:

    s[r, h, c] = q[r, h] . k[c]          one [BR·Hp, hd] x [hd, BC] tensor-core product (bf16 operands, fp32 sums)
    score[r, c] = sum_h w[r, h] * relu(s[r, h, c])   (fp32, the heads summed in the program)

The operands must be bf16 values: the index queries and keys as the model stores them with its fake quantisation
(FP4 e2m1 x a power-of-two scale per 32: two significant bits, exact in bf16), so every product is exact in fp32
and only the order of the fp32 sums is the kernel's (checked against the reference like the other kernels, MODEL.md
§7.5). The caller takes this path only then (`FastAttention` with fake quantisation on); elsewhere `index_scores`.

Row invariance: a row's products are its own output elements of the dot, and the head sum is a fixed reduction of
its own [Hp, BC] slice; the tile shape is fixed (never chosen from the row count). So a row's scores do not depend
on the other rows of its tile or of the chunk (chunked == one-shot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..exl3.backend import interpreting
from .indexer import score_operands

BLOCK_C = 64  # entries per program
TILE_M = 128  # rows x padded heads per program (BR = TILE_M // Hp rows)
# bf16 operands on the tensor cores where compiled; Triton's interpreter has no bf16 dot (it returns garbage), so
# there the same exact values go in as fp32 (numpy's fp32 sums)
MMA = tl.constexpr(not interpreting())


@triton.jit(do_not_specialize=["R", "ncols", "sat", "sot"])
def _tile_scores_kernel(q_ptr, sqt, sqh, w_ptr, swt, k_ptr, skc, nvis_ptr, allow_ptr, sat, out_ptr, sot, R, H, ncols,
                        wa, wb, BR: tl.constexpr, HP: tl.constexpr, HD: tl.constexpr, BC: tl.constexpr,
                        HAS_ALLOW: tl.constexpr):
    rb = tl.program_id(0)
    cb = tl.program_id(1)
    rows = rb * BR + tl.arange(0, BR)
    row_ok = rows < R
    c = cb * BC + tl.arange(0, BC)
    nvis = tl.load(nvis_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    live = (c[None, :] < nvis[:, None]) & row_ok[:, None]
    if HAS_ALLOW:
        live = live & (tl.load(allow_ptr + rows[:, None].to(tl.int64) * sat + c[None, :], mask=live, other=0) != 0)
    score = tl.full((BR, BC), float("-inf"), dtype=tl.float32)
    if cb * BC < tl.max(nvis, axis=0):
        m = tl.arange(0, BR * HP)
        r_of = rb * BR + m // HP
        h_of = m % HP
        m_ok = (r_of < R) & (h_of < H)
        d = tl.arange(0, HD)
        q = tl.load(q_ptr + r_of[:, None].to(tl.int64) * sqt + h_of[:, None] * sqh + d[None, :],
                    mask=m_ok[:, None], other=0.0)
        k = tl.load(k_ptr + c[:, None].to(tl.int64) * skc + d[None, :], mask=(c < tl.max(nvis, axis=0))[:, None],
                    other=0.0)
        if MMA:
            q = q.to(tl.bfloat16)
            k = k.to(tl.bfloat16)
        else:
            q = q.to(tl.float32)
            k = k.to(tl.float32)
        s = tl.maximum(tl.dot(q, tl.trans(k)), 0.0)  # [BR·HP, BC] fp32
        # the head weights' two scales in the reference's order (`w.float() * wa * wb`, as index_scores loads them)
        w = (tl.load(w_ptr + r_of.to(tl.int64) * swt + h_of, mask=m_ok, other=0.0).to(tl.float32) * wa) * wb
        per = tl.reshape(w[:, None] * s, (BR, HP, BC))
        score = tl.where(live, tl.sum(per, axis=1), score)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * sot + c[None, :], score,
             mask=row_ok[:, None] & (c < ncols)[None, :])


def index_scores_tiles(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, n_vis: torch.Tensor, ncols: int,
                       allow: torch.Tensor | None = None, w_scales: tuple[float, float] = (1.0, 1.0),
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Index scores [R, ncols] fp32 of R rows of ONE sequence: q [R, Hi, hd] and keys [C, hd] holding bf16 values
    (any float dtype), w [R, Hi] (scaled by w_scales in the load, as `index_scores`), n_vis [R] int: -inf at
    c >= n_vis[r], where allow[r, c] (bool [R, ncols]) is False, and past C. `out`: an [R, ncols] fp32 view to
    write (any row stride). No host sync."""
    if q.dim() != 3 or keys.dim() != 2 or keys.shape[1] != q.shape[2]:
        raise ValueError(f"q [R, Hi, hd] and keys [C, hd] do not fit: {list(q.shape)} {list(keys.shape)}")
    R, H, hd = q.shape
    if w.shape != (R, H) or n_vis.shape != (R,):
        raise ValueError(f"w {list(w.shape)} / n_vis {list(n_vis.shape)} must be [R={R}, Hi={H}] / [R]")
    if hd & (hd - 1) or hd < 16:
        raise ValueError(f"hd must be a power of two >= 16, got {hd}")
    hp = max(16, triton.next_power_of_2(H))
    if hp > TILE_M:
        raise ValueError(f"{H} heads do not fit a {TILE_M}-row tile")
    if out is None:
        out = torch.empty(R, ncols, dtype=torch.float32, device=q.device)
    elif out.shape != (R, ncols) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be an fp32 [{R}, {ncols}] view with unit column stride")
    q, w, keys, allow = score_operands(q, w, keys, allow, R, ncols)
    if R == 0 or ncols == 0:
        return out
    # past the keys (C) every column is -inf: n_vis never exceeds C
    n_vis = n_vis.clamp(max=keys.shape[0]).contiguous()
    br = TILE_M // hp
    a = allow if allow is not None else out
    _tile_scores_kernel[(triton.cdiv(R, br), triton.cdiv(ncols, BLOCK_C))](
        q, q.stride(0), q.stride(1), w, w.stride(0), keys, keys.stride(0), n_vis, a, a.stride(0), out, out.stride(0),
        R, H, ncols, float(w_scales[0]), float(w_scales[1]), BR=br, HP=hp, HD=hd, BC=BLOCK_C,
        HAS_ALLOW=allow is not None, num_warps=8)
    return out
