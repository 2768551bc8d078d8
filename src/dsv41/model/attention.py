"""Attention of one layer: sliding window + CSA2 compressed branch (MODEL.md §7).

Every layer computes its own query and its own window KV. Layers with a compress ratio also attend to entries of
the shared compressed KV of their KV source, picked by the lightning indexer:
- a KV source (`compresses`) runs the compressor and appends entries + index keys to the sequence state,
- an index source (`scores`) scores all visible entries with its own indexer query and publishes its top-k,
- the candidate source additionally publishes a block mask that later re-indexing layers must stay inside,
- every other layer reuses the latest index source's top-k list verbatim.
The per-forward `Shared` object carries top-k lists and the candidate mask from earlier to later layers.

Tensor parallelism: query heads (wq_b, sinks, the core) and `wo_a` groups are split across ranks; `wo_b` is
row-parallel and its partial output is summed by the caller's comm. Window KV, compressor and indexer are
replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..config import LayerRole, ModelConfig
from .norm import rms_norm
from .quant import fp4_block_e4m3, fp4_block_ue8m0, fp8_block_ue8m0
from .rope import RopeTable
from .state import SequenceState, SourceCache, WindowCache
from .rowwise import f64, row_blocks
from .topk import topk_lowest_index_ties

LinearFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Shared:
    """Decisions of earlier layers inside one forward (not persisted between forwards)."""

    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index source layer -> [T, k] entry ids / -1
    candidates: torch.Tensor | None = None  # [T, C] bool, from the candidate source


@dataclass
class CompressorParams:
    wkv: LinearFn
    norm: torch.Tensor
    wgate: LinearFn | None = None  # ratio-2 sources only
    index_wk: LinearFn | None = None
    index_k_norm: torch.Tensor | None = None


@dataclass
class IndexerParams:
    wq_b: LinearFn
    weights_proj: LinearFn


@dataclass
class AttentionParams:
    wq_a: LinearFn
    q_norm: torch.Tensor
    wq_b: LinearFn  # column-parallel: this rank's heads
    wkv: LinearFn
    kv_norm: torch.Tensor
    sink: torch.Tensor  # [local heads]
    wo_a: Sequence[LinearFn]  # one per local output group
    wo_b: LinearFn  # row-parallel over the local groups' outputs
    compressor: CompressorParams | None = None
    indexer: IndexerParams | None = None


def append_window(cache: WindowCache, kv: torch.Tensor, window: int) -> torch.Tensor:
    """Returns [previous window rows ; new rows] and keeps the last `window` of them as the new cache."""
    full = kv if cache.kv is None else torch.cat((cache.kv, kv), dim=0)
    cache.kv = full[-window:].clone()
    return full


def window_slots(win: torch.Tensor, positions: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's window keys [T, window, hd]: slot j holds position p - window + 1 + j (live when it is in
    `win`). `win` holds the consecutive positions ending at the chunk's last one; a sequence's own window starts
    at position 0 or covers the whole span, a truncated one (CED bounded replay) at the replay segment's start."""
    first = int(positions[-1]) + 1 - win.shape[0]
    key_pos = positions[:, None] + torch.arange(1 - window, 1, device=win.device)[None, :]
    ok = key_pos >= first
    return win[(key_pos - first).clamp(min=0)], ok


def compressed_slots(src: SourceCache, ids: torch.Tensor | None, width: int, T: int, head_dim: int,
                     device: torch.device):
    """Selected compressed entries [T, width, hd]: the top-k list (-1 first) left-padded with dead slots to
    the full index top-k, so that a row's layout does not depend on how many entries exist yet. Before the
    first group closes (`ids` None, no entries) every slot is dead; the dead rows live on the compute device
    like the window keys they are concatenated with."""
    if ids is None:
        ids = torch.empty(T, 0, dtype=torch.long, device=device)
    pad = width - ids.shape[1]
    ids = torch.cat((torch.full((T, pad), -1, dtype=ids.dtype, device=ids.device), ids), dim=1)
    if src.kv is None:
        return torch.zeros(T, width, head_dim, device=device), torch.zeros(T, width, dtype=torch.bool, device=device)
    return src.kv[ids.clamp(min=0)], ids >= 0


