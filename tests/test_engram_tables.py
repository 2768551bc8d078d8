"""Engram tables and shard files (dsv41.engram.tables, dsv41.engram.shards; EXL3-ENGRAM.md §5): checkpoint
tensors in f32/bf16/FP8, the per-rank shard files and their header checks, lazy reads, where the rows land."""

import json
import os
import struct
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import save_file

from dsv41.engram.hashing import EngramConstants, engram_primes, head_shard
from dsv41.engram.shards import decode_row_bytes, read_shard_header, shard_file_name, write_engram_shard, write_engram_shards
from dsv41.engram.tables import EngramTable
from dsv41.errors import CheckpointError
from engram_harness import (  # noqa: F401 (pytest fixtures)
    ORACLE,
    cfg,
    fp8_reference_rows,
    fp8_table,
    hasher,
    input_ids,
    weights,
)


def test_quantize_rows_fp8_is_close_and_power_of_two(weights, fp8_table):
    values, scales = fp8_table
    source = weights["layers.3.engram.embed.weight"] * 3.0
    back = fp8_reference_rows(values, scales)
    assert scales.shape == (source.shape[0], 1)
    torch.testing.assert_close(back, source, rtol=0.07, atol=1e-6)  # e4m3 has a 3-bit mantissa
    assert float(back.abs().max(1).values.div(source.abs().max(1).values).min()) > 0.9


def test_fp8_checkpoint_table(tmp_path, cfg, fp8_table, hasher, input_ids):
    values, scales = fp8_table
    save_file({"layers.3.engram.embed.weight": values.view(torch.float8_e4m3fn),
               "layers.3.engram.embed.scale": scales.view(torch.float8_e8m0fnu)},
              tmp_path / "model-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "layers.3.engram.embed.weight": "model-00001.safetensors",
        "layers.3.engram.embed.scale": "model-00001.safetensors"}}))
    table = EngramTable.from_checkpoint(tmp_path, 3, cfg)
    row_ids = hasher.hash(input_ids)[:, cfg.engram_layer_ids.index(3)]
    expected = fp8_reference_rows(values, scales)[row_ids]
    assert torch.equal(table.gather(row_ids), expected)
    stored = table.submit(row_ids).wait_bytes()  # the row's e4m3 bytes, then its scale bytes
    assert stored.kind == "fp8" and stored.data.shape == (*row_ids.shape, values.shape[1] + scales.shape[1])
    assert torch.equal(torch.from_numpy(stored.data), torch.cat((values, scales), dim=1)[row_ids])
    assert torch.equal(decode_row_bytes(torch.from_numpy(stored.data), "fp8", values.shape[1]), expected)


