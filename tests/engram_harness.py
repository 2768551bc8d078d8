"""Shared pieces of the Engram tests (tests/test_engram*.py): the oracle fixture, the release constants, and
restatements used by more than one file. Fixtures are imported by name into the test modules."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from dsv41.config import ModelConfig
from dsv41.engram.hashing import EngramHasher
from dsv41.engram.shards import quantize_rows_fp8
from dsv41.tokenizer import Tokenizer

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
ORACLE = SHARED / "fixtures" / "oracle-tiny-a"

RELEASE = SimpleNamespace(
    engram_layer_ids=[1, 14], engram_max_ngram_size=4, engram_vocab_size=16_000_000, engram_n_heads=8,
    engram_head_dim=256, engram_compressed_vocab_size=99092, engram_num_embeddings=[384006168, 384016682],
)


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_file(ORACLE / "config.json")


@pytest.fixture(scope="module")
def fixture_hashes():
    return load_file(ORACLE / "engram_hashes.safetensors")


@pytest.fixture(scope="module")
def input_ids():
    return json.loads((ORACLE / "inputs.json").read_text())["input_ids"][0]


@pytest.fixture(scope="module")
def hasher(cfg):
    return EngramHasher.from_tokenizer(cfg, Tokenizer.from_dir(ORACLE))


@pytest.fixture(scope="module")
def weights():
    return load_file(ORACLE / "model.safetensors")


@pytest.fixture(scope="module")
def fp8_table(weights):
    """Layer 3's fixture table quantised to the release's FP8 row format (head_dim 16: one scale per row)."""
    values, scales = quantize_rows_fp8(weights["layers.3.engram.embed.weight"] * 3.0)
    return values, scales


def fp8_reference_rows(values_u8, scales_u8):
    """e4m3(q) × 2^(e − 127) per 32 values, by hand (byte 0 scale read as 0, like the release's readers)."""
    vals = values_u8.view(torch.float8_e4m3fn).float()
    exp = scales_u8.to(torch.float64)
    scale = torch.where(scales_u8 == 0, torch.zeros_like(exp), torch.pow(2.0, exp - 127)).float()
    return vals * scale.repeat_interleave(32, dim=1)[:, :vals.shape[1]]


def restated_mix(x, kv, qw, kw, eps, live=None):
    """MODEL.md §9.4 one token and one stream at a time, in float64."""
    T, hc, d = x.shape
    x64, kv64, w = x.double(), kv.double(), (qw.double() * kw.double())
    out = x64.clone()
    for t in range(T):
        value = kv64[t, hc * d:]
        for c in range(hc):
            key = kv64[t, c * d:(c + 1) * d]
            xs = x64[t, c]
            dot = float((xs * w[c] * key).sum())
            dot /= math.sqrt(float((xs * xs).mean()) + eps) * math.sqrt(float((key * key).mean()) + eps)
            dot /= math.sqrt(d)
            root = math.sqrt(max(abs(dot), 1e-6))
            gate = 1 / (1 + math.exp(-math.copysign(root, dot)))
            if live is not None and not live[t]:
                gate = 0.0
            out[t, c] = xs + gate * value
    return out


def fixture_wkv(weights, layer, rows=None):
    weight = weights[f"layers.{layer}.engram.wkv.weight"]
    if rows is not None:
        weight = weight[:, rows[0]:rows[1]]
    return lambda x: x @ weight.T
