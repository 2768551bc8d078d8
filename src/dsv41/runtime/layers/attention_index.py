"""The lightning indexer of the fast path's attention (MODEL.md §7.5): each sequence's top-k of compressed entries.

`FastIndexer` is a part of `FastAttention` (runtime/layers/attention.py): `_topk` is the reference math per
sequence (plain CPU), `_index_kernels` the step kernels for the rows of every sequence of a step together
(`kernels.step.indexer`; the prefill rows' scores on the tensor cores, `kernels.step.index_tiles`, where the index
queries and keys are fake-quantised), `_scores` the reference's scores. A row's bits are those it gets alone.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dsv41.model.rowwise import row_blocks

# Rows per indexer launch (`_index_kernels`): bounds the [rows, C] fp32 scores (1,024 rows x 65,536 entries:
# 256 MiB). Any value gives the same bits (one program per row and entry block, one per row for the top-k).
INDEX_ROWS = 1024


class FastIndexer:
    """The indexer's methods of `FastAttention` (cfg, role, ref from it)."""

    def _topk(self, s, positions, iq, iw, src, trace: dict | None):
        cfg, role = self.cfg, self.role
        C = src.entries
        if not role.scores:
            return s.shared.topk.get(role.index_source)
        scores = None
        if C == 0:
            ids = torch.empty(s.T, 0, dtype=torch.long, device=positions.device)
        else:
            n_visible = torch.div(positions + 1, role.compress_ratio, rounding_mode="floor")
            visible = torch.arange(C, device=positions.device)[None, :] < n_visible[:, None]
            scores = self._scores(iq[s.rows], iw[s.rows], src, visible)
            if role.is_candidate_source:
                s.shared.candidates = self.ref._candidate_mask(scores, n_visible)
            elif role.uses_candidates:
                scores = scores.masked_fill(~s.shared.candidates, float("-inf"))
            ids = self.ref._select(scores, min(cfg.index_topk, C))
        s.shared.topk[role.index] = ids
        if trace is not None:
            trace.setdefault("index_ids", []).append(ids)
            trace.setdefault("index_scores", []).append(scores)
        return ids

    def _index_kernels(self, segs: Sequence, iq: torch.Tensor, iw: torch.Tensor, trace: dict | None,
                       rows_per_launch: int | None = None, w_scales: tuple[float, float] = (1.0, 1.0),
                       tiles: bool = False) -> None:
        """`_topk` of every segment with the step kernels (`kernels.step.indexer`), rows of all sequences together:
        each row reads its own sequence's keys (the sources' index keys concatenated, a row's offset into them) up
        to its visible count, columns padded with -inf to the longest source, and takes the last min(index_topk, C)
        columns of the padded top-k (the others are -1, `kernels.step.indexer`): a row's bits are those it gets
        alone. Candidate pools are per row too (the candidate source writes `[T, C]` masks; re-indexing layers pass
        them as the kernel's `allow`). `rows_per_launch` (default INDEX_ROWS) bounds the [rows, C] scores; any
        value gives the same bits. `tiles`: the scores of each segment's rows on the tensor cores
        (`kernels.step.index_tiles`: bf16 values only, the prefill path with fake quantisation), a row's bits again
        those it gets alone. Sets each segment's `shared.topk[index]` and the traces `_topk` writes."""
        from dsv41.kernels.step.index_tiles import index_scores_tiles
        from dsv41.kernels.step.indexer import candidate_mask, index_scores, topk_select

        cfg, role = self.cfg, self.role
        dev = iq.device
        srcs = [s.state.source(role.kv_source) for s in segs]
        work = [(s, src) for s, src in zip(segs, srcs) if src.entries > 0]
        out: dict[int, tuple] = {}
        if work:
            ncols = max(src.entries for _, src in work)
            k = min(cfg.index_topk, ncols)
            meta, key_list, at, firsts = [], [], 0, []
            for s, src in work:  # per row: (q row, key offset, visible entries), all known on the host
                firsts.append(firsts[-1] + work[len(firsts) - 1][0].T if firsts else 0)  # the segment's first row
                C, j = src.entries, torch.arange(s.T, dtype=torch.int64)
                vis = torch.div(s.pos + j + 1, role.compress_ratio, rounding_mode="floor").clamp(max=C)
                meta.append(torch.stack((s.start + j, torch.full_like(j, at), vis)))
                key_list.append(src.index_k)
                at += C
            meta = torch.cat(meta, dim=1).to(dev)  # [3, R]
            keys = key_list[0] if len(key_list) == 1 else torch.cat(key_list)
            R = meta.shape[1]
            allow = _candidate_pool(work, R, ncols) if role.uses_candidates else None
            step = rows_per_launch or INDEX_ROWS
            ids = torch.empty(R, k, dtype=torch.int64, device=dev)
            cand = torch.empty(R, ncols, dtype=torch.bool, device=dev) if role.is_candidate_source else None
            scores = [] if trace is not None else None
            for a in range(0, R, step):
                b = min(a + step, R)
                if tiles:
                    sc = torch.empty(b - a, ncols, dtype=torch.float32, device=dev)
                    for (s, src), r0 in zip(work, firsts):  # each segment's rows in [a, b): one sequence's keys
                        lo, hi = max(a, r0), min(b, r0 + s.T)
                        if lo < hi:
                            q0 = s.start + lo - r0
                            index_scores_tiles(iq[q0:q0 + hi - lo], iw[q0:q0 + hi - lo], src.index_k,
                                               meta[2, lo:hi], ncols, None if allow is None else allow[lo:hi],
                                               w_scales=w_scales, out=sc[lo - a:hi - a])
                else:
                    sc = index_scores(iq, iw, keys, meta[0, a:b], meta[1, a:b], meta[2, a:b], ncols,
                                      None if allow is None else allow[a:b], w_scales=w_scales)
                if cand is not None:
                    cand[a:b] = candidate_mask(sc, meta[2, a:b], cfg.candidate_block_size, cfg.candidate_topk_blocks)
                ids[a:b] = topk_select(sc, k)
                if scores is not None:
                    scores.append(sc)
            scores = torch.cat(scores) if scores is not None else None
            at = 0
            for s, src in work:
                C, rows = src.entries, slice(at, at + s.T)
                out[id(s)] = (ids[rows, k - min(cfg.index_topk, C):], None if scores is None else scores[rows, :C])
                if cand is not None:
                    s.shared.candidates = cand[rows, :C]
                at += s.T
        for s in segs:
            ids, scores = out.get(id(s), (torch.empty(s.T, 0, dtype=torch.long, device=dev), None))
            s.shared.topk[role.index] = ids
            if trace is not None:
                trace.setdefault("index_ids", []).append(ids)
                trace.setdefault("index_scores", []).append(scores)

    @staticmethod
    def _scores(q: torch.Tensor, w: torch.Tensor, src, visible: torch.Tensor) -> torch.Tensor:
        """The reference's index scores for one sequence's rows from their (quantised) index queries and weights."""
        keys = src.index_k.float()
        scores = torch.empty(q.shape[0], keys.shape[0], device=q.device)
        for rows in row_blocks(q.shape[0]):
            per_head = torch.relu((q[rows].float()[:, :, None, :] * keys[None, None]).sum(dim=-1))
            scores[rows] = (w[rows][:, :, None] * per_head).sum(dim=1)
        return scores.masked_fill(~visible, float("-inf"))


def _candidate_pool(work, R: int, ncols: int) -> torch.Tensor:
    """The candidate pools of the rows of `work` as one [R, ncols] mask: the candidate source's padded launch
    itself when every segment's pool is its row slice in this order (so within a forward), else padded per segment."""
    pools = [s.shared.candidates for s, _ in work]
    base, at = pools[0]._base, 0
    if base is not None and base.dtype == torch.bool and tuple(base.shape) == (R, ncols) and base.is_contiguous():
        for (s, _), p in zip(work, pools):
            if p._base is not base or p.storage_offset() != base.storage_offset() + at * ncols or p.shape[0] != s.T:
                break
            at += s.T
        else:
            return base
    return torch.cat([_pad_slots(p, ncols, False) for p in pools])


def _pad_slots(t: torch.Tensor, S: int, fill) -> torch.Tensor:
    """t [T, s, ...] padded along the slots to S with `fill` (dead slots)."""
    if t.shape[1] == S:
        return t
    pad = torch.full((t.shape[0], S - t.shape[1], *t.shape[2:]), fill, dtype=t.dtype, device=t.device)
    return torch.cat((t, pad), dim=1)
