"""`rows=` of the step launchers: a bucket's real rows are its first ones; programs run for them only.

A decode / verify bucket has a fixed row count (runtime/model.py `BUCKET`) so every op has one shape whatever the
number of real rows. The launchers given `rows` still launch over all B rows: the programs of rows [rows, B) read
nothing and write +0.0 to their outputs, so padding rows cost next to nothing, need no memset launch beside the
kernel (no host sync, CUDA-graph capturable), and hold zeros, which every later row-wise op keeps finite (RMSNorm of
a zero row is zero).
"""

from __future__ import annotations

import torch


def live_rows(rows, B: int) -> int:
    """`rows=` of a launcher: None -> B, else an int in [0, B] (a Python int: a tensor would need a host sync)."""
    if rows is None:
        return B
    if isinstance(rows, (bool, torch.Tensor)) or not hasattr(rows, "__index__"):
        raise ValueError(f"rows must be None or an int in [0, {B}], got {rows!r}")
    rows = rows.__index__()
    if not 0 <= rows <= B:
        raise ValueError(f"rows must be in [0, {B}] (the batch), got {rows}")
    return rows
