"""DSpark drafter forward on the tiny model (MODEL.md §10)."""

from __future__ import annotations

import copy

import pytest
import torch

from dsv41.model.loader import load_model


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    model = load_model(tiny_model_dir, fake_quant=False)
    ids = model.tokenizer.encode("<｜begin▁of▁sentence｜>" + "Drafting ahead saves time when guesses are right. " * 2)
    return model, ids


def test_rings_are_seeded_by_prefill_and_bounded(setup):
    model, ids = setup
    cfg = model.cfg
    state = model.new_state()
    model.forward(state, torch.tensor(ids))
    assert state.last_taps.shape == (len(cfg.dspark_target_layer_ids) * cfg.hidden_size,)
    for s in range(cfg.n_dspark):
        assert state.dspark_windows[s].kv.shape == (min(len(ids), cfg.sliding_window), cfg.head_dim)


def test_chunked_absorb_equals_oneshot(setup):
    model, ids = setup
    a, b = model.new_state(), model.new_state()
    model.forward(a, torch.tensor(ids))
    model.forward(b, torch.tensor(ids[:5]))
    for t in ids[5:]:
        model.forward(b, torch.tensor([t]))
    for s in range(model.cfg.n_dspark):
        assert torch.equal(a.dspark_windows[s].kv, b.dspark_windows[s].kv)


def test_draft_is_deterministic_and_leaves_the_state_alone(setup):
    model, ids = setup
    cfg = model.cfg
    state = model.new_state()
    logits = model.forward(state, torch.tensor(ids))
    before = copy.deepcopy(state)
    y = int(logits[-1].argmax())
    d1 = model.dspark.draft(model, state, y)
    d2 = model.dspark.draft(model, state, y)
    assert d1.tokens == d2.tokens and torch.equal(d1.logits, d2.logits)
    assert len(d1.tokens) == cfg.dspark_block_size and d1.logits.shape == (cfg.dspark_block_size, cfg.vocab_size)
    assert ((d1.confidence > 0) & (d1.confidence < 1)).all()
    assert d1.tokens == [int(r.argmax()) for r in d1.logits]  # greedy choice, row by row
    assert state.pos == before.pos
    for s in range(cfg.n_dspark):
        assert torch.equal(state.dspark_windows[s].kv, before.dspark_windows[s].kv)


def test_markov_head_chains_each_choice_into_the_next_row(setup):
    model, ids = setup
    state = model.new_state()
    logits = model.forward(state, torch.tensor(ids))
    y = int(logits[-1].argmax())
    forced = model.dspark.draft(model, state, y, choose=lambda row, i: 7)
    free = model.dspark.draft(model, state, y)
    assert forced.tokens == [7] * model.cfg.dspark_block_size
    assert torch.equal(forced.logits[0], free.logits[0])  # row 0 depends only on y
    if free.tokens[0] != 7:
        assert not torch.equal(forced.logits[1], free.logits[1])  # row 1 depends on row 0's choice
