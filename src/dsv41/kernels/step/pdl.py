"""Programmatic dependent launch (PDL) of the step kernels: a kernel's launch overlaps the tail of the one before it.

Inside the decode step's CUDA graph about half the kernels are the step kernels, most of them a few µs long, so
the launch gap between two kernels (~1-2 µs on the H200) is a large share of the step. With PDL a kernel is
launched while its predecessor still runs (the EXL3 kernels already signal it: `let_next_kernel_start` in
kernels/cuda/exl3_fused.cu): its programs are placed on the SMs ahead of time and wait in `gdc_wait` until every
program of the predecessor has finished and its memory is visible. So each kernel here, first thing:

- `gdc_launch_dependents`: its own successor may be launched now (it too waits before touching memory);
- `gdc_wait`: nothing is read or written before the predecessor is complete, which keeps the bits and the
  ordering of the plain launch (a kernel two back is complete too: the predecessor could not finish before it).

Where it runs: CUDA devices of compute capability 9.0 and later (the H200's sm_90 and GB10's sm_121; the
instructions do not exist before) and not in Triton's interpreter, unless `DSV41_PDL=0` (A/B runs). Elsewhere the
kernels compile without the two instructions (`PDL=False`): the portable twin is the same kernel.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .knobs import switched_on

ENV = "DSV41_PDL"


def enabled(device: torch.device) -> bool:
    """Whether launches on `device` use PDL (read at each launch: the A/B switch needs no restart)."""
    if not switched_on(ENV):
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def launch(device: torch.device) -> dict:
    """The keyword arguments of a step kernel's launch: its `PDL` constexpr, and the launch flag when on."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def wait_previous(PDL: tl.constexpr):
    """The top of every step kernel: let the next kernel launch, then wait for the previous one to complete."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
