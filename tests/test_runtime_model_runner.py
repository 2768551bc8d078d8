"""ModelRunner's sampling of a step's rows: the plain greedy rows drawn together (one argmax over their stacked
logits, one read-back) give exactly the tokens each row drawn alone gets, ties included (the first maximum); rows
with a grammar mask, logit adjustments or a temperature keep their own path and their own tokens."""

from __future__ import annotations

import torch

from dsv41.engine.batch import DECODE, Batch, Row, RowSampling
from dsv41.runtime.model_runner import ModelRunner

V = 64


class _Forward:
    """The step's logits as given: per row, `[len(logit_offsets), V]`."""

    def __init__(self, logits):
        self.logits = logits

    def execute(self, rows, pool):
        return self.logits


def _greedy(step: int, **kw) -> RowSampling:
    return RowSampling(0.0, 1.0, 0, 0.0, seed=7, step=step, **kw)


def test_greedy_rows_together_pick_what_each_picks_alone():
    g = torch.Generator().manual_seed(0)
    tie = torch.randn(V, generator=g)
    tie[[9, 40]] = tie.max() + 1.0  # two equal maxima: the first wins
    mask = bytearray(8)  # ids 0..63 in two int32 words: allow 3 and 50 only
    mask[0] |= 1 << 3
    mask[50 // 8] |= 1 << (50 % 8)
    rows = [Row(0, 0, [1], 5, [0], phase=DECODE, sample=_greedy(0)),
            Row(1, 1, [2], 5, [1], phase=DECODE, sample=_greedy(3)),
            Row(2, 2, [3], 5, [2], phase=DECODE, sample=_greedy(1, mask=bytes(mask))),
            Row(3, 3, [4], 5, [3], phase=DECODE, sample=RowSampling(1.0, 1.0, 0, 0.0, seed=3, step=2)),
            Row(4, 4, [5, 6], 5, [4], phase="verify", sample=_greedy(2, logprobs=2), scores=[(0, 6, 1)])]
    logits = [torch.randn(1, V, generator=g), tie[None].clone(), torch.randn(1, V, generator=g),
              torch.randn(1, V, generator=g), torch.randn(2, V, generator=g)]
    runner = ModelRunner(_Forward(logits), pool=None)
    assert sorted(runner._greedy_tokens(rows, logits)) == [0, 1, 4]  # the masked and the sampled row stay out
    got = runner.execute(Batch(0, rows)).rows
    alone = [runner._row(row, lg) for row, lg in zip(rows, logits)]
    assert [o.token for o in got] == [o.token for o in alone]
    assert got[1].token == 9 and got[2].token in (3, 50)
    assert got[4].logprob == alone[4].logprob and got[4].top == alone[4].top and got[4].scored == alone[4].scored
    assert got[0].token == int(logits[0][0].argmax()) and got[4].token == int(logits[4][1].argmax())


def test_a_lone_greedy_row_keeps_its_own_path():
    rows = [Row(0, 0, [1], 5, [0], phase=DECODE, sample=_greedy(0))]
    logits = [torch.randn(1, V)]
    assert ModelRunner._greedy_tokens(rows, logits) == {}
    assert ModelRunner(_Forward(logits), pool=None).execute(Batch(0, rows)).rows[0].token == int(logits[0].argmax())
