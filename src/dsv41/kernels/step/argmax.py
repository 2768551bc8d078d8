"""Greedy picks: each row's argmax over its logits in two launches, the rule of `torch.argmax`.

Reference: `torch.argmax(logits, dim=-1)` (what `runtime.sampling.sample_token` does for a greedy row): the index
of the first maximum, a NaN counting above every number (the first NaN wins). torch runs it as one reduction per
row: at one row of the head's 129,280 logits a single program reads them all (41 µs on the H200, outside the
step's graph). Here the first launch has a program per (row, chunk of CHUNK logits) and writes each chunk's first
maximum and its index; the second, a program per row, takes the first chunk holding the row's maximum. The chunks
are in index order, so that chunk's own first maximum is the row's first maximum: the same index as torch, with
no floating-point arithmetic on the values (only comparisons), so nothing depends on an order of summation.

Equal values compare equal whatever their sign (-0.0 == +0.0: the first of them is the pick, as in torch); a row
of -inf picks its first index. bf16 / fp16 logits are compared as their exact fp32 values.

`shard_offset`: the vocabulary id of column 0 (a rank's slice of the head, TP): the ids come back global, and
`first_across_shards` picks among the ranks' (value, id) proposals the one the full row's argmax would: the shards
are in rank order, so the first rank holding the maximum holds its first index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch as pdl_launch, wait_previous

CHUNK = 4096  # logits a program of the first launch reads: 32 programs a rank's 64,640 (the release at TP=2)
NUM_WARPS = 4
_NO_INDEX = tl.constexpr(2 ** 31 - 1)


@triton.jit
def _first_max(v, idx, ok):
    """(value, index) of the first maximum of v among the lanes `ok`, a NaN above every number (the first NaN)."""
    nan = (v != v) & ok
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    num = tl.where(ok & (v == v), v, float("-inf"))
    m = tl.max(num, axis=0)
    first_nan = tl.min(tl.where(nan, idx, _NO_INDEX), axis=0)
    first_m = tl.min(tl.where(ok & (num == m), idx, _NO_INDEX), axis=0)
    return tl.where(any_nan, float("nan"), m), tl.where(any_nan, first_nan, first_m)


@triton.jit
def _chunk_kernel(x_ptr, sx, V, val_ptr, idx_ptr, NC, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    wait_previous(PDL)
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    j = c * CHUNK + tl.arange(0, CHUNK)
    ok = j < V
    v = tl.load(x_ptr + r * sx + j, mask=ok, other=float("-inf")).to(tl.float32)
    best, at = _first_max(v, j, ok)
    tl.store(val_ptr + r * NC + c, best)
    tl.store(idx_ptr + r * NC + c, at)


@triton.jit
def _row_kernel(val_ptr, idx_ptr, NC, offset, out_val_ptr, out_id_ptr, NCP: tl.constexpr,
                PDL: tl.constexpr = False):
    wait_previous(PDL)
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, NCP)
    ok = c < NC
    v = tl.load(val_ptr + r * NC + c, mask=ok, other=float("-inf"))
    best, first = _first_max(v, c, ok)
    at = tl.load(idx_ptr + r * NC + first)
    tl.store(out_val_ptr + r, best)
    tl.store(out_id_ptr + r, at.to(tl.int64) + offset)


def greedy_rows(logits: torch.Tensor, shard_offset: int = 0, *, chunk: int = CHUNK
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(values fp32 [n], ids int64 [n]) of logits [n, V] (fp32 / bf16 / fp16, on the device the step kernels run
    on): each row's first maximum and its index + `shard_offset`; no host sync (CUDA-graph capturable)."""
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be fp32/bf16/fp16 [rows, vocab], got {logits.dtype} {list(logits.shape)}")
    n, V = logits.shape
    if V == 0:
        raise ValueError("logits have no column: a row has no argmax")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    values = torch.empty(n, dtype=torch.float32, device=dev)
    ids = torch.empty(n, dtype=torch.int64, device=dev)
    if n == 0:
        return values, ids
    NC = triton.cdiv(V, chunk)
    cval = torch.empty(n, NC, dtype=torch.float32, device=dev)
    cidx = torch.empty(n, NC, dtype=torch.int32, device=dev)
    _chunk_kernel[(n, NC)](logits, logits.stride(0), V, cval, cidx, NC, CHUNK=chunk, num_warps=NUM_WARPS,
                           **pdl_launch(dev))
    _row_kernel[(n,)](cval, cidx, NC, int(shard_offset), values, ids, NCP=triton.next_power_of_2(NC),
                      num_warps=1, **pdl_launch(dev))
    return values, ids


def first_across_shards(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The full rows' picks from the ranks' proposals `values` / `ids` [tp, n] (rank order, each `greedy_rows` of
    the rank's slice with its offset): per row the first rank holding the maximum (torch.argmax's rule over
    dim 0, NaN above all), its id. ids [n] int64, on the proposals' device, no host sync."""
    if values.dim() != 2 or values.shape != ids.shape:
        raise ValueError(f"values {list(values.shape)} and ids {list(ids.shape)} must both be [tp, rows]")
    winner = torch.argmax(values, dim=0)
    return ids.gather(0, winner[None, :])[0]


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of logits [n, V] (int64 [n], on their device): `greedy_rows` on a GPU, torch elsewhere;
    the same index either way."""
    return greedy_rows(logits)[1] if logits.is_cuda else logits.argmax(dim=-1)
