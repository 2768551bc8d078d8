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

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..exl3.backend import interpreting
from .indexer import score_operands

BLOCK_C = 64  # entries per product
TILE_M = 128  # rows x padded heads per program (BR = TILE_M // Hp rows)


@dataclass(frozen=True)
class IndexTile:
    """A launch shape: tile_m rows x padded heads, block_c entries a product, `sub` products a program over
    consecutive entry blocks (the queries loaded once for all of them: at 2,048 rows x 32K entries the one-product
    programs load the queries once per 64 entries, ~8.6 GB a layer from L2, against ~1 GB at 8), num_warps. Fixed per
    device, never from the row count (row invariance). With the default tile_m / block_c / warps each product and head
    sum has the one-product programs' shapes, so `sub` only says how many a program runs."""

    tile_m: int = TILE_M
    block_c: int = BLOCK_C
    sub: int = 1
    num_warps: int = 8


# `DSV41_INDEX_TILE=<name>` (read at each launch; unset: "128x64s1w8", the one-product programs): GPU A/B shapes
TILES = {
    "128x64s1w8": IndexTile(),
    "128x64s4w8": IndexTile(sub=4),
    "128x64s8w8": IndexTile(sub=8),
    "128x64s16w8": IndexTile(sub=16),
    "256x64s8w8": IndexTile(tile_m=256, sub=8),
    "128x128s4w8": IndexTile(block_c=128, sub=4),
}
TILE_ENV = "DSV41_INDEX_TILE"
# H100 at 8b1deea (bench/index_tiles_ab.py, 2,048 rows x 32,768 entries): 2.85 ms one product a program, 2.21 ms
# sixteen (the queries loaded once for 1,024 entries), the same bits (bench/results/index_tiles_ab_8b1deea.json)
DEFAULT_TILE = "128x64s16w8"


def index_tile(name: str | None = None) -> IndexTile:
    name = (os.environ.get(TILE_ENV, "") if name is None else name).strip() or DEFAULT_TILE
    if name not in TILES:
        raise ValueError(f"{TILE_ENV}={name!r}: expected one of {', '.join(TILES)}")
    return TILES[name]
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


@triton.jit(do_not_specialize=["R", "ncols", "sat", "sot"])
def _tile_scores_sub_kernel(q_ptr, sqt, sqh, w_ptr, swt, k_ptr, skc, nvis_ptr, allow_ptr, sat, out_ptr, sot, R, H,
                            ncols, wa, wb, BR: tl.constexpr, HP: tl.constexpr, HD: tl.constexpr, BC: tl.constexpr,
                            SUB: tl.constexpr, HAS_ALLOW: tl.constexpr):
    """`_tile_scores_kernel` over SUB consecutive blocks of BC entries: the rows' queries and head weights loaded
    once, then per block the same product, relu, weighting and head sum as that kernel's program for that block."""
    rb = tl.program_id(0)
    cb = tl.program_id(1)
    rows = rb * BR + tl.arange(0, BR)
    row_ok = rows < R
    nvis = tl.load(nvis_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    vis_max = tl.max(nvis, axis=0)
    m = tl.arange(0, BR * HP)
    r_of = rb * BR + m // HP
    h_of = m % HP
    m_ok = (r_of < R) & (h_of < H)
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + r_of[:, None].to(tl.int64) * sqt + h_of[:, None] * sqh + d[None, :], mask=m_ok[:, None],
                other=0.0)
    if MMA:
        q = q.to(tl.bfloat16)
    else:
        q = q.to(tl.float32)
    w = (tl.load(w_ptr + r_of.to(tl.int64) * swt + h_of, mask=m_ok, other=0.0).to(tl.float32) * wa) * wb
    for j in range(SUB):
        c = (cb * SUB + j) * BC + tl.arange(0, BC)
        live = (c[None, :] < nvis[:, None]) & row_ok[:, None]
        if HAS_ALLOW:
            live = live & (tl.load(allow_ptr + rows[:, None].to(tl.int64) * sat + c[None, :], mask=live,
                                   other=0) != 0)
        score = tl.full((BR, BC), float("-inf"), dtype=tl.float32)
        if (cb * SUB + j) * BC < vis_max:
            k = tl.load(k_ptr + c[:, None].to(tl.int64) * skc + d[None, :], mask=(c < vis_max)[:, None], other=0.0)
            if MMA:
                k = k.to(tl.bfloat16)
            else:
                k = k.to(tl.float32)
            s = tl.maximum(tl.dot(q, tl.trans(k)), 0.0)
            per = tl.reshape(w[:, None] * s, (BR, HP, BC))
            score = tl.where(live, tl.sum(per, axis=1), score)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * sot + c[None, :], score,
                 mask=row_ok[:, None] & (c < ncols)[None, :])


