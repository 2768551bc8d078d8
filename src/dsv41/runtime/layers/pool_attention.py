"""Attention of decode / verify rows over the KV pool in place (docs/ENGINE.md §5): `FastAttention`'s in-place half.

`attend_pool` replaces `FastAttention.attend` when the forward is given the pool: the bucket's `StepTables`
(runtime/step_tables.py) say where each row reads and writes, and every op has the bucket's shape, so the whole
step can be one CUDA graph. The kernels run the n real rows. In order, per layer: the window rows stored into the
ring (`kernels.step.cache.store_rows`: the rows of a verify window see the ones before them), the groups the rows
close pooled and their entries and index keys stored by the closer (the members' gather, the softmax pooling and
its norm one launch: `kernels.step.compress.close_norm_rows`), the index scores over the source's pages
(`index_scores_pool`, candidate pool, top-k), the core over the ring and the selected entries (`attention_pool`,
the keys dequantised in the kernel's load). The bits are those of `attend` over the same state loaded from the
pool (tests/test_runtime_pool_attention.py).
"""

from __future__ import annotations

import torch

from ..sections import section


class InPlaceAttention:
    """Mixed into `FastAttention` (which holds cfg, role, w, heads, sink and `_inv_freq`)."""

    def attend_pool(self, a: dict, n: int, P: torch.Tensor, t, pool, phase: str) -> torch.Tensor:
        """`attend` for decode / verify rows over the KV pool in place (`t`: the bucket's `StepTables`): fixed
        shapes, the pool read and written through the tables, no host sync, so a whole step can be one CUDA graph.
        The kernels run the n real rows (o's padding rows are zeros). In order: the window rows stored into the
        ring (the rows of a verify window see the ones before them), the groups the rows close pooled and their
        entries and index keys stored by the closer, the index scores over the source's pages (candidate pool,
        top-k), the core over the ring and the selected entries (`attention_pool`: the keys are read and
        dequantised in the kernel's load). The bits are those of `attend` over the same state loaded from the pool
        (tests/test_runtime_pool_attention.py)."""
        from dsv41.kernels.step.attention import attention_pool
        from dsv41.kernels.step.cache import store_rows

        cfg, role, L = self.cfg, self.role, self.role.index
        q = a["q"]
        with section("attention"):
            if not a.get("kv_stored"):  # else the row ops wrote them (`project(window=)`)
                store_rows(pool.stores[("window", L)], a["kv"][:n], t.ring_dest[:n], pool.window_codec)
            if role.compresses:
                self._close_groups(a["proj"], n, t, pool, a["dtype"], phase)
        window = dict(window_store=pool.stores[("window", L)], window_codec=pool.window_codec, slot=t.slot[:n],
                      pos=P[:n], window=cfg.sliding_window)
        entries = {}
        if not role.swa_only:
            src = pool.sources[role.kv_source]
            st = t.source(src.ratio)
            with section("indexer"):
                if role.scores:
                    t.topk[L] = self._index_pool(a["iq"][:n], a["iw"][:n], n, t, st, pool, a["iw_scales"])
                ids = t.topk[role.index_source]
            entries = dict(entry_store=pool.stores[("kv", role.kv_source)], entry_codec=pool.kv_codec,
                           pages=t.pages[:n], per_page=src.per_page, ids=ids, width=cfg.index_topk)
        with section("attention"):
            # o's inverse RoPE in the combine launch (`rope_rows`' bits, in the activations' dtype): `output` takes
            # it as it comes; the padding rows are stored as zeros, as `rope_rows(rows=n)` leaves them
            o = torch.empty(q.shape[0], self.heads, cfg.head_dim, dtype=a["dtype"], device=q.device)
            attention_pool(q[:n], self.sink, cfg.head_dim ** -0.5, **window, **entries, out=o,
                           rope=(P, self._inv_freq(q.device), cfg.qk_rope_head_dim, a["dtype"]))
        return o

    def _close_groups(self, proj: dict, n: int, t, pool, dtype: torch.dtype, phase: str) -> None:
        """The compressor over the real rows (`_pool` and `_append_entries` of every row at once): each row whose
        position ends a group pools its group (its earlier members from the step's rows or the open-group store),
        and stores its entry (RoPE at the group's first token, FP4) and index key in the source's pages; the rows
        still open at the step's end go to the open-group store. Rows that close nothing compute values nobody
        stores (their destinations are -1). Ratio > 1 gathers, pools and norms in one launch, the members read in
        the kernel's load (`kernels.step.compress.close_norm_rows`: `_pool`'s program on the same members in the same
        order, so `attend`'s bits), and the index keys' norm is `rms_norm_rows` (as `_append_entries`). No torch
        fallback: the in-place path runs only where the step kernels do (`store_rows` is one)."""
        from dsv41.kernels.step.cache import store_rows
        from dsv41.kernels.step.compress import close_norm_rows
        from dsv41.kernels.step.rowops import rms_norm_rows, rope_rows

        cfg, comp, L = self.cfg, self.w.compressor, self.role.index
        r = self.role.compress_ratio
        st = t.source(r)
        eps, R = cfg.rms_norm_eps, cfg.qk_rope_head_dim
        if r == 1:
            latent = proj["latent"][:n]
        else:
            v, g = proj["v"][:n], proj["s"][:n]
            open_store = pool.stores[("open", L)]
            latent = close_norm_rows(v, g, open_store, st.back_row, st.back_open, comp.norm, eps, dtype)
            store_rows(open_store, torch.cat((v, g), dim=1), st.open_dest[:n], pool.open_codec)
        freqs, entry_pos, dest = self._inv_freq(latent.device), st.entry_pos[:n], st.entry_dest[:n]
        store_rows(pool.stores[("kv", L)], rope_rows(latent[:, None, :], entry_pos, freqs, R)[:, 0], dest,
                   pool.kv_codec)
        if comp.index_wk is not None and ("index_k", L) in pool.stores:
            k = rms_norm_rows(comp.index_wk(latent, n, phase), comp.index_k_norm, eps)
            store_rows(pool.stores[("index_k", L)], rope_rows(k[:, None, :], entry_pos, freqs, R)[:, 0], dest,
                       pool.index_codec)

    def _index_pool(self, iq: torch.Tensor, iw: torch.Tensor, n: int, t, st, pool,
                    w_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """`_index_kernels` over the pool for the n real rows: each row's scores over its own sequence's index keys
        in the source's pages (`ncols` the page bucket's entries; columns past a row's entries are -inf, which
        neither the candidate blocks nor the top-k ever pick), the candidate pool at the candidate source, the
        top-k (ids ascending, -1 first; `attention_pool` left-pads them to index_topk as `compressed_slots`)."""
        from dsv41.kernels.step.indexer import candidate_mask, index_scores_pool, topk_select

        cfg, role = self.cfg, self.role
        allow = None
        if role.uses_candidates:
            allow = t.candidates
            if allow is None or allow.shape != (n, st.ncols):
                raise RuntimeError(f"layer {role.index}: no candidate pool of {st.ncols} columns in this step")
        sc = index_scores_pool(iq, iw, pool.stores[("index_k", role.kv_source)], pool.index_codec, t.pages[:n],
                               st.per_page, st.n_vis[:n], st.ncols, allow, w_scales=w_scales)
        if role.is_candidate_source:
            t.candidates = candidate_mask(sc, st.n_vis[:n], cfg.candidate_block_size, cfg.candidate_topk_blocks)
        return topk_select(sc, min(cfg.index_topk, st.ncols))
