"""The engine's shard reader (dsv41.engram.reader, RECIPE.md §2.9): the read plan (sorted unique rows,
sector-aligned extents merged across small holes), rows read with O_DIRECT equal to the source's, reads in
flight while others are submitted, open-time refusal of wrong magic / size / range files, clear errors for rows
outside the rank's range and for short reads or I/O errors, and the layer's prefetch seam."""

import errno
import os

import numpy as np
import pytest
import torch

from dsv41.engram import reader as reader_mod
from dsv41.engram.hashing import head_shard
from dsv41.engram.reader import ReadPool, ShardRows, plan_reads
from dsv41.engram.shards import decode_row_bytes, dequant_fp8_rows, shard_file_name
from dsv41.engram.tables import EngramTable
from dsv41.errors import CheckpointError
from dsv41.model.engram import EngramLayer
from test_engram_pack_source import original, packed  # noqa: F401 (fixtures)


def source_rows(table: np.ndarray, rows) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(table[np.asarray(rows)]))
    return dequant_fp8_rows(t[..., :256], t[..., 256:])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise, with NaN where NaN: the random rows hold e4m3 NaN codes, and which NaN payload a multiply returns
    is the processor's choice (x86 keeps the operand's, CUDA returns its canonical NaN), not the reader's."""
    if a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    keep = ~a.isnan()
    return torch.equal(a[keep].view(torch.int32), b[keep].view(torch.int32))


def open_table(packed, layer_id=1, rank=0, world=2, **kw) -> EngramTable:
    src, _, out = packed
    return EngramTable.from_shard_file(out / shard_file_name(layer_id, rank, world), layer_id, src.config, rank,
                                       world, constants=src.constants, **kw)


# --- the plan ----------------------------------------------------------------------------------------------------


