"""Mixture of experts (MODEL.md §8): sqrtsoftplus router with selection-only bias, routed + shared experts.

Tensor parallelism splits every expert by its intermediate dimension (w1/w3 by output, w2 by input), so each rank
produces a partial sum of the whole MoE output; one `sum_partials` per layer completes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .rowwise import f64, per_row
from .topk import topk_lowest_index_ties

LinearFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Expert:
    w1: LinearFn  # gate
    w2: LinearFn  # down
    w3: LinearFn  # up


def swiglu_clamped(x: torch.Tensor, e: Expert, limit: float, row_weight: torch.Tensor | None) -> torch.Tensor:
    """h = silu(min(g, limit)) * clamp(u, ±limit), scaled by the routing weight before w2; returns fp32."""
    g = e.w1(x).float().clamp(max=limit)
    u = e.w3(x).float().clamp(-limit, limit)
    h = F.silu(g) * u
    if row_weight is not None:
        h = h * row_weight[:, None]
    return e.w2(h.to(x.dtype)).float()


def route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, k: int, *, scale: float,
          renorm: bool, temp: float = 1.0):
    """Returns (ids [T, k], weights [T, k] fp32, logits [T, E] fp32). Bias picks experts, never weighs them."""
    gate_t = gate_weight.float().t()
    logits = per_row(lambda r: r @ gate_t, x.float()) / temp
    scores = f64(lambda z: torch.sqrt(F.softplus(z)), logits)
    select = scores + bias.float() if bias is not None else scores
    ids = topk_lowest_index_ties(select, k)
    w = scores.gather(1, ids)
    if renorm and k > 1:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, w * scale, logits


class MoE:
    def __init__(self, gate_weight: torch.Tensor, gate_bias: torch.Tensor | None, experts: Sequence[Expert],
                 shared: Sequence[Expert], *, topk: int, route_scale: float, renorm: bool, swiglu_limit: float,
                 gate_temp: float = 1.0):
        self.gate_weight = gate_weight
        self.gate_bias = gate_bias
        self.experts = experts
        self.shared = shared
        self.topk = topk
        self.route_scale = route_scale
        self.renorm = renorm
        self.limit = swiglu_limit
        self.gate_temp = gate_temp

    def partial(self, x: torch.Tensor, trace: dict | None = None) -> torch.Tensor:
        """This rank's fp32 share of the MoE output for rows x [T, d] (complete at TP=1)."""
        ids, weights, logits = route(x, self.gate_weight, self.gate_bias, self.topk, scale=self.route_scale,
                                     renorm=self.renorm, temp=self.gate_temp)
        if trace is not None:
            trace["router_logits"], trace["router_ids"], trace["router_weights"] = logits, ids, weights
        y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        # experts in ascending id, rows in ascending order: a fixed summation order for every row
        for e in torch.unique(ids).tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            y.index_add_(0, rows, swiglu_clamped(x[rows], self.experts[e], self.limit, weights[rows, slot]))
        for s in self.shared:
            y += swiglu_clamped(x, s, self.limit, None)
        return y
