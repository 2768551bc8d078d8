"""The model is derived from the config, not fitted to one layout: other role layouts load and chunk exactly."""

from __future__ import annotations

import pytest
import torch

from dsv41.model.loader import load_model
from dsv41.tiny.model import make_tiny

VARIANTS = {
    # ratio-4 pooling, two shared experts, top-1 routing, 2 mHC streams, no Engram / DSpark / candidate pool
    "ratio4-plain": {"num_hidden_layers": 5, "compress_ratios": [0, 4, 4, 1, 1], "kv_source_layer_ids": [1, 3],
                     "index_source_layer_ids": [1, 3, 4], "candidate_source_layer_id": None,
                     "engram_layer_ids": [], "num_nextn_predict_layers": 0, "dspark_target_layer_ids": [],
                     "hc_mult": 2, "hc_sinkhorn_iters": 3, "index_topk": 3, "n_shared_experts": 2,
                     "num_experts_per_tok": 1},
    # sources derived from ratio runs (no explicit lists), Engram on layer 0, DSpark taps on early layers
    "derived-sources": {"num_hidden_layers": 4, "compress_ratios": [0, 2, 2, 1, 0, 0, 0],
                        "kv_source_layer_ids": None, "index_source_layer_ids": None,
                        "candidate_source_layer_id": None, "engram_layer_ids": [0, 2],
                        "dspark_target_layer_ids": [1, 2, 3], "index_topk": 2, "sliding_window": 5},
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_loads_and_chunks_like_oneshot(tmp_path, name):
    folder = make_tiny(tmp_path / name, "bf16", seed=5, overrides=VARIANTS[name])  # None: field left out
    model = load_model(folder)
    ids = torch.tensor(model.tokenizer.encode("<｜begin▁of▁sentence｜>" + "variant layouts must work too. " * 2))
    oneshot = model.forward(model.new_state(), ids)
    state = model.new_state()
    rows = [model.forward(state, ids[:5]), model.forward(state, ids[5:11])]
    rows += [model.forward(state, ids[i:i + 1]) for i in range(11, len(ids))]
    chunked = torch.cat(rows)
    assert torch.equal(chunked, oneshot)
