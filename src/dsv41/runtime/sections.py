"""Named sections of the fast forward for the benchmark's per-op table: `torch.profiler.record_function` ranges
while `enable(True)` is in effect (bench/decode_step.py profiles with them), a shared no-op context otherwise."""

from __future__ import annotations

import contextlib

import torch

_NULL = contextlib.nullcontext()
_on = False
NAMES = ("embed", "engram", "mhc", "norms", "exl3", "dense", "attention", "indexer", "router", "moe", "head", "comm",
         "sampling")
PREFIX = "dsv41::"


def enable(on: bool) -> None:
    global _on
    _on = bool(on)


def section(name: str):
    return torch.profiler.record_function(PREFIX + name) if _on else _NULL
