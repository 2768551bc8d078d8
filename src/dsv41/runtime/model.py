"""FastModel: the second forward (ENGINE.md §1), over rows of several sequences at once, weights in stored form.

`FastModel.forward(segments, phase)` absorbs one chunk of token ids per sequence (`(state, ids)` pairs, at most one
per sequence) and returns fp32 logits. The phase picks the matmul path (ENGINE.md §4), never the row count:
- "decode" / "verify": every EXL3 matrix through the fused row-invariant kernels, routed experts through the
  kernels' MoE. The rows are laid out in a fixed bucket of `BUCKET` rows (real rows first, the rest mirroring
  row 0), so every torch op between the kernels runs on one shape whatever the number of real rows: a row's
  logits are the same bits alone and among up to BUCKET - 1 others. Over the KV pool (every op a row-invariant
  kernel) a step runs its row bucket (`row_bucket`: 1-8, 12, 16, 24, 32 rows, up to STEP_ROWS). Larger batches
  run in buckets one after another; a sequence's rows stay in one bucket (at most BUCKET of them).
- "prefill": the tile kernels (`kernels/exl3/prefill.py`: each weight tile decoded once per tile of rows, the routed
  experts grouped by expert on the device), all rows in one pass; DSV41_PREFILL_TILES=0 takes the
  reconstruct-into-the-workspace + GEMM path instead.
The head takes the fused kernel in every phase: its rows are sampling rows (`logits="last"`: one per sequence).

mHC (each site's coefficients, Sinkhorn, collapse and norm) runs in the step kernels (kernels/step/mhc.py: two
launches per layer, each site fused with the expand before it; a lone expand before an Engram layer and before the
final collapse + norm) wherever Triton runs (CUDA, the interpreter), else as the reference's math; prefill rows'
sites as tiles with DSV41_PREFILL_MHC_TILES=1 (kernels/step/mhc_prefill.py) or as row blocks with
DSV41_PREFILL_MHC_BLOCKS=1 (kernels/step/mhc_blocks.py; `MhcSites.of(phase=)` picks). The rest of the
forward is the reference's math (`model/`): norms, attention, indexer, compressor and Engram on per-sequence
`SequenceState`s, the states' tensors on the model's device. With the drafter (`dspark`: runtime/draft_fast.py) every
row's taps (the streams' mean entering each DSpark target layer: an extra output of that layer's "attn_in" piece)
go to the stage rings: in place inside the step's graph, else appended to the views ("dspark.absorb" piece).

Decode and verify forwards run their static parts as CUDA graph pieces (`graphs.PieceGraphs`, keyed by piece,
phase and n real rows; `DSV41_GRAPHS=0` keeps them eager): "embed" (the embedding, its reduction and the streams),
per layer "attn_in.L" (the attention mHC site, with the previous FFN's expand, and the attention's static
projections) and "ffn.L" (the attention's output projections, the reduction, the FFN mHC site, the MoE and its
reduction), and "final" (the last expand, the final norm and the head's local logits). Between them the per-sequence
attention work (`FastAttention.attend`) and the Engram layers run eagerly. Prefill and traced forwards are eager.
Given the KV pool (`forward(..., pool=...)`, decode / verify), attention works on the pool in place and the whole
bucket is one graph instead (`_forward_pool`, `_pool_step`; runtime/step_tables.py).
A replay is the eager run's kernels on the same buffers: the same bits (tests/test_runtime_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Sequence

import numpy as np
import torch

from dsv41.config import ModelConfig
from dsv41.engram.hashing import EngramHasher
from dsv41.engram.shards import decode_row_bytes
from dsv41.kernels.step import engram as step_engram
from dsv41.model.engram import engram_mix, engram_project
from dsv41.model.state import SequenceState
from dsv41.parallel.comm import Comm, LocalComm

from .graphs import PieceGraphs
from .mhc_sites import HC, MhcSites
from .layers.attention import FastAttention, Segment, step_kernels_run
from .layers.linear import PrefillWorkspace, is_fused
from .layers.moe import FusedMoE
from .pool_forward import decoder_start
from .engram_gate import GatedRows
from .pool_step import engram_stored, forward_pool, ids_positions
from .sections import section

_NOT_HELD = ("cfg", "workspace", "ref", "rope", "constants", "launch")
BUCKET = 16  # rows of one sequence's decode/verify chunk, and the fixed bucket of the forward without a pool
ROW_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)  # the row counts a step's graph is captured for (ENGINE.md §5)
STEP_ROWS = ROW_BUCKETS[-1]  # rows of one decode/verify step over the pool (the MoE runs them as 16-row windows)


def _tapped(attn_in, *args):
    """An "attn_in" piece that also returns the DSpark tap of the streams entering the layer (fp32 mean)."""
    out = attn_in(*args)
    return (*out, out[0].float().mean(dim=1))


def row_bucket(n: int) -> int:
    """The rows an in-place step of n real rows runs: the smallest of ROW_BUCKETS holding them (the rows past n
    mirror row 0 and write nothing, so a real row's bits are those of any other count)."""
    for b in ROW_BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"a bucket holds at most {ROW_BUCKETS[-1]} rows, got {n}")


