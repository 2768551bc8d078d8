"""config.json parsing and layer-role derivation (MODEL.md §2-§3)."""

from __future__ import annotations

import copy
import json

import pytest

from dsv41.config import ModelConfig
from dsv41.errors import ConfigError

from conftest import ORACLE

# the release's text_config as MODEL.md §3.1 lists it
RELEASE_TEXT = {
    "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304,
    "num_hidden_layers": 40, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8, "hidden_act": "silu",
    "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "tie_word_embeddings": False, "max_position_embeddings": 1048576,
    "rope_theta": 10000, "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                                          "original_max_position_embeddings": 65536},
    "compress_rope_theta": 160000, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "sliding_window": 128, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4, "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256,
    "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3,
    "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
}
RELEASE = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "image_token_id": 129264,
           "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                   "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
           "text_config": RELEASE_TEXT}
# the same model in inference/config.json's flat names (MODEL.md §3.2)
FLAT = {
    "vocab_size": 129280, "dim": 5120, "moe_inter_dim": 2304, "n_layers": 40, "n_mtp_layers": 3,
    "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_n_activated_experts": 3, "n_heads": 64,
    "n_routed_experts": 384, "n_shared_experts": 1, "n_activated_experts": 6, "score_func": "sqrtsoftplus",
    "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1280, "head_dim": 512, "rope_head_dim": 64,
    "norm_eps": 1e-20, "o_groups": 8, "o_lora_rank": 1024, "window_size": 128, "kv_source_layers": [2, 8, 14, 20],
    "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36], "original_seq_len": 65536, "rope_theta": 10000,
    "rope_factor": 16, "beta_fast": 32, "beta_slow": 1, "index_n_heads": 32, "index_head_dim": 128,
    "index_topk": 512, "candidate_source_layer": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "engram_layer_ids": [1, 14],
    "engram_vocab_size": 16000000, "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
    "engram_pad_id": 2, "engram_compressed_vocab_size": 99092, "dtype": "fp8", "expert_dtype": "fp4",
    "compress_rope_theta": 160000, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
    "image_token_id": 129264, "engram_n_heads": 8, "engram_head_dim": 256,
}


def test_release_roles():
    cfg = ModelConfig.from_dict(RELEASE)
    modes = [r.mode for r in cfg.roles]
    assert modes[:2] == ["swa", "swa"]
    assert [i for i, m in enumerate(modes) if m == "full"] == [2, 8, 14, 20]
    assert [i for i, m in enumerate(modes) if m == "reindex"] == [24, 28, 32, 36]
    assert all(modes[i] == "reuse" for i in (3, 7, 9, 13, 15, 19, 21, 23, 25, 39))
    assert [cfg.role(i).kv_source for i in (3, 7, 8, 13, 19, 20, 39)] == [2, 2, 8, 8, 14, 20, 20]
    assert [cfg.role(i).index_source for i in (21, 24, 27, 31, 39)] == [20, 24, 24, 28, 36]
    assert cfg.role(20).is_candidate_source and not cfg.role(20).uses_candidates
    assert [i for i in range(40) if cfg.role(i).uses_candidates] == [24, 28, 32, 36]
    assert [r.index for r in cfg.roles if r.is_dspark] == [40, 41, 42]
    assert all(cfg.role(i).rope_kind == "plain" for i in (0, 1, 40, 41, 42))
    assert all(cfg.role(i).rope_kind == "compress" for i in range(2, 40))
    assert cfg.yarn_range() == (15, 25)  # MODEL.md §3.3
    assert cfg.engram_cols == 24 and cfg.quant.method == "fp8"


