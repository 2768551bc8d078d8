"""DSpark drafter forward (MODEL.md §10): three draft blocks fed by taps of the target model.

- Taps: the mean over mHC streams of the residual entering each `dspark_target_layer_ids` layer, concatenated.
  `main_x = RMSNorm(taps · main_projᵀ; main_norm)`.
- Absorb: for every committed position p, each stage s appends to its own window ring the K = V latent of
  `main_x[p]` computed with that stage's `wkv`/`kv_norm`, plain RoPE at p and FP8 fake-quant.
- Draft at the last committed position p, given y (the token chosen for p+1): block ids [y, noise × (B−1)] at
  positions p+1 .. p+B go through the stages (single-pass mHC, attention over the stage's ring plus all block
  rows, no causal mask inside the block, MoE); the collapsed hidden x gives base logits through the shared head
  after `norm`; a Markov head adds `markov_head · markov_embed[previous token]` row by row, each row's choice
  feeding the next; a confidence head maps [x_i ; e_i] to the logit that the draft at row i is accepted.
The verify/accept loop is the scheduler's (not part of the model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..config import ModelConfig
from . import mhc
from .attention import append_window
from .norm import rms_norm
from .state import SequenceState
from .transformer import Block

LinearFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Draft:
    tokens: list[int]  # B drafted ids for positions p+2 .. p+B+1
    logits: torch.Tensor  # [B, vocab] fp32, row i = distribution of tokens[i]
    confidence: torch.Tensor  # [B] fp32 acceptance probability of each draft given the previous ones


@dataclass
class DSpark:
    cfg: ModelConfig
    blocks: Sequence[Block]
    main_proj: LinearFn
    main_norm: torch.Tensor
    norm: torch.Tensor
    markov_embed: torch.Tensor  # [vocab, rank]
    markov_head: torch.Tensor  # [vocab, rank]
    confidence_proj: torch.Tensor  # [1, d + rank]

    def main_x(self, taps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return rms_norm(self.main_proj(taps.to(dtype)), self.main_norm, self.cfg.rms_norm_eps)

    def absorb(self, model, state: SequenceState, taps: torch.Tensor) -> None:
        """Seed every stage's ring with the committed rows' `main_x` (prefill chunks and decode alike)."""
        T = taps.shape[0]
        positions = torch.arange(state.pos - T, state.pos, device=taps.device)
        mx = self.main_x(taps, model.dtype)
        for s, block in enumerate(self.blocks):
            append_window(state.dspark_window(s), block.attn.window_kv(mx, positions), self.cfg.sliding_window)

    @torch.no_grad()
    def draft(self, model, state: SequenceState, y: int,
              choose: Callable[[torch.Tensor, int], int] | None = None) -> Draft:
        """Draft B tokens after the committed sequence in `state` followed by `y`. `choose(logits_row, i)` picks
        each row's token (greedy when None).

        The reference for the engine's drafter (runtime/draft_dspark.py runs `draft_many` over the pool's rings,
        several sequences in one pass; its drafts are checked against this)."""
        rings = [state.dspark_window(s).kv for s in range(len(self.blocks))]
        return self.draft_many(model, [y], [state.pos - 1], [rings], [choose])[0]

    @torch.no_grad()
    def draft_many(self, model, ys: Sequence[int], last: Sequence[int], rings: Sequence[Sequence[torch.Tensor | None]],
                   chooses: Sequence[Callable[[torch.Tensor, int], int] | None]) -> list[Draft]:
        """`draft` for n sequences at once: sequence i's last committed position `last[i]`, its token `ys[i]` for
        the position after, its stage rings `rings[i][s]` (the window rows up to last[i]). The stages, the norm and
        the head run over every block row together (row-wise math: each sequence's bits are its own); attention
        runs per block over its own ring; the Markov and confidence heads chain row by row per sequence."""
        cfg = self.cfg
        B, n = cfg.dspark_block_size, len(ys)
        ids = torch.tensor([t for y in ys for t in [y] + [cfg.dspark_noise_token_id] * (B - 1)], device=model.device)
        positions = torch.cat([torch.arange(p + 1, p + 1 + B, device=model.device) for p in last])
        h = model.embed(ids)
        x = h[:, None, :].expand(n * B, cfg.hc_mult, h.shape[-1]).contiguous()
        pre = torch.zeros(n * B, cfg.hc_mult, device=model.device)
        pre[:, 0] = 1.0
        for s, block in enumerate(self.blocks):
            def attend(hh, blk=block, s=s):
                return torch.cat([blk.attn.forward_block(hh[i * B:(i + 1) * B], positions[i * B:(i + 1) * B],
                                                         rings[i][s]) for i in range(n)])

            x, pre, _ = block.run(model, x, pre, attend)
        collapsed = mhc.collapse(x, pre)
        base = model.logits(rms_norm(collapsed, self.norm, cfg.rms_norm_eps))
        return [self._chain(collapsed[i * B:(i + 1) * B], base[i * B:(i + 1) * B], ys[i],
                            chooses[i] or (lambda row, j: int(torch.argmax(row)))) for i in range(n)]

    def _chain(self, collapsed: torch.Tensor, base: torch.Tensor, y: int,
               choose: Callable[[torch.Tensor, int], int]) -> Draft:
        """The Markov head row by row (each row's choice feeds the next) and the confidence head."""
        tokens, rows, conf, prev = [], [], [], y
        for i in range(base.shape[0]):
            e = self.markov_embed[prev].float()
            row = base[i] + self.markov_head.float() @ e
            conf.append(torch.sigmoid(self.confidence_proj.float() @ torch.cat((collapsed[i].float(), e))))
            prev = choose(row, i)
            tokens.append(prev)
            rows.append(row)
        return Draft(tokens, torch.stack(rows), torch.cat(conf))