@dataclass
class Rows:
    """What a forward's blocks run on: the mHC sites, the n real rows, the segments, the positions P and the
    Engram rows; CED bounded replay (`FastModel._replay_cut`) replaces them with the rows it keeps."""

    sites: MhcSites
    n: int
    segs: list | None
    P: torch.Tensor
    engram_rows: dict | None = None
    live: torch.Tensor | None = None
    taps: list | None = None  # the DSpark taps of the rows, one [B, d] per target layer (with the drafter)


@dataclass
class FastBlock:
    index: int
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn: HC
    hc_ffn: HC
    attn: FastAttention
    moe: FusedMoE


@dataclass
class FastEngram:
    """The Engram before one layer: table rows (this rank's hash columns) -> wkv (row-parallel) -> sum -> gate."""

    layer_id: int
    table: object  # EngramTable (or a stand-in with its `gather`)
    wkv: object
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    gate_weight: torch.Tensor | None = None  # q_weight * k_weight in fp32 (the gate kernel's form), made at build

    def __post_init__(self):
        if self.gate_weight is None:
            self.gate_weight = step_engram.gate_weight(self.q_weight, self.k_weight)

    def __call__(self, x, rows, live, n, phase, comm: Comm):
        """`rows`: this layer's gathered table rows `[B, cols, head_dim]` on the device (read at the step's start,
        so no host copy waits inside the forward). Where the step kernels run, the gate and the mix are one launch
        (`kernels.step.engram`; the padding rows from n on come out zero)."""
        kv = comm.sum_partials(engram_project(rows, partial(self.wkv, n=n, phase=phase), x.dtype))
        if step_kernels_run(x.device):
            return step_engram.engram_mix_rows(x.contiguous(), kv, self.gate_weight, self.eps, live, rows=n)
        return engram_mix(x, kv, self.q_weight, self.k_weight, self.eps, live)


