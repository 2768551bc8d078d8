"""Quantisation-aware training: the export's storage roundings and the forward's fake quantisers, with
straight-through gradients.

Weights: every step uses `stored(W)` = what the loader will read back from the exported checkpoint (FP8 blocks,
MXFP4 experts, Engram FP8 rows, bf16 natives), computed with the element codecs of weights/formats.py, so the
exported model computes with exactly the trainer's effective weights (no post-training rounding step).
Activations: the reference forward's fake quantisers (model/quant.py: FP8 window KV, FP4 compressed KV and index
q/k; the release trains with them) applied as they are to the detached value. Gradients pass straight through
(d stored(W)/dW = 1), the usual QAT estimator.
"""

from __future__ import annotations

import torch

from dsv41.model.quant import fp4_block_e4m3, fp4_block_ue8m0, fp8_block_ue8m0
from dsv41.weights.formats import (BLOCK, FP4_MAX, FP8_MAX, e2m1_to_float, e8m0_to_float, nearest_e2m1_code,
                                   power_of_two_scale_byte)

from .layout import BF16, FP8, FP32, MXFP4, ROWS_FP8


def straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """`rounded`'s value with x's gradient."""
    return x + (rounded - x).detach()


@torch.no_grad()
def _fp8_rows(rows: torch.Tensor) -> torch.Tensor:
    """Each row one block: e4m3 with a power-of-two scale (formats.quantize_fp8_block's and the Engram table's
    rule: amax / 2^e <= 448, 2^ceil(log2(amax / 448)))."""
    scale = e8m0_to_float(power_of_two_scale_byte(rows.abs().amax(dim=-1, keepdim=True), FP8_MAX))
    return (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


@torch.no_grad()
def _mxfp4_rows(rows: torch.Tensor) -> torch.Tensor:
    """Each row one MXFP4 block of 32 (formats.quantize_mxfp4's rule)."""
    scale = e8m0_to_float(power_of_two_scale_byte(rows.abs().amax(dim=-1, keepdim=True), FP4_MAX))
    return e2m1_to_float(nearest_e2m1_code(rows / scale)) * scale


def _tiles(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> its 32x32 blocks as rows [n_blocks, 1024]."""
    o, i = w.shape
    return w.reshape(o // BLOCK, BLOCK, i // BLOCK, BLOCK).transpose(1, 2).reshape(-1, BLOCK * BLOCK)


def _untile(t: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    o, i = shape
    return t.reshape(o // BLOCK, i // BLOCK, BLOCK, BLOCK).transpose(1, 2).reshape(o, i)


def _rows32(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(-1, BLOCK)


_GROUPS = {  # kind -> (to rows, rounding of rows, back)
    FP8: (_tiles, _fp8_rows, _untile),
    MXFP4: (_rows32, _mxfp4_rows, lambda t, shape: t.reshape(shape)),
    ROWS_FP8: (_rows32, _fp8_rows, lambda t, shape: t.reshape(shape)),
    BF16: (lambda w: w.reshape(1, -1), lambda r: r.to(torch.bfloat16).float(), lambda t, shape: t.reshape(shape)),
}


def stored_all(weights: list[torch.Tensor], kind: str) -> list[torch.Tensor]:
    """The value the exported checkpoint gives back for each parameter stored as `kind`, straight-through.

    All parameters of a kind are rounded in one pass (their blocks concatenated): a few dozen kernels a step
    instead of a few dozen per tensor. Every block's rounding is its own, so the result is the per-tensor one."""
    if kind == FP32 or not weights:
        return list(weights)
    to_rows, rounding, back = _GROUPS[kind]
    rows = [to_rows(w.float()) for w in weights]
    flat = torch.cat([r.reshape(-1) for r in rows])
    flat = straight_through(flat, rounding(flat.detach().view(-1, rows[0].shape[-1])).reshape(-1)) \
        if kind != BF16 else straight_through(flat, rounding(flat.detach()))
    out, at = [], 0
    for w, r in zip(weights, rows):
        out.append(back(flat[at:at + r.numel()].view(r.shape), tuple(w.shape)))
        at += r.numel()
    return out


def stored(w: torch.Tensor, kind: str) -> torch.Tensor:
    return stored_all([w], kind)[0]


def kv_fp8(x: torch.Tensor) -> torch.Tensor:
    return straight_through(x, fp8_block_ue8m0(x.detach(), 32))


def compressed_fp4(x: torch.Tensor) -> torch.Tensor:
    return straight_through(x, fp4_block_e4m3(x.detach(), 16))


def index_fp4(x: torch.Tensor) -> torch.Tensor:
    return straight_through(x, fp4_block_ue8m0(x.detach(), 32))
