"""The two collectives the model needs, behind one small interface.

The model never calls torch.distributed directly: it receives a `Comm`. Both collectives must give every rank
the same bits, so partial sums are gathered and added in rank order (never an all-reduce whose order depends
on timing or topology).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing dsv41.dist (e.g. for the CLI options) must not load torch
    import torch


class Comm:
    rank: int = 0
    world: int = 1

    @property
    def graph_safe(self) -> bool:
        """Whether `sum_partials` may be captured in a CUDA graph (runtime/graphs.py): its work is device work on
        torch's current stream, with no host call or sync. Unknown comms are not."""
        return False

    def sum_partials(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's `x` (same shape on all ranks), added in rank order 0, 1, ..., world-1."""
        raise NotImplementedError

    def gather_cat(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenation of every rank's shard along `dim`, in rank order (shards may differ in size on `dim`)."""
        raise NotImplementedError


class LocalComm(Comm):
    """TP=1: one rank holds everything, both collectives are the identity."""

    @property
    def graph_safe(self) -> bool:
        return True

    def sum_partials(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_cat(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x
