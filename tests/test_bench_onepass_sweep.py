"""bench/onepass_sweep.py's fp64 reference (`reference_rows`, the one the core's tilings are judged against) equals
the model's attention core (`model.attention.Attention._core`) on the same slots gathered, rows with dead slots and
a row with none."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_reference_rows_is_the_model_core():
    from onepass_sweep import reference_rows

    from dsv41.model.attention import Attention

    g = torch.Generator().manual_seed(3)
    T, H, hd, W, C, S = 4, 3, 16, 6, 9, 7
    q, win, ents = torch.randn(T, H, hd, generator=g), torch.randn(W, hd, generator=g), torch.randn(C, hd, generator=g)
    slots = torch.randint(0, W + C, (T, S), generator=g, dtype=torch.int32)
    slots[1, ::2] = -1
    slots[3] = -1  # no live slot: zeros
    sink = torch.randn(H, generator=g)
    got = reference_rows(q, win, ents, slots, sink, hd ** -0.5, rows=T)
    keys, ok = torch.cat((win, ents))[slots.clamp(min=0).long()], slots >= 0
    layer = SimpleNamespace(cfg=SimpleNamespace(head_dim=hd), p=SimpleNamespace(sink=sink))
    want = Attention._core(layer, q, keys, ok).double()
    assert not got[3].any() and got[0].abs().sum() > 0
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
