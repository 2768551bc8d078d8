"""The reference forward (model/) over many sequences' rows at once, with their caches in the KV pool (CPU path).

`PoolForward.execute(rows, pool)` is `Model.forward` re-expressed for a batch: the embedding, Engram, mHC, norms,
MoE and head run over every row of every sequence together (they are row-wise: model/rowwise.py), attention runs
per sequence with the sequence's state loaded from the pool. Each sequence's state is a `PoolSequence`: a
`SequenceState` whose window, compressed entries, index keys and open compressor group are read from its ring slot
and pages on first use and whose new rows are stored back at the end of the step. Since the pool stores the very
codes and scales the fake quantisers round to, every row comes out bit for bit as `Model.forward` gives it alone.

This is the seam the fast path meets (docs/ENGINE.md §5): a forward is any object with
`execute(rows: list[Row], pool) -> list[Tensor]` returning, per row, the fp32 logits of `row.logit_offsets()`.

Approximate knobs (off by default; the engine tags results): CED bounded replay (rows before a row's
`replay_start` stop after the encoder half, feeding only the first decoder layer's compressor; MODEL.md §11) and
routed-expert pruning (`expert_topp`, RECIPE.md §2.10).
"""

from __future__ import annotations

import dataclasses

import torch

from ..engine.batch import PREFILL, VERIFY, Row
from ..model import mhc
from ..model.attention import Shared
from ..model.moe import route, swiglu_clamped
from ..model.norm import rms_norm
from ..model.state import SequenceState, SourceCache, WindowCache
from .kv_pool import KVPool


def decoder_start(cfg) -> int:
    """The first CED decoder layer: the ratio-1 KV source that reads the encoder's output (20 of 40)."""
    for role in cfg.roles[:cfg.num_hidden_layers]:
        if role.compresses and role.compress_ratio == 1:
            return role.index
    return cfg.num_hidden_layers // 2


class PoolSequence(SequenceState):
    """One row's sequence as the reference attention sees it: loaded from the pool on first use, stored back."""

    def __init__(self, pool: KVPool, row: Row, cfg, decoder_from: int):
        super().__init__(pos=row.start_pos)
        self.pool, self.row, self.cfg, self.decoder_from = pool, row, cfg, decoder_from
        self.start, self.end = row.start_pos, row.start_pos + len(row.token_ids)
        self._entries: dict[int, int] = {}
        self.step_open: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # verify rows: every row's (value, gate)

    def floor(self, layer: int | None) -> int:
        """Lowest live window position: the replay segment's start for the decoder layers (and DSpark)."""
        return self.row.replay_start if layer is None or layer >= self.decoder_from else 0

    def _load_window(self, kind: str, layer: int, floor: int) -> WindowCache:
        first = max(self.start, floor)
        lo = max(floor, first - self.cfg.sliding_window)
        return WindowCache(self.pool.read_ring(kind, layer, self.row.slot, lo, first))

    def window(self, layer: int) -> WindowCache:
        if layer not in self.windows:
            self.windows[layer] = self._load_window("window", layer, self.floor(layer))
        return self.windows[layer]

    def dspark_window(self, stage: int) -> WindowCache:
        if stage not in self.dspark_windows:
            self.dspark_windows[stage] = self._load_window("dspark", stage, self.floor(None))
        return self.dspark_windows[stage]

    def source(self, layer: int) -> SourceCache:
        if layer not in self.sources:
            r = self.pool.sources[layer].ratio
            n = self.start // r
            kv, index_k = self.pool.read_entries(layer, self.row.page_ids, n)
            open_v, open_s = self.pool.read_open(layer, self.row.slot, self.start) if r > 1 else (None, None)
            self.sources[layer] = SourceCache(kv, index_k, open_v, open_s, keep_unquantised=True)
            self._entries[layer] = n
        return self.sources[layer]

    def store(self) -> None:
        """Write this step's new rows back: window rows, new entries and index keys, the open group."""
        pool, slot = self.pool, self.row.slot
        for kind, caches, floor_of in (("window", self.windows, self.floor),
                                       ("dspark", self.dspark_windows, lambda s: self.floor(None))):
            for key, cache in caches.items():
                if cache.kv is None:
                    continue
                first = max(self.start, floor_of(key), self.end - cache.kv.shape[0])
                pool.write_ring(kind, key, slot, first, cache.kv[cache.kv.shape[0] - (self.end - first):])
        for layer, src in self.sources.items():
            old, r = self._entries[layer], pool.sources[layer].ratio
            if src.entries != self.end // r:
                raise RuntimeError(f"layer {layer}: {src.entries} compressed entries after position {self.end}")
            if src.kv is not None:
                # the new entries as they were before their FP4 (the codec's encode is the fake quantiser's
                # own rounding: it gives the bits attention read; `src.kv[old:]` re-encoded would not always)
                new = src.appended_unquantised
                appended = 0 if new is None else new.shape[0]
                if appended != src.entries - old:
                    raise RuntimeError(f"layer {layer}: {src.entries - old} new entries, {appended} appended "
                                       "through SourceCache.append_entries")
                if new is not None:
                    pool.write_entries(layer, self.row.page_ids, old, new,
                                       None if src.index_k is None else src.index_k[old:])
            pool.write_open(layer, slot, src.open_v, src.open_s, end=self.end)
            if layer in self.step_open:  # a verify window: every row, so that any rollback finds its group's rows
                pool.write_open(layer, slot, *self.step_open[layer], end=self.end)