def test_plan_aligns_merges_and_splits():
    rows = np.array([0, 1, 2, 10, 11, 1000, 1003])
    plan = plan_reads(rows, 264, 512, merge_gap=4096, max_extent=1 << 20)
    assert np.all(plan.starts % 512 == 0) and np.all(plan.lengths % 512 == 0)
    # rows 0-2 and 10-11 are 1.5 KiB apart: one extent; rows 1000/1003 are ~250 KB further: a second one
    assert plan.starts.tolist() == [4096, (4096 + 1000 * 264) // 512 * 512]
    assert plan.lengths.tolist() == [7680 - 4096, 269312 - 267776]  # to the end of the sector holding the last byte
    assert plan.total == plan.lengths.sum()
    # without merging only rows sharing or touching sectors share an extent: 0-2, 10-11, 1000 + 1003
    assert plan_reads(rows, 264, 512, merge_gap=0).starts.tolist() == [4096, 6656, 267776]
    dense = plan_reads(np.arange(10_000), 264, 512, merge_gap=4096, max_extent=64 * 1024)
    assert dense.starts.size == -(-(10_000 * 264) // (64 * 1024)) and dense.lengths.max() <= 64 * 1024 + 512
    assert plan_reads(np.zeros(0, dtype=np.int64), 264, 512).total == 0


@pytest.mark.parametrize("align,gap,max_extent", [(512, 4096, 1 << 20), (4096, 0, 8192), (1, 100, 1000)])
def test_plan_places_every_row_where_its_bytes_land(tmp_path, align, gap, max_extent):
    rng = np.random.default_rng(align)
    data = rng.integers(0, 256, 4096 + 5000 * 264, dtype=np.uint8)
    rows = np.unique(rng.integers(0, 5000, 700))
    plan = plan_reads(rows, 264, align, gap, max_extent)
    buf = np.zeros(plan.total, dtype=np.uint8)
    for s, n, b in zip(plan.starts, plan.lengths, plan.buf_starts):
        got = data[s:s + n]
        buf[b:b + got.size] = got
    for r, p in zip(rows, plan.row_pos):
        assert np.array_equal(buf[p:p + 264], data[4096 + r * 264:4096 + (r + 1) * 264])


# --- reads -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False])
def test_rows_equal_the_source(packed, direct):
    src, tables, _ = packed
    rng = np.random.default_rng(3)
    for layer_id in (1, 4):
        for rank in range(2):
            table = open_table(packed, layer_id, rank, direct=direct)
            ids = torch.from_numpy(rng.integers(table.lo, table.hi, size=(300, 12)))
            ids[5] = ids[7]  # repeats and unsorted ids
            ids[0, 0], ids[-1, -1] = table.lo, table.hi - 1  # the first and the last row of the file
            got = table.gather(ids)
            assert got.shape == (300, 12, 256)
            assert same(got, source_rows(tables[layer_id], ids))
            assert table._source.rows.direct == (direct and table._source.rows.direct)
    if direct:
        # this machine's /tmp takes O_DIRECT: the reads really bypassed the page cache
        assert open_table(packed)._source.rows.direct, "O_DIRECT was refused here"


def test_several_reads_in_flight(packed):
    _, tables, _ = packed
    table = open_table(packed, 4, 1)
    rng = np.random.default_rng(4)
    batches = [torch.from_numpy(rng.integers(table.lo, table.hi, size=(n, 12))) for n in (1, 2048, 3, 600)]
    pending = [table.submit(b) for b in batches]  # all submitted before any is collected
    for ids, p in reversed(list(zip(batches, pending))):
        assert same(p.wait(), source_rows(tables[4], ids))
    with pytest.raises(RuntimeError, match="twice"):
        pending[0].wait()


def test_stored_bytes_are_the_files_rows_in_the_asked_order(packed):
    """`wait_bytes` gives each asked row's bytes as the file stores them (repeats and order kept), and decoding
    them anywhere (`RowBytes.decode`, `decode_row_bytes`: what a step's graph runs) gives `wait`'s rows."""
    _, tables, _ = packed
    table = open_table(packed, 4, 1)
    rng = np.random.default_rng(8)
    ids = torch.from_numpy(rng.integers(table.lo, table.hi, size=(40, 12)))
    ids[3] = ids[30]
    stored = table.submit(ids).wait_bytes()
    assert stored.kind == "fp8" and stored.head_dim == 256 and stored.data.shape == (40, 12, 264)
    assert np.array_equal(stored.data, tables[4][ids.numpy()])
    assert same(stored.decode(), table.gather(ids))
    assert same(decode_row_bytes(torch.from_numpy(stored.data), "fp8", 256), source_rows(tables[4], ids))


def test_full_column_ids_are_restricted_to_the_rank(packed):
    src, tables, _ = packed
    table = open_table(packed, 1, 1)
    c0, c1 = head_shard(24, 1, 2)
    rng = np.random.default_rng(5)
    full = torch.stack([torch.from_numpy(rng.integers(int(src.constants.offsets[0, c]),
                                                      int(src.constants.offsets[0, c]) + 4000, size=40))
                        for c in range(24)], dim=1)
    assert same(table.gather(full), source_rows(tables[1], full[:, c0:c1]))


def test_one_pool_serves_every_file(packed):
    pool = ReadPool(threads=3)
    a, b = open_table(packed, 1, 0, pool=pool), open_table(packed, 4, 0, pool=pool)
    assert a._source.rows.pool is b._source.rows.pool is pool
    assert open_table(packed)._source.rows.pool is reader_mod.default_pool()
    ids = torch.tensor([[a.lo] * 12])
    a.gather(ids), b.gather(torch.tensor([[b.lo] * 12]))
    pool.close()


# --- refusals and errors -----------------------------------------------------------------------------------------


def damaged_copy(packed, tmp_path, mutate):
    _, _, out = packed
    name = shard_file_name(1, 0, 2)
    data = bytearray((out / name).read_bytes())
    data = mutate(data)
    (tmp_path / name).write_bytes(bytes(data))
    src = packed[0]
    return lambda: EngramTable.from_shard_file(tmp_path / name, 1, src.config, 0, 2, constants=src.constants)


@pytest.mark.parametrize("mutate,message", [
    (lambda d: b"DSV41EN1" + d[8:], r"not an Engram shard file \(magic 0x314e453134565344, expected 0x31344e4531565344\)"),
    (lambda d: d[:-1], r"file is \d+ bytes, expected \d+"),
    (lambda d: d + b"\0" * 264, r"file is \d+ bytes, expected \d+"),
    (lambda d: d[:16] + (5).to_bytes(8, "little") + d[24:], "header field 'lo' is 5, expected 0"),
    (lambda d: d[:24] + (7).to_bytes(8, "little") + d[32:], "header field 'hi' is 7, expected"),
    (lambda d: d[:40] + (132).to_bytes(8, "little") + d[48:], "header field 'row bytes' is 132, expected 264"),
    (lambda d: d[:30], "truncated Engram shard header"),
])
def test_wrong_files_are_refused_at_open(packed, tmp_path, mutate, message):
    opener = damaged_copy(packed, tmp_path, mutate)
    with pytest.raises(CheckpointError, match=str(tmp_path) + ".*" + message):
        opener()


def test_the_other_ranks_file_is_refused(packed):
    src, _, out = packed
    with pytest.raises(CheckpointError, match="header field 'lo' is .*expected 0 \\(layer 1, rank 0 of 2\\)"):
        EngramTable.from_shard_file(out / shard_file_name(1, 1, 2), 1, src.config, 0, 2, constants=src.constants)


def test_a_row_outside_the_rank_is_a_clear_error(packed):
    table = open_table(packed, 1, 0)
    bad = torch.full((2, 12), table.lo)
    bad[1, 3] = table.hi
    with pytest.raises(ValueError, match=f"engram-l1-r0of2.bin: row id {table.hi} outside this rank's rows "
                                         f"\\[{table.lo}, {table.hi}\\) \\(layer 1, rank 0 of 2\\)"):
        table.submit(bad)


def test_a_short_read_names_the_file_and_offset(packed, tmp_path):
    opener = damaged_copy(packed, tmp_path, lambda d: d)
    table = opener()
    path = tmp_path / shard_file_name(1, 0, 2)
    os.truncate(path, 4096 + 1000 * 264)  # shrinks under the open reader
    table.gather(torch.tensor([[table.lo + 10] * 12]))  # rows still there read fine
    pending = table.submit(torch.tensor([[table.lo + 20_000] * 12]))
    with pytest.raises(CheckpointError, match=f"{path}: short read at offset \\d+: 0 of \\d+ bytes \\(file {4096 + 1000 * 264} bytes, expected"):
        pending.wait()


def test_an_io_error_names_the_file_and_offset(packed, monkeypatch):
    table = open_table(packed, 1, 0)

    def failing(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(reader_mod.os, "preadv", failing)
    pending = table.submit(torch.tensor([[table.lo + 7] * 12]))
    with pytest.raises(CheckpointError, match=r"engram-l1-r0of2.bin: read of \d+ bytes at offset 5632 failed "
                                              r"\(Input/output error\)"):
        pending.wait()


def test_shard_rows_refuse_a_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="cannot open Engram shard"):
        ShardRows(tmp_path / "nope.bin", 10, 264, 256, direct=False)


# --- the layer's seam --------------------------------------------------------------------------------------------


class CountingTable:
    def __init__(self, table):
        self.table, self.submits = table, 0

    def submit(self, row_ids):
        self.submits += 1
        return self.table.submit(row_ids)

    def gather(self, row_ids, device=None):
        return self.submit(row_ids).wait(device)


def test_prefetch_is_used_by_the_forward_with_the_same_ids(packed):
    torch.manual_seed(0)
    table = CountingTable(open_table(packed, 1, 0))
    d, hc = 8, 2
    wkv = torch.randn((hc + 1) * d, 12 * 256) / 50
    layer = EngramLayer(1, table, lambda x: x @ wkv.T, torch.randn(hc, d), torch.randn(hc, d), 1e-20)
    rng = np.random.default_rng(6)
    ids = torch.from_numpy(rng.integers(table.table.lo, table.table.hi, size=(5, 12)))
    streams = torch.randn(5, hc, d)
    want = layer(streams, ids)
    assert table.submits == 1
    layer.prefetch(ids)
    assert same(layer(streams, ids), want) and table.submits == 2  # the prefetched read, no second one
    layer.prefetch(ids[:2])  # a prefetch for other ids: waited for, dropped, and the rows read afresh
    assert same(layer(streams, ids), want) and table.submits == 4
    assert same(layer(streams, ids), want) and table.submits == 5  # nothing pending any more


@pytest.mark.gpu
def test_rows_land_on_cuda_through_pinned_memory(packed):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: run on a GPU machine (`pytest -m gpu`)")
    _, tables, _ = packed
    table = open_table(packed, 4, 0)
    ids = torch.from_numpy(np.random.default_rng(8).integers(table.lo, table.hi, size=(2048, 12)))
    got = table.gather(ids.cuda())
    assert got.device.type == "cuda"
    assert same(got.cpu(), source_rows(tables[4], ids))
