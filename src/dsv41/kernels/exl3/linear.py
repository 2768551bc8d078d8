"""One entry point for an EXL3 linear: the fused kernel for decode/verify windows, reconstruct + GEMM above.

The fused kernel's time grows with every 16-row block while reconstruct + cuBLAS is flat, so each backend has a
crossover (docs/perf/exl3.md, "Numbers behind the code"): the CUDA fused kernel still wins at 32 rows and ties at
64, so up to 32 rows take it; the Triton kernel already loses at 32, so it keeps 16. Row invariance holds within
each path; a row's bits can differ between the two paths (different accumulation order), which is why the
threshold is a fixed constant per backend, never a function of the batch.
"""

from __future__ import annotations

import torch

from dsv41.kernels.exl3.backend import use_cuda_backend
from dsv41.kernels.exl3.layout import Exl3Tensor
from dsv41.kernels.exl3.matmul import fused_matmul
from dsv41.kernels.exl3.reconstruct import prefill_matmul

FUSED_MAX_ROWS = 16  # Triton fused kernel
FUSED_MAX_ROWS_CUDA = 32


def fused_max_rows(device: torch.device) -> int:
    return FUSED_MAX_ROWS_CUDA if use_cuda_backend(device) else FUSED_MAX_ROWS


def exl3_linear(x: torch.Tensor, weight: Exl3Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`y = x @ W_eff` for x `[..., k]`; returns `[..., n]` in `out_dtype`."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= fused_max_rows(rows.device):
        y = fused_matmul(rows, weight, out_dtype=out_dtype)
    else:
        y = prefill_matmul(rows, weight, out_dtype=out_dtype)
    return y.reshape(*x.shape[:-1], weight.n)
