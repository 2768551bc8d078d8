"""`Comm` over torch.distributed: gloo on CPU, NCCL on GPU.

Both collectives are built from all_gather only. An all_reduce would be shorter, but its summation order depends on
the backend's algorithm (ring, tree, chunking), so ranks could disagree in the last bit and TP=2 would not be
reproducible run to run. Gathering every partial and adding them in rank order 0, 1, ..., world-1 gives every rank
the same bits by construction.

Timeouts are those of the process group (set by `init_tp`); a lost peer is caught earlier by the fail-fast monitor.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from dsv41.parallel.comm import Comm

# torch >= 2.13 renamed all_gather_into_tensor (older builds, e.g. the CUDA 2.11 wheels, have only the old name)
_GATHER_INTO_TENSOR = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Low-precision partials are added in fp32 and rounded once: with two ranks this equals a plain bf16 add; with more
# ranks it avoids one rounding per addition. Either way the order is fixed, so every rank gets the same bits.
_WIDEN = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


class TorchComm(Comm):
    """Rank-ordered collectives on a torch.distributed process group (the default group unless given)."""

    def __init__(self, group=None):
        if not dist.is_initialized():
            raise RuntimeError("TorchComm needs an initialised process group (call dsv41.parallel.init_tp first)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
        self._into_tensor = True
        self.calls = {"sum_partials": 0, "gather_cat": 0}
        # (collective, dtype, row width) -> (calls, rows): what crosses the link, for docs and benchmarks
        self.traffic: Counter = Counter()

    @property
    def graph_safe(self) -> bool:
        """NCCL's collectives are captured by CUDA graphs (on the current stream); gloo's are host calls.
        (`calls` and `traffic` count eager calls only: a replay runs no Python.)"""
        return self.device is not None  # set for NCCL groups only

    def _count(self, op: str, x: torch.Tensor) -> None:
        width = x.shape[-1] if x.dim() else 1
        self.traffic[(op, str(x.dtype).removeprefix("torch."), width, "calls")] += 1
        self.traffic[(op, str(x.dtype).removeprefix("torch."), width, "rows")] += x.numel() // max(width, 1)

    def _all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = x.contiguous()
        if self._into_tensor:
            # one output buffer: NCCL writes it directly, no per-rank copies afterwards
            flat = x.reshape(-1)
            out = flat.new_empty(self.world * flat.numel())  # the ranks' slices back to back, in rank order
            try:
                _GATHER_INTO_TENSOR(out, flat, group=self.group)
                return list(out.view(self.world, *x.shape).unbind(0))
            except (RuntimeError, NotImplementedError) as exc:
                if "not supported" not in str(exc).lower() and "not implemented" not in str(exc).lower():
                    raise
                self._into_tensor = False  # an old backend without it: use the list form from now on
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x, group=self.group)
        return parts

    def sum_partials(self, x: torch.Tensor) -> torch.Tensor:
        self.calls["sum_partials"] += 1
        self._count("sum_partials", x)
        if self.world == 1:
            return x
        parts = self._all_gather(x)
        acc_dtype = _WIDEN.get(x.dtype, x.dtype)
        total = parts[0].to(acc_dtype, copy=True)
        for part in parts[1:]:
            total += part.to(acc_dtype)
        return total.to(x.dtype)

    def gather_cat(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        self.calls["gather_cat"] += 1
        self._count("gather_cat", x)
        if self.world == 1:
            return x
        dim = dim % x.dim()
        # Shards may differ along `dim` (uneven vocab splits in whole blocks), and all_gather needs equal shapes:
        # exchange the sizes first, pad every shard to the largest, cut the padding off after the gather.
        size = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device)
        sizes = [int(s.item()) for s in self._all_gather(size)]
        longest = max(sizes)
        if x.shape[dim] < longest:
            pad_shape = list(x.shape)
            pad_shape[dim] = longest - x.shape[dim]
            x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
        parts = self._all_gather(x)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)

