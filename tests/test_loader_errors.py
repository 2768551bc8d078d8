"""A damaged model folder gives a one-line error naming the culprit, from the CLI as from the API."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from dsv41.errors import CheckpointError, ConfigError
from dsv41.model.loader import load_model
from dsv41.tiny.model import make_tiny


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "bf16", "bf16", seed=2)


@pytest.fixture
def model_dir(pristine, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(pristine, dst)
    return dst


def shard_of(folder, name: str):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / index["weight_map"][name]


def rewrite_shard(folder, name: str, change) -> None:
    path = shard_of(folder, name)
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def cli_score(folder, tmp_path):
    spec = tmp_path / "in.json"
    spec.write_text(json.dumps({"ids": [0, 5, 6, 7], "chunks": [2]}))
    return subprocess.run([sys.executable, "-m", "dsv41.cli", "score", "--model", str(folder), "--input", str(spec),
                           "--out", str(tmp_path / "o.safetensors")], capture_output=True, text=True, timeout=300)


def assert_one_line(result, *needles):
    assert result.returncode == 2, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("dsv41: error:"), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_tensor(model_dir, tmp_path):
    name = "layers.3.attn.wq_b.weight"
    # drop it from both the shard and the index, as a broken conversion would
    rewrite_shard(model_dir, name, lambda t: t.pop(name))
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="layers.3.attn.wq_b"):
        load_model(model_dir)
    assert_one_line(cli_score(model_dir, tmp_path), "layers.3.attn.wq_b")


def test_wrong_shape(model_dir, tmp_path):
    name = "layers.2.attn.kv_norm.weight"
    rewrite_shard(model_dir, name, lambda t: t.update({name: t[name][:-1].clone()}))
    assert_one_line(cli_score(model_dir, tmp_path), name, "shape")


def test_unexpected_tensor(model_dir, tmp_path):
    name = "layers.0.attn.wq_a.weight"
    rewrite_shard(model_dir, name, lambda t: t.update({"layers.0.attn.mystery.weight": t[name].clone()}))
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["layers.0.attn.mystery.weight"] = shard_of(model_dir, name).name
    index_path.write_text(json.dumps(index))
    assert_one_line(cli_score(model_dir, tmp_path), "layers.0.attn.mystery.weight", "unexpected")


def test_bad_config_field(model_dir, tmp_path):
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["text_config"]["sliding_window"] = "wide"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError):
        load_model(model_dir)
    assert_one_line(cli_score(model_dir, tmp_path), "text_config.sliding_window")


def test_truncated_shard(model_dir, tmp_path):
    path = shard_of(model_dir, "layers.4.attn.wkv.weight")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    assert_one_line(cli_score(model_dir, tmp_path), path.name)


def test_missing_tokenizer_for_engram(model_dir, tmp_path):
    (model_dir / "tokenizer.json").unlink()
    assert_one_line(cli_score(model_dir, tmp_path), "tokenizer.json")


def test_bad_score_input(model_dir, tmp_path):
    spec = tmp_path / "in.json"
    spec.write_text(json.dumps({"ids": [0, 1], "chunks": [5]}))
    r = subprocess.run([sys.executable, "-m", "dsv41.cli", "score", "--model", str(model_dir), "--input", str(spec),
                        "--out", str(tmp_path / "o.safetensors")], capture_output=True, text=True, timeout=120)
    assert_one_line(r, "chunks")


def test_checkpoint_without_draft_blocks_loads_without_the_drafter(model_dir):
    """HF exports drop `mtp.*`: the backbone still loads; asking for the drafter names what is missing."""
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    mtp = [n for n in index["weight_map"] if n.startswith("mtp.")]
    assert mtp
    for shard in {index["weight_map"][n] for n in mtp}:
        tensors = load_file(model_dir / shard)
        save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, model_dir / shard)
    for n in mtp:
        del index["weight_map"][n]
    index_path.write_text(json.dumps(index))
    model = load_model(model_dir)
    assert model.dspark is None and model.cfg.n_dspark == 3
    with pytest.raises(CheckpointError, match="mtp.0"):
        load_model(model_dir, dspark=True)
