"""The NVMe tier's file store (dsv41.sessions.files): real files in tmp_path, real child processes killed with
SIGKILL mid-write, a real file-size limit standing in for a full disk."""

from __future__ import annotations

import array
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv41.sessions import files as sf
from dsv41.sessions.files import CHAIN_TOKENS, SessionFiles

TESTS = Path(__file__).resolve().parent
SRC = Path(sf.__file__).resolve().parents[2]
TAG = "knobs=exact;ckpt=tiny;code=1;tp=1of1"


def store(directory, budget=1 << 30, min_tokens=1, tag=TAG) -> SessionFiles:
    return SessionFiles(directory, budget_bytes=budget, min_tokens=min_tokens, tag=tag)


def entry_for(key: str, scale: int = 1) -> tuple[list[int], list[tuple[str, bytes]], dict]:
    """An entry's contents derived from its key alone, so a reader can tell a right entry from a wrong one."""
    rng = random.Random(key)
    ids = [rng.randrange(130_000) for _ in range(rng.randrange(300, 1500))]
    blocks = [("ring", rng.randbytes(rng.randrange(scale << 19, scale << 20))), ("empty", b""),
              ("taps", rng.randbytes(rng.randrange(0, 5000)))]
    return ids, blocks, {"key": key, "length": len(ids)}


def assert_reads_back(s: SessionFiles, key: str, ids, blocks, meta) -> None:
    got = s.read(key)
    assert got is not None, key
    assert got[0] == list(ids) and got[2] == meta
    assert {name: bytes(data) for name, data in got[1].items()} == {name: bytes(data) for name, data in blocks}


def entry_path(directory: Path, key: str, tag: str = TAG) -> Path:
    return directory / sf.file_name(tag, key)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def payload_offset(path: Path, block: str) -> int:
    with open(path, "rb") as f:
        header, start = sf.read_header(f)
    table = {b["name"]: b for b in header["blocks"]} | {"ids": header["ids"]}
    return start + table[block]["offset"]


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dsv41.sessions" and r.levelno >= logging.WARNING]


# ---- round trip, index, lookup ----

def test_round_trip_is_bit_exact_and_the_index_is_rebuilt(tmp_path):
    s = store(tmp_path)
    ids = [0, 1, 2**32 - 1] + list(range(1000, 1000 + 3 * CHAIN_TOKENS))
    floats = array.array("d", [0.5, -1.25, float("inf")])
    big = bytearray(random.Random(1).randbytes(3 << 20))
    blocks = [("window", memoryview(big)), ("empty", b""), ("floats", memoryview(floats)), ("lookback", b"\x00\xff")]
    meta = {"length": len(ids), "page_tokens": 256}
    assert s.write("k1", ids, blocks, meta)
    assert s.write("k2", ids[:300], [("window", b"abc")], {})
    assert "k1" in s and len(s) == 2
    assert_reads_back(s, "k1", ids, blocks, meta)

    again = store(tmp_path)  # a restart: the index comes from the files' headers
    assert sorted(again.keys()) == ["k1", "k2"]
    assert again.stats()["bytes"] == s.stats()["bytes"] == sum(p.stat().st_size for p in tmp_path.iterdir())
    assert again.longest_prefix(ids + [7], 10**9) == "k1"
    assert again.longest_prefix(ids, len(ids) - 1) == "k2"  # max_len excludes k1
    assert again.longest_prefix(ids, 299) is None
    assert_reads_back(again, "k1", ids, blocks, meta)
    assert again.stats()["reads"] == 1 and again.stats()["hits"] == 2
    # the bytes read back (blocks and ids) and the time they took, for the NVMe tier's read rate (bench/sessions.py)
    assert again.stats()["read_bytes"] == len(big) + 2 + floats.itemsize * len(floats) + 4 * len(ids)
    assert again.stats()["read_ns"] > 0


