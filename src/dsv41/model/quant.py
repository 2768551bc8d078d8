"""Fake quantisers of the release forward (QAT semantics): quantise, then dequantise back to the input dtype.

The release trains and runs with these roundings inside the forward, so an exact engine applies them too:
- window KV: FP8 e4m3 with a power-of-two (ue8m0) scale per 32 values,
- compressed KV: FP4 e2m1 with an e4m3 scale per 16 values,
- index q and k: FP4 e2m1 with a ue8m0 scale per 32 values.
A quantiser is skipped when the vector length is not a multiple of its block (MODEL.md §15b.6), and all of them
are switched off together by `enabled=False` (the `--no-fake-quant` diagnosis switch).
"""

from __future__ import annotations

import torch

from ..weights.formats import (FP4_MAX, FP8_MAX, e2m1_to_float, e8m0_to_float, nearest_e2m1_code,
                               power_of_two_scale_byte)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor | None:
    if x.shape[-1] % block:
        return None
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _pow2_ceil(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """The ue8m0 scale 2^ceil(log2(x / qmax)) as a float (x > 0), the same rule the weight quantisers use.
    The ratio is rounded to fp32 first, as the release's kernels compute it."""
    return e8m0_to_float(power_of_two_scale_byte(x.float() / qmax, 1.0))


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest e2m1 number (ties to the even code), saturating at ±6."""
    return e2m1_to_float(nearest_e2m1_code(v.clamp(-FP4_MAX, FP4_MAX)))


def _fake_quant(x: torch.Tensor, block: int, enabled: bool, scale_of, quantise) -> torch.Tensor:
    """Per block of `block` values: scale = scale_of(amax), values = quantise(x / scale) * scale."""
    b = _blocks(x, block) if enabled else None
    if b is None:
        return x
    scale = scale_of(b.abs().amax(dim=-1, keepdim=True))
    return (quantise(b / scale) * scale).reshape(x.shape).to(x.dtype)


def _round_e4m3(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def fp8_block_ue8m0(x: torch.Tensor, block: int = 32, enabled: bool = True) -> torch.Tensor:
    """FP8 e4m3 with one power-of-two scale per `block` values (window KV); amax floor 1e-4."""
    return _fake_quant(x, block, enabled, lambda amax: _pow2_ceil(amax.clamp(min=1e-4), FP8_MAX), _round_e4m3)


def fp4_block_e4m3(x: torch.Tensor, block: int = 16, enabled: bool = True) -> torch.Tensor:
    """FP4 e2m1 with one e4m3 scale per `block` values (compressed KV); amax floor 6·2^-9."""
    return _fake_quant(x, block, enabled,
                       lambda amax: _round_e4m3(amax.clamp(min=FP4_MAX * 2.0**-9) / FP4_MAX), round_e2m1)


def fp4_block_ue8m0(x: torch.Tensor, block: int = 32, enabled: bool = True) -> torch.Tensor:
    """FP4 e2m1 with one power-of-two scale per `block` values (MXFP4 style; index q and k); floor 6·2^-126."""
    return _fake_quant(x, block, enabled, lambda amax: _pow2_ceil(amax.clamp(min=FP4_MAX * 2.0**-126), FP4_MAX),
                       round_e2m1)
