"""What the EXL3 kernels take: one quantized matrix (or a stack of experts) checked once, viewed as uint32 words.

The stored trellis is used as is (no repack): `[k/16, n/16, 16K]` int16 read as `[k/16, n/16, 8K]` int32 is
exactly the little-endian uint32 word view of §1.3, so a prepared folder needs no extra kernel layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.errors import CheckpointError
from dsv41.kernels.exl3.decode import CODEBOOK_IDS


def _check_group(name: str, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, lead: int) -> tuple:
    if trellis.dtype != torch.int16:
        raise CheckpointError(f"{name}.trellis: dtype {trellis.dtype}, expected int16")
    if trellis.dim() != 3 + lead:
        raise CheckpointError(f"{name}.trellis: shape {list(trellis.shape)} is not [k/16, n/16, 16K]")
    words = trellis.shape[-1]
    if words % 16 != 0 or not 1 <= words // 16 <= 8:
        raise CheckpointError(
            f"{name}.trellis: last dim {words} is not 16*K for an integer K in 1..8 "
            "(half-integer K has no kernel path; use dsv41.weights.exl3 reference decode)"
        )
    K = words // 16
    k, n = trellis.shape[-3] * 16, trellis.shape[-2] * 16
    if k % 128 or n % 128:
        raise CheckpointError(f"{name}.trellis: k={k}, n={n} must both be multiples of 128 (Hadamard blocks)")
    lead_shape = list(trellis.shape[:lead])
    if list(suh.shape) != lead_shape + [k] or suh.dtype != torch.float16:
        raise CheckpointError(f"{name}.suh: {suh.dtype} {list(suh.shape)}, expected float16 {lead_shape + [k]}")
    if list(svh.shape) != lead_shape + [n] or svh.dtype != torch.float16:
        raise CheckpointError(f"{name}.svh: {svh.dtype} {list(svh.shape)}, expected float16 {lead_shape + [n]}")
    return K, k, n


@dataclass(frozen=True)
class Exl3Tensor:
    """One EXL3 linear `[k, n]` (y = x @ W) on one device."""

    words: torch.Tensor  # int32 [k/16, n/16, 8K]
    suh: torch.Tensor  # fp16 [k]
    svh: torch.Tensor  # fp16 [n]
    codebook: str
    K: int
    k: int
    n: int

    @classmethod
    def from_group(
        cls, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str, name: str = "EXL3 group"
    ) -> Exl3Tensor:
        if codebook not in CODEBOOK_IDS:
            raise CheckpointError(f"{name}: unknown codebook {codebook!r}")
        K, k, n = _check_group(name, trellis, suh, svh, lead=0)
        words = trellis.contiguous().view(torch.int32)
        return cls(words, suh.contiguous(), svh.contiguous(), codebook, K, k, n)

    @property
    def device(self) -> torch.device:
        return self.words.device

    @property
    def nbytes(self) -> int:
        """Bytes the kernels must read: trellis + suh + svh."""
        return self.words.numel() * 4 + self.suh.numel() * 2 + self.svh.numel() * 2


@dataclass(frozen=True)
class Exl3ExpertStack:
    """E experts of one projection, stacked: trellis `[E, k/16, n/16, 16K]`, suh `[E, k]`, svh `[E, n]`."""

    words: torch.Tensor  # int32 [E, k/16, n/16, 8K]
    suh: torch.Tensor
    svh: torch.Tensor
    codebook: str
    K: int
    k: int
    n: int

    @classmethod
    def from_stacked(
        cls, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str, name: str = "experts"
    ) -> Exl3ExpertStack:
        if codebook not in CODEBOOK_IDS:
            raise CheckpointError(f"{name}: unknown codebook {codebook!r}")
        K, k, n = _check_group(name, trellis, suh, svh, lead=1)
        return cls(trellis.contiguous().view(torch.int32), suh.contiguous(), svh.contiguous(), codebook, K, k, n)

    @classmethod
    def from_groups(cls, groups: list[tuple], codebook: str, name: str = "experts") -> Exl3ExpertStack:
        """Stack per-expert (trellis, suh, svh) groups (the checkpoint stores experts one by one, §4.4)."""
        if not groups:
            raise CheckpointError(f"{name}: no experts to stack")
        return cls.from_stacked(
            torch.stack([g[0] for g in groups]),
            torch.stack([g[1] for g in groups]),
            torch.stack([g[2] for g in groups]),
            codebook,
            name,
        )

    @property
    def experts(self) -> int:
        return self.words.shape[0]

    @property
    def device(self) -> torch.device:
        return self.words.device

    @property
    def expert_nbytes(self) -> int:
        return self.words[0].numel() * 4 + self.k * 2 + self.n * 2


def check_moe_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: Exl3ExpertStack,
                     w3: Exl3ExpertStack, w2: Exl3ExpertStack) -> None:
    """The routed-expert kernels' inputs agree: x [T, hidden], top-k tables [T, topk], stacks that chain."""
    T, hidden = x.shape
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids {list(topk_ids.shape)} / topk_weights {list(topk_weights.shape)} vs x {list(x.shape)}")
    if w1.k != hidden or w3.k != hidden or w2.n != hidden or w1.n != w3.n or w2.k != w1.n:
        raise ValueError("expert stacks do not chain: need w1/w3 [hidden, inter] and w2 [inter, hidden]")
    if w1.K != w3.K or w1.codebook != w3.codebook:
        raise ValueError("gate and up stacks must share K and codebook")
