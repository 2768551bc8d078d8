"""Mixture of experts on the fast path: the router in fp32 as the reference computes it, routed experts by phase.

The router is the reference's (MODEL.md §8: sqrtsoftplus scores, the bias picks experts and never weighs them,
top-k with ties to the lower expert id, renormalised and scaled): for decode and verify rows where the Triton step
kernels run (a CUDA device, or the interpreter) the two launches of `kernels.step.router` over the real rows (ids
and weights stay on the device, in the top-k tables the MoE kernels read); otherwise its product over the whole
row bucket in one fixed-shape matmul instead of row by row. Routed experts: decode and verify rows go through the
kernels' MoE (`kernels.exl3.moe`, two launches, routing read in-kernel, slots summed in order), with the split
counts resolved once at build; prefill rows of stacked EXL3 experts take the tile kernels
(`kernels.exl3.prefill.prefill_moe`: the chunk's (row, slot) pairs sorted by expert on the device, one grouped
launch for gate/up with the SwiGLU and the routing weight fused, one for down, the slots summed in order with the
shared output; no host read; the router logits as one tiled product, `kernels.step.router_tiles`), or with
DSV41_PREFILL_TILES=0 the loop over the experts they picked, in ascending id as the reference does, each expert's
matrices reconstructed into the rank's one prefill workspace, the rows grouped by expert on the device with one
host read of the counts per layer (`FusedMoE._grouped`). Experts stored in another format (the release's MXFP4)
take that loop in every phase. The routed and shared outputs are added locally, so tensor parallelism needs one
rank-ordered reduction per layer (the caller's).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Sequence

import torch
import torch.nn.functional as F

from dsv41.kernels.exl3.backend import interpreting, use_cuda_backend
from dsv41.kernels.exl3.layout import Exl3ExpertStack, Exl3Tensor
from dsv41.model.moe import Expert, swiglu_clamped
from dsv41.model.rowwise import f64
from dsv41.model.topk import topk_lowest_index_ties

from ..sections import section
from .attention import step_kernels_run
from .linear import LinearGroup, PrefillWorkspace, dense_group_enabled, is_fused, prefill_tiles_enabled


@dataclass(frozen=True)
class MoeLaunch:
    """The routed-expert launches of one layer, fixed at build."""

    backend: str  # "cuda" | "triton"
    config: object  # MoeCudaConfig | MoeConfig

    @classmethod
    def resolve(cls, w1: Exl3ExpertStack, w2: Exl3ExpertStack) -> "MoeLaunch":
        if use_cuda_backend(w1.device):
            from dsv41.kernels.exl3.cuda import moe_config

            return cls("cuda", moe_config(w1, w2, w1.device))
        from dsv41.kernels.exl3.moe import MoeConfig

        return cls("triton", MoeConfig(splits_gate_up=1, splits_down=1) if interpreting() else MoeConfig())

    def run(self, x, ids, weights, w1, w3, w2, limit: float, out: torch.Tensor | None = None,
            addend: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' fp32 sum [T, d] (into `out` when given: contiguous fp32 [T, d]), plus `addend`
        [T, d] when given (the CUDA kernel adds it in its epilogue: no launch of its own)."""
        if self.backend == "cuda":
            from dsv41.kernels.exl3.cuda import moe_forward_cuda

            return moe_forward_cuda(x, ids, weights, w1, w3, w2, limit, torch.float32, config=self.config, out=out,
                                    addend=addend)
        from dsv41.kernels.exl3.moe import moe_forward

        return moe_forward(x, ids, weights, w1, w3, w2, limit, torch.float32, config=self.config, out=out,
                           addend=addend)


class StackedExperts:
    """The routed experts of one layer as three stacks (gate, up, down), built once per layer and projection."""

    def __init__(self, w1: Exl3ExpertStack, w3: Exl3ExpertStack, w2: Exl3ExpertStack,
                 workspace: PrefillWorkspace):
        self.w1, self.w3, self.w2 = w1, w3, w2
        self.workspace = workspace
        self.launch = MoeLaunch.resolve(w1, w2)
        for s in (w1, w3, w2):
            workspace.reserve(s.k, s.n)

    @property
    def nbytes(self) -> int:
        return sum(s.words.numel() * 4 + s.suh.numel() * 2 + s.svh.numel() * 2 for s in (self.w1, self.w3, self.w2))

    def expert(self, e: int) -> Expert:
        """Expert `e` for the prefill loop: each projection reconstructed into the workspace, then one GEMM."""
        return Expert(*(partial(self._matmul, s, e) for s in (self.w1, self.w2, self.w3)))

    def _matmul(self, stack: Exl3ExpertStack, e: int, x: torch.Tensor) -> torch.Tensor:
        one = Exl3Tensor(stack.words[e], stack.suh[e], stack.svh[e], stack.codebook, stack.K, stack.k, stack.n)
        return self.workspace.matmul(x, one).to(x.dtype)


