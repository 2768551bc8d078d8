"""A synthetic original checkpoint in the release's layout (EXL3-ENGRAM.md §5.1, §5.5) for the pack tests, and
the tests of finding the tables in it (`dsv41.engram.source`, `dsv41 engram pack --list`).

The release keeps each Engram layer's F8_E4M3 `[N, 256]` weight and F8_E8M0 `[N, 8]` scale in one shard of 48,
beside other tensors, under `model.safetensors.index.json`. Here: 4 shards, the two tables in the last two with
other tensors before and after them, the real 264-byte rows, and the prime-derived column ranges scaled down
(`engram_vocab_size` 4,160 instead of 16,000,000: ~103 k rows a layer, 24 columns of ~4.3 k rows each).
Generated under tmp_path, never committed.
"""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dsv41.engram.hashing import engram_primes
from dsv41.engram.source import OriginalCheckpoint, download_command
from dsv41.errors import CheckpointError

VOCAB = 4160  # engram_vocab_size of the synthetic original


def original_config(vocab: int = VOCAB, layers=(1, 4), head_dim: int = 256) -> dict:
    from dsv41.tiny.model import TINY_TEXT_CONFIG

    fields = dict(engram_layer_ids=list(layers), engram_max_ngram_size=4, engram_vocab_size=vocab,
                  engram_n_heads=8, engram_head_dim=head_dim)
    rows = [int(r) for r in engram_primes(SimpleNamespace(**fields)).flatten(1).sum(1)]
    text = {**TINY_TEXT_CONFIG, **fields, "engram_num_embeddings": rows, "engram_compressed_vocab_size": 436,
            "dspark_noise_token_id": 500}
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text}


def make_original(folder: Path, vocab: int = VOCAB, seed: int = 0, layers=(1, 4)) -> dict[int, np.ndarray]:
    """Write the synthetic original into `folder`; returns each layer's rows as the shard file lays them out
    (uint8 `[N, 264]`: 256 value bytes then 8 scale bytes)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = original_config(vocab, layers)
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    tables, shards = {}, [{"embed.weight": torch.ones(64, 32, dtype=torch.bfloat16)},
                          {"layers.0.attn_norm.weight": torch.ones(256, dtype=torch.bfloat16)}]
    for layer_id, rows in zip(layers, config["text_config"]["engram_num_embeddings"]):
        table = rng.integers(0, 256, size=(rows, 264), dtype=np.uint8)
        tables[layer_id] = table
        shards.append({f"layers.{layer_id}.attn_norm.weight": torch.ones(256, dtype=torch.bfloat16),
                       f"layers.{layer_id}.engram.embed.weight":
                           torch.from_numpy(table[:, :256].copy()).view(torch.float8_e4m3fn),
                       f"layers.{layer_id}.engram.embed.scale":
                           torch.from_numpy(table[:, 256:].copy()).view(torch.float8_e8m0fnu),
                       f"layers.{layer_id}.ffn_norm.weight": torch.ones(256, dtype=torch.bfloat16)})
    weight_map = {}
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(folder / name))
        weight_map.update({t: name for t in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tables


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    folder = tmp_path_factory.mktemp("original")
    return folder, make_original(folder)


@pytest.fixture(scope="module")
def packed(tmp_path_factory, original):
    """The synthetic original packed for TP=2, both ranks, in one folder: (source, tables, folder)."""
    from dsv41.engram.pack import pack_rank

    folder, tables = original
    out = tmp_path_factory.mktemp("packed")
    for rank in range(2):
        pack_rank(folder, out, rank, 2, chunk_rows=10_000, progress=False)
    return OriginalCheckpoint(folder), tables, out


def run_cli(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    """`dsv41 engram ...` in a fresh process."""
    proc = subprocess.run([sys.executable, "-m", "dsv41.cli", "engram", *args], capture_output=True, text=True,
                          timeout=300)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_tables_are_found_in_their_shards(original):
    folder, tables = original
    src = OriginalCheckpoint(folder)
    assert src.table_files() == {1: "model-00003-of-00004.safetensors", 4: "model-00004-of-00004.safetensors"}
    for layer_id, table in tables.items():
        span = src.span(layer_id)
        assert (span.rows, span.head_dim, span.scale_cols, span.row_bytes) == (table.shape[0], 256, 8, 264)
        raw = span.file.read_bytes()
        assert raw[span.weight_offset:span.weight_offset + 256] == table[0, :256].tobytes()
        assert raw[span.scale_offset + 8 * 5:span.scale_offset + 8 * 6] == table[5, 256:].tobytes()
    assert 100_000 < tables[1].shape[0] < 110_000


def test_list_prints_the_shards_and_the_download_command(original):
    folder, _ = original
    out = run_cli("pack", "--src", str(folder), "--list", check=True).stdout
    assert "layer 1: layers.1.engram.embed.weight and .scale are in model-00003-of-00004.safetensors" in out
    assert "layer 4:" in out and "model-00004-of-00004.safetensors" in out
    command = out.strip().splitlines()[-1].strip()
    assert command == download_command("deepseek-ai/DeepSeek-V4.1-Flash", "dba1be0a40aa45a94ad051997016db3960a90277",
                                       folder, ["config.json", "model.safetensors.index.json",
                                                "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors"])
    assert "allow_patterns=" in command and "snapshot_download" in command


def test_list_needs_only_the_index_and_the_config(tmp_path, original):
    folder, _ = original
    for name in ("config.json", "model.safetensors.index.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    assert OriginalCheckpoint(tmp_path).table_files()[4] == "model-00004-of-00004.safetensors"
    with pytest.raises(CheckpointError, match="model-00003-of-00004.safetensors: shard missing.*snapshot_download"):
        OriginalCheckpoint(tmp_path).span(1)
    (tmp_path / "model.safetensors.index.json").unlink()
    proc = run_cli("pack", "--src", str(tmp_path), "--list")
    assert proc.returncode == 2
    assert "model.safetensors.index.json missing; fetch the small files first" in proc.stderr


def test_source_errors_name_the_tensor(tmp_path, original):
    folder, _ = original
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    for name in ("config.json",) + tuple(index["weight_map"].values()):
        target = tmp_path / name
        if not target.exists():
            target.symlink_to(folder / name)
    index["weight_map"]["layers.4.engram.embed.scale"] = "model-00003-of-00004.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="layers.4.engram.embed.weight is in model-00004.* but .*scale in"):
        OriginalCheckpoint(tmp_path).span(4)
    del index["weight_map"]["layers.4.engram.embed.scale"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="layers.4.engram.embed.scale is not in the weight_map"):
        OriginalCheckpoint(tmp_path).span(4)
