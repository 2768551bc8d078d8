"""Manifold-constrained hyper-connections (mHC), single-pass schedule (MODEL.md §6).

The residual is `hc` parallel streams X [T, hc, d]. Each sublayer site (attention, FFN) derives from its input
streams three coefficient sets: `pre` (how to collapse streams into the sublayer input — used by the *next*
site in the single-pass schedule), `post` (how much of the sublayer output each stream receives) and a doubly
stochastic `comb` [hc, hc] (Sinkhorn) mixing the streams themselves. All coefficients are fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rowwise import f64, per_row


@dataclass
class HCParams:
    fn: torch.Tensor  # [(2 + hc) * hc, hc * d]
    base: torch.Tensor  # [(2 + hc) * hc]
    scale: torch.Tensor  # [3]


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Rows are sources j, columns destinations k. Softmax over k counts as the first row normalisation."""
    c = f64(lambda z: torch.softmax(z, dim=-1), logits) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def coefficients(x: torch.Tensor, p: HCParams, hc: int, norm_eps: float, hc_eps: float, iters: int):
    """x: streams [T, hc, d] -> pre [T, hc], post [T, hc], comb [T, hc, hc] (fp32)."""
    flat = x.float().reshape(x.shape[0], -1)
    fn_t = p.fn.float().t()
    m = per_row(lambda r: r @ fn_t, flat) * f64(torch.rsqrt, flat.pow(2).mean(dim=-1, keepdim=True) + norm_eps)
    base, scale = p.base.float(), p.scale.float()
    pre = f64(torch.sigmoid, m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * f64(torch.sigmoid, m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb_logits = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc)
    return pre, post, sinkhorn(comb_logits, iters, hc_eps)


def collapse(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """u = Σ_c a_c X[c]: [T, hc, d] with [T, hc] -> [T, d] in the stream dtype."""
    return (weights.float()[:, :, None] * x.float()).sum(dim=1).to(x.dtype)


def expand(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'[k] = post_k y + Σ_j comb[j, k] X[j] (note the sum over the first index)."""
    mixed = (comb[:, :, :, None] * x.float()[:, :, None, :]).sum(dim=1)
    return (post[:, :, None] * y.float()[:, None, :] + mixed).to(x.dtype)