def index_scores_tiles(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, n_vis: torch.Tensor, ncols: int,
                       allow: torch.Tensor | None = None, w_scales: tuple[float, float] = (1.0, 1.0),
                       out: torch.Tensor | None = None, tile: str | None = None) -> torch.Tensor:
    """Index scores [R, ncols] fp32 of R rows of ONE sequence: q [R, Hi, hd] and keys [C, hd] holding bf16 values
    (any float dtype), w [R, Hi] (scaled by w_scales in the load, as `index_scores`), n_vis [R] int: -inf at
    c >= n_vis[r], where allow[r, c] (bool [R, ncols]) is False, and past C. `out`: an [R, ncols] fp32 view to
    write (any row stride). No host sync. tile: a name of TILES (None: `DSV41_INDEX_TILE`)."""
    if q.dim() != 3 or keys.dim() != 2 or keys.shape[1] != q.shape[2]:
        raise ValueError(f"q [R, Hi, hd] and keys [C, hd] do not fit: {list(q.shape)} {list(keys.shape)}")
    R, H, hd = q.shape
    if w.shape != (R, H) or n_vis.shape != (R,):
        raise ValueError(f"w {list(w.shape)} / n_vis {list(n_vis.shape)} must be [R={R}, Hi={H}] / [R]")
    if hd & (hd - 1) or hd < 16:
        raise ValueError(f"hd must be a power of two >= 16, got {hd}")
    cfg = index_tile(tile)
    hp = max(16, triton.next_power_of_2(H))
    if hp > cfg.tile_m:
        raise ValueError(f"{H} heads do not fit a {cfg.tile_m}-row tile")
    if out is None:
        out = torch.empty(R, ncols, dtype=torch.float32, device=q.device)
    elif out.shape != (R, ncols) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be an fp32 [{R}, {ncols}] view with unit column stride")
    q, w, keys, allow = score_operands(q, w, keys, allow, R, ncols)
    if R == 0 or ncols == 0:
        return out
    # past the keys (C) every column is -inf: n_vis never exceeds C
    n_vis = n_vis.clamp(max=keys.shape[0]).contiguous()
    br = cfg.tile_m // hp
    a = allow if allow is not None else out
    args = (q, q.stride(0), q.stride(1), w, w.stride(0), keys, keys.stride(0), n_vis, a, a.stride(0), out,
            out.stride(0), R, H, ncols, float(w_scales[0]), float(w_scales[1]))
    if cfg.sub == 1:
        _tile_scores_kernel[(triton.cdiv(R, br), triton.cdiv(ncols, cfg.block_c))](
            *args, BR=br, HP=hp, HD=hd, BC=cfg.block_c, HAS_ALLOW=allow is not None, num_warps=cfg.num_warps)
    else:
        _tile_scores_sub_kernel[(triton.cdiv(R, br), triton.cdiv(ncols, cfg.block_c * cfg.sub))](
            *args, BR=br, HP=hp, HD=hd, BC=cfg.block_c, SUB=cfg.sub, HAS_ALLOW=allow is not None,
            num_warps=cfg.num_warps)
    return out