def test_flat_inference_config_equals_release():
    a, b = ModelConfig.from_dict(RELEASE), ModelConfig.from_dict(FLAT)
    for field in ("hidden_size", "num_hidden_layers", "moe_intermediate_size", "num_experts_per_tok",
                  "routed_scaling_factor", "sliding_window", "kv_source_layer_ids", "index_source_layer_ids",
                  "candidate_source_layer_id", "rms_norm_eps", "qk_rope_head_dim", "engram_pad_token_id",
                  "dspark_num_experts_per_tok", "max_position_embeddings", "yarn_factor",
                  "yarn_original_max_position"):
        assert getattr(a, field) == getattr(b, field), field
    assert a.roles == b.roles


def test_exl3_quantization_config():
    raw = copy.deepcopy(RELEASE)
    raw["quantization_config"] = {"quant_method": "exl3", "version": "1.4.2", "bits": 2.9, "head_bits": 6,
                                  "mtp_bits": 4, "codebook": "mul1"}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.quant.is_exl3 and cfg.quant.raw["head_bits"] == 6


def test_oracle_config_roles():
    cfg = ModelConfig.from_file(ORACLE / "config.json")
    assert [r.mode for r in cfg.roles] == ["swa", "full", "reuse", "full", "reindex"]
    assert cfg.role(3).is_candidate_source and cfg.role(4).uses_candidates


def test_roles_without_explicit_source_lists_follow_ratio_runs():
    raw = copy.deepcopy(RELEASE_TEXT)
    for k in ("kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id"):
        raw.pop(k)
    cfg = ModelConfig.from_dict(raw)
    assert cfg.kv_source_layer_ids == (2, 20)  # the first layer of each run of equal ratios
    assert cfg.role(19).kv_source == 2 and cfg.role(39).kv_source == 20


@pytest.mark.parametrize("mutate, field", [
    (lambda t: t.pop("hidden_size"), "hidden_size"),
    (lambda t: t.update(num_attention_heads="64"), "num_attention_heads"),
    (lambda t: t.update(compress_ratios=[0, 2]), "compress_ratios"),
    (lambda t: t.update(kv_source_layer_ids=[0, 8]), "kv_source_layer_ids"),
    (lambda t: t.update(o_groups=7), "o_groups"),
    (lambda t: t.update(sliding_window=0), "sliding_window"),
    (lambda t: t.update(scoring_func="softermax"), "scoring_func"),
    (lambda t: t.update(rope_scaling={"factor": "x"}), "rope_scaling.factor"),
    (lambda t: t.update(engram_num_embeddings=[1]), "engram_num_embeddings"),
    (lambda t: t.update(hc_mult=True), "hc_mult"),
])
def test_bad_fields_name_the_field(mutate, field):
    raw = copy.deepcopy(RELEASE)
    mutate(raw["text_config"])
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(raw)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_bad_quant_method_and_bad_json(tmp_path):
    raw = copy.deepcopy(RELEASE)
    raw["quantization_config"] = {"quant_method": "gptq"}
    with pytest.raises(ConfigError, match="quantization_config.quant_method"):
        ModelConfig.from_dict(raw)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.from_file(tmp_path / "missing")


def test_text_config_file_roundtrip(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASE))
    assert ModelConfig.from_file(tmp_path) == ModelConfig.from_dict(RELEASE)


def test_hf_test_suite_style_config_derives_what_it_omits():
    """HF's tiny config leaves the source lists out and spells the pad id `engram_pad_id` (MODEL.md §14)."""
    raw = copy.deepcopy(RELEASE_TEXT)
    for k in ("kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id", "engram_pad_token_id"):
        raw.pop(k)
    raw["engram_pad_id"] = 2
    raw["num_nextn_predict_layers"] = 0  # the release's 43 ratios stay; the 3 draft entries are then unused
    cfg = ModelConfig.from_dict(raw)
    assert cfg.engram_pad_token_id == 2 and cfg.n_dspark == 0 and len(cfg.roles) == 40
    assert cfg.candidate_source_layer_id == 20  # the first ratio-1 KV source
    assert cfg.role(24).mode == "reuse"  # without an explicit index list only KV sources score
