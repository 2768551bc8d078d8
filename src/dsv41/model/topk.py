"""Deterministic top-k: equal scores are ordered by ascending index (router, indexer, candidate blocks)."""

from __future__ import annotations

import torch


def topk_lowest_index_ties(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim, best first; ties go to the lower index.

    A stable descending sort keeps equal values in index order, which torch.topk does not promise.
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :k]
