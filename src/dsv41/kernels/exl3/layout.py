"""What the EXL3 kernels take: one quantized matrix (or a stack of experts) checked once, viewed as uint32 words.

The stored trellis is used as is (no repack): `[k/16, n/16, 16K]` int16 read as `[k/16, n/16, 8K]` int32 is
exactly the little-endian uint32 word view of §1.3, so a prepared folder needs no extra kernel layout. The group
is checked by the reference's own validator (`dsv41.weights.exl3.check_group`); the kernels add one rule, an
integer K. Torch only: importing this module loads neither Triton nor a CUDA module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dsv41.errors import CheckpointError
from dsv41.kernels.cuda_build import CODEBOOK_IDS
from dsv41.weights.exl3 import check_group


def kernel_k(K: float, name: str) -> int:
    """K as the kernels take it (compiled per integer K in 1..8)."""
    if not float(K).is_integer():
        raise CheckpointError(f"tensor '{name}.trellis': half-integer K={K:g} has no kernel path "
                              "(valid for the reference decode, dsv41.weights.exl3)")
    return int(K)


@dataclass(frozen=True)
class Exl3Layout:
    """The kernels' view of an EXL3 group: uint32 trellis words, the fp16 scales, codebook, K and `[k, n]`."""

    words: torch.Tensor  # int32 [lead..., k/16, n/16, 8K]
    suh: torch.Tensor  # fp16 [lead..., k]
    svh: torch.Tensor  # fp16 [lead..., n]
    codebook: str
    K: int
    k: int
    n: int
    LEAD: ClassVar[int] = 0  # leading (expert) dimensions

    @classmethod
    def from_group(cls, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str,
                   name: str = "EXL3 group"):
        """The group's tensors, checked (`check_group`, then an integer K) and viewed as words; nothing copied
        unless a tensor is not contiguous."""
        dims = check_group(name, trellis, suh, svh, codebook, cls.LEAD)
        words = trellis.contiguous().view(torch.int32)
        return cls(words, suh.contiguous(), svh.contiguous(), codebook, kernel_k(dims.K, name), dims.k, dims.n)

    @property
    def codebook_id(self) -> int:
        """The kernels' CODEBOOK constant (the EXL3_CB define of the CUDA source)."""
        return CODEBOOK_IDS[self.codebook]

    @property
    def device(self) -> torch.device:
        return self.words.device


@dataclass(frozen=True)
class Exl3Tensor(Exl3Layout):
    """One EXL3 linear `[k, n]` (y = x @ W) on one device: words `[k/16, n/16, 8K]`, suh `[k]`, svh `[n]`."""

    @property
    def nbytes(self) -> int:
        """Bytes the kernels must read: trellis + suh + svh."""
        return self.words.numel() * 4 + self.suh.numel() * 2 + self.svh.numel() * 2


@dataclass(frozen=True)
class Exl3ExpertStack(Exl3Layout):
    """E experts of one projection, stacked: trellis `[E, k/16, n/16, 16K]`, suh `[E, k]`, svh `[E, n]`."""

    LEAD: ClassVar[int] = 1

    @classmethod
    def from_stacked(cls, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str,
                     name: str = "experts") -> Exl3ExpertStack:
        return cls.from_group(trellis, suh, svh, codebook, name)

    @property
    def experts(self) -> int:
        return self.words.shape[0]

    @property
    def expert_nbytes(self) -> int:
        return self.words[0].numel() * 4 + self.k * 2 + self.n * 2


def check_moe_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: Exl3ExpertStack,
                     w3: Exl3ExpertStack, w2: Exl3ExpertStack) -> None:
    """The routed-expert kernels' inputs agree: x [T, hidden], top-k tables [T, topk], stacks that chain."""
    T, hidden = x.shape
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids {list(topk_ids.shape)} / topk_weights {list(topk_weights.shape)} "
                         f"vs x {list(x.shape)}")
    if w1.k != hidden or w3.k != hidden or w2.n != hidden or w1.n != w3.n or w2.k != w1.n:
        raise ValueError("expert stacks do not chain: need w1/w3 [hidden, inter] and w2 [inter, hidden]")
    if w1.K != w3.K or w1.codebook != w3.codebook:
        raise ValueError("gate and up stacks must share K and codebook")


def moe_out(out: torch.Tensor | None, T: int, hidden: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The MoE launch's output: a new [T, hidden] tensor, or the caller's `out` (contiguous, of that shape, dtype
    and device: e.g. the real rows of a bucket's sum, which then needs no copy)."""
    if out is None:
        return torch.empty((T, hidden), dtype=dtype, device=device)
    if out.shape != (T, hidden) or out.dtype != dtype or not out.is_contiguous() or out.device != torch.device(device):
        raise ValueError(f"out must be contiguous {dtype} [{T}, {hidden}] on {device}, got {out.dtype} "
                         f"{list(out.shape)} on {out.device}")
    return out
