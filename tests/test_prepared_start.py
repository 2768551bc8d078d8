"""Start from a prepared folder == start from the checkpoint, bit for bit, at TP = 1 and TP = 2.

- The built-in tiny model (EXL3 pack layout), every rank of TP 1 and 2: the model started from the folder holds
  the same object tree as the one built from the checkpoint: every tensor (dtype, shape, stride, device, bytes),
  every launch record, flag and size.
- Greedy decoding, token ids and every logit bit for bit, at TP = 1 and TP = 2 (two gloo ranks in child processes):
  on the release's FP8 layout of the slimmed tiny model (test_runtime_fast.py's LITE), whose fast path is plain
  torch on the CPU; the EXL3 kernels run on the CPU only in Triton's interpreter, minutes per token on this
  machine, so the EXL3 greedy comparison is the GPU test at the end.
- `dsv41 generate --prepared` prints the text `dsv41 generate --forward fast` prints.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_runtime_fast import LITE

REPO = Path(__file__).resolve().parents[1]

PROMPT = [0] + [(i * 37) % 500 + 5 for i in range(11)]
DECODE_STEPS = 3


def greedy(model) -> tuple[list[int], list[torch.Tensor]]:
    state = model.new_state()
    logits = [model.forward([(state, PROMPT)], "prefill")]
    ids = []
    for _ in range(DECODE_STEPS):
        ids.append(int(logits[-1][-1].argmax()))
        logits.append(model.forward([(state, [ids[-1]])], "decode"))
    ids.append(int(logits[-1][-1].argmax()))
    return ids, logits


def tree_differences(a, b, path="model", seen=None) -> list[str]:
    """Where two built models differ: tensors by dtype, shape, stride and bytes, other leaves by value."""
    seen = set() if seen is None else seen
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: tensor vs {type(b).__name__}"]
        if (a.dtype, a.shape, a.stride(), a.device.type) != (b.dtype, b.shape, b.stride(), b.device.type):
            return [f"{path}: {a.dtype} {list(a.shape)} {a.stride()} vs {b.dtype} {list(b.shape)} {b.stride()}"]
        same = torch.equal(a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                           b.view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8)) \
            if a.is_contiguous() and b.is_contiguous() else torch.equal(a, b)
        return [] if same else [f"{path}: values differ"]
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
    if a is None or isinstance(a, (str, int, float, bool, torch.dtype, torch.device)):
        return [] if a == b or (isinstance(a, float) and a != a and b != b) else [f"{path}: {a!r} vs {b!r}"]
    if id(a) in seen:  # met before under another path (a linear both in its params and in a launch group)
        return []
    seen.add(id(a))
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in a for d in tree_differences(a[k], b[k], f"{path}.{k}", seen)]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in tree_differences(x, y, f"{path}.{i}", seen)]
    skip = ("comm", "workspace", "tokenizer", "table", "graphs", "gemm")
    if hasattr(a, "__dict__") and not callable(getattr(a, "__self__", None)):
        va, vb = vars(a), vars(b)
        if va.keys() != vb.keys():
            return [f"{path}: attributes differ"]
        return [d for k in va if k not in skip for d in tree_differences(va[k], vb[k], f"{path}.{k}", seen)]
    return []


def _child(args: dict) -> None:
    from dsv41.prepared.reader import load_prepared
    from dsv41.prepared.writer import prepare
    from dsv41.runtime.build import build_fast_model

    torch.set_num_threads(1)
    rank, world, comm, group = args["rank"], args["world"], None, None
    if world > 1:
        from dsv41.parallel.rendezvous import init_tp

        group = init_tp(rank, world, args["master"], deadline_s=120, backend="gloo")
        comm = group.comm
    kw = dict(device=args.get("device", "cpu"), dtype=torch.float32, rank=rank, world=world, comm=comm)
    prepare(args["model"], args["root"], **kw)
    from_folder = load_prepared(args["root"], args["model"], **kw)
    from_ckpt = build_fast_model(args["model"], **kw)
    ids_f, logits_f = greedy(from_folder)
    ids_c, logits_c = greedy(from_ckpt)
    same = all(torch.equal(x, y) for x, y in zip(logits_f, logits_c))
    Path(args["out"]).write_text(json.dumps({"ids_folder": ids_f, "ids_ckpt": ids_c, "logits_equal": same}))
    if group is not None:
        group.comm.sum_partials(torch.zeros(1))  # both ranks done before either tears gloo down
        group.close()


def run_ranks(model: Path, root: Path, world: int, tmp: Path, device: str = "cpu") -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master = f"127.0.0.1:{s.getsockname()[1]}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs, outs = [], []
    for rank in range(world):
        out = tmp / f"start-{world}-{rank}.json"
        args = dict(model=str(model), root=str(root), rank=rank, world=world, master=master, out=str(out),
                    device=device)
        procs.append(subprocess.Popen([sys.executable, __file__, json.dumps(args)], env=env))
        outs.append(out)
    codes = [p.wait(timeout=600) for p in procs]
    assert codes == [0] * world, f"children exited {codes}"
    return [json.loads(o.read_text()) for o in outs]


def check_ranks(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        assert res["ids_folder"] == res["ids_ckpt"], f"rank {rank}"
        assert res["logits_equal"], f"rank {rank}: logits differ"
    assert len({tuple(r["ids_folder"]) for r in results}) == 1  # every rank decodes the same text


@pytest.fixture(scope="module")
def fp8_lite(tmp_path_factory) -> Path:
    from dsv41.tiny.model import make_tiny

    return make_tiny(tmp_path_factory.mktemp("prepared-fp8") / "model", "fp8", seed=0, overrides=LITE)


@pytest.mark.parametrize("world", [1, 2])
def test_exl3_tree_from_folder_is_the_built_tree(tiny_model_dir, tmp_path, world):
    from dsv41.prepared.reader import load_prepared
    from dsv41.prepared.writer import prepare
    from dsv41.runtime.build import build_fast_model

    for rank in range(world):
        kw = dict(device="cpu", dtype=torch.float32, rank=rank, world=world)
        folder = prepare(tiny_model_dir, tmp_path, **kw)
        assert folder == tmp_path / f"rank{rank}-of-{world}"
        loaded = load_prepared(tmp_path, tiny_model_dir, **kw)
        built = build_fast_model(tiny_model_dir, dspark=True, **kw)  # the folder carries the drafter
        assert loaded.dspark is not None and loaded.dspark.blocks
        assert tree_differences(loaded, built) == [], f"rank {rank}"
        assert loaded.workspace.numel == built.workspace.numel and loaded.workspace.buf is not None
        assert loaded.stored_bytes() == built.stored_bytes()
        trellis = loaded.blocks[0].attn.w.wq_a.weight.words
        trellis.view(-1)[0] ^= 1  # the comparison sees one flipped bit
        assert tree_differences(loaded, built) == ["model.blocks.0.attn.w.wq_a.weight.words: values differ"]


@pytest.mark.parametrize("world", [1, 2])
def test_greedy_from_folder_is_greedy_from_checkpoint(fp8_lite, tmp_path, world):
    check_ranks(run_ranks(fp8_lite, tmp_path / "prepared", world, tmp_path))
    folders = sorted(p.name for p in (tmp_path / "prepared").iterdir())
    assert folders == [f"rank{r}-of-{world}" for r in range(world)]


def _dsv41(*argv, check=True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_PREPARED")}
    env.update(PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1", DSV41_HOME=os.environ.get("DSV41_HOME", ""))
    if not env["DSV41_HOME"]:
        env.pop("DSV41_HOME")
    res = subprocess.run([sys.executable, "-m", "dsv41.cli", *argv], capture_output=True, text=True, env=env,
                         timeout=300)
    if check:
        assert res.returncode == 0, res.stderr
    return res


def test_generate_from_prepared_prints_the_checkpoints_text(fp8_lite, tmp_path):
    from dsv41.prepared.writer import prepare

    prepare(fp8_lite, tmp_path, device="cpu", dtype=torch.float32, log=lambda line: None)  # `dsv41 prepare`'s call
    args = ["generate", "--model", str(fp8_lite), "--prompt", "hello there", "--max-tokens", "5", "--ignore-eos"]
    prepared = _dsv41(*args, "--prepared", str(tmp_path))
    built = _dsv41(*args, "--forward", "fast")
    assert "start: read" in prepared.stderr and "start: build" in built.stderr
    ids = [line.split("ids ")[-1] for r in (prepared, built) for line in r.stderr.splitlines() if "ids [" in line]
    assert len(ids) == 2 and ids[0] == ids[1] and prepared.stdout == built.stdout


def test_start_bench_times_both_starts(fp8_lite, tmp_path):
    """bench/start.py on the CPU (the lead runs it on the GPU with the synthetic rank): every phase timed."""
    out = tmp_path / "start.json"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "start.py"), "--model", str(fp8_lite), "--device",
                          "cpu", "--no-first-token", "--out", str(out)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["prepare_s"] > 0 and result["folder_gib"] > 0
    assert list(result["starts"]["prepared"]["phases"]) == ["imports", "manifest", "read", "skeleton"]
    assert list(result["starts"]["checkpoint"]["phases"]) == ["imports", "build"]
    assert list(result["starts"]["prepared_first_boot"]["phases"]) == ["imports", "manifest", "read", "skeleton"]
    # the warm step (the runner and its first request on CUDA only) into an emptied cache, and a start after it
    assert list(result["starts"]["warm"]["phases"]) == ["imports", "manifest", "read", "skeleton"]
    assert result["starts"]["warm"]["cache_files"] == 0  # nothing compiles on the CPU
    assert list(result["starts"]["prepared_after_warm"]["phases"]) == ["imports", "manifest", "read", "skeleton"]
    assert not (tmp_path / ".start-prepared").exists()  # the folder it prepared is removed
    assert not (tmp_path / ".start-triton-cache").exists()  # and the children's Triton cache


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_gpu_exl3_greedy_from_folder_is_greedy_from_checkpoint(tiny_model_dir, tmp_path, world):
    """The built-in EXL3 tiny model on the GPU (both ranks on one GPU over gloo): the kernels' launch records
    resolved for this GPU are in the folder."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    check_ranks(run_ranks(tiny_model_dir, tmp_path / "prepared", world, tmp_path, device="cuda"))


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))


def test_a_start_that_drafts_keeps_the_folders_drafter_and_one_that_does_not_drops_it(tiny_model_dir, tmp_path):
    """The folder carries the DSpark drafter: `serve --prepared` with DSpark drafting on gets it (the blocks the
    checkpoint build makes), with drafting off the start lets it go."""
    from argparse import Namespace

    from dsv41.prepared.start import load_fast_model
    from dsv41.prepared.writer import prepare

    prepare(tiny_model_dir, tmp_path, device="cpu", dtype=torch.float32, log=lambda line: None)
    base = dict(prepared=str(tmp_path), no_fake_quant=False, engine="batched", draft_depth=5)
    on = load_fast_model(Namespace(**base, draft_dspark="on"), tiny_model_dir, device="cpu", dtype=torch.float32,
                         log=lambda line: None)
    off = load_fast_model(Namespace(**base, draft_dspark="off"), tiny_model_dir, device="cpu", dtype=torch.float32,
                          log=lambda line: None)
    assert on.dspark is not None and len(on.dspark.blocks) == on.cfg.n_dspark and off.dspark is None