class FusedMoE:
    def __init__(self, gate_weight: torch.Tensor, gate_bias: torch.Tensor | None, experts, shared: Sequence,
                 *, topk: int, route_scale: float, renorm: bool, swiglu_limit: float, gate_temp: float = 1.0):
        """`experts`: a `StackedExperts` or a list of (w1, w3, w2) fast linears (any other storage format);
        `shared`: (w1, w3, w2) fast linears of the shared experts."""
        # [d, E] as stored (the release's bf16: every value exact in fp32; the step router reads it as fp32, half
        # the bytes of an fp32 copy); other dtypes upcast once
        lossless = gate_weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
        self.gate_t = (gate_weight if lossless else gate_weight.float()).t()
        self.gate_bias = None if gate_bias is None else gate_bias.float()
        self.experts = experts
        self.shared = list(shared)
        # each shared expert's gate and up read the same x: one launch on the fused path
        self.shared_gate_up = [LinearGroup([w1, w3]) for w1, w3, _ in self.shared]
        self.topk, self.route_scale, self.renorm = topk, route_scale, renorm
        self.limit, self.gate_temp = swiglu_limit, gate_temp

    def route(self, x: torch.Tensor):
        """(ids [B, k], weights [B, k] fp32, logits [B, E] fp32, select [B, E] fp32) of every row of the bucket."""
        logits = (x.float() @ self.gate_t.float()) / self.gate_temp
        scores = f64(lambda z: torch.sqrt(F.softplus(z)), logits)
        select = scores + self.gate_bias if self.gate_bias is not None else scores
        ids = topk_lowest_index_ties(select, self.topk)
        w = scores.gather(1, ids)
        if self.renorm and self.topk > 1:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, w * self.route_scale, logits, select

    def _expert(self, e: int) -> Expert:
        if isinstance(self.experts, StackedExperts):
            return self.experts.expert(e)
        w1, w3, w2 = self.experts[e]
        return Expert(w1=partial(w1, phase="prefill"), w2=partial(w2, phase="prefill"), w3=partial(w3, phase="prefill"))

    def partial(self, x: torch.Tensor, n: int, phase: str, trace: dict | None = None) -> torch.Tensor:
        """This rank's fp32 share of the MoE output for the bucket x [B, d] whose first n rows are real."""
        stacked = isinstance(self.experts, StackedExperts)
        # prefill rows of stacked EXL3 experts take the tile kernels (`kernels/exl3/prefill.py`), and with them the
        # router's tiled logits (`kernels/step/router_tiles.py`): every op of the chunk row-invariant, so chunks are
        # bitwise one-shot
        tiles = phase == "prefill" and stacked and prefill_tiles_enabled() and step_kernels_run(x.device)
        with section("router"):
            if tiles:
                from dsv41.kernels.step.router_tiles import route_rows_tiles

                ids, weights, logits, select = route_rows_tiles(
                    x[:n], self.gate_t, self.gate_bias, self.topk, scale=self.route_scale, renorm=self.renorm,
                    temp=self.gate_temp, ids_dtype=torch.int32)
            elif is_fused(phase) and step_kernels_run(x.device):
                from dsv41.kernels.step.router import route_rows

                ids, weights, logits, select = route_rows(
                    x[:n], self.gate_t, self.gate_bias, self.topk, scale=self.route_scale, renorm=self.renorm,
                    temp=self.gate_temp,  # int32 ids: the table the MoE kernels read, no conversion launch
                    ids_dtype=torch.int32 if stacked else torch.int64)
            else:
                ids, weights, logits, select = self.route(x)
        if trace is not None:
            trace.update(router_ids=ids[:n].long(), router_logits=logits[:n], router_select=select[:n])
        if tiles:
            shared = self._shared(x, n, phase)
            with section("moe"):
                from dsv41.kernels.exl3.prefill import prefill_moe

                s = self.experts
                y = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
                prefill_moe(x[:n], ids[:n], weights[:n], s.w1, s.w3, s.w2, self.limit, out=y[:n],
                            addend=None if shared is None else shared[:n])
            return y
        if is_fused(phase) and stacked:
            shared = self._shared(x, n, phase)
            with section("moe"):
                # the routed sum written straight into the bucket's real rows, the shared output added to it in
                # the MoE's epilogue: fp32 + (shared + ...), the order of `_shared` first then the routed (the add
                # commutes); the padding rows stay unwritten (row-wise from here on)
                s = self.experts
                y = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
                s.launch.run(x[:n], ids[:n], weights[:n], s.w1, s.w3, s.w2, self.limit, out=y[:n],
                             addend=None if shared is None else shared[:n])
            return y
        y = self._shared(x, n, phase)
        y = y.float() if y is not None else torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        with section("moe"):
            self._grouped(x, ids[:n], weights[:n], y)
        return y

    def _shared(self, x: torch.Tensor, n: int, phase: str) -> torch.Tensor | None:
        """The shared experts' sum [B, d] (None without any): fp32, or one expert's output as the linear gives it
        (x's dtype; an fp32 add of it widens it exactly, as `.float()` would, without the launch). Decode / verify
        rows where the step kernels run take the SwiGLU between the matmuls as one launch (`kernels.step.swiglu`)."""
        y = None
        for (w1, w3, w2), gate_up in zip(self.shared, self.shared_gate_up):
            if is_fused(phase) and step_kernels_run(x.device):
                from dsv41.kernels.step.swiglu import swiglu_rows

                out = w2(swiglu_rows(*gate_up([x, x], n, phase), self.limit, rows=n), n, phase)
            elif not is_fused(phase) and dense_group_enabled() and gate_up.dense_batches():
                g, u = gate_up([x, x], n, phase)  # prefill, DSV41_PREFILL_DENSE_GROUP: gate and up in one launch
                if step_kernels_run(x.device):  # the SwiGLU in one launch, not torch's six (a row's bits its own)
                    from dsv41.kernels.step.swiglu import swiglu_rows

                    out = w2(swiglu_rows(g, u, self.limit, rows=n), n, phase)
                else:
                    out = swiglu_clamped(x, Expert(w1=lambda _: g, w2=partial(w2, n=n, phase=phase),
                                                   w3=lambda _: u), self.limit, None)
            else:
                out = swiglu_clamped(x, Expert(w1=partial(w1, n=n, phase=phase), w2=partial(w2, n=n, phase=phase),
                                               w3=partial(w3, n=n, phase=phase)), self.limit, None)
            y = out if y is None else y.float().add_(out)
        return y

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, y: torch.Tensor) -> None:
        """The routed experts of rows that take the expert loop (prefill rows; any phase for other storage
        formats), accumulated into y [B, d] fp32 in place.

        Experts in ascending id, each expert's rows ascending (the reference's summation order), grouped on the
        device: one stable sort of the flattened routing ids [n * k] (within an expert the flat indices
        row * k + slot stay ascending, so its rows come out ascending: the order of `(ids == e).nonzero()`), one
        bincount and ONE host read of the counts per layer; each expert with rows then takes them as a slice of
        the sorted order, row ids and routing weights gathered on the device (no further sync). Per expert the
        math (x[rows], the expert's swiglu, its routing weights) and the accumulation (`index_add_` into y,
        experts ascending) are exactly those of the per-expert loop it replaces (`torch.unique` + `nonzero` per
        expert: 1 + experts host syncs per layer), so the result is bitwise the same
        (tests/test_runtime_moe_prefill.py)."""
        n, k = ids.shape
        if n == 0:
            return
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_t.shape[1]).tolist()  # the layer's one host read
        rows_sorted = torch.div(order, k, rounding_mode="floor")
        w_sorted = weights.reshape(-1)[order]
        at = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            rows, w = rows_sorted[at:at + c], w_sorted[at:at + c]
            at += c
            y.index_add_(0, rows, swiglu_clamped(x[rows], self._expert(e), self.limit, w))
