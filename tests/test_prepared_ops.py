"""Prepared folders in operations: preflight's check, the warm unit's page-cache read and its memory policy,
`deploy --prepare` (dry run), and `dsv41 prepare --env-file` taking the appliance's knobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsv41.ops.deploy import Deploy, Options
from dsv41.ops.preflight import Node, check_prepared
from dsv41.ops.warm import warm_prepared
from dsv41.prepared import manifest as mf
from dsv41.prepared.writer import prepare


@pytest.fixture(scope="module")
def root(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared")
    prepare(tiny_model_dir, out, device="cpu", dtype=torch.float32, log=lambda line: None)
    return out


def _env(root, model, **more) -> dict:
    return {"DSV41_PREPARED": str(root), "DSV41_MODEL": str(model), "DSV41_LOCAL_RANKS": "rank0", **more}


def test_preflight_checks_the_folder_against_the_model_and_rank(root, tiny_model_dir, tmp_path):
    check = check_prepared(Node(_env(root, tiny_model_dir)))
    size = (root / "rank0-of-1" / "data.bin").stat().st_size
    assert check.status == "pass", check.detail
    assert check.detail == f"{root}: rank0 {size / 2**30:.1f} GiB, matching the model and this code"
    assert check_prepared(Node({})).status == "skip"
    other = check_prepared(Node(_env(root, tiny_model_dir, DSV41_TP="2", DSV41_LOCAL_RANKS="rank1")))
    assert other.status == "fail" and other.detail == (f"{root / 'rank1-of-2'}: no manifest.json (not a prepared "
                                                       f"folder; run `dsv41 prepare`)")
    (tmp_path / "m").mkdir()
    for f in tiny_model_dir.iterdir():
        (tmp_path / "m" / f.name).symlink_to(f)
    (tmp_path / "m" / "tokenizer.json").unlink()
    (tmp_path / "m" / "tokenizer.json").write_text((tiny_model_dir / "tokenizer.json").read_text() + " ")
    moved = check_prepared(Node(_env(root, tmp_path / "m")))
    assert moved.status == "fail" and moved.detail.endswith("prepared from another checkpoint: tokenizer.json differs")


def test_warm_reads_the_folder_only_when_memory_allows(root, tmp_path):
    size = json.loads((root / "rank0-of-1" / mf.MANIFEST).read_text())["data"]["bytes"]
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 100 kB\nMemAvailable: {(2 * size) // 1024 - 1} kB\n")
    env = {"DSV41_PREPARED": str(root)}
    skipped = warm_prepared(env, 0, meminfo)
    assert skipped.startswith(f"skip: not caching {root / 'rank0-of-1' / 'data.bin'} (MemAvailable ")
    assert skipped.endswith("the page cache would take the memory the weights load into)")
    assert warm_prepared({**env, "DSV41_WARM_PREPARED": "1"}, 0, meminfo).startswith(
        f"read {root / 'rank0-of-1' / 'data.bin'} into the page cache: ")
    meminfo.write_text(f"MemAvailable: {(2 * size) // 1024 + 8} kB\n")
    assert warm_prepared(env, 0, meminfo).startswith("read ")
    assert warm_prepared({**env, "DSV41_WARM_PREPARED": "0"}, 0, meminfo) == (
        f"skip: not caching {root / 'rank0-of-1' / 'data.bin'} (DSV41_WARM_PREPARED=0)")
    assert warm_prepared({}, 0, meminfo) == "skip: DSV41_PREPARED is empty"


def test_deploy_prepare_runs_on_each_node_before_the_restart():
    lines: list[str] = []

    def never(*args, **kwargs):
        raise AssertionError("a dry run must not run anything")

    opts = Options(head="root@a", worker="root@b", flake="/src", dry_run=True, prepare=True)
    assert Deploy(opts, run=never, out=lines.append).execute() == 0
    steps = [line.split("] ", 1)[1] for line in lines if line.startswith("[")]
    prof = "/nix/var/nix/profiles/dsv41/bin/dsv41"
    note = "  # prepared folder of this rank (docs/WEIGHTS.md)"
    at = steps.index("root@a: systemctl stop dsv41@rank0.service  # before prepare")
    assert steps[at:at + 4] == [
        "root@a: systemctl stop dsv41@rank0.service  # before prepare",
        "root@b: systemctl stop dsv41@rank1.service  # before prepare",
        f"root@a: {prof} prepare --env-file /etc/dsv41/dsv41.env --rank 0" + note,
        f"root@b: {prof} prepare --env-file /etc/dsv41/dsv41.env --rank 1" + note]
    assert at > max(i for i, s in enumerate(steps) if "systemctl enable" in s)
    assert not any("warm-kernels" in s for s in steps)  # prepare compiles the kernels at its end (on CUDA)
    assert at < steps.index("root@b: systemctl start --no-block dsv41@rank1.service  # rank 1 waits for rank 0's "
                            "rendezvous")


def test_prepare_takes_the_appliance_knobs_from_the_env_file(root, tiny_model_dir, tmp_path, capsys):
    from dsv41.cli import main

    env_file = tmp_path / "dsv41.env"
    env_file.write_text(f"DSV41_MODEL={tiny_model_dir}\nDSV41_PREPARED={root}\nDSV41_TP=1\nDSV41_DEVICE=cpu\n"
                        f"DSV41_DTYPE=float32\n")
    assert main(["prepare", "--env-file", str(env_file), "--rank", "0"]) == 0
    assert f"prepare: {root / 'rank0-of-1'} is already prepared (" in capsys.readouterr().err
    assert main(["prepare", "--env-file", str(env_file), "--check"]) == 0
    assert main(["prepare", "--model", str(tiny_model_dir)]) == 2
    assert capsys.readouterr().err.strip().endswith("--out (or DSV41_PREPARED in --env-file) names where the "
                                                    "prepared folders go")
