"""The DSpark draft pass over the KV pool (CPU path; MODEL.md §10, docs/ENGINE.md §6 "Drafting").

After a step, a row that asks for drafts (`Row.propose`) gets them from its last kept position p and the token y
just chosen for p + 1: the three draft blocks run over the block [y, noise x 4] at positions p + 1 .. p + 5,
attending to each stage's ring (positions ≤ p, seeded by every committed row: `PoolForward` absorbs the taps of
every row it runs, and the rows a rejected draft wrote lie past p, so they are never read and are overwritten
later). The math is `model/dspark.py`'s `draft_many` (the reference `draft` is that for one sequence): the blocks
run over all sequences' block rows together, attention per block over its own ring. The drafted token at each
position is the request's keyed choice at that absolute position (its seed, the step the target will use there,
its temperature / top-k / top-p / min-p; no grammar mask or penalties: a draft is only a guess, verified later),
so at T > 0 drafts track what the target will draw. Nothing is written to the pool.
"""

from __future__ import annotations

import torch

from ..engine.batch import Row
from .draft_chain import KeyedChoice
from .sampling import SamplingParams
from .pool_forward import PoolSequence, decoder_start


class DSparkDrafter:
    def __init__(self, model):
        if model.dspark is None:
            raise ValueError("the DSpark drafter needs the model's draft blocks (load with dspark=True)")
        self.model, self.dspark, self.cfg = model, model.dspark, model.cfg
        self.decoder_from = decoder_start(model.cfg)
        self.block = model.cfg.dspark_block_size

    @torch.inference_mode()
    def propose(self, pool, asks: list[tuple[Row, int, int, SamplingParams, int, int]]):
        """asks: (row, last kept position p, token y at p + 1, sampling, keyed step of the draft at p + 2, how
        many). Returns per ask (draft ids, confidences), at most `block` each."""
        if not asks:
            return []
        views = [PoolSequence(pool, Row(row.seq_id, row.slot, [], p + 1, row.page_ids,
                                        replay_start=row.replay_start), self.cfg, self.decoder_from)
                 for row, p, *_ in asks]
        rings = [[v.dspark_window(s).kv for s in range(len(self.dspark.blocks))] for v in views]
        drafts = self.dspark.draft_many(self.model, [y for _, _, y, *_ in asks], [p for _, p, *_ in asks], rings,
                                        [KeyedChoice(params, step0) for *_, params, step0, _ in asks])
        return [(d.tokens[:n], [float(c) for c in d.confidence[:n]]) for d, (*_, n) in zip(drafts, asks)]
