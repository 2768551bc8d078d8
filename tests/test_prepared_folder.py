"""Prepared folders refused with their reason (damaged, other rank / layout / checkpoint / build / code, truncated,
unfinished), the checkpoint fallback, resume after an interruption, `--check`, and the skeleton's restricted load.

The built-in tiny model (EXL3 pack layout), prepared once per module for both ranks of TP = 2 on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsv41.config import ModelConfig
import torch

from dsv41.prepared import manifest as mf
from dsv41.prepared.manifest import PreparedMismatch
from dsv41.prepared.reader import load_prepared
from dsv41.prepared.writer import check_folder, prepare

from test_prepared_start import REPO, tree_differences

KW = dict(device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def prepared(tiny_model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prepared")
    for rank in (0, 1):
        prepare(tiny_model_dir, root, rank=rank, world=2, log=lambda line: None, **KW)
    return root


@pytest.fixture()
def copy(prepared, tmp_path) -> Path:
    """A private copy of rank 0's folder, to damage."""
    shutil.copytree(prepared / "rank0-of-2", tmp_path / "rank0-of-2")
    return tmp_path / "rank0-of-2"


def refusal(folder, model, **kw) -> str:
    args = {**KW, "rank": 0, "world": 2, **kw}
    with pytest.raises(PreparedMismatch) as info:
        load_prepared(folder, model, **args)
    return str(info.value)


def _edit_manifest(folder: Path, edit) -> None:
    manifest = json.loads((folder / mf.MANIFEST).read_text())
    edit(manifest)
    (folder / mf.MANIFEST).write_text(json.dumps(manifest))


def _flip(folder: Path, entry: dict, at: int = 0) -> None:
    with open(folder / mf.DATA, "r+b") as handle:
        handle.seek(entry["offset"] + at)
        byte = handle.read(1)
        handle.seek(entry["offset"] + at)
        handle.write(bytes([byte[0] ^ 0x10]))


def _tensor_entries(folder: Path) -> list[dict]:
    return [e for e in mf.read_manifest(folder)["entries"] if e["kind"] == "tensor"]


def test_a_flipped_byte_is_refused_and_named(copy, tiny_model_dir):
    first = _tensor_entries(copy)[0]  # in the start's sample (every 16th tensor entry and the last)
    _flip(copy, first, at=first["nbytes"] // 2)
    reason = refusal(copy, tiny_model_dir)
    assert reason == f"{copy}: entry {first['name']} of data.bin is damaged (sha256 differs): run `dsv41 prepare` again"
    assert len(reason.splitlines()) == 1
    assert check_folder(copy) == [f"{copy / 'data.bin'}: entry {first['name']} (offset {first['offset']}, "
                                  f"{first['nbytes']} bytes) is damaged (sha256 differs)"]


def test_the_sample_skips_what_full_verification_catches(copy, tiny_model_dir):
    unsampled = _tensor_entries(copy)[1]
    _flip(copy, unsampled)
    load_prepared(copy, tiny_model_dir, rank=0, world=2, verify="sample", **KW)  # not in the sample
    assert "is damaged" in refusal(copy, tiny_model_dir, verify="full")
    assert len(check_folder(copy)) == 1


def test_other_rank_layout_build_and_code_are_refused(prepared, copy, tiny_model_dir):
    assert refusal(prepared / "rank1-of-2", tiny_model_dir).endswith(
        "prepared for rank 1 of TP 2, this process is rank 0 of TP 2")
    assert refusal(prepared, tiny_model_dir, world=1).endswith(": no manifest.json (not a prepared folder; run "
                                                               "`dsv41 prepare`)")
    assert refusal(prepared, tiny_model_dir, dtype=torch.bfloat16).endswith(
        "prepared with dtype = float32, this start has bfloat16")
    assert refusal(prepared, tiny_model_dir, fake_quant=False).endswith(
        "prepared with fake_quant = True, this start has False")
    _edit_manifest(copy, lambda m: m.update(layout_version=mf.LAYOUT_VERSION + 1))
    assert refusal(copy, tiny_model_dir).endswith(
        f"layout version {mf.LAYOUT_VERSION + 1}, this code reads {mf.LAYOUT_VERSION}: run `dsv41 prepare` again")
    _edit_manifest(copy, lambda m: m.update(layout_version=mf.LAYOUT_VERSION))
    _edit_manifest(copy, lambda m: m["code"]["modules"].update({"dsv41.runtime.layers.linear": "0" * 64}))
    assert refusal(copy, tiny_model_dir).endswith("the code that built it changed since "
                                                  "(dsv41.runtime.layers.linear)")


def test_another_checkpoint_is_refused(prepared, tiny_model_dir, tmp_path):
    from dsv41.tiny.model import make_tiny

    other = make_tiny(tmp_path / "seed1", "exl3", seed=1)  # same shapes, names and sizes; other weights
    reason = refusal(prepared, other)
    assert "prepared from another checkpoint: shard model-00001-of-" in reason
    (tmp_path / "cfg").mkdir()
    for f in tiny_model_dir.iterdir():
        (tmp_path / "cfg" / f.name).symlink_to(f)
    (tmp_path / "cfg" / "config.json").unlink()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "cfg" / "config.json").write_text(json.dumps({**config, "note": "edited"}))
    assert refusal(prepared, tmp_path / "cfg").endswith("prepared from another checkpoint: config.json differs")


