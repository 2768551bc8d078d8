"""Row invariance: a row's result must not depend on which other rows share its forward.

Chunked prefill, one-token decode and (later) batching and speculative verification all feed the same row through
forwards of different shapes. On the CPU a matmul over 48 rows and one over 1 row take different kernels and round
differently, so the reference path computes every matrix product one row at a time (the same kernel for every
row) and every other reduction over fixed-shape per-row vectors. With one intra-op thread this makes chunked ==
one-shot bit for bit (tests/test_model_chunking.py); more threads may split a single row's reduction differently.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

# rows per block where a per-row tensor would otherwise grow with the chunk (attention, indexer)
ROW_BLOCK = 32


def per_row(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn applied to each row x[i:i+1] separately, concatenated."""
    if x.shape[0] == 1:
        return fn(x)
    return torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])


def row_blocks(n: int) -> Iterator[slice]:
    for start in range(0, n, ROW_BLOCK):
        yield slice(start, min(start + ROW_BLOCK, n))


class RowInvariant:
    """Wraps a linear layer so that each input row goes through its own `[1, in] @ W^T`."""

    def __init__(self, linear):
        self.linear = linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return per_row(self.linear, x)

    def __getattr__(self, name):  # in_features, fmt, materialize, ...
        return getattr(self.linear, name)


def f64(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn` (a transcendental: exp, sigmoid, rsqrt, ...) evaluated in fp64 and rounded once to x's dtype.

    torch picks a vectorised or a scalar implementation by tensor size and alignment, and the two can differ in the
    last bit; a row would then round differently alone than inside a chunk. In fp64 both are far more precise than
    the fp32 result, so the single rounding makes them agree."""
    return fn(x.double()).to(x.dtype)
