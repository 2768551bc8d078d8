"""Rotary position embedding on the trailing `rope_dim` dims, adjacent-pair (interleaved) convention.

Two tables exist (MODEL.md §7.1): `plain` (rope_theta, no YaRN) for ratio-0 layers and DSpark blocks, and
`compress` (compress_rope_theta with YaRN) for every layer with a compressed branch. No YaRN attention scale.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .rowwise import f64

def inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

def yarn_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """θ'_j = θ_j (1 − ρ_j) + θ_j / factor · ρ_j with the linear ramp ρ between the YaRN low/high pair indices."""
    dim = cfg.qk_rope_head_dim
    freqs = inv_freq(cfg.compress_rope_theta, dim)
    if cfg.yarn_factor == 1.0 or cfg.yarn_original_max_position <= 0:
        return freqs
    low, high = cfg.yarn_range()
    span = (high - low) if high != low else 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / span).clamp(0, 1)
    return freqs * (1 - ramp) + freqs / cfg.yarn_factor * ramp

class RopeTable:
    """cos/sin for positions, computed on demand in fp32 (positions are unbounded, tables are cheap)."""

    def __init__(self, freqs: torch.Tensor):
        self.inv_freq = freqs.to(torch.float32)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        return f64(torch.cos, angles), f64(torch.sin, angles)

    def apply(self, x: torch.Tensor, positions: torch.Tensor, rope_dim: int, inverse: bool = False) -> torch.Tensor:
        """Rotate the last `rope_dim` dims of x [T, ..., D] by each row's position (conjugate when inverse)."""
        cos, sin = self.cos_sin(positions)
        extra = x.dim() - 2
        cos = cos.view(cos.shape[0], *([1] * extra), cos.shape[1])
        sin = sin.view(sin.shape[0], *([1] * extra), sin.shape[1])
        if inverse:
            sin = -sin
        head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
        pairs = tail.float().reshape(*tail.shape[:-1], rope_dim // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).reshape(tail.shape)
        return torch.cat((head, rotated.to(x.dtype)), dim=-1)

def rope_tables(cfg: ModelConfig) -> dict[str, RopeTable]:
    return {
        "plain": RopeTable(inv_freq(cfg.rope_theta, cfg.qk_rope_head_dim)),
        "compress": RopeTable(yarn_inv_freq(cfg)),
    }

__all__ = ["RopeTable", "rope_tables", "inv_freq", "yarn_inv_freq"]
