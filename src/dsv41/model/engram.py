"""Engram: the conditional n-gram memory added to the residual streams before the Engram layers (MODEL.md §9.4).

The rows come from `dsv41.engram` (token map -> hash row ids -> table rows); here they meet the model: gathered
rows -> `wkv` -> one key per stream + a shared value; a per-stream sigmoid gate of a signed-sqrt score adds the
value into each stream.

Tensor parallelism (EXL3-ENGRAM.md §5.3): the hash columns of a layer are split into contiguous blocks, one
per rank (`head_shard`). A rank gathers only its columns' rows, multiplies them by its slice of `wkv`'s input
rows (row-parallel), and the partial `kv` vectors are summed over ranks before the gate.

Devices: the tables live in host memory or on local NVMe and the hash runs on the CPU; the row ids may arrive on
any device. `EngramLayer.forward` asks the table for its rows on the streams' device, and everything after that is
computed on that device. `EngramLayer.prefetch` starts that read early (the ids depend only on the tokens), so a
shard file's reads run under the layers before this one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dsv41.engram.hashing import head_shard
from dsv41.engram.tables import EngramTable

from .rowwise import f64

# Lower bound on |score| before the square root in the gate (the release's clamp value).
GATE_SQRT_FLOOR = 1e-6


def engram_wkv_input_range(head_dim: int, n_cols: int, rank: int, world: int) -> tuple[int, int]:
    """`wkv` input features `[start, end)` a rank multiplies (row-parallel): its hash columns' rows."""
    c0, c1 = head_shard(n_cols, rank, world)
    return c0 * head_dim, c1 * head_dim


def engram_project(rows: torch.Tensor, wkv: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype
                   ) -> torch.Tensor:
    """Gathered rows `[T, cols, head_dim]` -> `kv` (or this rank's partial of it) `[T, (hc+1)·d]`.

    The rows go in at the streams' dtype, as in the release (dequantised FP8 rows are exact in bf16).
    """
    return wkv(rows.reshape(rows.shape[0], -1).to(dtype))


def engram_gate(streams: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float) -> torch.Tensor:
    """fp32 gate `[T, hc]`: sigmoid(signed sqrt of the RMS-normalised, q⊙k-weighted stream·key score).

    Each stream is normalised on its own (not jointly over the streams); |score| is floored at 1e-6 before
    the square root and the sign is put back afterwards.
    """
    x = streams.float()
    key = key.float()
    d = x.shape[-1]
    weight = q_weight.float() * k_weight.float()  # only their product is ever used
    rstd = f64(torch.rsqrt, x.square().mean(-1) + eps) * f64(torch.rsqrt, key.square().mean(-1) + eps)
    score = (x * weight * key).sum(-1) * rstd / math.sqrt(d)
    # copysign, not sign(): a score of exactly 0 still gets the floor (sigmoid(±1e-3), not sigmoid(0)).
    return f64(lambda z: torch.sigmoid(torch.copysign(z.abs().clamp_min(GATE_SQRT_FLOOR).sqrt(), z)), score)


def engram_mix(streams: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
               eps: float, live: torch.Tensor | None = None) -> torch.Tensor:
    """`X[c] += g_c · value` for streams `[T, hc, d]` and the full (rank-summed) `kv` `[T, (hc+1)·d]`.

    `kv` = hc keys (one per stream) then one shared value. `live` (bool `[T]`, optional) False shuts the gate
    (image-span tokens). Computed in fp32, returned in the streams' dtype.
    """
    T, hc, d = streams.shape
    if kv.shape != (T, (hc + 1) * d):
        raise ValueError(f"Engram kv has shape {list(kv.shape)}, expected {[T, (hc + 1) * d]}")
    kv = kv.float()
    key = kv[:, : hc * d].reshape(T, hc, d)
    value = kv[:, hc * d:]
    gate = engram_gate(streams, key, q_weight, k_weight, eps)
    if live is not None:
        gate = gate * live.to(gate.device).reshape(T, 1).float()
    out = streams.float() + gate[..., None] * value[:, None, :]
    return out.to(streams.dtype)


class EngramLayer:
    """The Engram in front of one layer, for one rank: table rows -> wkv (row-parallel) -> sum -> gate -> add.

    `wkv` is this rank's slice of `layers.{L}.engram.wkv`: input features `engram_wkv_input_range` of the full
    `[ (hc+1)·d, n_cols·head_dim ]` weight. `sum_partials` adds the ranks' partial `kv` (identity at TP=1,
    `Comm.sum_partials` otherwise).
    """

    def __init__(self, layer_id: int, table: EngramTable, wkv: Callable[[torch.Tensor], torch.Tensor],
                 q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 sum_partials: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.layer_id = layer_id
        self.table = table
        self.wkv = wkv
        self.q_weight, self.k_weight = q_weight, k_weight
        self.eps = eps
        self.sum_partials = sum_partials or (lambda x: x)
        self._pending = None  # (row ids, PendingRows) of the last `prefetch`

    def prefetch(self, row_ids: torch.Tensor) -> None:
        """Start reading the rows of `row_ids` `[T, n_cols]` now (as soon as the tokens are known); the `forward`
        with the same ids then only waits for them. A prefetch that no forward uses is dropped by the next one."""
        self._pending = (torch.as_tensor(row_ids).cpu(), self.table.submit(row_ids))

    def _rows(self, row_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        pending, self._pending = self._pending, None
        if pending is not None:
            ids, read = pending
            rows = read.wait(device)  # waited on even when unused, so its buffer goes back and errors surface
            if torch.equal(ids, torch.as_tensor(row_ids).cpu()):
                return rows
        return self.table.gather(row_ids, device=device)

    def forward(self, streams: torch.Tensor, row_ids: torch.Tensor, live: torch.Tensor | None = None
                ) -> torch.Tensor:
        """streams `[T, hc, d]`, this layer's row ids `[T, n_cols]` (on any device) -> updated streams, on the
        streams' device."""
        rows = self._rows(row_ids, streams.device)
        kv = self.sum_partials(engram_project(rows, self.wkv, streams.dtype))
        return engram_mix(streams, kv, self.q_weight.to(streams.device), self.k_weight.to(streams.device),
                          self.eps, live)

    __call__ = forward
