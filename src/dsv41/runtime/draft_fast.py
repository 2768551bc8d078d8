"""The DSpark drafter on the fast path (MODEL.md §10; the reference: model/dspark.py, runtime/draft_dspark.py).

`FastDSpark` holds the three draft blocks as `FastBlock`s (EXL3 linears, the routed experts as `FusedMoE` stacks,
the mHC sites), the tap projection `main_proj` (a fast linear) with its norm, and the heads' small tensors in a
reference `DSpark` record (markov_embed, markov_head, confidence_proj, the final norm). Two jobs:

- **Absorb** (`stage_rows`): from the taps of the rows a target forward ran (the mean over mHC streams of the
  residual entering each `dspark_target_layer_ids` layer, collected by `FastModel`), `main_x` = RMSNorm(taps ·
  main_projᵀ) and each stage's window-ring row of it (its `wkv`, `kv_norm`, plain RoPE at the row's position,
  FP8 fake-quant): the reference's `DSpark.absorb`. Over the pool in place (`stores=`) the row-op launch that
  makes a row stores it into the stage's ring at the row's `ring_dest` (the ring layout `PoolSequence.dspark_window`
  reads), inside the step's graph; on the load-and-store path the caller appends them to the sequences' views.
- **Draft**: the block [y, noise × 4] per sequence at positions p+1 .. p+5 through the stages with the target's own
  pieces (`FastModel._attn_in` / `_ffn`, decode/verify kernels), the attention of each block row over its stage
  ring plus all five block rows (no causal mask, the sink) as one `attention_core` launch, the collapsed hidden's
  norm and the shared head, then the chain on the device (runtime/draft_chain.py: the Markov head, each row's keyed
  choice as tensors, the confidence head) and ONE host read. The drafter's pass (`propose_pool`) reads the rings
  from the pool in place through one packed table (runtime/draft_tables.py), so it is a pure function of that
  table: one CUDA graph per (sequences, chain variant) ("dspark.draft.<variant>"; at TP > 1 the pass and the chain
  apart, the vocabulary gather between them), eager on the CPU. `draft_many` (the reference's signature, rings
  given as tensors) runs the same blocks through graph pieces keyed "dspark.*" and the draft blocks' layer indices,
  the rings gathered between them.

`FastDSparkDrafter` is the runner's drafter over it: `DSparkDrafter.propose`'s asks and answers, the pass over the
pool (the same drafts as the views' rings give, bit for bit), and the pass's graphs captured before serving.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import torch

from dsv41.config import ModelConfig
from dsv41.engine.batch import Row
from dsv41.model import mhc
from dsv41.model.dspark import DSpark, Draft
from dsv41.model.norm import rms_norm
from dsv41.model.quant import fp8_block_ue8m0

from .draft_chain import Chained, chain, sampling_rows
from .draft_dspark import DSparkDrafter
from .draft_tables import DraftTables
from .layers.attention import step_kernels_run
from .layers.attention_index import _pad_slots
from .mhc_sites import MhcSites
from .model import row_bucket
from .sampling import SamplingParams

PHASE = "verify"  # the draft pass's rows take the decode/verify kernels (row-invariant)
MOST_ROWS = 32  # rows of one draft pass (`row_bucket`'s largest): 6 sequences' blocks of 5


def stage_window_kv(attn, x: torch.Tensor, n: int, P: torch.Tensor, phase: str, store=None) -> torch.Tensor:
    """`Attention.window_kv` on the fast path for the bucket x [B, d] (n real rows) at positions P: wkv, kv_norm,
    RoPE, FP8 — one row-op launch where the step kernels run, which stores the rows into `store` (store, dest,
    codec) when given (the raw codec: `store_rows`); else the reference's torch ops (no store)."""
    cfg, w, eps = attn.cfg, attn.w, attn.cfg.rms_norm_eps
    kva = w.wkv(x, n, phase)
    if not step_kernels_run(x.device):
        if store is not None:
            raise ValueError("the DSpark rings are stored in place by the row-op kernels: none run on this device")
        return fp8_block_ue8m0(attn.ref._rope(rms_norm(kva, w.kv_norm, eps), P), 32, attn.fq)
    from dsv41.kernels.step.cache import store_rows
    from dsv41.kernels.step.rowops import encodes, norm_rope_rows

    encoded = store is not None and attn.fq and encodes(store[2])
    kv = norm_rope_rows(kva, w.kv_norm, eps, P, attn._inv_freq(x.device), cfg.qk_rope_head_dim,
                        quant="fp8_ue8m0" if attn.fq else None, block=32, rows=n, store=store if encoded else None)
    if store is not None and not encoded:
        store_rows(store[0], kv[:n], store[1][:n], store[2])
    return kv