def test_longest_prefix_agrees_with_a_brute_force_search(tmp_path):
    rng = random.Random(7)
    base = [rng.randrange(130_000) for _ in range(2100)]
    entries = {f"p{n}": base[:n] for n in (1, 100, 255, 256, 257, 511, 512, 700, 1024, 1500, 2100)}
    entries["fork-in-page-4"] = base[:800] + [base[800] + 1] + base[801:900]
    entries["fork-in-page-1"] = base[:10] + [base[10] + 1] + base[11:1300]
    entries["fork-in-tail"] = base[:1024] + [base[1024] + 1, 5]
    s = store(tmp_path)
    for key, ids in entries.items():
        assert s.write(key, ids, [("x", key.encode())], {})
    other = store(tmp_path / "other", tag="another tag")
    assert other.write("other-tag-longer", base + [1], [("x", b"")], {})

    prompts = [base + [1, 2], base[:1000], base[:256], base[:255], base[:800] + [base[800] + 1] + base[801:950],
               base[:10] + [base[10] + 1] + base[11:2000], base[:1024] + [base[1024] + 1, 5, 9], [base[0] + 1] + base]
    for prompt in prompts:
        for max_len in (0, 1, 256, 257, 799, 900, 1026, 1300, 10**9):
            fits = [k for k, ids in entries.items() if len(ids) <= min(max_len, len(prompt))
                    and prompt[:len(ids)] == ids]
            want = max(fits, key=lambda k: len(entries[k]), default=None)
            assert s.longest_prefix(prompt, max_len) == want, (len(prompt), max_len)


