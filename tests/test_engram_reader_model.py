"""The engine with packed Engram shard files (`load_model(engram_dir=...)`, dsv41 serve --engram-dir): the tiny
model's in-checkpoint tables packed by `dsv41 engram pack`, then the same logits bit for bit as the tables read
from the checkpoint, at TP=1 and at TP=2 (two gloo processes; each rank packs and reads only its own files)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv41.engram.pack import pack_rank
from dsv41.engram.shards import shard_file_name
from dsv41.engram.tables import _ShardSource
from dsv41.errors import CheckpointError
from dsv41.model.loader import load_model
from test_parallel_model import CHUNKS, PROMPT, free_port, run_schedule


@pytest.fixture(scope="module")
def tiny_dir():
    from dsv41.tiny.model import default_model_dir

    return default_model_dir()


def compare(model_dir: Path, engram_dir: Path, rank: int = 0, world: int = 1, comm=None, want=None) -> dict:
    """Logits of the same schedule with the checkpoint's tables (or `want`: those of an earlier call, the same
    model and schedule) and with the shard files."""
    kw = dict(rank=rank, world=world, comm=comm, fake_quant=False)
    packed = load_model(model_dir, engram_dir=engram_dir, **kw)
    assert all(isinstance(layer.table._source, _ShardSource) for layer in packed.engram.values())
    with torch.no_grad():
        if want is None:
            ref = load_model(model_dir, **kw)
            assert not any(isinstance(layer.table._source, _ShardSource) for layer in ref.engram.values())
            want = run_schedule(ref, PROMPT, CHUNKS)
        got = run_schedule(packed, PROMPT, CHUNKS)
    return {key: (want[key], got[key]) for key in want}


def test_tp1_logits_are_bit_identical(tiny_dir, tmp_path):
    report = pack_rank(tiny_dir, tmp_path, 0, 1, progress=False)
    assert [p.name for p in report.files] == [shard_file_name(1, 0, 1), shard_file_name(4, 0, 1)]
    first = compare(tiny_dir, tmp_path)
    for key, (want, got) in first.items():
        assert torch.equal(got, want), key
    # the control: the rows really come from the files (other bytes there, other logits than the checkpoint's)
    path = tmp_path / shard_file_name(1, 0, 1)
    data = bytearray(path.read_bytes())
    data[4096:] = bytes(len(data) - 4096)
    path.write_bytes(bytes(data))
    for key, (want, got) in compare(tiny_dir, tmp_path, want={k: w for k, (w, _) in first.items()}).items():
        assert not torch.equal(got, want), key


def test_a_missing_shard_file_is_named_with_the_pack_command(tiny_dir, tmp_path):
    pack_rank(tiny_dir, tmp_path, 0, 1, progress=False)
    with pytest.raises(CheckpointError, match=f"{tmp_path}: Engram shard file engram-l1-r1of2.bin \\(layer 1, rank 1 "
                                              f"of 2\\) is missing; write it with `dsv41 engram pack --src "
                                              f"ORIGINAL_CHECKPOINT --out {tmp_path} --rank 1 --tp 2`"):
        load_model(tiny_dir, engram_dir=tmp_path, rank=1, world=2)


@pytest.mark.slow
def test_tp2_logits_are_bit_identical(tiny_dir, tmp_path):
    master = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, __file__, str(r), master, str(tiny_dir), str(tmp_path)])
             for r in range(2)]
    assert [p.wait(timeout=600) for p in procs] == [0, 0]
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for key in results[0]:
        for r in range(2):
            want, got = results[r][key]
            assert torch.equal(got, want), f"rank {r} {key}: the shard files change the logits"
        assert torch.equal(results[1][key][1], results[0][key][1]), f"{key}: the ranks differ"
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == sorted(
        shard_file_name(L, r, 2) for L in (1, 4) for r in range(2))


def worker(rank: int, master: str, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    from dsv41.parallel.rendezvous import init_tp

    pack_rank(model_dir, out, rank, 2, progress=False)  # each rank packs only its own files
    group = init_tp(rank, 2, master, deadline_s=120, backend="gloo")
    torch.save(compare(Path(model_dir), Path(out), rank, 2, group.comm), Path(out) / f"rank{rank}.pt")
    group.close()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    worker(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
