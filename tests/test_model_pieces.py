"""Crafted inputs for the rules a single fixture cannot pin down (MODEL.md §15b.7): quantiser rounding ties,
scale floors, skipped blocks; Sinkhorn; RoPE convention; deterministic top-k ties."""

from __future__ import annotations

import torch

from dsv41.model import mhc
from dsv41.model.quant import fp4_block_e4m3, fp4_block_ue8m0, fp8_block_ue8m0, round_e2m1
from dsv41.model.rope import RopeTable, inv_freq
from dsv41.model.topk import topk_lowest_index_ties


def test_e2m1_ties_go_to_even_mantissa_and_saturate():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, -5.0, 0.26, 2.6])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -4.0, 0.5, 3.0])
    assert torch.equal(round_e2m1(x), want)


def test_fp4_ue8m0_scale_is_a_power_of_two_covering_amax():
    v = torch.zeros(32)
    v[0], v[1] = 12.0, 1.0  # amax 12 -> scale 2 (12/6 = 2 exactly): 12 -> 6*2, 1 -> 0.5*2
    out = fp4_block_ue8m0(v[None])[0]
    assert out[0] == 12.0 and out[1] == 1.0
    v[0] = 12.5  # scale rounds up to 4: 12.5/4 = 3.125 -> 3 -> 12; 1/4 = 0.25 tie -> 0
    out = fp4_block_ue8m0(v[None])[0]
    assert out[0] == 12.0 and out[1] == 0.0


def test_fp4_e4m3_scale_and_floor():
    v = torch.zeros(16)
    v[0] = 3.0  # scale = e4m3(3/6) = 0.5 -> 3/0.5 = 6
    assert fp4_block_e4m3(v[None])[0][0] == 3.0
    tiny = torch.full((1, 16), 1e-6)  # below the 6*2^-9 floor: scale = 2^-9, values round to 0
    assert torch.equal(fp4_block_e4m3(tiny), torch.zeros(1, 16))


def test_fp8_amax_floor_and_exact_powers():
    v = torch.zeros(1, 32)
    assert torch.equal(fp8_block_ue8m0(v), v)  # all-zero block: floor keeps the scale finite
    v[0, 0] = 448.0
    assert fp8_block_ue8m0(v)[0, 0] == 448.0
    v[0, 1] = 1.0 + 2**-5  # e4m3 has 3 mantissa bits: 1 + 1/32 rounds to 1
    assert fp8_block_ue8m0(v)[0, 1] == 1.0


def test_quantisers_skip_dims_that_are_not_whole_blocks_and_obey_the_switch():
    x = torch.randn(3, 40)
    assert fp8_block_ue8m0(x) is x and fp4_block_ue8m0(x) is x
    y = torch.randn(3, 48)
    assert fp4_block_e4m3(y) is not y and fp4_block_e4m3(y, enabled=False) is y


def test_sinkhorn_is_doubly_stochastic_after_enough_iterations():
    c = mhc.sinkhorn(torch.randn(5, 4, 4), iters=20, eps=1e-6)
    assert torch.allclose(c.sum(dim=-2), torch.ones(5, 4), atol=1e-5)
    assert torch.allclose(c.sum(dim=-1), torch.ones(5, 4), atol=2e-2)  # rows converge, columns are exact


def test_expand_sums_over_the_first_comb_index():
    x = torch.randn(1, 2, 3)
    comb = torch.tensor([[[0.0, 1.0], [0.0, 0.0]]])  # source stream 0 feeds destination 1
    out = mhc.expand(torch.zeros(1, 3), x, torch.zeros(1, 2), comb)
    assert torch.equal(out[0, 1], x[0, 0]) and torch.equal(out[0, 0], torch.zeros(3))


def test_rope_rotates_adjacent_pairs_of_the_trailing_dims_and_inverts():
    table = RopeTable(inv_freq(10000.0, 4))
    x = torch.zeros(1, 6)
    x[0, 2] = 1.0  # first rope pair is (2, 3); dims 0-1 are untouched
    out = table.apply(x, torch.tensor([1]), 4)
    assert torch.allclose(out[0, 2:4], torch.tensor([torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0))]))
    assert torch.equal(out[0, :2], x[0, :2])
    back = table.apply(out, torch.tensor([1]), 4, inverse=True)
    assert torch.allclose(back, x, atol=1e-6)


def test_topk_ties_go_to_the_lower_index():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    assert topk_lowest_index_ties(scores, 2).tolist() == [[1, 2]]
    assert topk_lowest_index_ties(torch.zeros(1, 6), 3).tolist() == [[0, 1, 2]]


def test_empty_compressed_slots_live_on_the_compute_device():
    """Before a source's first group closes there are no entries: the dead slots must still be made on the device
    the window keys live on (a one-token prompt at position 0 on a GPU met CPU tensors here). `meta` stands for
    any device that is not the CPU."""
    from dsv41.model.attention import compressed_slots
    from dsv41.model.state import SourceCache

    meta = torch.device("meta")
    keys, ok = compressed_slots(SourceCache(), None, width=4, T=1, head_dim=8, device=meta)
    assert keys.device == meta and ok.device == meta
    assert keys.shape == (1, 4, 8) and ok.shape == (1, 4)
    cpu_keys, cpu_ok = compressed_slots(SourceCache(), None, width=4, T=1, head_dim=8, device=torch.device("cpu"))
    assert not cpu_ok.any() and cpu_keys.abs().sum() == 0
