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
def _fp8_blocks(w: torch.Tensor) -> torch.Tensor:
    """formats.quantize_fp8_block then dequant_fp8_block, on w's device (32x32 blocks; shapes are multiples)."""
    rows, cols = w.shape
    blocks = w.float().view(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = e8m0_to_float(power_of_two_scale_byte(blocks.abs().amax(dim=(1, 3)), FP8_MAX))[:, None, :, None]
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).view(rows, cols)


@torch.no_grad()
def _mxfp4(w: torch.Tensor) -> torch.Tensor:
    """formats.quantize_mxfp4 then dequant_mxfp4 (1x32 blocks along the input)."""
    rows, cols = w.shape
    blocks = w.float().view(rows, cols // BLOCK, BLOCK)
    scale = e8m0_to_float(power_of_two_scale_byte(blocks.abs().amax(dim=-1), FP4_MAX)).unsqueeze(-1)
    return (e2m1_to_float(nearest_e2m1_code(blocks / scale)) * scale).view(rows, cols)


@torch.no_grad()
def _fp8_rows(w: torch.Tensor) -> torch.Tensor:
    """engram.shards.quantize_rows_fp8 then the table's decode (a row's head_dim is a multiple of 32 here)."""
    rows, cols = w.shape
    blocks = w.float().view(rows, cols // BLOCK, BLOCK)
    scale = e8m0_to_float(power_of_two_scale_byte(blocks.abs().amax(dim=-1), FP8_MAX)).unsqueeze(-1)
    return ((blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale).view(rows, cols)


_ROUND = {
    FP8: _fp8_blocks,
    MXFP4: _mxfp4,
    ROWS_FP8: _fp8_rows,
    BF16: lambda w: w.detach().to(torch.bfloat16).float(),
}


def stored(w: torch.Tensor, kind: str) -> torch.Tensor:
    """The value the exported checkpoint gives back for parameter w stored as `kind`, straight-through."""
    if kind == FP32:
        return w
    return straight_through(w, _ROUND[kind](w))


def kv_fp8(x: torch.Tensor) -> torch.Tensor:
    return straight_through(x, fp8_block_ue8m0(x.detach(), 32))


def compressed_fp4(x: torch.Tensor) -> torch.Tensor:
    return straight_through(x, fp4_block_e4m3(x.detach(), 16))


def index_fp4(x: torch.Tensor) -> torch.Tensor:
    return straight_through(x, fp4_block_ue8m0(x.detach(), 32))
