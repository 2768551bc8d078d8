"""The routed experts' tile table of a prefill chunk in two launches after the sort (issue 31: the host's launches).

`prefill.tile_table_reference` builds the table with ~25 torch ops (counts, cumsums, a searchsorted, gathers) and
`prefill_moe` gathers each sorted pair's row, weight and place with ~6 more: ~30 launches of a few µs a layer,
~800 a 2,048-row chunk of 26 layers, during which the GPU waits for the host to launch them. Here, after the
stable argsort of the flattened ids (kept: torch's radix sort):
  1. `_sorted_pairs_kernel`: per sorted pair its expert, source row (flat index // k), routing weight (fp32) and
     output place (the flat index), int32 where the kernels read int32;
  2. `_table_kernel`, one program: each expert's first sorted pair and count by binary search in the sorted experts,
     its tiles (ceil(count / BM)) and their running sum (`tl.cumsum`), then the table [tiles, 3] (expert, first
     pair, count) with the reference's spare tiles past the last (expert E - 1, count 0).
Integers only: the table is the reference's, element for element (tests/test_exl3_prefill.py), so the products that
read it keep their bits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class RouteTable(NamedTuple):
    order: torch.Tensor  # int64 [pairs]: the flat pair indices (row * k + slot) sorted by expert, stably
    pair_e: torch.Tensor  # int32 [pairs]: each sorted pair's expert
    table: torch.Tensor  # int32 [max_tiles, 3]: per tile its expert, first sorted pair, pair count
    src: torch.Tensor | None  # int32 [pairs]: each sorted pair's row (order // k)
    route: torch.Tensor | None  # fp32 [pairs]: each sorted pair's routing weight
    out_rows: torch.Tensor | None  # int32 [pairs]: the order as int32 (the down product's output places)


@triton.jit(do_not_specialize=["pairs"])
def _sorted_pairs_kernel(order_ptr, ids_ptr, w_ptr, pair_e_ptr, src_ptr, route_ptr, rows_ptr, pairs,
                         TOPK: tl.constexpr, WEIGHTS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < pairs
    o = tl.load(order_ptr + i, mask=ok, other=0)
    tl.store(pair_e_ptr + i, tl.load(ids_ptr + o, mask=ok, other=0).to(tl.int32), mask=ok)
    if WEIGHTS:
        tl.store(src_ptr + i, (o // TOPK).to(tl.int32), mask=ok)
        tl.store(route_ptr + i, tl.load(w_ptr + o, mask=ok, other=0.0).to(tl.float32), mask=ok)
        tl.store(rows_ptr + i, o.to(tl.int32), mask=ok)


@triton.jit
def _lower_bound(sorted_ptr, n, target, STEPS: tl.constexpr):
    """The first index of `sorted_ptr[0:n]` (ascending int32) whose value is >= target, per lane of target (STEPS
    halvings: 31 cover any int32 n, and a chunk's length never recompiles it)."""
    lo = tl.zeros(target.shape, dtype=tl.int32)
    hi = tl.zeros(target.shape, dtype=tl.int32) + n
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(sorted_ptr + mid, mask=active, other=0)
        below = v < target
        lo = tl.where(active & below, mid + 1, lo)
        hi = tl.where(active & ~below, mid, hi)
    return lo


@triton.jit(do_not_specialize=["pairs", "n_tiles"])
def _table_kernel(pair_e_ptr, table_ptr, pairs, experts, n_tiles, BM: tl.constexpr, EP: tl.constexpr,
                  BT: tl.constexpr, STEPS: tl.constexpr):
    e = tl.arange(0, EP)
    real = e < experts
    starts = _lower_bound(pair_e_ptr, pairs, e, STEPS)
    counts = tl.where(real, _lower_bound(pair_e_ptr, pairs, e + 1, STEPS) - starts, 0)
    tiles = (counts + BM - 1) // BM
    tile_end = tl.cumsum(tiles, 0)
    tile_start = tile_end - tiles
    last = e == experts - 1  # the reference's spare tiles: searchsorted past the end, clamped to the last expert
    for t0 in range(0, n_tiles, BT):
        t = t0 + tl.arange(0, BT)
        mine = (tile_start[None, :] <= t[:, None]) & (t[:, None] < tile_end[None, :])
        spare = tl.sum(mine.to(tl.int32), axis=1) == 0
        pick = mine | (spare[:, None] & last[None, :])  # one expert a tile
        ex = tl.sum(tl.where(pick, e[None, :], 0), axis=1)
        within = t - tl.sum(tl.where(pick, tile_start[None, :], 0), axis=1)
        first = tl.sum(tl.where(pick, starts[None, :], 0), axis=1) + within * BM
        count = tl.sum(tl.where(pick, counts[None, :], 0), axis=1) - within * BM
        count = tl.where(spare, 0, tl.minimum(tl.maximum(count, 0), BM))
        ok = t < n_tiles
        tl.store(table_ptr + t * 3, ex, mask=ok)
        tl.store(table_ptr + t * 3 + 1, first, mask=ok)
        tl.store(table_ptr + t * 3 + 2, count, mask=ok)


def route_table(flat_ids: torch.Tensor, experts: int, block_m: int, n_tiles: int,
                weights: torch.Tensor | None = None, topk: int = 1) -> RouteTable:
    """The tile table of the flattened routing ids [pairs] (int32 or int64, values < experts) with `n_tiles` rows
    (`prefill.max_tiles`), and with `weights` (the flattened routing weights [pairs]) each sorted pair's source row,
    weight and output place; three launches after the sort, no host read."""
    flat = flat_ids.reshape(-1)
    pairs = flat.numel()
    dev = flat.device
    order = torch.argsort(flat, stable=True)
    pair_e = torch.empty(pairs, dtype=torch.int32, device=dev)
    table = torch.empty(n_tiles, 3, dtype=torch.int32, device=dev)
    with_w = weights is not None
    src = torch.empty(pairs, dtype=torch.int32, device=dev) if with_w else None
    route = torch.empty(pairs, dtype=torch.float32, device=dev) if with_w else None
    rows = torch.empty(pairs, dtype=torch.int32, device=dev) if with_w else None
    if pairs:
        w = weights.reshape(-1) if with_w else pair_e
        _sorted_pairs_kernel[(triton.cdiv(pairs, 1024),)](
            order, flat, w, pair_e, src if with_w else pair_e, route if with_w else pair_e,
            rows if with_w else pair_e, pairs, TOPK=topk, WEIGHTS=with_w, BLOCK=1024, num_warps=4)
    if n_tiles:
        _table_kernel[(1,)](pair_e, table, pairs, experts, n_tiles, BM=block_m,
                            EP=triton.next_power_of_2(max(experts, 2)), BT=32, STEPS=31, num_warps=8)
    return RouteTable(order, pair_e, table, src, route, rows)
