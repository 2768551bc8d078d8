"""Stopping a long forward between its layers when nobody wants its step any more (issue 31, item 7).

A prefill chunk is one engine step: 2,048 rows through every layer (~0.6 s of a full-shape rank on an H100, ~1.5 s
projected on a GB10, 10-13 s on the CPU). A client that leaves during it used to hold its slot, its pages and the
device until the chunk's last layer. The engine's probe (`LLMEngine.step_abandoned`: every request with rows in
the step was cancelled since it began) is asked between layers, and the forward raises `StepAborted`; the engine
then ends those requests from the state before the step: both forwards run on views of the pool
(`pool_forward.PoolSequence`) stored back only after the last layer, so nothing of the cut step is kept.

Tensor parallel: every rank must stop at the same layer, or their collectives fall out of step. Only rank 0 has the
engine's probe; its answer reaches the others in one small `sum_partials` (a [1] tensor), made at the same layers
on every rank (every `every` layers: each check is a round trip between the ranks). The decision at a check is the
sum issued at the check before it (the same bits on every rank), so reading it never waits for the device: on
NCCL the sum is queued behind the layers already in flight and is done by the next check. One rank alone checks at
every layer and reads its own probe (no collective).

Only unfused forwards check (prefill rows, and any chunk that runs eagerly): decode and verify steps are a few
milliseconds, often one CUDA graph, and are never cut.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..engine.batch import StepAborted

# layers between two checks at TP > 1: at most 4, about 10 round trips a forward (each ~0.1-0.3 ms over the
# Sparks' link, against ~1.5 s a 40-layer chunk); a cancelled chunk stops within two checks (the decision is read
# one check late)
TP_EVERY = 4


def checks_every(world: int, layers: int) -> int:
    """Layers between two checks: every layer on one rank (a Python read), else about a tenth of the layers."""
    return 1 if world == 1 else max(1, min(TP_EVERY, layers // 10))


class AbortWatch:
    """One rank's view of the engine's probe for a forward's layers: `start()` before the first layer, then
    `check(i)` before layer i (raises StepAborted)."""

    def __init__(self, comm=None, probe: Callable[[], bool] | None = None, layers: int = 40):
        self.comm = comm
        self.probe = probe  # rank 0's (the engine's); None elsewhere: this rank follows rank 0's answer
        self.world = getattr(comm, "world", 1) if comm is not None else 1
        self.every = checks_every(self.world, layers)
        self._pending: torch.Tensor | None = None
        self.checks = 0  # collectives issued (tests, benchmarks)
        self.stopped_at: int | None = None  # the layer the last StepAborted was raised before

    def _asked(self) -> bool:
        try:
            return bool(self.probe()) if self.probe is not None else False
        except Exception:  # noqa: BLE001 - a probe that fails never stops a step
            return False

    def start(self) -> None:
        self._pending = None

    def check(self, i: int, device: torch.device | None = None) -> None:
        """Before layer i (i > 0) of the forward: raise StepAborted when the step is abandoned."""
        if i == 0 or i % self.every:
            return
        if self.world == 1:
            if self._asked():
                self._stop(i)
            return
        decided = self._pending
        # gloo moves host tensors; NCCL needs the flag on the rank's device
        dev = getattr(self.comm, "device", None) or torch.device("cpu")
        flag = torch.tensor([1.0 if self._asked() else 0.0], dtype=torch.float32, device=dev)
        self._pending = self.comm.sum_partials(flag)
        self.checks += 1
        if decided is not None and float(decided[0]) > 0:
            self._stop(i)

    def _stop(self, i: int) -> None:
        self.stopped_at, self._pending = i, None
        raise StepAborted(f"every request of the step left: stopped before layer {i}")