def load_sequences(pool: KVPool, rows: list[Row], cfg, decoder_from: int, hasher=None) -> list[PoolSequence]:
    """Each row's sequence as a `PoolSequence` over `pool` (the state both forwards run on). With `hasher`, the
    Engram history is primed from `row.lookback`, so hashing the row's ids from it gives the row ids of
    `lookback + token_ids` hashed from the sequence start, as `PoolForward` computes them."""
    views = [PoolSequence(pool, row, cfg, decoder_from) for row in rows]
    if hasher is not None:
        for v in views:
            v.engram = hasher.new_history()
        primed = [(row.lookback, v.engram) for v, row in zip(views, rows) if row.lookback]
        if primed:  # one pass for every row (a decode step's rows each carry their look-back)
            hasher.hash_many(primed)
    return views


def store_sequences(views: list[PoolSequence]) -> None:
    """Write every sequence's new rows of the step back to the pool."""
    for v in views:
        v.store()


class PrunedMoE:
    """MoE.partial with routed-expert pruning on the rows marked in `prunable` (RECIPE.md §2.10): after the
    router's top-k, keep the shortest prefix by weight (ties to the lower slot) reaching `topp` of the mass and
    never fewer than `min_k`; dropped experts are not computed. Kept weights keep the router's normalisation."""

    def __init__(self, moe, topp: float, min_k: int):
        self.moe, self.topp, self.min_k = moe, topp, min_k
        self.prunable: torch.Tensor | None = None

    def partial(self, x: torch.Tensor, trace: dict | None = None) -> torch.Tensor:
        m = self.moe
        ids, weights, _ = route(x, m.gate_weight, m.gate_bias, m.topk, scale=m.route_scale, renorm=m.renorm,
                                temp=m.gate_temp)
        order = torch.sort(weights, dim=-1, descending=True, stable=True).indices
        w_sorted = weights.gather(1, order)
        before = (torch.cumsum(w_sorted, dim=-1) - w_sorted) / w_sorted.sum(dim=-1, keepdim=True)
        keep_sorted = (before < self.topp) | (torch.arange(m.topk, device=x.device) < self.min_k)[None, :]
        keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
        if self.prunable is not None:
            keep |= ~self.prunable[:, None]
        y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in torch.unique(ids[keep]).tolist():
            rows, slot = ((ids == e) & keep).nonzero(as_tuple=True)
            y.index_add_(0, rows, swiglu_clamped(x[rows], m.experts[e], m.limit, weights[rows, slot]))
        for s in m.shared:
            y += swiglu_clamped(x, s, m.limit, None)
        return y


