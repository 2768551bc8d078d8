"""The row tables of one decode / verify bucket over the KV pool (docs/ENGINE.md §3, §5).

Every bucket row reads and writes the pool through small integer tables, built on the host from the step's
segments and copied to the device in ONE transfer (one packed int64 tensor; `StepTables.on` rebinds the same
layout to another buffer, e.g. a CUDA graph's static input). Nothing in them depends on a device value, so every
kernel that reads them has fixed shapes and no host sync: attention over the pool joins the step's graphs.

Per row b (real rows first; padding rows read what row 0 reads and write nothing):
- `slot` ring slot, `ring_dest` the window row it writes (slot * ring_rows + pos % ring_rows; -1 for padding),
- `pages` [B, P] its sequence's page table, P the number of pages rounded up to a power of two (the bucket that
  fixes the index scores' columns: `ncols = P * per_page`; a graph per bucket),
- per KV-source ratio r (`SourceTables`): `n_vis` the entries the row sees ((pos + 1) // r), `entry_dest` the flat
  page row of the entry the row closes (the row whose position ends a group: "write by closer"; -1 otherwise),
  `entry_pos` that entry's RoPE position (its group's first token), and for r > 1 where the group's earlier members
  are: `back_row[d - 1]` the bucket row holding position pos - d when it is in this step, else -1 and
  `back_open[d - 1]` its row in the open-group store; `open_dest` the open-store row of each row still open when the
  step ends (the next step's open group; in a pool with verify rows, of every row: a rollback's group), -1
  otherwise; its row is the position's in the store's ring (`KVPool.open_modulus`: the place in the group without
  verify rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


def ring_chunk_rows(pool, window: int) -> int:
    """The most rows one sequence's chunk may have in place: the ring must still hold every window position its
    first row reads after the chunk's rows are written (ring_rows >= window + rows - 1)."""
    return pool.ring_rows - window + 1


def page_bucket(pages: int) -> int:
    """Pages per table row: the next power of two (at least 1)."""
    return 1 << max(0, pages - 1).bit_length()


@dataclass
class SourceTables:
    ratio: int
    per_page: int
    ncols: int
    n_vis: torch.Tensor
    entry_dest: torch.Tensor
    entry_pos: torch.Tensor
    open_dest: torch.Tensor | None = None
    back_row: torch.Tensor | None = None  # [r - 1, B]
    back_open: torch.Tensor | None = None  # [r - 1, B]


