"""Compile the EXL3 kernels ahead of the first request (`dsv41 warm rankN`, dsv41-warm@.service).

CUDA: every (K, codebook) variant of cuda/exl3_fused.cu is loaded for this machine's GPU: from the closure's
prebuilt cubins (`$DSV41_CUBIN_DIR`), else built once into the cubin cache (`$DSV41_HOME/cuda`), so the rank
itself never compiles. Triton's kernels compile on their first
launch into TRITON_CACHE_DIR; the CUDA path is the one the engine runs on NVIDIA GPUs.
"""

from __future__ import annotations

import logging
import os

import torch

from dsv41.kernels.exl3 import prefill_wgmma
from dsv41.kernels.exl3.backend import cuda_path_available
from dsv41.weights.exl3 import CODEBOOKS

log = logging.getLogger(__name__)


def warm(cache_dir: str | None = None, ks: tuple[int, ...] = tuple(range(1, 9))) -> int:
    """Builds and loads the CUDA kernels for every K in `ks` and codebook; returns how many variants are ready."""
    if cache_dir:
        os.environ.setdefault("TRITON_CACHE_DIR", cache_dir)
    from dsv41.kernels.exl3.cuda import kernels_for

    if not torch.cuda.is_available() or not cuda_path_available(torch.device("cuda")):
        log.info("CUDA kernels: skipped (no NVIDIA GPU of sm_80 or newer here)")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    wgmma = prefill_wgmma.use_wgmma(device)  # Hopper: its own image too (the prefill's wgmma tiles)
    for K in ks:
        for codebook in CODEBOOKS:
            kernels_for(device, K, codebook)
            if wgmma:
                prefill_wgmma.kernel_for(device, K, codebook)
    ready = len(ks) * len(CODEBOOKS) * (2 if wgmma else 1)
    log.info("CUDA kernels: %d variants ready for %s", ready, torch.cuda.get_device_name(device))
    return ready