@dataclass
class FastModel:
    cfg: ModelConfig
    blocks: Sequence[FastBlock]
    vocab_start: int
    vocab_end: int
    embed_rows: torch.Tensor  # [vocab_end - vocab_start, d]
    head: object  # column-parallel over the vocabulary, fused in every phase
    final_norm: torch.Tensor
    workspace: PrefillWorkspace
    engram: dict = field(default_factory=dict)  # layer id -> FastEngram
    engram_hasher: EngramHasher | None = None
    dtype: torch.dtype = torch.bfloat16
    device: torch.device = torch.device("cpu")
    comm: Comm = field(default_factory=LocalComm)
    tokenizer: object | None = None
    fake_quant: bool = True
    held: list = field(default_factory=list)  # weights built but not run here (DSpark blocks of a synthetic rank)
    graphs: PieceGraphs | None = None  # the decode/verify pieces' CUDA graphs, made on the first fused forward
    dspark: object | None = None  # FastDSpark (runtime/draft_fast.py): the rows' taps seed its rings
    engram_gate: object | None = None  # EngramGate (runtime/engram_gate.py): Engram rows published after the launch

    def new_state(self) -> SequenceState:
        state = SequenceState()
        if self.engram_hasher is not None:
            state.engram = self.engram_hasher.new_history()
        return state

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, segments: Sequence[tuple[SequenceState, object]], phase: str = "decode",
                logits: str = "last", trace: dict | None = None, pool=None, writes: bool = True,
                watch=None, replay_from: Sequence[int] | None = None, follow=None) -> torch.Tensor:
        """Absorb each `(state, ids)` chunk; returns fp32 logits `[rows, vocab]` (complete on every rank): every
        row's for `logits="all"`, else each chunk's last row (decode chunks are one row: every row).

        `pool` (a `KVPool`; decode / verify, untraced, where the step kernels run): the states are the pool's
        sequences (`PoolSequence`: `.row` names the ring slot and page table) and attention works on the pool in
        place (`FastAttention.attend_pool`), the whole bucket one CUDA graph (`_pool_step`); nothing of the
        sequences is loaded into the states, and nothing is left to store back. `writes=False` (over a pool): the
        step's tables write nothing, so the pool is left as it was (what the graphs captured before serving run on:
        `FastForward.capture_graphs`). `watch` (runtime/abort.py, prefill): asked between layers whether the step is
        still wanted; raises StepAborted before the states advance, their caches partly written (the engine's are
        views of the pool, stored back only after the last layer: it drops them).

        `replay_from` (prefill; CED bounded replay, MODEL.md §11): per chunk, the replay segment's start. A chunk's
        rows before it run the encoder layers, then only the first decoder layer's compressor and index keys
        (`_replay_cut`); the logits are those of the rows that remain (a chunk with none gives none: "last" then
        returns one row per chunk that has rows left).

        `follow` (over a pool, decode; the overlapped loop): `(source, index)`, `index[i] >= 0` naming chunk i a
        follow row whose one id is `source[index[i]]` (the previous step's sample, int64 on the device): its id
        in `segments` is a placeholder, and the tables' ids take the device's before the step's graph."""
        if logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
        chunks = [(state, torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()) for state, ids in segments]
        if len({id(s) for s, _ in chunks}) != len(chunks):
            raise ValueError("one chunk per sequence per forward")
        if replay_from is not None:
            if len(replay_from) != len(chunks):
                raise ValueError(f"replay_from names {len(replay_from)} chunks, the forward has {len(chunks)}")
            cuts = [min(max(int(r) - s.pos, 0), ids.numel()) for (s, ids), r in zip(chunks, replay_from)]
            if any(cuts) and (is_fused(phase) or trace is not None):
                raise ValueError("CED bounded replay cuts prefill rows only (untraced)")
            replay_from = cuts if any(cuts) else None
        if not is_fused(phase):
            return self._forward(chunks, phase, logits, trace, watch=watch, cuts=replay_from)
        most = STEP_ROWS if pool is not None and self.pool_runs(phase, trace) else BUCKET
        if follow is not None and most != STEP_ROWS:
            raise ValueError("follow rows take their ids on the device in a step over the pool only")
        index = list(follow[1]) if follow is not None else [-1] * len(chunks)
        out, group, rows, at = [], [], 0, 0
        sub = lambda: None if follow is None else (follow[0], index[at - len(group):at])  # noqa: E731
        for state, ids in chunks:
            if ids.numel() > BUCKET:
                raise ValueError(f"a {phase} chunk has at most {BUCKET} rows, got {ids.numel()}")
            if rows + ids.numel() > most:
                out.append(self._forward(group, phase, logits, trace, pool, writes, follow=sub()))
                group, rows = [], 0
            group.append((state, ids))
            rows += ids.numel()
            at += 1
        out.append(self._forward(group, phase, logits, trace, pool, writes, follow=sub()))
        return torch.cat(out)  # always a new tensor: the logits outlive the graph pieces' output buffers

    __call__ = forward

    def _seeds(self, states=(), pool=None) -> list | None:
        return None if self.dspark is None else self.dspark.seeds(states, pool)  # runtime/draft_fast.py

    def piece_graphs(self) -> PieceGraphs:
        """This model's CUDA graphs, made on first use."""
        if self.graphs is None:
            self.graphs = PieceGraphs(self.device, self.comm)
        return self.graphs

    def pool_runs(self, phase: str, trace: dict | None = None) -> bool:
        """Whether a forward of `phase` given a pool works on it in place (decode / verify, untraced, where the
        step kernels run: CUDA, or the interpreter)."""
        return is_fused(phase) and trace is None and step_kernels_run(self.device)

    def _forward(self, chunks, phase: str, logits: str, trace: dict | None, pool=None, writes: bool = True,
                 watch=None, cuts: list[int] | None = None, follow=None) -> torch.Tensor:
        cfg, dev = self.cfg, self.device
        segs, at = [], 0
        for state, ids in chunks:
            segs.append(Segment(state, at, ids.numel(), state.pos))
            at += ids.numel()
        n = at
        pooled = pool is not None and self.pool_runs(phase, trace)
        B = row_bucket(n) if pooled else BUCKET if is_fused(phase) else n
        if pooled:
            return self._forward_pool(segs, chunks, pool, phase, n, B, writes, follow)
        if follow is not None and max(follow[1]) >= 0:
            raise ValueError("follow rows take their ids on the device in a step over the pool only")
        ids_b, pos_b = ids_positions(segs, [c[1] for c in chunks], B)
        stored = rows = live = None
        if self.engram_hasher is not None:
            stored = engram_stored(self, segs, [c[1] for c in chunks], B)
        if stored is not None:
            with section("engram"):
                rows = {L: r.decode(dev) for L, r in stored.items()}
                live = self.engram_hasher.live(ids_b).to(dev)
        piece = self._piece_runner(phase, n, trace)
        x, pre, P = piece("embed", self._streams, ids_b.to(dev), pos_b.to(dev))
        # what the blocks run on: the replay cut (`_replay_cut`) leaves fewer rows, segments and positions
        at = Rows(MhcSites.of(cfg, dev, rows=n, phase=phase), n, segs, P, rows, live,
                  self._seeds([s.state for s in segs]))

        def run_block(block, x, pre, pending):
            layer_trace = {} if trace is not None else None
            out = self._block(block, at.sites, x, pre, pending, at.n, at.P, at.segs, phase, layer_trace, piece,
                              taps=at.taps)
            if trace is not None:
                trace.setdefault(block.index, []).append(layer_trace)
            return out

        cut = None if cuts is None else partial(self._replay_cut, at, cuts, phase)
        x, pre, pending = self._layers(at, x, pre, phase, run_block, None if is_fused(phase) else watch, cut)
        if at.taps:  # the stage rows in a piece, appended to the views on the host
            stage = partial(self.dspark.stage_rows, n=at.n, phase=phase, dtype=self.dtype)
            self.dspark.absorb_segments(piece("dspark.absorb", stage, at.taps, at.P), at.segs)
        for s, (_, i) in zip(segs, chunks):
            s.state.pos += s.T
            s.state.ids.extend(i.tolist())
        sites, n, segs = at.sites, at.n, at.segs
        if is_fused(phase):  # every row is a sampling row (`forward` copies them out of the piece's buffer)
            local = piece("final", partial(self._final, sites, n, phase), x, pending, pre)
            with section("comm"):
                return self.comm.gather_cat(local, dim=-1)
        if n == 0:  # every row stopped after the encoder half (replay)
            return torch.zeros(0, self.cfg.vocab_size, dtype=torch.float32, device=dev)
        out = self._final_norm(sites, x, pending, pre)
        if logits == "all":
            return self._logits(out, n, phase)
        last = torch.tensor([s.start + s.T - 1 for s in segs], device=dev)
        return self._logits(out[last], len(segs), phase)

    def _replay_cut(self, at: "Rows", cuts: list[int], phase: str, block: FastBlock, x, pre, pending):
        """CED bounded replay at the first decoder layer (MODEL.md §11; `PoolForward._encoder_only_rows`): each
        segment's first `cuts[i]` rows (before its replay segment) feed this layer's KV source — the attention
        site's normed input (the pending FFN expand applied), the compressor's projections, entries and index keys
        — and go no further. The remaining rows (a contiguous suffix of each segment) go on: `at`'s sites, n,
        segments, positions and Engram rows rebuilt for them; returns their `(x, pre, pending)`. Every launch
        here is row-wise, so a kept row's bits do not depend on the rows cut beside it (chunked == one-shot)."""
        dev = x.device
        drop = np.zeros(at.n, dtype=bool)
        kept_segs, gone_segs, k, g = [], [], 0, 0
        for s, c in zip(at.segs, cuts):
            drop[s.start:s.start + c] = True
            if c:
                gone_segs.append(Segment(s.state, g, c, s.pos, s.shared))
                g += c
            if s.T > c:
                kept_segs.append(Segment(s.state, k, s.T - c, s.pos + c, s.shared))
                k += s.T - c
        gone = torch.from_numpy(np.flatnonzero(drop)).to(dev)
        keep = torch.from_numpy(np.flatnonzero(~drop)).to(dev)
        sub = lambda t: None if t is None else tuple(v[gone] for v in t)  # noqa: E731
        gone_sites = MhcSites.of(self.cfg, dev, rows=g, phase=phase)
        with section("mhc"):
            if pending is None:
                h = gone_sites.site(x[gone], block.hc_attn, pre[gone], block.attn_norm)[0]
            else:
                y, post, comb = sub(pending)
                h = gone_sites.expand_site(y, x[gone], post, comb, block.hc_attn, pre[gone], block.attn_norm)[1]
        block.attn.compress_only(h, g, gone_segs, phase)
        at.sites, at.n, at.segs, at.P = MhcSites.of(self.cfg, dev, rows=k, phase=phase), k, kept_segs, at.P[keep]
        if at.engram_rows is not None:
            at.engram_rows = {L: r[keep] for L, r in at.engram_rows.items()}
            at.live = at.live[keep]
        pending = None if pending is None else tuple(v[keep] for v in pending)
        return x[keep], pre[keep], pending

    def _forward_pool(self, segs, chunks, pool, phase: str, n: int, B: int, writes=True, follow=None):
        """One bucket over the pool as one graph (runtime/pool_step.py `forward_pool`)."""
        return forward_pool(self, segs, chunks, pool, phase, n, B, writes, follow)

    def _pool_step(self, sites: MhcSites, n: int, phase: str, pool, tables, packed, formats: dict, gated=False):
        """The whole decode / verify step of a bucket over the pool: a pure function of its tensors (the pool's
        stores and the weights are constants), so it can be one CUDA graph. The bucket's token ids, positions and
        Engram rows as stored (`formats`: layer -> (kind, head_dim)) travel in the tables' buffer; the rows are
        decoded here, inside the graph (`gated`: the Engram gate copies them in before the first Engram layer, then
        they are decoded). Returns this rank's logits [n, V/tp]."""
        t = tables.on(packed)
        decode = lambda t: {L: decode_row_bytes(t.bytes_of(f"engram.{L}"), kind, dim)  # noqa: E731
                            for L, (kind, dim) in formats.items()}
        rows = GatedRows(self.engram_gate, t, decode) if gated else decode(t)
        live = self.engram_hasher.live(t["ids"]) if self.engram_hasher is not None else None
        eager = lambda name, fn, *args: fn(*args)  # noqa: E731
        x, pre, P = self._streams(t["ids"], t["pos"])
        taps = self._seeds(pool=pool)
        x, pre, pending = self._layers(
            Rows(sites, n, None, P, rows, live), x, pre, phase,
            lambda block, x, pre, pending: self._block(block, sites, x, pre, pending, n, P, None, phase, None, eager,
                                                       pool=(t, pool), taps=taps))
        if taps:  # into the DSpark rings at the rows' ring rows, inside the graph
            self.dspark.absorb_pool(taps, n, P, t, pool, phase, self.dtype)
        return self._final(sites, n, phase, x, pending, pre)

    def _layers(self, at: "Rows", x, pre, phase: str, run_block, watch=None, cut=None):
        """The blocks in order (`run_block(block, x, pre, pending) -> (x, pre, pending)`), each Engram layer before
        its block with the pending FFN expand applied first (`at`: the sites, row count and Engram rows). `pending`:
        the last FFN site's (y, post, comb), whose expand runs fused with the next attention site. Returns the last
        `(x, pre, pending)`. `watch` (runtime/abort.py): checked before each block (StepAborted). `cut` (replay:
        `_replay_cut`, which updates `at`): called before the first decoder layer; the loop ends once no row
        remains."""
        pending = None
        cut_at = None if cut is None else decoder_start(self.cfg)
        if watch is not None:
            watch.start()
        for i, block in enumerate(self.blocks):
            if watch is not None:
                watch.check(i)
            if block.index == cut_at:
                x, pre, pending = cut(block, x, pre, pending)
                if at.n == 0:  # every row of the step stopped after the encoder half
                    break
            if block.index in self.engram:
                with section("mhc"):
                    x, pending = at.sites.expanded(x, pending), None
                with section("engram"):
                    x = self.engram[block.index](x, at.engram_rows[block.index], at.live, at.n, phase,
                                                 self.comm).contiguous()
            x, pre, pending = run_block(block, x, pre, pending)
        return x, pre, pending

    def _piece_runner(self, phase: str, n: int, trace: dict | None):
        """`piece(name, fn, *args) -> fn(*args)`: through the graphs for decode and verify rows, else eager."""
        if not is_fused(phase):
            return lambda name, fn, *args: fn(*args)
        graphs, tracing = self.piece_graphs(), trace is not None
        return lambda name, fn, *args: graphs.run(name, phase, n, fn, *args, tracing=tracing)

    def _block(self, block: FastBlock, sites: MhcSites, x, pre_in, pending, n, P, segs, phase, trace, piece=None,
               pool=None, taps: list | None = None):
        """Single-pass schedule (MODEL.md §6.3): the attention site collapses with `pre_in` and computes the pre the
        FFN site collapses with; the FFN site's pre goes to the next layer. `pending`: the previous layer's FFN
        output and coefficients `(y, post, comb)`, expanded into x in this attention site's launch (None: x is the
        streams). Returns `(x, pre, pending)`, x before this layer's FFN expand, which `pending` carries. `piece`
        runs the static parts (`_piece_runner`; default eager). `taps` (with the drafter): a DSpark target layer's
        tap of the streams entering it is appended, an output of the "attn_in" piece."""
        piece = piece or (lambda name, fn, *args: fn(*args))
        L = block.index
        # over the pool, the window KV goes into its ring row from the launch that makes it (`project(window=)`)
        window = None if pool is None else (pool[1].stores[("window", L)], pool[0].ring_dest, pool[1].window_codec)
        attn_in = partial(self._attn_in, block, sites, n, phase, window=window)
        tapped = taps is not None and L in self.cfg.dspark_target_layer_ids
        out = piece(f"attn_in.{L}{'.tap' if tapped else ''}", partial(_tapped, attn_in) if tapped else attn_in, x,
                    pre_in, pending, P)
        if tapped:
            taps.append(out[-1])
        x, a_pre, a_post, a_comb, proj = out[:5]
        if pool is None:
            o = block.attn.attend(proj, n, P, segs, phase, trace)
            roped = block.attn.attend_ropes(phase, o.device)
        else:  # (tables, pool): attention over the pool in place
            o, roped = block.attn.attend_pool(proj, n, P, pool[0], pool[1], phase), True
        x, f_pre, y, f_post, f_comb = piece(f"ffn.{L}", partial(self._ffn, block, sites, n, phase, trace, roped), o,
                                            P, x, a_post, a_comb, a_pre)
        if trace is not None:  # the reference's per-layer record (model/transformer.py); one more launch, traced only
            trace.update(streams_out=sites.expanded(x, (y, f_post, f_comb))[:n], pre_mix_out=f_pre[:n])
        return x, f_pre, (y, f_post, f_comb)

    # ------------------------------------------------------------------ pieces (pure functions of their tensors)
    def _streams(self, ids: torch.Tensor, P: torch.Tensor):
        """The embedding of the bucket's ids as hc streams, the first collapse's pre (stream 0), and the positions
        P as they came (as a piece's output, P is then one static buffer every later piece reads: one copy a step)."""
        with section("embed"):
            h = self._embed(ids)
        x = h[:, None, :].expand(h.shape[0], self.cfg.hc_mult, h.shape[-1]).contiguous()
        pre = torch.zeros(h.shape[0], self.cfg.hc_mult, device=h.device)
        pre[:, 0] = 1.0
        return x, pre, P

    def _attn_in(self, block: FastBlock, sites: MhcSites, n, phase, x, pre_in, pending, P, window=None):
        """The attention mHC site (the previous FFN's expand fused in) and the attention's static projections:
        `(x, pre, post, comb, proj)`; `window` (over the pool): `project`'s."""
        with section("mhc"):
            if pending is None:
                h, a_pre, a_post, a_comb = sites.site(x, block.hc_attn, pre_in, block.attn_norm)
            else:
                y, post, comb = pending
                x, h, a_pre, a_post, a_comb = sites.expand_site(y, x, post, comb, block.hc_attn, pre_in,
                                                                block.attn_norm)
        return x, a_pre, a_post, a_comb, block.attn.project(h, n, P, phase, window=window)

    def _ffn(self, block: FastBlock, sites: MhcSites, n, phase, trace, roped, o, P, x, a_post, a_comb, a_pre):
        """The attention's output projections and reduction, the FFN mHC site, the MoE and its reduction:
        `(x, pre, y, post, comb)`. `roped`: o comes inverse-RoPE'd in x's dtype (`attend_pool`, `attend` where
        `attend_ropes`)."""
        comm = self.comm
        y = block.attn.output(o, n, P, phase, x.dtype, roped=roped)
        with section("comm"):  # the partials are x.dtype: the comm widens them to fp32 for the sum and rounds once
            y = comm.sum_partials(y)
        with section("mhc"):
            x, h, f_pre, f_post, f_comb = sites.expand_site(y, x, a_post, a_comb, block.hc_ffn, a_pre, block.ffn_norm)
        y = block.moe.partial(h, n, phase, trace)
        with section("comm"):
            y = comm.sum_partials(y)
        if not sites.kernels:  # the step kernels round the fp32 sum to the streams' dtype in the expand's load
            y = y.to(x.dtype)
        return x, f_pre, y, f_post, f_comb

    def _final_norm(self, sites: MhcSites, x, pending, pre):
        with section("mhc"):
            x = sites.expanded(x, pending)
        with section("norms"):
            return sites.collapse_norm(x, pre, self.final_norm)

    def _final(self, sites: MhcSites, n, phase, x, pending, pre):
        """The last expand, the final norm and this rank's logits of the n real rows (the gather stays outside:
        TorchComm's gather_cat reads the shard sizes on the host)."""
        out = self._final_norm(sites, x, pending, pre)
        with section("head"):
            return self.head(out.float(), n, phase, out_dtype=torch.float32)[:n]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        v0, v1 = self.vocab_start, self.vocab_end
        local = (ids >= v0) & (ids < v1)
        rows = self.embed_rows[(ids - v0).clamp(0, v1 - v0 - 1)].float() * local[:, None]
        with section("comm"):
            return self.comm.sum_partials(rows).to(self.dtype)

    def _logits(self, x: torch.Tensor, n: int, phase: str) -> torch.Tensor:
        with section("head"):
            local = self.head(x.float(), n, phase, out_dtype=torch.float32)[:n]
        with section("comm"):
            return self.comm.gather_cat(local, dim=-1)

    # ------------------------------------------------------------------ accounting
    def tensors(self):
        """Every device tensor the model holds (weights, norms, tables; not the workspace), each once."""
        seen, stack = set(), [self.blocks, self.head, self.embed_rows, self.final_norm, self.engram, self.held,
                              self.dspark]
        while stack:
            obj = stack.pop()
            if isinstance(obj, torch.Tensor):
                if obj.device.type == self.device.type and id(obj) not in seen:
                    seen.add(id(obj))
                    yield obj
            elif isinstance(obj, dict):
                stack.extend(obj.values())
            elif isinstance(obj, (list, tuple)):
                stack.extend(obj)
            elif hasattr(obj, "__dict__") and not isinstance(obj, (ModelConfig, PrefillWorkspace, type)):
                stack.extend(v for k, v in vars(obj).items() if k not in _NOT_HELD)

    def stored_bytes(self) -> int:
        """Bytes of the tensors held (views of one storage counted once)."""
        storages = {}
        for t in self.tensors():
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        return sum(storages.values())
