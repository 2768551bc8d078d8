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

FP8_MAX = 448.0
FP4_MAX = 6.0
# e2m1 magnitudes and the midpoints between neighbours; a midpoint tie goes to the value with an even mantissa
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor | None:
    if x.shape[-1] % block:
        return None
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(x)) exactly, for positive normal fp32 x (ue8m0 scales are powers of two)."""
    mant, exp = torch.frexp(x)  # x = mant * 2^exp, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp)
    return torch.ldexp(torch.ones_like(x), exp)


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest e2m1 number (ties to even mantissa), saturating at ±6."""
    mag = v.abs().clamp(max=FP4_MAX)
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=v.dtype, device=v.device)
    vals = torch.tensor(_E2M1_VALUES, dtype=v.dtype, device=v.device)
    idx = torch.bucketize(mag, mids, right=False)  # a value equal to a midpoint lands on the lower neighbour
    at_mid = (idx < len(_E2M1_MIDPOINTS)) & (mag == mids[idx.clamp(max=len(_E2M1_MIDPOINTS) - 1)])
    idx = torch.where(at_mid & (idx % 2 == 1), idx + 1, idx)  # odd index = odd mantissa: move the tie up
    return torch.copysign(vals[idx], v)


def fp8_block_ue8m0(x: torch.Tensor, block: int = 32, enabled: bool = True) -> torch.Tensor:
    """FP8 e4m3 with one power-of-two scale per `block` values (window KV)."""
    b = _blocks(x, block) if enabled else None
    if b is None:
        return x
    amax = b.abs().amax(dim=-1, keepdim=True)
    scale = _pow2_ceil(amax.clamp(min=1e-4) / FP8_MAX)
    q = (b / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).reshape(x.shape).to(x.dtype)


def fp4_block_e4m3(x: torch.Tensor, block: int = 16, enabled: bool = True) -> torch.Tensor:
    """FP4 e2m1 with one e4m3 scale per `block` values (compressed KV)."""
    b = _blocks(x, block) if enabled else None
    if b is None:
        return x
    amax = b.abs().amax(dim=-1, keepdim=True)
    scale = (amax.clamp(min=FP4_MAX * 2.0**-9) / FP4_MAX).to(torch.float8_e4m3fn).float()
    q = round_e2m1(b / scale)
    return (q * scale).reshape(x.shape).to(x.dtype)


def fp4_block_ue8m0(x: torch.Tensor, block: int = 32, enabled: bool = True) -> torch.Tensor:
    """FP4 e2m1 with one power-of-two scale per `block` values (MXFP4 style; index q and k)."""
    b = _blocks(x, block) if enabled else None
    if b is None:
        return x
    amax = b.abs().amax(dim=-1, keepdim=True)
    scale = _pow2_ceil(amax.clamp(min=FP4_MAX * 2.0**-126) / FP4_MAX)
    q = round_e2m1(b / scale)
    return (q * scale).reshape(x.shape).to(x.dtype)