def test_checkpoint_table_errors(tmp_path, cfg, weights):
    save_file({"other": torch.zeros(1)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="layers.1.engram.embed.weight.* not found"):
        EngramTable.from_checkpoint(tmp_path, 1, cfg)
    save_file({"layers.1.engram.embed.weight": torch.zeros(461, 16)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"shape \[461, 16\], expected \[462, 16\]"):
        EngramTable.from_checkpoint(tmp_path, 1, cfg)
    save_file({"layers.1.engram.embed.weight": torch.zeros(462, 16, dtype=torch.float8_e4m3fn)},
              tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="layers.1.engram.embed.scale"):
        EngramTable.from_checkpoint(tmp_path, 1, cfg)
    # a truncated shard
    save_file({"layers.1.engram.embed.weight": weights["layers.1.engram.embed.weight"]}, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        EngramTable.from_checkpoint(tmp_path, 1, cfg)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_files_round_trip(tmp_path, cfg, fp8_table, hasher, input_ids, world):
    values, scales = fp8_table
    paths = write_engram_shards(tmp_path, 3, values, scales, cfg, world)
    assert [p.name for p in paths] == [shard_file_name(3, r, world) for r in range(world)]
    reference = fp8_reference_rows(values, scales)
    row_ids = hasher.hash(input_ids)[:, cfg.engram_layer_ids.index(3)]
    constants = EngramConstants.from_config(cfg)
    pieces = []
    for rank, path in enumerate(paths):
        c0, c1 = head_shard(cfg.engram_cols, rank, world)
        lo, hi = constants.row_range(3, c0, c1)
        header = read_shard_header(path)
        assert header == {"layer": 3, "lo": lo, "hi": hi, "total rows": 630, "row bytes": 17}
        assert path.stat().st_size == 4096 + (hi - lo) * 17
        raw = path.read_bytes()
        # the spec's magic number, as packers write it (its little-endian bytes spell "DSV1EN41", not the
        # "DSV41EN1" the spec's prose says; the number is what existing shard files carry)
        assert struct.unpack("<Q", raw[:8])[0] == 0x31344E4531565344
        assert raw[48:4096] == bytes(4048)
        first = raw[4096:4096 + 17] if hi > lo else b""
        assert first == (bytes(values[lo].tolist()) + bytes(scales[lo].tolist()) if hi > lo else b"")
        table = EngramTable.from_shard_file(path, 3, cfg, rank=rank, world=world)
        assert table.cols == (c0, c1)
        pieces.append(table.gather(row_ids))
    gathered = torch.cat(pieces, dim=1)
    assert torch.equal(gathered, reference[row_ids])


def write_rank0_of_2(tmp_path, cfg, fp8_table):
    values, scales = fp8_table
    return write_engram_shards(tmp_path, 3, values, scales, cfg, 2)[0]


def patch_header(path, field_index, value):
    data = bytearray(path.read_bytes())
    struct.pack_into("<Q", data, 8 * field_index, value)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("field,index,value", [
    ("layer", 1, 1), ("lo", 2, 5), ("hi", 3, 10), ("total rows", 4, 631), ("row bytes", 5, 264)])
def test_shard_header_mismatch_names_the_field(tmp_path, cfg, fp8_table, field, index, value):
    path = write_rank0_of_2(tmp_path, cfg, fp8_table)
    patch_header(path, index, value)
    with pytest.raises(CheckpointError, match=f"header field '{field}' is {value}"):
        EngramTable.from_shard_file(path, 3, cfg, rank=0, world=2)


def test_shard_file_errors(tmp_path, cfg, fp8_table):
    path = write_rank0_of_2(tmp_path, cfg, fp8_table)
    # opened as the wrong rank: its lo/hi do not match
    with pytest.raises(CheckpointError, match="header field 'lo'"):
        EngramTable.from_shard_file(path, 3, cfg, rank=1, world=2)
    # wrong layer asked for
    with pytest.raises(CheckpointError, match="header field 'layer' is 3, expected 1"):
        EngramTable.from_shard_file(path, 1, cfg, rank=0, world=2)
    good = path.read_bytes()
    path.write_bytes(good[:-1])
    with pytest.raises(CheckpointError, match="bytes, expected"):
        EngramTable.from_shard_file(path, 3, cfg, rank=0, world=2)
    path.write_bytes(good + b"\0")
    with pytest.raises(CheckpointError, match="bytes, expected"):
        EngramTable.from_shard_file(path, 3, cfg, rank=0, world=2)
    path.write_bytes(b"NOTMAGIC" + good[8:])
    with pytest.raises(CheckpointError, match="magic"):
        EngramTable.from_shard_file(path, 3, cfg, rank=0, world=2)
    path.write_bytes(good[:20])
    with pytest.raises(CheckpointError, match="truncated"):
        EngramTable.from_shard_file(path, 3, cfg, rank=0, world=2)
    with pytest.raises(CheckpointError, match="cannot open"):
        EngramTable.from_shard_file(tmp_path / "missing.bin", 3, cfg, rank=0, world=2)


def test_gather_refuses_rows_of_another_rank(tmp_path, cfg, fp8_table, hasher, input_ids):
    path = write_rank0_of_2(tmp_path, cfg, fp8_table)
    table = EngramTable.from_shard_file(path, 3, cfg, rank=0, world=2)
    row_ids = hasher.hash(input_ids)[:, cfg.engram_layer_ids.index(3)]
    assert table.cols == (0, 3)
    table.gather(row_ids[:, :3])
    with pytest.raises(ValueError, match="outside this rank"):
        table.gather(row_ids[:, 3:6])  # rank 1's columns


ROW_1234 = [b if b not in (0x7F, 0xFF) else 0 for b in range(256)]  # 0x7F/0xFF are e4m3fn NaN


def test_shard_reader_is_lazy(tmp_path):
    """A ~1.1 GB (sparse) shard file: gathering a few rows must not read the table into memory."""
    config = SimpleNamespace(engram_layer_ids=[1], engram_max_ngram_size=4, engram_vocab_size=180_000,
                             engram_n_heads=8, engram_head_dim=256, engram_compressed_vocab_size=1000,
                             engram_num_embeddings=[0])
    constants = EngramConstants.from_config(SimpleNamespace(**{**vars(config), "engram_num_embeddings":
                                                               [int(engram_primes(config).sum())]}))
    rows = constants.num_rows[0]
    path = tmp_path / shard_file_name(1, 0, 1)
    tiny_values = torch.zeros(1, 256, dtype=torch.uint8)
    write_engram_shard(path, 1, 0, 0, rows, tiny_values, torch.zeros(1, 8, dtype=torch.uint8))  # header only
    patch_header(path, 3, rows)  # hi
    with open(path, "r+b") as handle:  # sparse: the rows read back as zeros without using disk
        handle.truncate(4096 + rows * 264)
        handle.seek(4096 + 1234 * 264)
        handle.write(bytes(ROW_1234) + bytes([127] * 8))  # row 1234: every non-NaN e4m3 code, scale 1
    assert path.stat().st_size > 1_000_000_000
    process = psutil.Process(os.getpid())
    before = process.memory_info().rss
    table = EngramTable.from_shard_file(path, 1, constants=constants, config=None)
    ids = torch.tensor([[1234] + [0] * 23, [rows - 1] + [5_000_000] * 23])
    ids = torch.minimum(ids, torch.tensor(rows - 1))
    out = table.gather(ids)
    grown = process.memory_info().rss - before
    assert grown < 64 * 2**20, f"gathering 48 rows grew RSS by {grown / 2**20:.0f} MiB"
    expected = torch.tensor(ROW_1234, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(out[0, 0], expected)
    assert torch.equal(out[1], torch.zeros(24, 256))



def test_bf16_checkpoint_table_equals_fp32(cfg, weights, hasher, input_ids):
    # the fixture's bf16 file holds the same numbers (its README: every value is exact in bf16)
    bf16 = EngramTable.from_checkpoint(ORACLE / "model.bf16.safetensors", 1, cfg)
    row_ids = hasher.hash(input_ids)[:, cfg.engram_layer_ids.index(1)]
    expected = weights["layers.1.engram.embed.weight"][row_ids]
    assert torch.equal(bf16.gather(row_ids), expected)


@pytest.mark.parametrize("name", ["model.safetensors", "model.bf16.safetensors"])
def test_checkpoint_rows_as_stored_decode_to_the_gathered_rows(cfg, hasher, input_ids, name):
    """`wait_bytes` of a checkpoint table (fp32 or bf16 values): the stored bytes of each asked row, which
    `decode_row_bytes` (what a step's graph runs) turns into `gather`'s rows bit for bit."""
    table = EngramTable.from_checkpoint(ORACLE / name, 1, cfg)
    row_ids = hasher.hash(input_ids)[:, cfg.engram_layer_ids.index(1)]
    stored = table.submit(row_ids).wait_bytes()
    width = {"f32": 4, "bf16": 2}[stored.kind] * stored.head_dim
    assert stored.data.dtype == np.uint8 and stored.data.shape == (*row_ids.shape, width)
    assert torch.equal(decode_row_bytes(torch.from_numpy(stored.data), stored.kind, stored.head_dim),
                       table.gather(row_ids))


def test_gather_reads_on_the_host_and_returns_on_the_asked_device(cfg, hasher, input_ids):
    """Row ids of any integer dtype and layout are read on the host; the rows land on `device`, by default the
    ids' own device (the CUDA run: tests/test_engram.py::test_layer_on_cuda)."""
    table = EngramTable.from_checkpoint(ORACLE, 1, cfg)
    row_ids = hasher.hash(input_ids)[:, cfg.engram_layer_ids.index(1)]
    expected = table.gather(row_ids)
    assert expected.device == row_ids.device and expected.dtype == torch.float32
    assert torch.equal(table.gather(row_ids.to(torch.int32), device=torch.device("cpu")), expected)
    column_major = row_ids.T.contiguous().T  # same values, another memory layout
    assert not column_major.is_contiguous()
    assert torch.equal(table.gather(column_major, device="cpu"), expected)
    assert torch.equal(table.gather(row_ids.tolist()), expected)