def test_truncated_and_unfinished_folders_are_refused(copy, tiny_model_dir):
    size = (copy / mf.DATA).stat().st_size
    with open(copy / mf.DATA, "r+b") as handle:
        handle.truncate(size - 1)
    assert refusal(copy, tiny_model_dir).endswith(f"data.bin is {size - 1} bytes, the manifest says {size} "
                                                  f"(a partial copy?)")
    _edit_manifest(copy, lambda m: m.update(complete=False))
    assert refusal(copy, tiny_model_dir).endswith("incomplete (prepare was interrupted): run `dsv41 prepare` "
                                                  "again to finish it")


def test_fallback_builds_from_the_checkpoint_only_when_asked(prepared, tiny_model_dir):
    from dsv41.prepared.start import load_fast_model

    args = argparse.Namespace(prepared=str(prepared / "rank1-of-2"), prepared_fallback=False, prepared_verify=None,
                              no_fake_quant=False)
    with pytest.raises(PreparedMismatch):
        load_fast_model(args, tiny_model_dir, rank=0, world=2, **KW)
    lines = []
    args.prepared_fallback = True
    model = load_fast_model(args, tiny_model_dir, rank=0, world=2, log=lines.append, **KW)
    assert lines[0].startswith("dsv41: prepared folder refused (") and "rank 1 of TP 2" in lines[0]
    assert lines[0].endswith("building from the checkpoint (--prepared-fallback)")
    assert lines[1].startswith("start: build ") and model.vocab_start == 0


def test_an_interrupted_prepare_resumes_without_rebuilding_kept_blocks(tiny_model_dir, tmp_path, monkeypatch):
    from dsv41.prepared import writer
    from dsv41.runtime import build

    real_built, built_layers = writer.FolderWriter.built, []

    def stop_at_4(self, index, block):
        if index == 4:
            raise KeyboardInterrupt  # the power goes
        return real_built(self, index, block)

    monkeypatch.setattr(writer.FolderWriter, "built", stop_at_4)
    with pytest.raises(KeyboardInterrupt):
        prepare(tiny_model_dir, tmp_path, log=lambda line: None, **KW)
    folder = tmp_path / "rank0-of-1"
    assert refusal(tmp_path, tiny_model_dir, rank=0, world=1).endswith("incomplete (prepare was interrupted): run "
                                                                       "`dsv41 prepare` again to finish it")
    kept = [p["name"] for p in mf.read_manifest(folder)["parts"]]
    assert kept == ["block.0", "block.1", "block.2", "block.3"]
    block2 = [e for e in mf.read_manifest(folder)["entries"] if e["part"] == "block.2" and e["kind"] == "tensor"]
    _flip(folder, block2[-1])  # a part damaged on disk is written again, with every part after it

    monkeypatch.setattr(writer.FolderWriter, "built", real_built)
    real_load = build.load_block
    monkeypatch.setattr(build, "load_block", lambda *a, **k: built_layers.append(a[2]) or real_load(*a, **k))
    lines = []
    prepare(tiny_model_dir, tmp_path, log=lines.append, **KW)
    assert lines[0] == f"prepare: resuming {folder}: 2 part(s) already written and verified"
    n_dspark = ModelConfig.from_file(tiny_model_dir).n_dspark
    assert n_dspark and sum(r.is_dspark for r in built_layers) == n_dspark  # the drafter's blocks ride in the model part
    assert len(built_layers) == 9 - 2 + n_dspark  # blocks 0 and 1 neither read nor built again
    assert check_folder(folder) == []
    from dsv41.runtime.build import build_fast_model

    loaded = load_prepared(tmp_path, tiny_model_dir, verify="full", **KW)
    assert loaded.dspark is not None
    assert tree_differences(loaded, build_fast_model(tiny_model_dir, dspark=True, **KW)) == []
    lines.clear()
    mtime = (folder / mf.DATA).stat().st_mtime_ns
    prepare(tiny_model_dir, tmp_path, log=lines.append, **KW)
    assert lines[0].startswith(f"prepare: {folder} is already prepared (") and (folder / mf.DATA).stat().st_mtime_ns \
        == mtime