@dataclass
class FastDSpark:
    cfg: ModelConfig
    blocks: Sequence  # FastBlock per stage (layer indices num_hidden_layers + s)
    main_proj: object  # fast linear [n_taps * d -> d], not split under TP (the taps are full rows on every rank)
    main_norm: torch.Tensor
    heads: DSpark  # the reference record of norm, markov_embed, markov_head, confidence_proj (no blocks)

    @staticmethod
    def seeds(states=(), pool=None) -> list | None:
        """The taps list a target forward collects (empty), or None when it seeds no rings: a pool (given, or the
        states' own: `PoolSequence.pool`) laid out without them (`pool_layout(drafting=False)`)."""
        pools = [pool] if pool is not None else [p for p in (getattr(s, "pool", None) for s in states) if p is not None]
        return [] if all(("dspark", 0) in p.stores for p in pools) else None

    # ------------------------------------------------------------------ absorb
    def stage_rows(self, taps: Sequence[torch.Tensor], P: torch.Tensor, *, n: int, phase: str, dtype: torch.dtype,
                   stores: Sequence | None = None) -> list[torch.Tensor]:
        """Each stage's window-ring rows [B, head_dim] of the bucket's taps (one [B, d] per target layer, in
        order); `stores` (in place): per stage (store, dest, codec), the rows written there by the launch."""
        tap = torch.cat(list(taps), dim=-1).to(dtype)
        mx = self.main_proj(tap, n, phase)
        if step_kernels_run(mx.device):
            from dsv41.kernels.step.rowops import rms_norm_rows

            mx = rms_norm_rows(mx, self.main_norm, self.cfg.rms_norm_eps, rows=n)
        else:
            mx = rms_norm(mx, self.main_norm, self.cfg.rms_norm_eps)
        return [stage_window_kv(b.attn, mx, n, P, phase, None if stores is None else stores[s])
                for s, b in enumerate(self.blocks)]

    def absorb_pool(self, taps, n: int, P: torch.Tensor, tables, pool, phase: str, dtype: torch.dtype) -> None:
        """The in-place step's absorb: every real row's stage rows into the pool's DSpark rings at its ring row
        (`tables.ring_dest`: -1 for the padding rows and for tables that write nothing)."""
        stores = [(pool.stores[("dspark", s)], tables.ring_dest, pool.window_codec) for s in range(len(self.blocks))]
        self.stage_rows(taps, P, n=n, phase=phase, dtype=dtype, stores=stores)

    def absorb_segments(self, rows: Sequence[torch.Tensor], segs) -> None:
        """The load-and-store absorb: each segment's stage rows appended to its sequence's DSpark windows (the
        views `store_sequences` writes back, as `DSpark.absorb` does on the reference path)."""
        from dsv41.model.attention import append_window

        for s in segs:
            if s.T:
                for stage, kv in enumerate(rows):
                    append_window(s.state.dspark_window(stage), kv[s.rows], self.cfg.sliding_window)

    # ------------------------------------------------------------------ draft
    @torch.no_grad()
    def draft_many(self, model, ys: Sequence[int], last: Sequence[int], rings: Sequence[Sequence[torch.Tensor | None]],
                   chooses: Sequence[Callable[[torch.Tensor, int], int] | None]) -> list[Draft]:
        """`model/dspark.py` `DSpark.draft_many` on the fast path over rings given as tensors (`model`: the target
        FastModel, whose embedding, pieces and head the pass uses): at most MOST_ROWS block rows a pass, the
        pieces as CUDA graph pieces on CUDA, the rings gathered between them, the chain on the device (chooses
        None or `KeyedChoice`; another callable runs the reference chain) and read back once."""
        per = MOST_ROWS // self.cfg.dspark_block_size
        out: list[Draft] = []
        for a in range(0, len(ys), per):
            out += self._draft(model, ys[a:a + per], last[a:a + per], rings[a:a + per], chooses[a:a + per])
        return out

    def _draft(self, model, ys, last, rings, chooses) -> list[Draft]:
        cfg, dev = self.cfg, model.device
        Bk = cfg.dspark_block_size
        n = Bk * len(ys)
        N = row_bucket(n)
        ids = [t for y in ys for t in [y] + [cfg.dspark_noise_token_id] * (Bk - 1)]
        pos = [p + 1 + j for p in last for j in range(Bk)]
        ids_b = torch.tensor(ids + [ids[0]] * (N - n), dtype=torch.long, device=dev)
        pos_b = torch.tensor(pos + [pos[0]] * (N - n), dtype=torch.long, device=dev)
        sites = MhcSites.of(cfg, dev, rows=n)

        def keys_of(s: int, kv: torch.Tensor):
            return self._ring_keys(kv, Bk, [r[s] for r in rings])

        collapsed, local = self._blocks(model, sites, n, ids_b, pos_b, keys_of, model._piece_runner(PHASE, n, None))
        base = model.comm.gather_cat(local, dim=-1)
        collapsed = collapsed.clone()  # past the pieces' static buffers
        try:
            ints, floats, flags = sampling_rows(chooses, Bk, cfg.vocab_size)
        except TypeError:  # a choose of the caller's own: the reference chain, a host read per row
            return [self.heads._chain(collapsed[i * Bk:(i + 1) * Bk], base[i * Bk:(i + 1) * Bk], ys[i],
                                      chooses[i] or (lambda row, j: int(torch.argmax(row)))) for i in range(len(ys))]
        got = chain(self.heads, collapsed, base, torch.tensor(ys, device=dev), torch.tensor(ints, device=dev),
                    torch.tensor(floats, dtype=torch.float64, device=dev), flags, Bk, logits=True)
        read = Chained.read(got.packed())
        return [Draft(t, got.logits[i], torch.tensor(c, dtype=torch.float32)) for i, (t, c) in enumerate(read)]

    def _blocks(self, model, sites: MhcSites, n: int, ids_b, pos_b, keys_of, piece):
        """The block rows through the stages and the head: (the raw collapse [n, d], this rank's logits [n, V/tp]).
        `keys_of(stage, kv)` gives each row's attention keys and their live mask; `piece` runs the static parts."""
        x, pre, P = piece("dspark.embed", model._streams, ids_b, pos_b)
        pending = None
        for s, block in enumerate(self.blocks):
            L = block.index
            x, a_pre, a_post, a_comb, proj = piece(f"attn_in.{L}", partial(model._attn_in, block, sites, n, PHASE),
                                                   x, pre, pending, P)
            o = self._core(block.attn, proj["q"], n, *keys_of(s, proj["kv"]))
            x, pre, y, post, comb = piece(f"ffn.{L}", partial(model._ffn, block, sites, n, PHASE, None, False),
                                          o, P, x, a_post, a_comb, a_pre)
            pending = (y, post, comb)
        return piece("dspark.final", partial(self._final, model, sites, n), x, pending, pre)

    @staticmethod
    def _ring_keys(kv: torch.Tensor, Bk: int, rings: Sequence[torch.Tensor | None]):
        """Each block row's keys over rings given as tensors: its stage ring then all Bk rows of its block (every
        slot live), the sequences' keys padded with dead slots to the longest. Returns (keys [n, S, hd], ok)."""
        keys, ok = [], []
        for i, ring in enumerate(rings):
            block = kv[i * Bk:(i + 1) * Bk]
            k = block if ring is None else torch.cat((ring.to(block.dtype), block))
            keys.append(k[None].expand(Bk, -1, -1))
            ok.append(torch.ones(Bk, k.shape[0], dtype=torch.bool, device=k.device))
        S = max(k.shape[1] for k in keys)
        return torch.cat([_pad_slots(k, S, 0) for k in keys]), torch.cat([_pad_slots(m, S, False) for m in ok])

    @staticmethod
    def _pool_keys(pool, t: dict, stage: int, kv: torch.Tensor, Bk: int):
        """`_ring_keys` over the pool in place (`DraftTables`): each sequence's live ring rows gathered from its
        slot of the stage's ring and decoded, then its block's rows, the dead slots after them zero. The same keys,
        slot for slot, as `_ring_keys` of the rings `PoolSequence.dspark_window` reads, padded to W + Bk slots."""
        store = pool.stores[("dspark", stage)]
        Q, W = t["ring"].shape
        raw = store[t["slot"][:, None], t["ring"]]
        ring = pool.window_codec.decode(raw.reshape(Q * W, -1), pool.dtype).reshape(Q, W, -1).to(kv.dtype)
        src = torch.cat((ring, kv[:Q * Bk].reshape(Q, Bk, -1)), dim=1)
        ok = t["ok"] != 0
        keys = src.gather(1, t["src"][:, :, None].expand(-1, -1, src.shape[-1])).masked_fill(~ok[:, :, None], 0)
        S = keys.shape[1]
        return (keys[:, None].expand(Q, Bk, S, keys.shape[-1]).reshape(Q * Bk, S, -1),
                ok[:, None].expand(Q, Bk, S).reshape(Q * Bk, S))

    @staticmethod
    def _core(attn, q: torch.Tensor, n: int, keys: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        """Each block row over its keys (no causal mask; the sink): the reference's `forward_block`, all sequences
        in one launch of the core. Returns o [B, heads, head_dim] fp32 (padding rows zero)."""
        o = torch.zeros(q.shape[0], attn.heads, attn.cfg.head_dim, dtype=torch.float32, device=q.device)
        if step_kernels_run(q.device):
            from dsv41.kernels.step.attention import attention_core

            o[:n] = attention_core(q[:n], keys, ok, attn.sink, attn.cfg.head_dim ** -0.5, **attn._decode_tiling(keys))
        else:
            o[:n] = attn.ref._core(q[:n], keys, ok)
        return o

    # ------------------------------------------------------------------ the pass over the pool (the drafter's)
    @torch.no_grad()
    def propose_pool(self, model, pool, asks) -> list[tuple[list[int], list[float]]]:
        """`DSparkDrafter.propose` over the pool in place: per ask (row, p, y, SamplingParams, keyed step of the
        draft at p + 2, k) its k drafted ids and their confidences. Each pass (at most MOST_ROWS block rows) is one
        function of one packed table (`DraftTables`): the rings gathered from the pool, the stages, the head and
        the chain on the device, then ONE host read; on CUDA one graph per (sequences, chain variant)."""
        per = MOST_ROWS // self.cfg.dspark_block_size
        out = []
        for a in range(0, len(asks), per):
            part = asks[a:a + per]
            read = Chained.read(self.pool_pass(model, pool, DraftTables.build(self.cfg, pool, part, model.device)))
            out += [(ids[:k], conf[:k]) for (ids, conf), (*_, k) in zip(read, part)]
        return out

    def pool_pass(self, model, pool, tables: DraftTables, graphs: bool = True) -> torch.Tensor:
        """One pass over the pool: the packed ids and confidences [Q, 2, block] on the device (`Chained.packed`),
        the whole pass one CUDA graph piece ("dspark.draft.<chain variant>", keyed by its n rows) where graphs
        run, else eager; at TP > 1 two ("dspark.pass", the vocabulary gather outside, "dspark.chain"). The pool
        is bound, not keyed, as in the in-place step's graph (a new runner drops the model's graphs)."""
        f = tables.flags
        variant = "".join(c for c, on in zip("sktp", (f.sampled, f.top_k, f.min_p, f.top_p)) if on) or "g"
        run = model.piece_graphs().run if graphs else (lambda name, phase, n, fn, *args: fn(*args))
        whole = partial(self._pool_pass, model, pool, tables)
        if model.comm.world == 1:
            return run(f"dspark.draft.{variant}", PHASE, tables.n, whole, tables.packed)
        collapsed, local = run("dspark.pass", PHASE, tables.n, partial(whole, chain_too=False), tables.packed)
        base = model.comm.gather_cat(local, dim=-1)
        return run(f"dspark.chain.{variant}", PHASE, tables.n, partial(self._pool_chain, tables), collapsed, base,
                   tables.packed)

    def _pool_pass(self, model, pool, tables: DraftTables, packed: torch.Tensor, chain_too: bool = True):
        t = tables.layout.on(packed)
        Bk, n = self.cfg.dspark_block_size, tables.n
        sites = MhcSites.of(self.cfg, model.device, rows=n)
        eager = lambda name, fn, *args: fn(*args)  # noqa: E731 (inside the pass's one graph)
        collapsed, local = self._blocks(model, sites, n, t["ids"], t["pos"],
                                        lambda s, kv: self._pool_keys(pool, t, s, kv, Bk), eager)
        if not chain_too:
            return collapsed, local
        return self._pool_chain(tables, collapsed, model.comm.gather_cat(local, dim=-1), packed)

    def _pool_chain(self, tables: DraftTables, collapsed, base, packed):
        t = tables.layout.on(packed)
        return chain(self.heads, collapsed, base, t["y"], t["samp_i"], t["samp_f"], tables.flags,
                     self.cfg.dspark_block_size).packed()

    def _final(self, model, sites: MhcSites, n: int, x, pending, pre):
        """The last expand, the raw collapse (the confidence head's input), the norm and this rank's logits."""
        x = sites.expanded(x, pending)
        normed = sites.collapse_norm(x, pre, self.heads.norm)
        local = model.head(normed.float(), n, PHASE, out_dtype=torch.float32)[:n]
        return mhc.collapse(x[:n], pre[:n]), local


# the chain variants captured before serving: greedy, plain T > 0, T > 0 with top-p (the common request shapes)
BOOT_CHAINS = (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=0),
               SamplingParams(temperature=1.0, top_p=0.9, seed=0))


