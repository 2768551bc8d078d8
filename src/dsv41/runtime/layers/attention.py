"""Attention of one layer on the fast path: projections over the whole row batch, state work per sequence.

The rows of a step come from several sequences (`Segment`: one sequence's consecutive rows). Every projection
(wq_a, wq_b, wkv, the compressor's, the indexer's, wo_a, wo_b) runs once over all rows through the fast linears;
norms, RoPE and the fake quantisers run over the row bucket. What reads or writes a sequence's state — window
append, compressor pooling and its entries, index scores, candidate blocks, top-k, the core softmax — runs per
sequence with the reference's own functions (`model.attention`), so a row's bits depend only on its sequence.
The index keys of every group closed in the step are projected in one launch (the kernel is row-invariant).
Decode and verify rows, where the Triton step kernels run (`step_kernels_run`: a CUDA device, or the interpreter),
take the core softmax of every sequence in one launch (`kernels.step.attention`): each sequence's key slots are
gathered as the reference lays them out, padded with dead slots to a common length (the kernel's bits ignore such
padding and the other rows). Prefill rows there take the same kernel per sequence reading the slots in place
(`_core_indexed`: the segment's int32 slot index into the window rows and the source's entries, one launch pair for
up to `PREFILL_INDEXED_ROWS` rows, the split scratch bounded by it); `DSV41_PREFILL_CORE_INDEXED=0` keeps the
gathered form (the same bits: `PREFILL_CORE_ROWS` rows per launch, each block's key slots gathered just before its
launch); `DSV41_PREFILL_CORE_ONEPASS=1` takes the indexed slots through the one-pass core (`kernels.step.prefill_core`:
no key splits, no combine; its own bits, row-invariant). Plain CPU without the interpreter keeps the reference's
`_core` in every phase. Where the step kernels run, the indexer of every phase (scores, candidate blocks, top-k) runs
for the rows of all sequences together (`_index_kernels`, `kernels.step.indexer`); plain CPU keeps the per-sequence
reference math (`_topk`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from dsv41.config import LayerRole, ModelConfig
from dsv41.kernels.exl3.backend import interpreting
from dsv41.model.attention import Attention, AttentionParams, Shared, append_window, compressed_slots
from dsv41.model.norm import rms_norm
from dsv41.model.quant import fp4_block_e4m3, fp4_block_ue8m0, fp8_block_ue8m0
from dsv41.model.rope import RopeTable
from dsv41.model.state import SequenceState

from ..sections import section
from .linear import Exl3Linear, LinearGroup, is_fused
from .attention_index import FastIndexer, _pad_slots
from .pool_attention import InPlaceAttention
from .prefill_cores import (INDEXED_ENV, ONEPASS_ENV, PREFILL_CORE_ROWS, PREFILL_INDEXED_ROWS,  # noqa: F401
                            PREFILL_TILING, indexed_core_enabled, onepass_core_enabled)


@dataclass
class Segment:
    """One sequence's rows [start, start + T) of a step, at positions pos .. pos + T - 1."""

    state: SequenceState
    start: int
    T: int
    pos: int
    shared: Shared = field(default_factory=Shared)

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.T)


def step_kernels_run(device: torch.device) -> bool:
    """Whether the Triton step kernels (`kernels.step`) run for tensors on `device`: a CUDA device, or any device
    under Triton's CPU interpreter (TRITON_INTERPRET=1). Elsewhere the reference's functions run."""
    return device.type == "cuda" or interpreting()


