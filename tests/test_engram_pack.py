"""`dsv41 engram pack` (dsv41.engram.pack, .check): the synthetic original of tests/test_engram_pack_source.py packed
per rank, every row read back against the source bytes, `--check` passing and naming a corrupted byte, resumption
after kill -9 ending in the identical file, and bounded memory."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from dsv41.engram.check import check_pack
from dsv41.engram.hashing import EngramConstants, head_shard
from dsv41.engram.pack import STATE_SUFFIX, pack_rank
from dsv41.engram.shards import dequant_fp8_rows, shard_file_name, shard_header
from dsv41.engram.source import OriginalCheckpoint
from dsv41.engram.tables import EngramTable
from dsv41.errors import CheckpointError
from test_engram_pack_source import original, packed, run_cli  # noqa: F401 (fixtures)


def expected_file(src: OriginalCheckpoint, tables, layer_id: int, rank: int, world: int) -> bytes:
    c = src.constants
    lo, hi = c.row_range(layer_id, *head_shard(c.n_cols, rank, world))
    return shard_header(layer_id, lo, hi, tables[layer_id].shape[0], 264) + tables[layer_id][lo:hi].tobytes()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_row_equals_the_source(tmp_path, original, world):
    folder, tables = original
    src = OriginalCheckpoint(folder)
    for rank in range(world):
        report = pack_rank(src, tmp_path, rank, world, chunk_rows=7_777, progress=False)
        assert [p.name for p in report.files] == [shard_file_name(L, rank, world) for L in (1, 4)]
        for layer_id in (1, 4):
            path = tmp_path / shard_file_name(layer_id, rank, world)
            assert path.read_bytes() == expected_file(src, tables, layer_id, rank, world)
    assert not list(tmp_path.glob("*.partial*"))  # nothing left behind
    # and through the engine's reader: every row of the table, from the rank files, equals the source's rows
    for layer_id in (1, 4):
        table = tables[layer_id]
        want = dequant_fp8_rows(torch.from_numpy(table[:, :256]), torch.from_numpy(table[:, 256:]))
        c = src.constants
        pieces = []
        for rank in range(world):
            t = EngramTable.from_shard_file(tmp_path / shard_file_name(layer_id, rank, world), layer_id, src.config,
                                            rank, world, constants=c)
            cols = t.cols[1] - t.cols[0]
            ids = torch.arange(t.lo, t.hi + (-(t.hi - t.lo)) % cols).clamp(max=t.hi - 1)  # whole rows of ids
            pieces.append(t.gather(ids.reshape(-1, cols)).reshape(-1, 256)[:t.hi - t.lo])
        torch.testing.assert_close(torch.cat(pieces), want, rtol=0, atol=0, equal_nan=True)


def test_a_second_run_leaves_complete_files_alone(packed, original):
    out = packed[2]
    before = {p: p.stat().st_mtime_ns for p in out.glob("*.bin")}
    report = pack_rank(original[0], out, 0, 2, progress=False)
    assert not report.files and len(report.skipped) == 2 and report.bytes_written == 0
    assert {p: p.stat().st_mtime_ns for p in out.glob("*.bin")} == before


def test_a_foreign_file_under_the_final_name_is_refused(tmp_path, original):
    (tmp_path / shard_file_name(1, 0, 2)).write_bytes(shard_header(1, 0, 5, 5, 264) + bytes(5 * 264))
    with pytest.raises(CheckpointError, match="exists but is not this rank's file.*remove it"):
        pack_rank(original[0], tmp_path, 0, 2, progress=False)


def test_check_passes_on_the_packed_files(packed, original):
    out = packed[2]
    report = check_pack(original[0], out, full=True)
    assert report.ok and len(report.passed) == 4, report.problems
    proc = run_cli("pack", "--src", str(original[0]), "--check", str(out), "--rank", "1", "--tp", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok: ") == 2 and "MISMATCH" not in proc.stdout


def corrupt_copy(tmp_path, packed, name: str, offset: int, flip: int = 0x01):
    data = bytearray((packed[2] / name).read_bytes())
    data[offset] ^= flip
    (tmp_path / name).write_bytes(bytes(data))
    return tmp_path / name


def test_check_names_one_corrupted_byte(tmp_path, packed, original):
    src = OriginalCheckpoint(original[0])
    name = shard_file_name(4, 1, 2)
    lo = src.constants.row_range(4, 12, 24)[0]
    rng = random.Random(7)
    row, byte = rng.randrange(1, 50_000), rng.randrange(264)
    corrupt_copy(tmp_path, packed, name, 4096 + row * 264 + byte)
    proc = run_cli("pack", "--src", str(original[0]), "--check", str(tmp_path), "--full")
    assert proc.returncode == 1
    part = f"value byte {byte}" if byte < 256 else f"scale byte {byte - 256}"
    assert (f"MISMATCH: {tmp_path / name}: row {lo + row} (file offset {4096 + row * 264 + byte}, {part})"
            in proc.stdout), proc.stdout
    assert "1 of " in proc.stdout
    # the sampled check always looks at the first and the last row
    corrupt_copy(tmp_path, packed, name, 4096 + 263)
    problems = check_pack(src, tmp_path).problems
    assert len(problems) == 1 and f"row {lo} (file offset {4096 + 263}, scale byte 7)" in problems[0]


@pytest.mark.parametrize("offset,message", [
    (0, "not an Engram shard file"), (8, "header field 'layer' is 5, expected 4"), (16 + 1, "header field 'lo'"),
    (100, "header padding")])
def test_check_names_a_corrupted_header(tmp_path, packed, original, offset, message):
    corrupt_copy(tmp_path, packed, shard_file_name(4, 1, 2), offset)
    problems = check_pack(original[0], tmp_path).problems
    assert len(problems) == 1 and message in problems[0], problems


def test_check_names_missing_and_wrong_size_files(tmp_path, packed, original):
    name = shard_file_name(1, 0, 2)
    (tmp_path / name).write_bytes((packed[2] / name).read_bytes() + b"\0")
    problems = check_pack(original[0], tmp_path, rank=0, world=2).problems
    assert any(p.endswith(f"{shard_file_name(4, 0, 2)}: missing") for p in problems)
    assert any("bytes, expected" in p and name in p for p in problems)
    assert check_pack(original[0], tmp_path / "nothing-here").problems[0].endswith("no engram-l*-r*of*.bin shard files")


def pack_command(src, out, *extra):
    return [sys.executable, "-m", "dsv41.cli", "engram", "pack", "--src", str(src), "--out", str(out), "--rank", "0",
            "--tp", "2", "--chunk-rows", "2048", *extra]


@pytest.mark.slow
def test_kill_9_at_random_points_then_resume_gives_the_identical_file(tmp_path, original):
    folder, tables = original
    src = OriginalCheckpoint(folder)
    rng = random.Random(1234)
    resumed = []
    for attempt in range(4):
        # paced to ~8 MiB/s so that the copy (~27 MB for the rank) is still running when the kill comes
        proc = subprocess.Popen(pack_command(folder, tmp_path, "--max-mib-s", "8"), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("*" + STATE_SUFFIX)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # the copy has started once a progress record exists
        time.sleep(rng.uniform(0.0, 1.5))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        states = [json.loads(p.read_text())["rows done"] for p in tmp_path.glob("*" + STATE_SUFFIX)]
        resumed.append(states)
    final = subprocess.run(pack_command(folder, tmp_path), capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stdout + final.stderr
    assert any(s and s[0] > 0 for s in resumed), resumed  # some kill landed mid-copy
    for layer_id in (1, 4):
        assert (tmp_path / shard_file_name(layer_id, 0, 2)).read_bytes() == expected_file(src, tables, layer_id, 0, 2)
    assert not list(tmp_path.glob("*.partial*"))
    assert check_pack(src, tmp_path, full=True).ok


def test_resume_ignores_a_record_of_another_job(tmp_path, original):
    folder, tables = original
    src = OriginalCheckpoint(folder)
    name = shard_file_name(1, 0, 2)
    # a partial file full of garbage and a record claiming 5000 rows of some other source
    (tmp_path / (name + ".partial")).write_bytes(os.urandom(4096 + 6000 * 264))
    (tmp_path / (name + STATE_SUFFIX)).write_text(json.dumps({"job": {"source": "elsewhere"}, "rows done": 5000}))
    report = pack_rank(src, tmp_path, 0, 2, layers=[1], progress=False)
    assert report.resumed_rows == 0
    assert (tmp_path / name).read_bytes() == expected_file(src, tables, 1, 0, 2)


def test_memory_stays_bounded(tmp_path, original):
    """The pack of a 27 MB rank share with 2048-row chunks (1.6 MB of buffers) grows the resident set by a few MiB,
    not by the table."""
    proc = subprocess.run(pack_command(original[0], tmp_path, "--no-progress"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = proc.stdout.strip().splitlines()[-1]
    growth = float(summary.split("MiB (")[1].split(" MiB during")[0])
    buffers = float(summary.split("buffers ")[1].split(" MiB")[0])
    assert buffers <= 2 and growth < 12, summary
    sizes = [os.path.getsize(tmp_path / shard_file_name(L, 0, 2)) for L in (1, 4)]
    assert sum(sizes) > 25e6
    print(summary)


def test_constants_of_the_synthetic_original_tile_the_tables(original):
    src = OriginalCheckpoint(original[0])
    c: EngramConstants = src.constants
    for li, layer_id in enumerate(c.layer_ids):
        assert c.row_range(layer_id, 0, c.n_cols) == (0, original[1][layer_id].shape[0])
        assert np.all(np.diff(c.offsets[li].numpy()) > 4000)  # 24 columns of ~4.2 k rows
