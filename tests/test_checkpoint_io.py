"""Checkpoint reader / ShardedWriter: interchange with the official `safetensors` library, slices, and
one-line CheckpointErrors for damaged folders (missing tensor, truncated shard, bad header, missing shard...)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv41.errors import CheckpointError
from dsv41.weights import Checkpoint, ShardedWriter
from dsv41.weights.safetensors_io import INDEX_FILE


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.f32": torch.randn(5, 7, generator=g),
        "a.f16": torch.randn(6, 3, generator=g).half(),
        "a.bf16": torch.randn(4, 9, generator=g).bfloat16(),
        "a.i8": torch.randint(-128, 128, (3, 8), generator=g, dtype=torch.int8),
        "a.i16": torch.randint(-32768, 32768, (2, 3, 8), generator=g, dtype=torch.int32).to(torch.int16),
        "a.i32": torch.tensor(-2082680531, dtype=torch.int32),  # 0-d, like an EXL3 marker
        "a.i64": torch.arange(5, dtype=torch.int64) * 10**12,
        "a.u8": torch.arange(256, dtype=torch.uint8).reshape(16, 16),
        "a.fp8": torch.randn(64, 32, generator=g).to(torch.float8_e4m3fn),
        "a.empty": torch.zeros(0, 4),
    }


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_reads_files_written_by_the_official_library(tmp_path):
    tensors = sample_tensors()
    tensors["a.e8m0"] = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float8_e8m0fnu)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt = Checkpoint(tmp_path)
    assert sorted(ckpt.names()) == sorted(tensors)
    for name, t in tensors.items():
        got = ckpt.get(name)
        assert got.shape == t.shape and raw_bytes(got) == raw_bytes(t), name
    assert ckpt.dtype("a.e8m0") == "F8_E8M0"
    assert ckpt.get("a.e8m0").dtype == torch.uint8 and ckpt.get("a.e8m0").tolist() == [127, 128, 126]
    assert ckpt.get("a.fp8").dtype == torch.float8_e4m3fn
    assert ckpt.shape("a.i16") == (2, 3, 8) and ckpt.dtype("a.bf16") == "BF16"
    assert ckpt.has("a.u8") and not ckpt.has("a.nope")
    assert ckpt.unclaimed() == []


def test_unclaimed_lists_tensors_nobody_asked_for(tmp_path):
    save_file(sample_tensors(), str(tmp_path / "model.safetensors"))
    ckpt = Checkpoint(tmp_path)
    ckpt.get("a.f32")
    ckpt.get_slice("a.u8", 0, 0, 1)
    ckpt.shape("a.i8")
    assert ckpt.has("a.f16")  # has() does not claim
    assert sorted(ckpt.unclaimed()) == sorted(set(sample_tensors()) - {"a.f32", "a.u8", "a.i8"})


def test_writer_output_reads_back_with_the_official_library(tmp_path):
    tensors = sample_tensors()
    with ShardedWriter(tmp_path, max_shard_bytes=300) as w:
        for name, t in tensors.items():
            w.add(name, t)
        w.add("a.scale", torch.tensor([127, 130], dtype=torch.uint8), dtype="F8_E8M0")
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    shards = sorted({f for f in index["weight_map"].values()})
    assert len(shards) > 2
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values()) + 2
    for name, t in tensors.items():
        with safe_open(str(tmp_path / index["weight_map"][name]), "pt") as f:
            assert raw_bytes(f.get_tensor(name)) == raw_bytes(t), name
    with safe_open(str(tmp_path / index["weight_map"]["a.scale"]), "pt") as f:
        assert f.get_tensor("a.scale").dtype == torch.float8_e8m0fnu
    assert not list(tmp_path.glob("*.tmp"))


def test_writer_rejects_duplicate_names(tmp_path):
    w = ShardedWriter(tmp_path)
    w.add("x", torch.zeros(2))
    with pytest.raises(ValueError, match="'x' written twice"):
        w.add("x", torch.zeros(2))


@pytest.mark.parametrize("name,dim,start,stop", [
    ("a.f32", 0, 1, 4), ("a.f32", 1, 2, 6), ("a.bf16", 1, 0, 9), ("a.i16", 1, 1, 3), ("a.i16", 0, 1, 2),
    ("a.fp8", 1, 8, 24), ("a.u8", 0, 15, 16), ("a.f16", 1, 3, 3),
])
def test_get_slice_equals_slicing_the_whole_tensor(tmp_path, name, dim, start, stop):
    tensors = sample_tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    got = Checkpoint(tmp_path).get_slice(name, dim, start, stop)
    expected = tensors[name].narrow(dim, start, stop - start)
    assert got.shape == expected.shape and got.is_contiguous()
    assert raw_bytes(got) == raw_bytes(expected)


def test_get_slice_bounds_are_checked(tmp_path):
    save_file(sample_tensors(), str(tmp_path / "model.safetensors"))
    ckpt = Checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="'a.f32': slice 3:9 out of range"):
        ckpt.get_slice("a.f32", 1, 3, 9)
    with pytest.raises(CheckpointError, match="cannot slice dim 1"):
        ckpt.get_slice("a.i64", 1, 0, 1)


# ---- damaged checkpoints -------------------------------------------------------------------------------------


def one_line_error(fn, *match: str) -> str:
    with pytest.raises(CheckpointError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    for m in match:
        assert m in message, (m, message)
    return message


def sharded(tmp_path: Path) -> Path:
    with ShardedWriter(tmp_path, max_shard_bytes=200) as w:
        for name, t in sample_tensors().items():
            w.add(name, t)
    return tmp_path


def shard_of(folder: Path, name: str) -> Path:
    return folder / json.loads((folder / INDEX_FILE).read_text())["weight_map"][name]


def write_raw_shard(path: Path, header: dict, data: bytes, header_len: int | None = None) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)


def test_missing_tensor_names_it(tmp_path):
    ckpt = Checkpoint(sharded(tmp_path))
    one_line_error(lambda: ckpt.get("layers.0.attn.wq_a.weight"), "'layers.0.attn.wq_a.weight'", "not found")
    one_line_error(lambda: ckpt.expect("a.f32", shape=(7, 5)), "'a.f32'", "[5, 7]", "[7, 5]")
    one_line_error(lambda: ckpt.expect("a.f32", dtypes=("BF16",)), "'a.f32'", "F32")


def test_truncated_shard_names_the_file(tmp_path):
    folder = sharded(tmp_path)
    shard = shard_of(folder, "a.fp8")
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    one_line_error(lambda: Checkpoint(folder), shard.name, "truncated")


def test_trailing_bytes_are_reported(tmp_path):
    folder = sharded(tmp_path)
    shard = shard_of(folder, "a.f32")
    shard.write_bytes(shard.read_bytes() + b"\0" * 16)
    one_line_error(lambda: Checkpoint(folder), shard.name, "16 bytes beyond")


def test_bad_headers_name_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    write_raw_shard(path, {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, header_len=10**12)
    one_line_error(lambda: Checkpoint(tmp_path), "model.safetensors", "header length")
    path.write_bytes(struct.pack("<Q", 5) + b"{nope" + b"\0" * 8)
    one_line_error(lambda: Checkpoint(tmp_path), "model.safetensors", "not valid JSON")
    path.write_bytes(b"\x01\x02")
    one_line_error(lambda: Checkpoint(tmp_path), "model.safetensors", "not a safetensors file")


@pytest.mark.parametrize("entry,match", [
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "needs 12 bytes"),
    ({"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}, "unsupported dtype 'Q4'"),
    ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, "bad shape"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "bad data_offsets"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "truncated"),
])
def test_inconsistent_header_entries_name_the_tensor(tmp_path, entry, match):
    write_raw_shard(tmp_path / "model.safetensors", {"w.x": entry}, b"\0" * 8)
    message = one_line_error(lambda: Checkpoint(tmp_path), "model.safetensors", match)
    if match != "truncated":
        assert "'w.x'" in message


def test_index_pointing_at_a_missing_shard(tmp_path):
    folder = sharded(tmp_path)
    shard = shard_of(folder, "a.bf16")
    shard.unlink()
    one_line_error(lambda: Checkpoint(folder), INDEX_FILE, shard.name, "does not exist")


def test_index_naming_a_tensor_its_shard_lacks(tmp_path):
    folder = sharded(tmp_path)
    index = json.loads((folder / INDEX_FILE).read_text())
    index["weight_map"]["layers.9.ffn.gate.weight"] = index["weight_map"]["a.f32"]
    (folder / INDEX_FILE).write_text(json.dumps(index))
    one_line_error(lambda: Checkpoint(folder), "'layers.9.ffn.gate.weight'", "not in this shard")


def test_bad_index_and_empty_folder(tmp_path):
    one_line_error(lambda: Checkpoint(tmp_path), str(tmp_path), "no model.safetensors.index.json")
    (tmp_path / INDEX_FILE).write_text('{"metadata": {}}')
    one_line_error(lambda: Checkpoint(tmp_path), INDEX_FILE, "weight_map")
    (tmp_path / INDEX_FILE).write_text("{")
    one_line_error(lambda: Checkpoint(tmp_path), INDEX_FILE, "cannot parse")
