"""The whole text model (MODEL.md §5): embedding -> Engram-augmented blocks -> final collapse -> head.

`Model.forward(state, ids)` absorbs a chunk of token ids into a sequence state and returns their logits; calling it
with the prompt in one piece, in chunks of any size, or one token at a time gives the same result, because every
piece of cross-chunk information lives in `SequenceState`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..config import ModelConfig
from dsv41.parallel.comm import Comm, LocalComm
from . import mhc
from .attention import Attention, Shared
from .moe import MoE
from .norm import rms_norm
from .state import SequenceState

LinearFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Block:
    """One layer: attention and MoE sublayers wrapped in single-pass mHC."""

    index: int
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn: mhc.HCParams
    hc_ffn: mhc.HCParams
    attn: Attention
    moe: MoE

    def forward(self, model: "Model", x: torch.Tensor, pre_in: torch.Tensor, positions: torch.Tensor,
                state: SequenceState, shared: Shared, trace: dict | None):
        attn_trace = {} if trace is not None else None
        x, f_pre, moe_trace = self.run(model, x, pre_in,
                                       lambda h: self.attn.forward(h, positions, state, shared, attn_trace),
                                       trace is not None)
        if trace is not None:
            trace[self.index] = {**attn_trace, **moe_trace, "streams_out": x, "pre_mix_out": f_pre}
        return x, f_pre

    def run(self, model: "Model", x: torch.Tensor, pre_in: torch.Tensor,
            attend: Callable[[torch.Tensor], torch.Tensor], want_trace: bool = False):
        """Both sublayers with single-pass mHC; `attend` maps the normed attention input to this rank's partial."""
        cfg, comm = model.cfg, model.comm
        hc, eps = cfg.hc_mult, cfg.rms_norm_eps
        a_pre, a_post, a_comb = mhc.coefficients(x, self.hc_attn, hc, eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
        h = rms_norm(mhc.collapse(x, pre_in), self.attn_norm, eps)
        y = comm.sum_partials(attend(h).float()).to(x.dtype)
        x = mhc.expand(y, x, a_post, a_comb)

        f_pre, f_post, f_comb = mhc.coefficients(x, self.hc_ffn, hc, eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
        h = rms_norm(mhc.collapse(x, a_pre), self.ffn_norm, eps)  # the FFN collapses with the attention site's pre
        moe_trace = {} if want_trace else None
        y = comm.sum_partials(self.moe.partial(h, moe_trace)).to(x.dtype)
        return mhc.expand(y, x, f_post, f_comb), f_pre, moe_trace


@dataclass
class VocabShard:
    """This rank's rows [start, end) of the embedding and of the head (vocab-parallel)."""

    start: int
    end: int
    embed: torch.Tensor  # [end - start, d]
    head: LinearFn  # rows [start, end) of the head; called on fp32 input: logits are computed in fp32


@dataclass
class Model:
    cfg: ModelConfig
    blocks: Sequence[Block]
    vocab: VocabShard
    final_norm: torch.Tensor
    engram: dict = field(default_factory=dict)  # layer id -> EngramLayer
    engram_hasher: object | None = None
    dspark: object | None = None
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    comm: Comm = field(default_factory=LocalComm)
    tokenizer: object | None = None

    def new_state(self) -> SequenceState:
        state = SequenceState()
        if self.engram_hasher is not None:
            state.engram = self.engram_hasher.new_history()
        return state

    # ------------------------------------------------------------------ pieces
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        v = self.vocab
        local = (ids >= v.start) & (ids < v.end)
        rows = v.embed[(ids - v.start).clamp(0, v.end - v.start - 1)].float()
        rows = rows * local[:, None]
        return self.comm.sum_partials(rows).to(self.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden rows [T, d] -> fp32 logits over the whole vocabulary [T, vocab]."""
        local = self.vocab.head(x.float())
        return self.comm.gather_cat(local, dim=-1)

    def hidden(self, state: SequenceState, ids: torch.Tensor, trace: dict | None = None):
        """Absorb `ids` [T] into `state`; returns (final-normed hidden [T, d], DSpark taps [T, n_taps*d] or None)."""
        cfg = self.cfg
        ids = ids.to(self.device).long().reshape(-1)
        T = ids.shape[0]
        positions = torch.arange(state.pos, state.pos + T, device=self.device)
        row_ids = live = None
        if self.engram_hasher is not None:
            row_ids = self.engram_hasher.hash(ids.cpu(), state.engram)  # [T, n_layers, n_cols]
            live = self.engram_hasher.live(ids.cpu())  # image-span tokens get no Engram term
            # the ids depend only on the tokens: start every Engram layer's reads now, under the layers before it
            for L, layer in self.engram.items():
                layer.prefetch(row_ids[:, cfg.engram_layer_ids.index(L)])

        h = self.embed(ids)
        if trace is not None:
            trace["embed_out"] = h
        x = h[:, None, :].expand(T, cfg.hc_mult, h.shape[-1]).contiguous()
        pre = torch.zeros(T, cfg.hc_mult, device=self.device)
        pre[:, 0] = 1.0  # the first collapse reads stream 0 only
        shared = Shared()
        taps = []
        for block in self.blocks:
            L = block.index
            if L in self.engram:
                x = self.engram[L](x, row_ids[:, cfg.engram_layer_ids.index(L)], live)
            if L in cfg.dspark_target_layer_ids:
                taps.append(x.float().mean(dim=1))
            x, pre = block.forward(self, x, pre, positions, state, shared, trace)
        out = rms_norm(mhc.collapse(x, pre), self.final_norm, cfg.rms_norm_eps)
        if trace is not None:
            trace["final_norm_out"] = out
        state.pos += T
        state.ids.extend(ids.tolist())
        tap = torch.cat(taps, dim=-1) if taps else None
        if tap is not None:
            state.last_taps = tap[-1]
        return out, tap

    def forward(self, state: SequenceState, ids: torch.Tensor, trace: dict | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Absorb `ids` [T] into `state` and return fp32 logits [T, vocab] (complete on every rank); with
        `last_only` just the last row's [1, vocab] (a prefill chunk needs no more: the head is the largest matmul
        and, under TP, the largest gather)."""
        out, taps = self.hidden(state, ids, trace)
        if self.dspark is not None and taps is not None:
            self.dspark.absorb(self, state, taps)
        return self.logits(out[-1:] if last_only else out)

    __call__ = forward