class Attention:
    def __init__(self, cfg: ModelConfig, role: LayerRole, p: AttentionParams, rope: RopeTable, *,
                 local_heads: int, fake_quant: bool = True):
        self.cfg = cfg
        self.role = role
        self.p = p
        self.rope = rope
        self.heads = local_heads
        self.fake_quant = fake_quant

    # ------------------------------------------------------------------ pieces
    def _rope(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return self.rope.apply(x, positions, self.cfg.qk_rope_head_dim, inverse=inverse)

    def _compress(self, x: torch.Tensor, positions: torch.Tensor, src: SourceCache) -> None:
        """Append the entries completed by this chunk (and their index keys) to the KV source's cache."""
        cfg, c, r = self.cfg, self.p.compressor, self.role.compress_ratio
        if r == 1:
            latent = rms_norm(c.wkv(x), c.norm, cfg.rms_norm_eps)
            first = int(positions[0])
        else:
            # ratio > 1 pools in fp32 with a per-channel softmax over the group's tokens
            v = c.wkv(x.float()).float()
            s = c.wgate(x.float()).float()
            if src.open_v is not None:
                v, s = torch.cat((src.open_v, v)), torch.cat((src.open_s, s))
            first_tok = int(positions[0]) - (0 if src.open_v is None else src.open_v.shape[0])
            n_groups = v.shape[0] // r
            done = n_groups * r
            src.open_v, src.open_s = (v[done:].clone(), s[done:].clone()) if done < v.shape[0] else (None, None)
            if n_groups == 0:
                return
            vg = v[:done].view(n_groups, r, -1)
            sg = s[:done].view(n_groups, r, -1)
            pooled = (torch.softmax(sg, dim=1) * vg).sum(dim=1)
            latent = rms_norm(pooled.to(x.dtype), c.norm, cfg.rms_norm_eps)
            first = first_tok
        g0 = first // r
        entry_pos = (torch.arange(latent.shape[0], device=x.device) + g0) * r  # rotated at the group's first token
        rotated = self._rope(latent, entry_pos)
        src.append_entries(rotated, fp4_block_e4m3(rotated, 16, self.fake_quant))
        if c.index_wk is not None:
            k = rms_norm(c.index_wk(latent), c.index_k_norm, cfg.rms_norm_eps)  # from the pre-RoPE latent
            k = fp4_block_ue8m0(self._rope(k, entry_pos), 32, self.fake_quant)
            src.index_k = k if src.index_k is None else torch.cat((src.index_k, k))

    def _index_scores(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, src: SourceCache,
                      visible: torch.Tensor) -> torch.Tensor:
        cfg, ix = self.cfg, self.p.indexer
        T = x.shape[0]
        q = ix.wq_b(qr).view(T, cfg.index_n_heads, cfg.index_head_dim)
        q = fp4_block_ue8m0(self._rope(q, positions), 32, self.fake_quant)
        w = ix.weights_proj(x).float() * (cfg.index_head_dim ** -0.5) * (cfg.index_n_heads ** -0.5)
        keys = src.index_k.float()
        scores = torch.empty(T, keys.shape[0], device=x.device)
        for rows in row_blocks(T):  # products summed over fixed-length vectors: each row's bits stand alone
            per_head = torch.relu((q[rows].float()[:, :, None, :] * keys[None, None]).sum(dim=-1))
            scores[rows] = (w[rows][:, :, None] * per_head).sum(dim=1)
        return scores.masked_fill(~visible, float("-inf"))

    def _candidate_mask(self, scores: torch.Tensor, n_visible: torch.Tensor) -> torch.Tensor:
        """Blocks of `candidate_block_size` entries scored by their max; the newest visible block always kept."""
        cfg = self.cfg
        T, C = scores.shape
        B = cfg.candidate_block_size
        n_blocks = -(-C // B)
        padded = torch.full((T, n_blocks * B), float("-inf"), device=scores.device)
        padded[:, :C] = scores
        block = padded.view(T, n_blocks, B).amax(dim=-1)
        newest = ((n_visible - 1) // B).clamp(min=0)
        has_any = n_visible > 0
        block[has_any, newest[has_any]] = float("inf")
        k = min(cfg.candidate_topk_blocks, n_blocks)
        chosen = topk_lowest_index_ties(block, k)
        keep_block = torch.zeros(T, n_blocks, dtype=torch.bool, device=scores.device)
        keep_block.scatter_(1, chosen, block.gather(1, chosen) > float("-inf"))
        return keep_block.repeat_interleave(B, dim=1)[:, :C]

    @staticmethod
    def _select(scores: torch.Tensor, k: int) -> torch.Tensor:
        """Top-k entry ids sorted by position; picks of invisible (-inf) entries become -1 (they sort first)."""
        ids = topk_lowest_index_ties(scores, k)
        ids = torch.where(scores.gather(1, ids) == float("-inf"), torch.full_like(ids, -1), ids)
        return torch.sort(ids, dim=-1).values

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, positions: torch.Tensor, state: SequenceState, shared: Shared,
                trace: dict | None = None) -> torch.Tensor:
        """x: normed attention input [T, d]. Returns this rank's partial output [T, d] (wo_b row-parallel)."""
        cfg, role = self.cfg, self.role
        qr, q = self._query(x, positions)
        kv = self.window_kv(x, positions)
        win = append_window(state.window(role.index), kv, cfg.sliding_window)
        keys, ok = window_slots(win, positions, cfg.sliding_window)
        if not role.swa_only:
            src = state.source(role.kv_source)
            if role.compresses:
                self._compress(x, positions, src)
            ids = self._topk_for(x, qr, positions, src, shared, trace)
            comp, comp_ok = compressed_slots(src, ids, cfg.index_topk, x.shape[0], cfg.head_dim, x.device)
            keys, ok = torch.cat((keys, comp.to(keys.dtype)), dim=1), torch.cat((ok, comp_ok), dim=1)
        return self._output(self._core(q, keys, ok), positions, x.dtype)

    def forward_block(self, x: torch.Tensor, positions: torch.Tensor, ring: torch.Tensor | None) -> torch.Tensor:
        """DSpark draft block: every row attends to all `ring` rows and to all rows of the block (no causal
        mask inside the block); nothing is written to any cache. Returns this rank's partial output."""
        _, q = self._query(x, positions)
        kv = self.window_kv(x, positions)
        keys = kv if ring is None else torch.cat((ring, kv))
        keys = keys[None].expand(x.shape[0], -1, -1)
        visible = torch.ones(keys.shape[:2], dtype=torch.bool, device=x.device)
        return self._output(self._core(q, keys, visible), positions, x.dtype)

    def window_kv(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The single K = V latent of rows x: RMSNorm(x wkv), RoPE at their positions, FP8 fake-quant."""
        kv = rms_norm(self.p.wkv(x), self.p.kv_norm, self.cfg.rms_norm_eps)
        return fp8_block_ue8m0(self._rope(kv, positions), 32, self.fake_quant)

    def _query(self, x: torch.Tensor, positions: torch.Tensor):
        qr = rms_norm(self.p.wq_a(x), self.p.q_norm, self.cfg.rms_norm_eps)
        q = self._rope(self.p.wq_b(qr).view(x.shape[0], self.heads, self.cfg.head_dim), positions)
        return qr, q

    def _output(self, o: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Inverse RoPE on the head outputs, then the grouped low-rank projection (wo_a per group, wo_b)."""
        o = self._rope(o.to(dtype), positions, inverse=True)
        groups = o.reshape(o.shape[0], len(self.p.wo_a), -1)
        u = torch.cat([wo(groups[:, g]) for g, wo in enumerate(self.p.wo_a)], dim=-1)
        return self.p.wo_b(u)

    def _topk_for(self, x, qr, positions, src: SourceCache, shared: Shared, trace: dict | None):
        cfg, role = self.cfg, self.role
        C = src.entries
        if not role.scores:
            return shared.topk.get(role.index_source)
        if C == 0:
            ids = torch.empty(x.shape[0], 0, dtype=torch.long, device=x.device)
        else:
            n_visible = torch.div(positions + 1, role.compress_ratio, rounding_mode="floor")
            visible = torch.arange(C, device=x.device)[None, :] < n_visible[:, None]
            scores = self._index_scores(x, qr, positions, src, visible)
            if role.is_candidate_source:
                shared.candidates = self._candidate_mask(scores, n_visible)
                if trace is not None:
                    trace["candidate_mask"] = shared.candidates
            elif role.uses_candidates:
                scores = scores.masked_fill(~shared.candidates, float("-inf"))
            ids = self._select(scores, min(cfg.index_topk, C))
        shared.topk[role.index] = ids
        if trace is not None:
            trace["index_topk_ids"] = ids
        return ids

    def _core(self, q: torch.Tensor, keys: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        """One softmax per query over its own key slots [T, S, hd] (K = V; `ok` marks the live ones), with the
        per-head sink in the denominator. Every row's slots have the same layout however the rows are chunked."""
        scale = self.cfg.head_dim ** -0.5
        sink = self.p.sink.float()
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for rows in row_blocks(q.shape[0]):
            k = keys[rows].float()
            s = (q[rows].float()[:, :, None, :] * k[:, None, :, :]).sum(dim=-1) * scale  # [t, H, S]
            s = s.masked_fill(~ok[rows][:, None, :], float("-inf"))
            lse = f64(lambda z: torch.logsumexp(z, dim=-1, keepdim=True),
                      torch.cat((s, sink[None, :, None].expand(s.shape[0], -1, 1)), dim=-1))
            out[rows] = (f64(torch.exp, s - lse)[..., None] * k[:, None, :, :]).sum(dim=2)
        return out