class FastDSparkDrafter(DSparkDrafter):
    def __init__(self, model):
        if not isinstance(getattr(model, "dspark", None), FastDSpark):
            raise ValueError("the fast DSpark drafter needs a FastModel built with its draft blocks "
                             "(runtime.build.build_fast_model(dspark=True))")
        super().__init__(model)

    @torch.inference_mode()
    def propose(self, pool, asks):
        """`DSparkDrafter.propose` as the pass over the pool in place (`FastDSpark.propose_pool`): the same drafts,
        one host read a pass."""
        return self.dspark.propose_pool(self.model, pool, asks) if asks else []

    @torch.inference_mode()
    def capture_graphs(self, pool, *, max_seqs: int, budget_s: float, clock=time.perf_counter) -> dict:
        """Capture the pass's graphs before serving (as `FastForward.capture_graphs` does the decode step's): for
        1..max_seqs sequences (at most a pass's 6), each chain of BOOT_CHAINS, on scratch asks over ring slots
        (the pass reads the pool and writes nothing, so the pool is left as it was). Stops once `budget_s` is
        spent at TP = 1; at TP > 1 it runs the whole plan (the ranks must capture alike). Returns the counts."""
        m, cfg = self.model, self.cfg
        if budget_s <= 0 or not m.piece_graphs().active:
            return {"captured": 0, "planned": 0, "run": 0, "seconds": 0.0}
        plan = [(q, params) for q in range(1, min(max_seqs, MOST_ROWS // self.block) + 1) for params in BOOT_CHAINS]
        t0, before, done = clock(), m.graphs.stats.captures, 0
        for q, params in plan:
            if getattr(m.comm, "world", 1) == 1 and clock() - t0 >= budget_s:
                break
            asks = [(Row(-1 - i, i % pool.num_slots, [], 0, [0]), cfg.sliding_window, 0, params, 0, self.block)
                    for i in range(q)]
            self.dspark.propose_pool(m, pool, asks)
            done += 1
        return {"captured": m.graphs.stats.captures - before, "planned": len(plan), "run": done,
                "seconds": clock() - t0}
