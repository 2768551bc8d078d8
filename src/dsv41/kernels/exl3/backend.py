"""Which EXL3 kernel path runs where (torch only: no Triton, no CUDA module loaded to decide).

The CUDA kernels (exl3/cuda.py) on NVIDIA GPUs of sm_80 or newer, the Triton kernels elsewhere and in Triton's
CPU interpreter; `DSV41_EXL3_BACKEND=auto|cuda|triton` overrides the choice, `DSV41_EXL3_NO_ASM=1` keeps the
Triton decode free of inline PTX (what non-NVIDIA backends run).
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cuda_path_available(device: torch.device) -> bool:
    """NVIDIA GPU of sm_80 or newer (mma.sync m16n8k16, cp.async)."""
    if device.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def use_cuda_backend(device: torch.device) -> bool:
    """The CUDA kernels where they can run; DSV41_EXL3_BACKEND=triton forces the Triton ones."""
    choice = os.environ.get("DSV41_EXL3_BACKEND", "auto")
    if choice not in ("auto", "cuda", "triton"):
        raise ValueError(f"DSV41_EXL3_BACKEND={choice!r}: expected auto, cuda or triton")
    if choice == "triton" or interpreting():
        return False
    available = cuda_path_available(device)
    if choice == "cuda" and not available:
        raise RuntimeError(f"DSV41_EXL3_BACKEND=cuda but {device} cannot run the CUDA kernels (NVIDIA sm_80+ needed)")
    return available


def use_inline_asm(device: torch.device, codebook: str) -> bool:
    """The Triton decode's inline PTX (dp4a + fp16 FMA, MUL1 only) on a real NVIDIA GPU; the interpreter has no PTX.

    DSV41_EXL3_NO_ASM=1 selects the portable pure-Triton decode (what runs on non-NVIDIA backends too).
    """
    if codebook != "mul1" or interpreting() or device.type != "cuda" or torch.version.hip is not None:
        return False
    return os.environ.get("DSV41_EXL3_NO_ASM", "0") in ("", "0")
