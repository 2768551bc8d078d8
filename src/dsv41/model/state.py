"""Per-sequence decode state: everything a later chunk needs from the earlier ones.

Chunked prefill and decode are exact continuations of one-shot prefill because each piece of state here is
exactly what the one-shot forward would have computed at that point:
- per layer, the window KV of the last `sliding_window` positions (after RoPE and FP8 fake-quant),
- per KV-source layer, the compressed KV entries and their index keys, plus the open (incomplete) compressor
  group's per-token (value, gate) rows in fp32,
- the Engram hash look-back,
- the DSpark per-stage window rings and the last committed position's taps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class WindowCache:
    kv: torch.Tensor | None = None  # [n <= window, head_dim], positions state.pos - n .. state.pos - 1


@dataclass
class SourceCache:
    kv: torch.Tensor | None = None  # [C, head_dim] compressed entries after RoPE + FP4
    index_k: torch.Tensor | None = None  # [C, index_head_dim] after RoPE + FP4
    open_v: torch.Tensor | None = None  # [p < ratio, head_dim] fp32 values of the incomplete group
    open_s: torch.Tensor | None = None  # [p < ratio, head_dim] fp32 gate logits of the incomplete group
    # a pool-backed state (runtime/pool_forward.PoolSequence) keeps the entries it appends as they were before
    # their FP4, so the pool stores encode(x), which decodes to fake_quant(x) exactly: encoding fake_quant(x) again
    # is not that for every block (the e4m3 scale's band, docs/ENGINE.md §3)
    keep_unquantised: bool = False
    appended_unquantised: torch.Tensor | None = None  # [entries appended, head_dim] before their FP4

    @property
    def entries(self) -> int:
        return 0 if self.kv is None else self.kv.shape[0]

    def append_entries(self, rotated: torch.Tensor, quantised: torch.Tensor) -> None:
        """Append compressed entries: `quantised` (what attention reads) = the fake quantiser of `rotated`."""
        self.kv = quantised if self.kv is None else torch.cat((self.kv, quantised))
        if self.keep_unquantised:
            a = self.appended_unquantised
            self.appended_unquantised = rotated if a is None else torch.cat((a, rotated))


@dataclass
class SequenceState:
    pos: int = 0  # number of tokens already absorbed = position of the next token
    windows: dict[int, WindowCache] = field(default_factory=dict)
    sources: dict[int, SourceCache] = field(default_factory=dict)
    engram: object | None = None  # EngramHasher look-back state
    dspark_windows: dict[int, WindowCache] = field(default_factory=dict)
    last_taps: torch.Tensor | None = None  # [n_taps * d] of the last absorbed position (DSpark input)
    ids: list[int] = field(default_factory=list)

    def window(self, layer: int) -> WindowCache:
        return self.windows.setdefault(layer, WindowCache())

    def source(self, layer: int) -> SourceCache:
        return self.sources.setdefault(layer, SourceCache())

    def dspark_window(self, stage: int) -> WindowCache:
        return self.dspark_windows.setdefault(stage, WindowCache())