def window_slots(win: torch.Tensor, s: Segment, window: int,
                 rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`model.attention.window_slots` with the segment's positions known on the host (no device read); `rows`
    (relative to the segment, default all) picks the query rows. Slots before the window's first position are
    dead, as the reference's: a whole window starts at position 0 or covers every slot, a truncated one (CED
    bounded replay: the decoder layers' windows start at the replay segment) stops there."""
    rows = slice(0, s.T) if rows is None else rows
    first = s.pos + s.T - win.shape[0]
    key_pos = (torch.arange(s.pos + rows.start, s.pos + rows.stop, device=win.device)[:, None]
               + torch.arange(1 - window, 1, device=win.device)[None, :])
    return win[(key_pos - first).clamp(min=0)], key_pos >= first


class FastAttention(InPlaceAttention, FastIndexer):
    def __init__(self, cfg: ModelConfig, role: LayerRole, w: AttentionParams, rope: RopeTable, *, local_heads: int,
                 fake_quant: bool = True):
        """`w`: the reference's parameter record, its linears fast ones (this rank's heads and groups)."""
        self.cfg, self.role, self.w = cfg, role, w
        self.heads = local_heads
        self.fq = fake_quant
        # the reference layer on the same record: its RoPE, candidate blocks, top-k and core are reused as they are
        # (it never calls the linears)
        self.ref = Attention(cfg, role, w, rope, local_heads=local_heads, fake_quant=fake_quant)
        self.sink = w.sink.float().contiguous()  # what the core kernel reads
        # the matrices that read one input at one point of the step, one launch each on the fused path
        c = w.compressor if role.compresses else None
        self.x_group = LinearGroup([w.wq_a, w.wkv] + ([] if c is None else [c.wkv] + ([c.wgate] if c.wgate else [])))
        self.qr_group = LinearGroup([w.wq_b] + ([w.indexer.wq_b] if role.scores else []))
        self.wo_a_group = LinearGroup(w.wo_a)

    def linears(self) -> list:
        """Every linear of the layer (for accounting)."""
        w, c, i = self.w, self.w.compressor, self.w.indexer
        out = [w.wq_a, w.wq_b, w.wkv, *w.wo_a, w.wo_b]
        out += [c.wkv, c.wgate, c.index_wk] if c is not None else []
        out += [i.wq_b, i.weights_proj] if i is not None else []
        return [lin for lin in out if lin is not None]

    def forward(self, x: torch.Tensor, n: int, P: torch.Tensor, segs: Sequence[Segment], phase: str,
                trace: dict | None = None) -> torch.Tensor:
        """x: normed attention input [B, d] (first n rows real), P: positions [B]. Returns this rank's partial
        output [B, d] (wo_b is row-parallel). Three parts: `project` and `output` are static (fixed shapes, no
        sequence state, no host sync: CUDA graph pieces of the decode step, runtime/graphs.py), `attend` is the
        per-sequence work between them."""
        return self.output(self.attend(self.project(x, n, P, phase), n, P, segs, phase, trace), n, P, phase, x.dtype,
                           roped=self.attend_ropes(phase, x.device))

    def project(self, x: torch.Tensor, n: int, P: torch.Tensor, phase: str, window=None) -> dict:
        """The projections over the bucket: q (RoPE), the window KV (RoPE, FP8), the compressor's inputs, the
        indexer's queries (RoPE; their FP4 quantiser runs in `attend`: `formats.nearest_e2m1_code` builds its table
        with a host copy per call, which a graph capture refuses) and weights. `window` (store, dest, codec): the
        ring of the in-place step, into which the row ops store the window KV they make (`proj["kv_stored"]`;
        only where the step kernels run)."""
        cfg, role, w, eps = self.cfg, self.role, self.w, self.cfg.rms_norm_eps
        B = x.shape[0]
        if step_kernels_run(x.device):
            return self._project_rowops(x, n, P, phase, window)
        if window is not None:
            raise ValueError("the window KV is stored by the row-op kernels: none run on this device")
        rope = self.ref._rope
        qa, kva, proj = self._project_x(x, n, phase)
        with section("norms"):
            qr = rms_norm(qa, w.q_norm, eps)
        qb, ib = self._project_qr(qr, n, phase)
        with section("norms"):
            q = rope(qb.view(B, self.heads, cfg.head_dim), P)
            kv = fp8_block_ue8m0(rope(rms_norm(kva, w.kv_norm, eps), P), 32, self.fq)
        iq = iw = None
        if role.scores:
            wp = w.indexer.weights_proj(x, n, phase)
            with section("indexer"):
                iq = rope(ib.view(B, cfg.index_n_heads, cfg.index_head_dim), P)
                a, b = self._iw_scales()
                iw = wp.float() * a * b
        return {"dtype": x.dtype, "q": q, "kv": kv, "proj": proj, "iq": iq, "iw": iw, "iw_scales": (1.0, 1.0),
                "iq_quantised": False}

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        """The layer's RoPE table on the device, made once (a per-call host copy would stop a graph capture)."""
        if getattr(self, "_inv_freq_dev", None) is None or self._inv_freq_dev.device != device:
            self._inv_freq_dev = self.ref.rope.inv_freq.to(device=device, dtype=torch.float32).contiguous()
        return self._inv_freq_dev

    def _project_rowops(self, x: torch.Tensor, n: int, P: torch.Tensor, phase: str, window=None) -> dict:
        """`project` with the norms, RoPE and quantisers as the row-op kernels (kernels/step/rowops.py: one launch
        each, RoPE and the quantisers the reference's bits on the same input); the index queries' FP4 is fused with
        their RoPE here."""
        from dsv41.kernels.step.rowops import encodes, norm_rope_rows, rms_norm_rows, rope_rows

        cfg, role, w, eps = self.cfg, self.role, self.w, self.cfg.rms_norm_eps
        if window is not None and not (self.fq and encodes(window[2])):
            window = None  # raw rows (no fake quantiser): `attend_pool` stores them (`store_rows`)
        B, R, freqs = x.shape[0], cfg.qk_rope_head_dim, self._inv_freq(x.device)
        qa, kva, proj = self._project_x(x, n, phase)
        with section("norms"):  # the row ops run the n real rows (the padding rows come out zero)
            qr = rms_norm_rows(qa, w.q_norm, eps, rows=n)
        qb, ib = self._project_qr(qr, n, phase)
        with section("norms"):
            # in place: qb is this call's own fresh output, and only its rotated tail is read and written (the
            # same bits as a fresh output: the other dims pass through unchanged)
            q = rope_rows(qb.view(B, self.heads, cfg.head_dim), P, freqs, R, rows=n, inplace=True)
            kv = norm_rope_rows(kva, w.kv_norm, eps, P, freqs, R, quant="fp8_ue8m0" if self.fq else None, block=32,
                                rows=n, store=window)
        iq = iw = None
        if role.scores:
            # the head weights as weights_proj gives them: the score kernels scale them in their load (the bits of
            # `wp.float() * a * b`, three launches fewer)
            iw = w.indexer.weights_proj(x, n, phase)
            with section("indexer"):
                iq = rope_rows(ib.view(B, cfg.index_n_heads, cfg.index_head_dim), P, freqs, R,
                               quant="fp4_ue8m0" if self.fq else None, block=32, rows=n)
        return {"dtype": x.dtype, "q": q, "kv": kv, "proj": proj, "iq": iq, "iw": iw, "iw_scales": self._iw_scales(),
                "iq_quantised": True, "kv_stored": window is not None}

    def _iw_scales(self) -> tuple[float, float]:
        return (self.cfg.index_head_dim ** -0.5, self.cfg.index_n_heads ** -0.5)

    def attend(self, a: dict, n: int, P: torch.Tensor, segs: Sequence[Segment], phase: str,
               trace: dict | None = None) -> torch.Tensor:
        """The per-sequence part on `project`'s tensors: window append, compressor pooling and entries, the index
        top-k, key gathers, the core. Returns o [B, heads, head_dim] fp32 (rows of no segment are zero)."""
        cfg, role = self.cfg, self.role
        q, kv, proj, iw = a["q"], a["kv"], a["proj"], a["iw"]
        B, dev = q.shape[0], q.device
        iq = None
        if a["iq"] is not None:
            with section("indexer"):
                iq = a["iq"] if a["iq_quantised"] else fp4_block_ue8m0(a["iq"], 32, self.fq)
        with section("attention"):
            wins = [append_window(s.state.window(role.index), kv[s.rows], cfg.sliding_window) for s in segs]
            closed = [self._pool(s, proj, a["dtype"]) for s in segs] if role.compresses else []
        if any(c is not None for c in closed):
            self._append_entries(segs, closed, phase)
        kernels = step_kernels_run(dev)
        batched, blocked = kernels and is_fused(phase), kernels and not is_fused(phase)
        roped = self.attend_ropes(phase, dev)  # o inverse-RoPE'd in x's dtype by the one-pass core's epilogue
        if roped and sum(s.T for s in segs) == B:  # the segments' disjoint rows cover o: each row written
            o = torch.empty(B, self.heads, cfg.head_dim, dtype=a["dtype"], device=dev)
        else:
            o = torch.zeros(B, self.heads, cfg.head_dim, dtype=a["dtype"] if roped else torch.float32, device=dev)
        gathered = []
        indexed = kernels and role.scores
        if indexed:
            with section("indexer"):
                # prefill rows of fake-quantised index queries and keys (bf16 values) score on the tensor cores
                self._index_kernels(segs, iq, iw, trace, w_scales=a["iw_scales"],
                                    tiles=not is_fused(phase) and self.fq)
        for s, win in zip(segs, wins):
            ids = src = None
            if not role.swa_only:
                src = s.state.source(role.kv_source)
                with section("indexer"):
                    ids = s.shared.topk[role.index] if indexed else self._topk(s, P[s.rows], iq, iw, src, trace)
            if blocked:
                with section("attention"):
                    rope = (P[s.rows], self._inv_freq(dev), cfg.qk_rope_head_dim, a["dtype"]) if roped else None
                    self._core_blocked(q, o, s, win, ids, src, rope=rope)
                continue
            with section("attention"):
                keys, ok = self._slots(s, win, ids, src, slice(0, s.T))
            if batched:
                gathered.append((s, keys, ok))
                continue
            with section("attention"):
                o[s.rows] = self.ref._core(q[s.rows], keys, ok)
        if gathered:
            with section("attention"):
                self._core_batched(q, gathered, o)
        return o

    def attend_ropes(self, phase: str, device: torch.device) -> bool:
        """Whether `attend`'s o comes inverse-RoPE'd in x's dtype (prefill rows through the one-pass core, whose
        epilogue does it with `rope_rows`' bits: one launch and the fp32 o's write and read fewer), so that `output`
        takes it as it is."""
        return (not is_fused(phase) and step_kernels_run(device) and indexed_core_enabled()
                and onepass_core_enabled())

    def output(self, o: torch.Tensor, n: int, P: torch.Tensor, phase: str, dtype: torch.dtype,
               roped: bool = False) -> torch.Tensor:
        """The tail over the bucket: inverse RoPE of o (rounded to `dtype`), wo_a per group, wo_b: this rank's
        partial [B, d]. `roped`: o has had its inverse RoPE (`attend_pool`'s combine launch: the same bits)."""
        w = self.w
        with section("norms"):
            if roped:
                if o.dtype != dtype:
                    raise ValueError(f"an inverse-RoPE'd o must be {dtype}, got {o.dtype}")
            elif step_kernels_run(o.device):
                from dsv41.kernels.step.rowops import rope_rows

                o = rope_rows(o, P, self._inv_freq(o.device), self.cfg.qk_rope_head_dim, inverse=True, out_dtype=dtype,
                              rows=n)
            else:
                o = self.ref._rope(o.to(dtype), P, inverse=True)
        groups = o.reshape(o.shape[0], len(w.wo_a), -1)
        if is_fused(phase) and all(isinstance(wo, Exl3Linear) for wo in w.wo_a):
            # each group's product straight into its columns of u (no concatenation launch), all in one launch
            widths = [wo.out_features for wo in w.wo_a]
            u = torch.empty(o.shape[0], sum(widths), dtype=o.dtype, device=o.device)
            self.wo_a_group([groups[:, g] for g in range(len(w.wo_a))], n, phase, outs=list(u.split(widths, dim=1)))
        else:  # prefill: one group launch straight into u where DSV41_PREFILL_DENSE_GROUP is on
            u = self.wo_a_group.prefill_concat([groups[:, g] for g in range(len(w.wo_a))], phase)
            u = torch.cat([wo(groups[:, g], n, phase) for g, wo in enumerate(w.wo_a)], dim=-1) if u is None else u
        return w.wo_b(u, n, phase)

    def _slots(self, s: Segment, win: torch.Tensor, ids: torch.Tensor | None, src, rows: slice):
        """Key slots [t, S, hd] and live mask [t, S] of the segment's rows `rows` (relative) in the reference's
        layout: the window's slots, then (layers that read a KV source `src`) the selected compressed entries."""
        cfg = self.cfg
        keys, ok = window_slots(win, s, cfg.sliding_window, rows)
        if src is None:
            return keys, ok
        sel = None if ids is None else ids[rows]
        comp, comp_ok = compressed_slots(src, sel, cfg.index_topk, rows.stop - rows.start, cfg.head_dim, win.device)
        return torch.cat((keys, comp.to(keys.dtype)), dim=1), torch.cat((ok, comp_ok), dim=1)

    def _keys_bf16(self, keys: torch.Tensor) -> bool:
        """Whether every key value is a bf16 one: bf16 keys, or keys the pool's codecs for this layer's stores
        (`kv_pool.codec_for`) would hold as bf16 values: the rule `attention_pool` applies to them (the same bits)."""
        from dsv41.kernels.step.attention import codecs_hold_bf16
        from dsv41.runtime.kv_pool import codec_for

        hd = self.cfg.head_dim
        return keys.dtype == torch.bfloat16 or codecs_hold_bf16(codec_for("window", hd, keys.dtype, self.fq),
                                                                codec_for("kv", hd, keys.dtype, self.fq))

    def _decode_tiling(self, keys: torch.Tensor) -> dict:
        """The gathered core of decode / verify rows on `attention_pool`'s tiling (the same bits; both read
        `decode_tiling`, DSV41_DECODE_CORE_TILING included)."""
        from dsv41.kernels.step.attention import decode_tiling

        return dict(keys_bf16=self._keys_bf16(keys), **decode_tiling())

    def _core_blocked(self, q: torch.Tensor, o: torch.Tensor, s: Segment, win: torch.Tensor,
                      ids: torch.Tensor | None, src, block: int | None = None, rope: tuple | None = None) -> None:
        """The core of a prefill segment's rows with the step kernel, `block` (default PREFILL_CORE_ROWS) rows per
        launch, each block's slots gathered right before it in ONE gather from the window and the source's entries
        stacked once per segment (the reference's slot layout, the same values: `_slots`); o's rows written in
        place. The kernel runs one program per (row, head block, split) and reads nothing of another row
        (`kernels.step.attention`), so a row's bits do not depend on the block it is in nor on the chunk: chunked ==
        one-shot holds for the core bitwise (tests/test_runtime_prefill_core.py)."""
        if indexed_core_enabled():
            self._core_indexed(q, o, s, win, ids, src, block, rope)
            return
        if rope is not None:
            raise ValueError("o's inverse RoPE in the core is the one-pass core's (`attend_ropes`)")
        from dsv41.kernels.step.attention import attention_core

        block = block or PREFILL_CORE_ROWS
        cfg = self.cfg
        stacked = win if src is None or src.kv is None else torch.cat((win, src.kv.to(win.dtype)))
        first = s.pos + s.T - win.shape[0]
        for start in range(0, s.T, block):
            rows = slice(start, min(start + block, s.T))
            key_pos = (torch.arange(s.pos + rows.start, s.pos + rows.stop, device=win.device)[:, None]
                       + torch.arange(1 - cfg.sliding_window, 1, device=win.device)[None, :])
            idx, ok = (key_pos - first).clamp(min=0), key_pos >= first  # `window_slots`' rule
            if src is not None:
                sel = None if ids is None else ids[rows]
                n = rows.stop - rows.start
                sel = torch.empty(n, 0, dtype=torch.long, device=win.device) if sel is None else sel
                sel = torch.cat((torch.full((n, cfg.index_topk - sel.shape[1]), -1, dtype=sel.dtype,
                                            device=sel.device), sel), dim=1)
                # no entries yet: every compressed slot dead (it reads the window's row 0, never used)
                idx = torch.cat((idx, win.shape[0] + sel.clamp(min=0) if src.kv is not None
                                 else torch.zeros_like(sel)), dim=1)
                ok = torch.cat((ok, sel >= 0), dim=1)
            keys = stacked[idx]
            at = slice(s.start + rows.start, s.start + rows.stop)
            o[at] = attention_core(q[at], keys, ok, self.sink, self.cfg.head_dim ** -0.5,
                                   keys_bf16=self._keys_bf16(keys), **PREFILL_TILING)

    def _core_indexed(self, q: torch.Tensor, o: torch.Tensor, s: Segment, win: torch.Tensor,
                      ids: torch.Tensor | None, src, block: int | None = None, rope: tuple | None = None) -> None:
        """`_core_blocked`'s core without the gathered copy: the segment's slot index (int32 [T, S], one launch:
        `kernels.step.prefill_slots`) into the window rows and the source's entries where they are, and the core
        reading each slot's row through it (`attention_indexed`), `block` (default PREFILL_INDEXED_ROWS) rows a
        launch, straight into o's rows. The same slots, values, tiling and keys_bf16 rule as the gathered path, so
        the same bits (tests/test_runtime_prefill_core.py); a row's bits again depend only on that row. With
        `ONEPASS_ENV` on, the one-pass core over the same slots (`attention_onepass`: other bits, row-invariant);
        `rope` (its positions, inv_freq, R, dtype): o's inverse RoPE in its epilogue (`attend_ropes`)."""
        from dsv41.kernels.step.prefill_slots import attention_indexed, prefill_slot_index

        cfg = self.cfg
        entries = None if src is None else src.kv
        if entries is not None and entries.dtype != win.dtype:
            entries = entries.to(win.dtype)  # the gathered path's rounding (the fast path's are one dtype: no copy)
        slots = prefill_slot_index(s.T, s.pos, win.shape[0], cfg.sliding_window,
                                   width=0 if src is None else cfg.index_topk, ids=ids,
                                   entries=0 if entries is None else entries.shape[0], device=win.device,
                                   floor=s.pos + s.T - win.shape[0])  # `window_slots`' rule
        exact = self._keys_bf16(win)
        if onepass_core_enabled():  # no scratch: all the segment's rows in one launch
            from dsv41.kernels.step.prefill_core import attention_onepass

            attention_onepass(q[s.rows], win, entries, slots, self.sink, cfg.head_dim ** -0.5, keys_bf16=exact,
                              out=o[s.rows], rope=rope)
            return
        if rope is not None:
            raise ValueError("o's inverse RoPE in the core is the one-pass core's (`attend_ropes`)")
        block = block or PREFILL_INDEXED_ROWS
        for start in range(0, s.T, block):
            stop = min(start + block, s.T)
            at = slice(s.start + start, s.start + stop)
            attention_indexed(q[at], win, entries, slots[start:stop], self.sink, cfg.head_dim ** -0.5,
                              keys_bf16=exact, out=o[at], **PREFILL_TILING)

    def _core_batched(self, q: torch.Tensor, gathered, o: torch.Tensor) -> None:
        """The core of every segment's rows in one launch: their key slots [T, S, hd] stacked in row order (dead
        slots pad a shorter S), o's rows written in place."""
        from dsv41.kernels.step.attention import attention_core

        S = max(keys.shape[1] for _, keys, _ in gathered)
        keys = torch.cat([_pad_slots(k, S, 0) for _, k, _ in gathered])
        ok = torch.cat([_pad_slots(m, S, False) for _, _, m in gathered])
        rows = [s.rows for s, _, _ in gathered]
        first, last = rows[0].start, rows[-1].stop
        if all(a.stop == b.start for a, b in zip(rows, rows[1:])):
            o[first:last] = attention_core(q[first:last], keys, ok, self.sink, self.cfg.head_dim ** -0.5,
                                           **self._decode_tiling(keys))
            return
        idx = torch.cat([torch.arange(r.start, r.stop, device=q.device) for r in rows])
        o[idx] = attention_core(q[idx], keys, ok, self.sink, self.cfg.head_dim ** -0.5, **self._decode_tiling(keys))

    # ------------------------------------------------------------------ compressor
    def _project_x(self, x, n, phase):
        """q_a, the window KV latent and the compressor's inputs: the projections of x, one group."""
        r = self.role.compress_ratio if self.role.compresses else 0
        dtypes = [x.dtype, x.dtype] + [self._compressor_dtype(x)] * (len(self.x_group.linears) - 2)
        qa, kva, *cmp = self.x_group([x] * len(dtypes), n, phase, dtypes)
        return qa, kva, self._compressor_inputs(cmp) if r else {}

    def _compressor_dtype(self, x: torch.Tensor) -> torch.dtype:
        # ratio > 1 pools in fp32 (the reference feeds x.float(); the kernels round either to fp16 alike)
        return torch.float32 if self.role.compress_ratio > 1 else x.dtype

    def _compressor_inputs(self, cmp: list) -> dict:
        """The compressor's projections as `_pool` takes them: ratio 1 the normed latent, else (value, gate)."""
        if self.role.compress_ratio == 1:
            with section("norms"):
                if step_kernels_run(cmp[0].device):
                    # one program a row: torch's CUDA mean splits a row's sum among more threads when there are
                    # fewer rows, so a prefill chunk's length (a session's cut at S) changed the latent's bits
                    from dsv41.kernels.step.rowops import rms_norm_rows

                    return {"latent": rms_norm_rows(cmp[0], self.w.compressor.norm, self.cfg.rms_norm_eps)}
                return {"latent": rms_norm(cmp[0], self.w.compressor.norm, self.cfg.rms_norm_eps)}
        return {"v": cmp[0], "s": cmp[1]}

    def compress_only(self, x: torch.Tensor, n: int, segs: Sequence[Segment], phase: str) -> None:
        """CED bounded replay (MODEL.md §11): rows before their sequence's replay segment feed this layer's KV
        source and go no further. x: their normed attention input [n, d]; the compressor's projections alone (each
        member of `x_group` runs on its own for prefill rows: `_project_x`'s bits), the groups they close pooled,
        the entries and index keys appended as `attend` appends them; no query, window or core."""
        if not self.role.compresses:
            raise ValueError(f"layer {self.role.index} has no compressor to feed")
        if is_fused(phase):
            raise ValueError("replayed-out rows are prefill rows")
        dtype = self._compressor_dtype(x)
        cmp = [lin(x, n, phase, dtype) for lin in self.x_group.linears[2:]]
        proj = self._compressor_inputs(cmp)
        with section("attention"):
            closed = [self._pool(s, proj, x.dtype) for s in segs]
        if any(c is not None for c in closed):
            self._append_entries(segs, closed, phase)

    def _project_qr(self, qr, n, phase):
        """q (before RoPE) and the index queries (layers that score; else None): the projections of q_a's norm."""
        out = self.qr_group([qr] * len(self.qr_group.linears), n, phase)
        return out[0], (out[1] if len(out) > 1 else None)

    def _pool(self, s: Segment, proj: dict, dtype: torch.dtype):
        """The groups this segment closes: (latent [g, hd], entry positions [g]) or None; keeps the open group.
        Ratio > 1 where the step kernels run: the softmax pooling and its norm are one launch
        (`kernels.step.compress.pool_norm_rows`, the members in position order: `_close_groups`' kernel program, so
        the in-place path's bits); elsewhere the reference's torch ops."""
        r = self.role.compress_ratio
        src = s.state.source(self.role.kv_source)
        if r == 1:
            latent, first = proj["latent"][s.rows], s.pos
        else:
            v, g = proj["v"][s.rows], proj["s"][s.rows]
            if getattr(s.state, "step_open", None) is not None and s.state.row.phase != "prefill" \
                    and s.state.pool.verify_rows:  # every row kept, as in place (`PoolSequence.store`: rollback)
                s.state.step_open[self.role.index] = (v.float(), g.float())
            if src.open_v is not None:
                v, g = torch.cat((src.open_v, v)), torch.cat((src.open_s, g))
            first = s.pos - (0 if src.open_v is None else src.open_v.shape[0])
            n_groups = v.shape[0] // r
            done = n_groups * r
            src.open_v, src.open_s = (v[done:].clone(), g[done:].clone()) if done < v.shape[0] else (None, None)
            if n_groups == 0:
                return None
            gv, gs = v[:done].view(n_groups, r, -1), g[:done].view(n_groups, r, -1)
            if step_kernels_run(v.device):
                from dsv41.kernels.step.compress import pool_norm_rows

                latent = pool_norm_rows(gv, gs, self.w.compressor.norm, self.cfg.rms_norm_eps, dtype)
            else:
                pooled = (torch.softmax(gs, dim=1) * gv).sum(1)
                latent = rms_norm(pooled.to(dtype), self.w.compressor.norm, self.cfg.rms_norm_eps)
        g0 = first // r
        return latent, (torch.arange(latent.shape[0], device=latent.device) + g0) * r

    def _append_entries(self, segs, closed, phase) -> None:
        """Entries (RoPE at the group's first token, FP4) and index keys of every closed group, appended per
        sequence; the index-key projection runs once over all of them, and so does their norm where the step
        kernels run (`kernels.step.rowops.rms_norm_rows`, row-invariant: `_close_groups`' bits; elsewhere the
        reference's per sequence)."""
        comp, cfg = self.w.compressor, self.cfg
        keys, normed = None, False
        if comp.index_wk is not None:
            latents = torch.cat([c[0] for c in closed if c is not None])
            keys = comp.index_wk(latents, None, phase)
            if step_kernels_run(keys.device):
                from dsv41.kernels.step.rowops import rms_norm_rows

                keys, normed = rms_norm_rows(keys, comp.index_k_norm, cfg.rms_norm_eps), True
        at = 0
        with section("attention"):
            for s, c in zip(segs, closed):
                if c is None:
                    continue
                latent, entry_pos = c
                src = s.state.source(self.role.kv_source)
                rotated = self.ref._rope(latent, entry_pos)
                src.append_entries(rotated, fp4_block_e4m3(rotated, 16, self.fq))
                if keys is not None:
                    k = keys[at:at + latent.shape[0]]
                    k = k if normed else rms_norm(k, comp.index_k_norm, cfg.rms_norm_eps)
                    k = fp4_block_ue8m0(self.ref._rope(k, entry_pos), 32, self.fq)
                    src.index_k = k if src.index_k is None else torch.cat((src.index_k, k))
                at += latent.shape[0]