class PoolForward:
    abort_watch = None  # runtime/abort.py: set by the ModelRunner; checked between layers of unfused forwards

    def __init__(self, model, *, replay: bool = False, expert_topp: float | None = None, expert_min_k: int = 1,
                 prune_prefill: bool = False):
        self.model, self.cfg = model, model.cfg
        self.replay, self.prune_prefill = replay, prune_prefill
        # the reference's row-wise math on the CPU gives a row the same bits in a decode step and in a prefill chunk
        # (tests/test_engine_sessions.py); torch's CUDA kernels choose their reductions by the shape
        self.decode_rows_are_prefill_rows = torch.device(getattr(model, "device", "cpu")).type == "cpu"
        self.decoder_from = decoder_start(model.cfg)
        self.pruned = None
        self.blocks = list(model.blocks)
        if expert_topp is not None:
            self.pruned = [PrunedMoE(b.moe, expert_topp, expert_min_k) for b in model.blocks]
            self.blocks = [dataclasses.replace(b, moe=p) for b, p in zip(model.blocks, self.pruned)]

    @torch.inference_mode()
    def execute(self, rows: list[Row], pool: KVPool) -> list[torch.Tensor]:
        m, cfg = self.model, self.cfg
        dev = m.device
        views = load_sequences(pool, rows, cfg, self.decoder_from)
        ids = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.long, device=dev)
        positions = torch.cat([torch.arange(v.start, v.end, device=dev) for v in views])
        row_ids = live = None
        if m.engram_hasher is not None:
            hashed = [m.engram_hasher.hash(r.lookback + r.token_ids)[len(r.lookback):] for r in rows]
            row_ids, live = torch.cat(hashed), m.engram_hasher.live(ids.cpu())
            for L, layer in m.engram.items():  # the ids depend only on the tokens: start the reads now
                if not self.replay or L < self.decoder_from:
                    layer.prefetch(row_ids[:, cfg.engram_layer_ids.index(L)])
        prunable = torch.tensor([self.prune_prefill or r.phase != PREFILL for r in rows for _ in r.token_ids],
                                dtype=torch.bool, device=dev)
        h = m.embed(ids)
        x = h[:, None, :].expand(ids.shape[0], cfg.hc_mult, h.shape[-1]).contiguous()
        pre = torch.zeros(ids.shape[0], cfg.hc_mult, device=dev)
        pre[:, 0] = 1.0
        owner = torch.cat([torch.full((v.end - v.start,), i, device=dev) for i, v in enumerate(views)])
        shared = [Shared() for _ in rows]
        taps = []
        watch = self.abort_watch
        if watch is not None:
            watch.start()
        for i, block in enumerate(self.blocks):
            if watch is not None:  # a long step nobody wants any more stops here (runtime/abort.py)
                watch.check(i)
            L = block.index
            if self.replay and L == self.decoder_from:
                keep = positions >= torch.tensor([r.replay_start for r in rows], device=dev)[owner]
                if not bool(keep.all()):
                    self._encoder_only_rows(block, x[~keep], pre[~keep], positions[~keep], owner[~keep], views)
                    x, pre, positions, owner, prunable = x[keep], pre[keep], positions[keep], owner[keep], prunable[keep]
                    if row_ids is not None:
                        row_ids, live = row_ids[keep.cpu()], live[keep.cpu()]
                if x.shape[0] == 0:  # every row of the step stopped after the encoder half (same on every rank)
                    break
            if L in m.engram:
                x = m.engram[L](x, row_ids[:, cfg.engram_layer_ids.index(L)], live)
            if L in cfg.dspark_target_layer_ids:
                taps.append(x.float().mean(dim=1))
            if self.pruned is not None:
                self.pruned[L].prunable = prunable
            x, pre, _ = block.run(m, x, pre, lambda hh, blk=block: self._attend(blk, hh, positions, owner, views, shared))
        out = rms_norm(mhc.collapse(x, pre), m.final_norm, cfg.rms_norm_eps)
        spans = self._spans(owner, len(views))
        if m.dspark is not None and taps:
            tap = torch.cat(taps, dim=-1)
            for v, (a, b) in zip(views, spans):
                if b > a:
                    v.pos = v.end
                    m.dspark.absorb(m, v, tap[a:b])
        store_sequences(views)
        wanted, counts = [], []
        for r, (a, b) in zip(rows, spans):
            offsets = r.logit_offsets()
            first = r.start_pos + len(r.token_ids) - (b - a)  # rows before it stopped after the encoder half
            if any(o < first - r.start_pos for o in offsets):
                raise ValueError(f"sequence {r.seq_id}: logits asked for rows that replay leaves out")
            wanted += [a + o - (first - r.start_pos) for o in offsets]
            counts.append(len(offsets))
        logits = m.logits(out[torch.tensor(wanted, dtype=torch.long, device=dev)]) if wanted else None
        return list(logits.split(counts)) if logits is not None else [None] * len(rows)

    @staticmethod
    def _spans(owner: torch.Tensor, n: int) -> list[tuple[int, int]]:
        counts = torch.bincount(owner.cpu(), minlength=n).tolist()
        spans, a = [], 0
        for c in counts:
            spans.append((a, a + c))
            a += c
        return spans

    def _attend(self, block, h, positions, owner, views, shared) -> torch.Tensor:
        """Attention of every sequence over its own cache: the reference `Attention.forward`, one sequence at a
        time, on the rows of that sequence."""
        spans = self._spans(owner, len(views))
        role = block.attn.role
        if role.compresses and role.compress_ratio > 1:
            c = block.attn.p.compressor
            for v, (a, b) in zip(views, spans):
                if b > a and v.row.phase == VERIFY and v.pool.verify_rows:
                    # the (value, gate) rows `_compress` computes (the same row-wise functions of the same rows),
                    # kept for every row of the window: the open-group ring then survives any rollback
                    x = h[a:b].float()
                    v.step_open[role.index] = (c.wkv(x).float(), c.wgate(x).float())
        parts = [block.attn.forward(h[a:b], positions[a:b], views[i], shared[i])
                 for i, (a, b) in enumerate(spans) if b > a]
        return torch.cat(parts)

    def _encoder_only_rows(self, block, x, pre, positions, owner, views) -> None:
        """Replay: prompt rows before the replay segment feed the decoder's global KV and go no further — the
        first decoder layer's compressor (and index keys) over its normed attention input (MODEL.md §11)."""
        h = rms_norm(mhc.collapse(x, pre), block.attn_norm, self.cfg.rms_norm_eps)
        for i, (a, b) in enumerate(self._spans(owner, len(views))):
            if b > a:
                block.attn._compress(h[a:b], positions[a:b], views[i].source(block.index))