@dataclass
class StepTables:
    B: int
    n: int
    packed: torch.Tensor  # every table, int64, one tensor
    layout: dict  # name -> (offset, shape)
    ratios: dict  # ratio -> per_page
    pages_bucket: int
    byte_widths: dict = field(default_factory=dict)  # name -> bytes a row of a byte input (`bytes_of`)
    # per-step results shared across layers (index top-k of each scoring layer, the candidate pool)
    topk: dict = field(default_factory=dict)
    candidates: torch.Tensor | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        at, shape = self.layout[name]
        size = 1
        for s in shape:
            size *= s
        return self.packed[at:at + size].view(shape)

    def bytes_of(self, name: str) -> torch.Tensor:
        """A byte input of `build` (uint8 `[..., width]`), a view of its int64 words."""
        return self[name].view(torch.uint8)[..., :self.byte_widths[name]]

    @property
    def slot(self) -> torch.Tensor:
        return self["slot"]

    @property
    def ring_dest(self) -> torch.Tensor:
        return self["ring_dest"]

    @property
    def pages(self) -> torch.Tensor:
        return self["pages"]

    def source(self, ratio: int) -> SourceTables:
        per = self.ratios[ratio]
        g = lambda k: self[f"r{ratio}.{k}"]  # noqa: E731
        back = ratio > 1
        return SourceTables(ratio, per, self.pages_bucket * per, g("n_vis"), g("entry_dest"), g("entry_pos"),
                            g("open_dest") if back else None, g("back_row") if back else None,
                            g("back_open") if back else None)

    def on(self, packed: torch.Tensor) -> "StepTables":
        """The same tables over another buffer of the same layout (a graph's static copy of `packed`)."""
        if packed.shape != self.packed.shape:
            raise ValueError(f"tables of {list(self.packed.shape)} cannot move to {list(packed.shape)}")
        return StepTables(self.B, self.n, packed, self.layout, self.ratios, self.pages_bucket, self.byte_widths)

    def without_writes(self) -> "StepTables":
        """A copy whose rows write nothing (every destination -1): what a graph's warm-up runs on."""
        packed = self.packed.clone()
        out = StepTables(self.B, self.n, packed, self.layout, self.ratios, self.pages_bucket, self.byte_widths)
        for name in self.layout:
            if name == "ring_dest" or name.endswith(".entry_dest") or name.endswith(".open_dest"):
                out[name].fill_(-1)
        return out

    @classmethod
    def build(cls, segs, B: int, pool, device, inputs: dict | None = None) -> "StepTables":
        """Tables of a bucket of B rows from the step's segments (`Segment`s whose state has `.row` with the
        sequence's `slot` and `page_ids`, as `PoolSequence`), for `pool` (a `KVPool`). Built in numpy (a few µs an
        op where torch's CPU ops cost ~10: this runs on the host before every step's graph), one host array, one
        copy to the device. `inputs`: more integer vectors of the step (the bucket's token ids and positions) to
        travel in the same copy, read back by name (`tables["ids"]`); a uint8 input (the step's Engram rows as
        stored) travels as whole int64 words, its last dimension padded, read back by `bytes_of(name)`."""
        return cls.plan(segs, B, pool).pack(device, inputs)

    @classmethod
    def plan(cls, segs, B: int, pool) -> "PlannedTables":
        """`build`'s host part: every table from the segments, nothing that depends on the token ids (the
        overlapped loop plans them before the ids are known, then `pack`s them with the ids and Engram rows)."""
        n = sum(s.T for s in segs)
        if not 0 < n <= B:
            raise ValueError(f"a bucket of {B} rows cannot hold {n}")
        ring = pool.ring_rows
        slot, pos, j, end, tables = [], [], [], [], []
        for s in segs:
            row = s.state.row
            slot += [row.slot] * s.T
            pos += range(s.pos, s.pos + s.T)
            j += range(s.T)
            end += [s.pos + s.T] * s.T
            tables += [row.page_ids] * s.T
        P = page_bucket(max(len(t) for t in tables))
        pad = B - n
        real = np.arange(B) < n
        slot_t = np.array(slot + [slot[0]] * pad, dtype=np.int64)
        pos_t = np.array(pos + [pos[0]] * pad, dtype=np.int64)
        j_t = np.array(j + [j[0]] * pad, dtype=np.int64)
        end_t = np.array(end + [end[0]] * pad, dtype=np.int64)
        pages = np.zeros((B, P), dtype=np.int64)
        for b, t in enumerate(tables + [tables[0]] * pad):
            pages[b, :len(t)] = t
        parts = {"slot": slot_t, "ring_dest": np.where(real, slot_t * ring + pos_t % ring, -1), "pages": pages}
        ratios = {}
        rows = np.arange(B, dtype=np.int64)[None, :]
        for src in pool.sources.values():
            r, per = src.ratio, src.per_page
            if r in ratios:
                continue
            ratios[r] = per
            closes = ((pos_t + 1) % r == 0) & real
            e = np.maximum((pos_t + 1) // r - 1, 0)
            flat = pages[np.arange(B), np.minimum(e // per, P - 1)] * per + e % per
            parts[f"r{r}.n_vis"] = (pos_t + 1) // r
            parts[f"r{r}.entry_dest"] = np.where(closes, flat, -1)
            parts[f"r{r}.entry_pos"] = e * r
            if r > 1:
                # the open-group store is a ring over positions (KVPool.open_modulus): without verify rows a row's
                # place in its group, and the rows still open at the step's end are stored (what the load-and-store
                # path stores). With verify rows every row of the step is stored (as the load-and-store path's
                # decode and verify rows do: `PoolSequence.step_open`), so a rollback into a group the window closed
                # finds its earlier members; the ring's M >= r - 1 + verify rows positions keep one chunk's rows and
                # its group's apart
                M, R = (pool.open_modulus(r), pool.open_rows(r)) if hasattr(pool, "open_modulus") else (r, r - 1)
                every = bool(getattr(pool, "verify_rows", 0))
                kept = pos_t >= end_t // r * r
                open_row = slot_t * R + np.minimum(pos_t % M, R - 1)
                parts[f"r{r}.open_dest"] = np.where(real & (every | (kept & (pos_t % r < r - 1))), open_row, -1)
                d = np.arange(1, r, dtype=np.int64)[:, None]
                parts[f"r{r}.back_row"] = np.where(j_t[None, :] >= d, rows - d, -1)
                parts[f"r{r}.back_open"] = slot_t[None, :] * R + np.minimum((pos_t[None, :] - d) % M, R - 1)
        return PlannedTables(B, n, parts, ratios, P)


def byte_words(t: np.ndarray) -> np.ndarray:
    """A uint8 input `[..., width]` as the int64 words it travels in (its last dimension padded with zeros to a
    whole word): what `pack` puts in the tables, and what the Engram gate publishes (runtime/engram_gate.py)."""
    words = np.zeros((*t.shape[:-1], -(-t.shape[-1] // 8) * 8), dtype=np.uint8)
    words[..., :t.shape[-1]] = t
    return words.view(np.int64)


@dataclass
class PlannedTables:
    """A bucket's tables on the host (`StepTables.plan`), waiting for the step's inputs."""

    B: int
    n: int
    parts: dict
    ratios: dict
    pages_bucket: int

    def pack(self, device, inputs: dict | None = None) -> StepTables:
        """The tables and `inputs` (`StepTables.build`'s) in one packed tensor on `device`: one copy."""
        parts, widths = dict(self.parts), {}
        for name, t in (inputs or {}).items():
            t = np.asarray(t)
            if t.dtype == np.uint8:
                widths[name] = t.shape[-1]
                t = byte_words(t)
            parts[name] = np.asarray(t, dtype=np.int64)
        layout, at = {}, 0
        for name, t in parts.items():
            layout[name] = (at, tuple(t.shape))
            at += t.size
        packed = torch.from_numpy(np.concatenate([t.reshape(-1) for t in parts.values()]).astype(np.int64))
        if device.type == "cuda":  # a fresh pinned buffer: 21 µs a send on the H200's host, a reused ring 24
            packed = packed.pin_memory().to(device, non_blocking=True)
        else:
            packed = packed.to(device)
        return StepTables(self.B, self.n, packed, layout, self.ratios, self.pages_bucket, widths)