def test_another_tags_entries_are_invisible_and_evicted_first(tmp_path):
    ids, blocks, meta = entry_for("a")
    first = store(tmp_path, tag="tag A")
    assert first.write("a", ids, blocks, meta)
    size = first.stats()["bytes"]

    second = store(tmp_path, budget=2 * size + size // 2, tag="tag B")
    assert len(second) == 0 and "a" not in second and second.read("a") is None
    assert second.longest_prefix(ids, 10**9) is None
    assert entry_path(tmp_path, "a", "tag A").exists()  # kept: the other build may come back
    assert second.stats()["foreign_files"] == 1 and second.stats()["bytes"] == size
    assert second.write("b1", ids, blocks, meta)
    assert entry_path(tmp_path, "a", "tag A").exists()
    assert second.write("b2", ids, blocks, meta)  # the budget needs room: the other tag's file goes, not b1
    assert not entry_path(tmp_path, "a", "tag A").exists()
    assert second.keys() == ["b1", "b2"] and second.stats()["evictions"] == 1


# ---- budget ----

def test_budget_evicts_the_least_recently_used_and_the_order_survives_a_restart(tmp_path):
    contents = {k: ([i] * 400, [("x", bytes([i]) * 5000)], {"i": i}) for i, k in enumerate("abcdef")}
    probe = store(tmp_path / "probe")
    probe.write("a", *contents["a"])
    size = probe.stats()["bytes"]  # every entry here has the same file size

    s = store(tmp_path / "s", budget=3 * size + size // 2)
    for k in "abc":
        assert s.write(k, *contents[k])
    assert s.read("a") is not None  # a read refreshes
    assert s.write("d", *contents["d"])
    assert s.keys() == ["c", "a", "d"] and "b" not in s
    assert not entry_path(tmp_path / "s", "b").exists()
    assert store(tmp_path / "s", budget=3 * size + size // 2).keys() == ["c", "a", "d"]  # mtime keeps the order

    again = store(tmp_path / "s", budget=3 * size + size // 2)
    assert again.read("c") is not None  # order now a, d, c
    assert again.write("e", *contents["e"])
    assert again.keys() == ["d", "c", "e"] and not entry_path(tmp_path / "s", "a").exists()
    assert again.stats()["evictions"] == 1 and again.stats()["bytes"] == 3 * size

    lowered = store(tmp_path / "s", budget=2 * size)  # a smaller budget holds from the start
    assert lowered.keys() == ["c", "e"] and lowered.stats()["bytes"] == 2 * size
    assert len(list((tmp_path / "s").iterdir())) == 2


def test_an_entry_over_the_budget_or_under_min_tokens_is_not_written(tmp_path, caplog):
    s = store(tmp_path, budget=64 << 10, min_tokens=100)
    assert s.write("kept", [1] * 100, [("x", b"y")], {})
    for _ in range(2):
        assert not s.write("huge", [1] * 100, [("x", bytes(64 << 10))], {})
    assert not s.write("short", [1] * 99, [("x", b"y")], {})
    assert s.keys() == ["kept"]  # nothing evicted for an entry that can never fit
    assert sorted(p.name for p in tmp_path.iterdir()) == [entry_path(tmp_path, "kept").name]
    assert s.stats()["too_large"] == 2 and s.stats()["evictions"] == 0
    assert len([m for m in warnings(caplog) if "larger than the whole budget" in m]) == 1


# ---- damage ----

@pytest.mark.parametrize("where", ["ring", "taps", "ids"])
def test_a_flipped_byte_in_a_block_is_caught_on_read(tmp_path, caplog, where):
    s = store(tmp_path)
    ids, blocks, meta = entry_for("k")
    assert s.write("k", ids, blocks, meta) and s.write("other", *entry_for("other"))
    path = entry_path(tmp_path, "k")
    flip_byte(path, payload_offset(path, where) + 3)
    assert s.longest_prefix(ids, 10**9) == "k"  # the index cannot know yet: only a read looks at the payload
    assert s.read("k") is None
    assert not path.exists() and "k" not in s and s.longest_prefix(ids, 10**9) is None
    assert s.stats()["read_failures"] == 1
    why = "ids checksum mismatch" if where == "ids" else f"block {where!r} checksum mismatch"
    assert [m for m in warnings(caplog) if "dropped" in m] == [f"session entry {path.name} dropped: {why}"]
    assert_reads_back(s, "other", *entry_for("other"))


def test_a_flipped_header_byte_or_a_truncated_file_is_dropped_at_start(tmp_path, caplog):
    s = store(tmp_path)
    for key in ("header", "short", "shorter", "fine"):
        assert s.write(key, *entry_for(key))
    flip_byte(entry_path(tmp_path, "header"), 40)  # inside the header's JSON
    os.truncate(entry_path(tmp_path, "short"), entry_path(tmp_path, "short").stat().st_size - 1)
    os.truncate(entry_path(tmp_path, "shorter"), 10)
    (tmp_path / "stray.ses").write_bytes(b"not an entry, but long enough for a preamble")
    caplog.clear()

    again = store(tmp_path)
    assert again.keys() == ["fine"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [entry_path(tmp_path, "fine").name]
    logged = " | ".join(warnings(caplog))
    for why in ("header checksum mismatch", "(truncated?)", "shorter than its preamble", "no entry-file magic"):
        assert why in logged
    assert_reads_back(again, "fine", *entry_for("fine"))


def test_a_file_truncated_after_start_is_caught_on_read(tmp_path):
    s = store(tmp_path)
    assert s.write("k", *entry_for("k"))
    path = entry_path(tmp_path, "k")
    os.truncate(path, path.stat().st_size - 100)
    assert s.read("k") is None and not path.exists() and s.stats()["read_failures"] == 1


def test_leftover_temporary_files_are_removed_at_start_and_the_log_stays_short(tmp_path, caplog):
    s = store(tmp_path)
    assert s.write("k", *entry_for("k"))
    for i in range(8):
        (tmp_path / f"{entry_path(tmp_path, 'k').name}.{i:08x}.tmp").write_bytes(b"half an entry")
    (tmp_path / "README").write_text("not ours")  # other files are left alone
    caplog.clear()
    again = store(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["README", entry_path(tmp_path, "k").name])
    assert again.keys() == ["k"]
    logged = warnings(caplog)
    assert len(logged) == sf.START_LOG_LINES + 1 and logged[-1] == "... and 3 more session files removed at start"


# ---- crash safety, for real ----

def crash_writer(directory: str, round_: str) -> None:
    """Run in a child: write entries forever (the test kills it), evicting under a small budget as it goes."""
    s = store(directory, budget=24 << 20)
    print("ready", flush=True)
    for i in range(10**6):
        key = f"r{round_}-{i}"
        s.write(key, *entry_for(key, scale=2))


def child(function: str, *args, **popen) -> subprocess.Popen:
    code = f"import sys; sys.path[:0] = [{str(TESTS)!r}, {str(SRC)!r}]; import test_session_files as t; t.{function}"
    return subprocess.Popen([sys.executable, "-c", f"{code}(*sys.argv[1:])", *map(str, args)], **popen)


def test_sigkill_mid_write_never_leaves_an_entry_that_reads_back_wrong(tmp_path):
    rng = random.Random(34)
    torn, checked = 0, 0
    for round_ in range(6):
        proc = child("crash_writer", tmp_path, round_, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0.05, 0.4))
        deadline = time.monotonic() + 10
        while round_ % 2 == 0 and not any(p.suffix == ".tmp" for p in tmp_path.iterdir()):
            assert time.monotonic() < deadline, "the writer never started a file"  # odd rounds: any moment
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        proc.stdout.close()
        torn += any(p.suffix == ".tmp" for p in tmp_path.iterdir())

        s = store(tmp_path, budget=24 << 20)
        assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]
        assert len(s) > 0
        for key in s.keys():
            assert_reads_back(s, key, *entry_for(key, scale=2))
            checked += 1
        assert s.stats()["read_failures"] == 0
    assert torn >= 1  # at least one kill landed inside a write (the even rounds wait for a temporary file)
    assert checked >= 6


# ---- an unusable directory, a full disk ----

def test_an_unwritable_directory_turns_the_store_off_with_one_log_line(tmp_path, caplog):
    if os.geteuid() == 0:
        pytest.skip("running as root: chmod 0o500 does not stop root (the directory under a regular file covers it)")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        check_store_off(store(locked), caplog)
    finally:
        locked.chmod(0o700)


def test_a_directory_under_a_regular_file_turns_the_store_off_with_one_log_line(tmp_path, caplog):
    (tmp_path / "a-file").write_text("x")
    check_store_off(store(tmp_path / "a-file" / "sessions"), caplog)


def check_store_off(s: SessionFiles, caplog) -> None:
    ids, blocks, meta = entry_for("k")
    for _ in range(3):
        assert not s.write("k", ids, blocks, meta)
    assert s.read("k") is None and s.longest_prefix(ids, 10**9) is None and len(s) == 0
    assert s.stats()["disabled"] and s.stats()["entries"] == 0
    logged = warnings(caplog)
    assert len(logged) == 1 and "not usable" in logged[0] and "session tier is off" in logged[0]


def full_disk_writer(directory: str) -> None:
    """Run in a child under a 1 MiB file-size limit (SIGXFSZ ignored, so a write fails with EFBIG)."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    logging.basicConfig(stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    s = store(directory)
    ids = list(range(2000))
    big = [s.write(f"big{i}", ids, [("ring", bytes(2 << 20))], {}) for i in range(4)]
    small = s.write("small", ids, [("ring", b"x" * 1000)], {})  # serving goes on: a small entry still fits
    back = s.read("small")
    print(json.dumps({"big": big, "small": small, "back": back is not None and bytes(back[1]["ring"]) == b"x" * 1000,
                      "stats": s.stats(), "files": sorted(os.listdir(directory))}))


def test_a_full_disk_fails_the_write_logs_once_and_serving_goes_on(tmp_path):
    proc = child("full_disk_writer", tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    result = json.loads(out)
    assert result["big"] == [False] * 4 and result["small"] and result["back"]
    assert result["stats"]["write_failures"] == 4 and result["stats"]["writes"] == 1
    assert result["files"] == [sf.file_name(TAG, "small")]  # no temporary file left behind
    assert len([line for line in err.splitlines() if "dsv41.sessions" in line]) == 1
    assert "File too large" in err
