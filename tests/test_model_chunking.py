"""Chunked prefill and decode continue exactly where one-shot prefill would be (MODEL.md §7.7), bit for bit.

Every piece of cross-chunk information lives in the sequence state, and the reference path is row-invariant
(model/rowwise.py): each matrix product runs one row at a time, each other reduction over fixed per-row layouts,
transcendentals are rounded once from fp64. With one intra-op thread (tests/conftest.py) a row's logits are the
same bits whichever way the prompt is cut, fake quantisation included.
"""

from __future__ import annotations

import json

import pytest
import torch

from dsv41.model.loader import load_model

from conftest import ORACLE

ORACLE_IDS = json.loads((ORACLE / "inputs.json").read_text())["input_ids"][0]


def run_chunks(model, ids: list[int], chunks: list[int]) -> torch.Tensor:
    state = model.new_state()
    rows, pos = [], 0
    for n in chunks:
        rows.append(model.forward(state, torch.tensor(ids[pos:pos + n])))
        pos += n
    rows += [model.forward(state, torch.tensor([t])) for t in ids[pos:]]
    assert state.pos == len(ids)
    return torch.cat(rows)




SCHEMES = {
    "one big chunk": lambda n: [n],
    "odd cuts inside ratio-2 groups": lambda n: [1, 4, 3, 8, 5] + [n - 21],
    "one token at a time": lambda n: [],
    "prefill then decode": lambda n: [n // 2],
    "two-token chunks": lambda n: [2] * (n // 2),
}


@pytest.fixture(scope="module")
def oracle():
    model = load_model(ORACLE)
    return model, model.forward(model.new_state(), torch.tensor(ORACLE_IDS))


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_oracle_chunkings_equal_oneshot(oracle, scheme):
    model, oneshot = oracle
    got = run_chunks(model, ORACLE_IDS, SCHEMES[scheme](len(ORACLE_IDS)))
    assert torch.equal(got, oneshot)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model = load_model(tiny_model_dir, dspark=False)
    text = "<｜begin▁of▁sentence｜>" + "The quick brown fox jumps over the lazy dog; 12345 apples. " * 2
    ids = model.tokenizer.encode(text)
    assert len(ids) > 40
    return model, ids, model.forward(model.new_state(), torch.tensor(ids))


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_tiny_chunkings_equal_oneshot(tiny, scheme):
    model, ids, oneshot = tiny
    got = run_chunks(model, ids, SCHEMES[scheme](len(ids)))
    assert torch.equal(got, oneshot)


def test_tiny_state_holds_the_open_group_and_bounded_windows(tiny):
    model, ids, _ = tiny
    cfg = model.cfg
    state = model.new_state()
    model.forward(state, torch.tensor(ids[:7]))  # 7 tokens: ratio-2 sources hold one open token
    for layer in cfg.kv_source_layer_ids:
        src = state.sources[layer]
        r = cfg.compress_ratios[layer]
        assert src.entries == 7 // r
        assert (src.open_v is None) == (7 % r == 0)
    model.forward(state, torch.tensor(ids[7:40]))
    assert all(w.kv.shape[0] == cfg.sliding_window for w in state.windows.values())


def test_fake_quant_switch_changes_the_forward(tiny, tiny_model_dir):
    model, ids, quantised = tiny
    plain = load_model(tiny_model_dir, fake_quant=False, dspark=False)
    got = plain.forward(plain.new_state(), torch.tensor(ids))
    assert not torch.allclose(got, quantised, atol=1e-4)


def test_bf16_chunking_is_bitwise_too(tiny_model_dir):
    model = load_model(tiny_model_dir, dtype=torch.bfloat16, dspark=False)
    ids = model.tokenizer.encode("<｜begin▁of▁sentence｜>" + "Bits stay bits when the prompt is cut. " * 2)
    oneshot = model.forward(model.new_state(), torch.tensor(ids))
    assert torch.equal(run_chunks(model, ids, [3, 10]), oneshot)
