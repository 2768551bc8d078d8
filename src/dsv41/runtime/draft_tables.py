"""The inputs of one DSpark draft pass over the KV pool, as ONE packed int64 tensor (one host-to-device copy; the
pass's CUDA graph copies it into its static buffer), like the step's `StepTables`.

Per pass of Q sequences (n = Q * block rows, the row bucket N = `row_bucket(n)`, rows past n mirroring row 0):
- `ids`, `pos` [N]: each block [y, noise x (block - 1)] at positions p + 1 .. p + block;
- `slot` [Q], `ring` [Q, W]: the ring slot and the ring rows (position mod ring_rows) of the stage rings' live
  positions max(floor, p + 1 - W) .. p, oldest first (`PoolSequence.dspark_window`'s rows; W = sliding window,
  floor the CED replay start), padded with row 0;
- `src`, `ok` [Q, S = W + block]: each key slot's row in [ring rows ; block rows] and whether it is live. The live
  ring rows come first, then the block's rows, then the dead slots: the order the reference's keys have (a ring, then
  the block), padded at the end as the gathered core pads shorter rings (its bits do not depend on dead slots past
  the live ones);
- `y` [Q], `samp_i` [Q, 2 + 2 * block], `samp_f` [Q, 3] (float64 bits): the chain's inputs
  (`draft_chain.sampling_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .draft_chain import Flags, KeyedChoice, sampling_rows
from .model import row_bucket


@dataclass(frozen=True)
class Layout:
    """name -> (offset, shape, float64?) in the packed tensor; `on(packed)` gives the named views."""

    parts: tuple

    def on(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, at, shape, f64 in self.parts:
            size = int(np.prod(shape))
            v = packed[at:at + size]
            out[name] = (v.view(torch.float64) if f64 else v).view(shape)
        return out


@dataclass
class DraftTables:
    Q: int
    n: int
    N: int
    layout: Layout
    packed: torch.Tensor
    flags: Flags

    @classmethod
    def build(cls, cfg, pool, asks, device) -> "DraftTables":
        """asks: (row, last kept position p, token y at p + 1, SamplingParams, keyed step of the draft at p + 2, k)
        as `DSparkDrafter.propose` takes them."""
        Bk, W = cfg.dspark_block_size, cfg.sliding_window
        Q = len(asks)
        n = Q * Bk
        N, S = row_bucket(n), W + Bk
        ids = [t for _, _, y, *_ in asks for t in [y] + [cfg.dspark_noise_token_id] * (Bk - 1)]
        pos = [p + 1 + j for _, p, *_ in asks for j in range(Bk)]
        ring, src, ok = (np.zeros((Q, W), np.int64), np.zeros((Q, S), np.int64), np.zeros((Q, S), np.int64))
        for q, (row, p, *_) in enumerate(asks):
            first = max(p + 1, row.replay_start)
            lo = max(row.replay_start, first - W)
            live = first - lo
            ring[q, :live] = np.arange(lo, first) % pool.ring_rows
            src[q, :live] = np.arange(live)
            src[q, live:live + Bk] = W + np.arange(Bk)
            ok[q, :live + Bk] = 1
        ints, floats, flags = sampling_rows([KeyedChoice(params, step0) for _, _, _, params, step0, _ in asks], Bk,
                                            cfg.vocab_size)
        parts = {"ids": np.array(ids + [ids[0]] * (N - n)), "pos": np.array(pos + [pos[0]] * (N - n)),
                 "slot": np.array([row.slot for row, *_ in asks]), "ring": ring, "src": src, "ok": ok,
                 "y": np.array([y for _, _, y, *_ in asks]), "samp_i": np.array(ints, np.int64),
                 "samp_f": np.array(floats, np.float64)}
        layout, chunks, at = [], [], 0
        for name, a in parts.items():
            f64 = a.dtype == np.float64
            a = np.ascontiguousarray(a.astype(np.float64) if f64 else a.astype(np.int64))
            layout.append((name, at, a.shape, f64))
            chunks.append(a.reshape(-1).view(np.int64))
            at += a.size
        packed = torch.from_numpy(np.concatenate(chunks))
        if torch.device(device).type == "cuda":  # pinned and asynchronous, as `StepTables`: no sync on the send
            packed = packed.pin_memory().to(device, non_blocking=True)
        else:
            packed = packed.to(device)
        return cls(Q, n, N, Layout(tuple(layout)), packed, flags)