def test_the_skeleton_loads_only_allowed_globals():
    from dsv41.prepared.skeleton import load_part

    with pytest.raises(PreparedMismatch, match=r"skeleton part model names posix\.system, which a prepared folder "
                                               r"may not load"):
        load_part(pickle.dumps(os.system), "model", lambda pid: None)


def _cli(*argv, env=None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_PREPARED")}
    return subprocess.run([sys.executable, "-m", "dsv41.cli", *argv], capture_output=True, text=True, timeout=300,
                          env={**base, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", **(env or {})})


def test_cli_check_and_serve_refusal(prepared, copy, tiny_model_dir):
    ok = _cli("prepare", "--out", str(prepared), "--tp", "2", "--check")
    assert ok.returncode == 0 and ok.stderr.count("every entry verified") == 2
    entry = _tensor_entries(copy)[3]
    _flip(copy, entry)
    bad = _cli("prepare", "--out", str(copy), "--tp", "2", "--rank", "0", "--check")
    assert bad.returncode == 1 and f"entry {entry['name']} (offset" in bad.stderr
    served = _cli("serve", "--model", str(tiny_model_dir), "--port", "0", "--device", "cpu", "--forward", "fast",
                  "--prepared", str(prepared / "rank1-of-2"), env={"TRITON_INTERPRET": "1"})
    assert served.returncode == 2
    assert served.stderr.strip().splitlines()[-1] == (f"dsv41: error: {prepared / 'rank1-of-2'}: prepared for rank 1 "
                                                      f"of TP 2, this process is rank 0 of TP 1")


def test_the_pipelined_read_gives_the_plain_reads_bytes(prepared, copy, monkeypatch):
    """The CUDA read path (ring of chunk buffers, reader threads, one hashing thread) walked on the CPU, with chunks
    small and unaligned enough that entries span several of them and chunks hold several entries."""
    from dsv41.prepared import reader

    folder = prepared / "rank0-of-2"
    manifest = mf.read_manifest(folder)
    monkeypatch.setattr(reader, "CHUNK", 70001)
    cpu = torch.device("cpu")
    plain = reader.read_entries(folder, manifest, cpu, verify="full")
    monkeypatch.setenv("DSV41_PREPARED_PAGE_CACHE", "drop")  # the unified-memory variant: pieces dropped once read
    piped = reader.read_entries(folder, manifest, cpu, verify="full", pipelined=True)
    assert len(plain) == len(piped) == len(manifest["entries"])
    as_bytes = lambda storage: torch.empty(0, dtype=torch.uint8).set_(storage)  # noqa: E731
    assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(plain, piped))
    big = max(_tensor_entries(copy), key=lambda e: e["nbytes"])
    assert big["nbytes"] > 3 * 70001
    _flip(copy, big, at=big["nbytes"] - 1)
    with pytest.raises(PreparedMismatch, match=f"entry {big['name']} of data.bin is damaged"):
        reader.read_entries(copy, mf.read_manifest(copy), cpu, verify="full", pipelined=True)


def test_a_folder_that_no_longer_fits_is_prepared_afresh(copy, tiny_model_dir):
    _edit_manifest(copy, lambda m: m["code"]["modules"].update({"dsv41.runtime.model": "0" * 64}))
    lines = []
    prepare(tiny_model_dir, copy.parent, rank=0, world=2, log=lines.append, **KW)
    assert lines[0] == f"prepare: {copy} holds another preparation: starting afresh"
    assert check_folder(copy) == [] and load_prepared(copy.parent, tiny_model_dir, rank=0, world=2, **KW)


def test_too_little_room_is_refused_before_building(tmp_path):
    from dsv41.errors import DSV41Error
    from dsv41.prepared.writer import check_room

    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(DSV41Error, match=r"/new/rank0-of-1: about .* GiB to write, only .* GiB free there"):
        check_room(tmp_path / "new" / "rank0-of-1", free * 2)
    check_room(tmp_path / "new" / "rank0-of-1", 1 << 20)
