"""RMSNorm as the release computes it: in fp32, weight applied after the rescale, cast back to the input dtype."""

from __future__ import annotations

import torch

from .rowwise import f64


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * f64(torch.rsqrt, xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)
