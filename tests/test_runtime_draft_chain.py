"""The DSpark chain on the device (runtime/draft_chain.py) against the reference chain (`model/dspark.py`
`DSpark._chain` with `runtime/sampling.py`'s keyed choice): the same ids, logits and confidences bit for bit, greedy
and sampled with every filter, several sequences at once; and no host read inside the chain."""

from __future__ import annotations

import pytest
import torch

from dsv41.model.dspark import DSpark
from dsv41.runtime.draft_chain import Chained, Flags, KeyedChoice, chain, keyed_choices, keyed_scores, sampling_rows
from dsv41.runtime.sampling import SamplingParams, filter_logits, keyed_gumbel, sample_token

V, D, R, ROWS = 3001, 48, 16, 5  # an odd vocabulary: the vector loops' tails are exercised
PARAMS = [SamplingParams(temperature=0.0),
          SamplingParams(temperature=0.7, seed=3),
          SamplingParams(temperature=1.3, seed=11, top_k=40),
          SamplingParams(temperature=0.9, seed=5, top_p=0.8),
          SamplingParams(temperature=1.1, seed=2**40 + 7, min_p=0.05),
          SamplingParams(temperature=0.6, seed=9, top_k=200, min_p=0.01, top_p=0.95),
          SamplingParams(temperature=2.0, seed=1, top_k=V + 5, top_p=1.0)]


def _logits(g: torch.Generator, n: int) -> torch.Tensor:
    x = torch.randn(n, V, generator=g) * 3
    x[:, 17] = x[:, 18]  # an exact tie (the first maximum wins, as torch.argmax's)
    return x


@pytest.mark.parametrize("step0", [0, 1234567])
def test_keyed_choices_are_sample_token_bit_for_bit(step0):
    g = torch.Generator().manual_seed(step0 + 1)
    chooses = [KeyedChoice(p, step0 + 3 * q) for q, p in enumerate(PARAMS)]
    ints, floats, flags = sampling_rows(chooses, ROWS, V)
    assert flags == Flags(True, True, True, True)
    ints, floats = torch.tensor(ints), torch.tensor(floats, dtype=torch.float64)
    for i in range(ROWS):
        rows = _logits(g, len(PARAMS))
        got = keyed_choices(rows, ints, floats, i, flags).tolist()
        want = [sample_token(rows[q].clone(), c.params, c.params.seed, c.step0 + i) for q, c in enumerate(chooses)]
        assert got == want, i
        # and the scores they are the argmax of: the filtered row plus the noise, bit for bit
        scores = keyed_scores(rows, ints, floats, i, flags)
        for q, c in enumerate(chooses[1:], 1):
            ref = filter_logits(rows[q].clone(), c.params) + keyed_gumbel(c.params.seed, c.step0 + i, torch.arange(V))
            assert torch.equal(scores[q], ref), (i, q)
    # a pass of greedy rows only takes the argmaxes (no float64 work)
    ints, floats, flags = sampling_rows([None, KeyedChoice(PARAMS[0], 0)], ROWS, V)
    assert flags == Flags()
    rows = _logits(g, 2)
    assert keyed_choices(rows, torch.tensor(ints), torch.tensor(floats), 0, flags).tolist() == \
        [int(torch.argmax(r)) for r in rows]


def _heads(g: torch.Generator) -> DSpark:
    return DSpark(None, [], None, None, None, (torch.randn(V, R, generator=g) * 0.5).bfloat16(),
                  torch.randn(V, R, generator=g) * 0.5, (torch.randn(1, D + R, generator=g) * 0.1).bfloat16())


def test_the_device_chain_is_the_reference_chain_and_reads_nothing(monkeypatch):
    g = torch.Generator().manual_seed(0)
    heads = _heads(g)
    Q = len(PARAMS)
    collapsed = torch.randn(Q * ROWS, D, generator=g)
    base = torch.randn(Q * ROWS, V, generator=g) * 2
    ys = [int(t) for t in torch.randint(0, V, (Q,), generator=g)]
    chooses = [None] + [KeyedChoice(p, 40 + q) for q, p in enumerate(PARAMS[1:])]
    want = [heads._chain(collapsed[q * ROWS:(q + 1) * ROWS], base[q * ROWS:(q + 1) * ROWS], ys[q],
                         chooses[q] or (lambda row, j: int(torch.argmax(row)))) for q in range(Q)]
    ints, floats, flags = sampling_rows(chooses, ROWS, V)
    reads = []
    for name in ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: (reads.append(_n),
                                                                                          _o(self, *a, **k))[1])
    got = chain(heads, collapsed, base, torch.tensor(ys), torch.tensor(ints), torch.tensor(floats, dtype=torch.float64),
                flags, ROWS, logits=True)
    assert reads == []  # the chain itself reads nothing back
    packed = got.packed()
    monkeypatch.undo()
    out = Chained.read(packed)
    assert sum(len(set(w.tokens)) for w in want) > Q  # the chains move (not one id repeated)
    for q, w in enumerate(want):
        assert out[q][0] == w.tokens, q
        assert out[q][1] == [float(c) for c in w.confidence], q
        assert torch.equal(got.logits[q], w.logits), q
