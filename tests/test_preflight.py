"""Preflight's checks on real files, sockets, a sysfs tree and /proc (the canary, status and driver rules:
test_ops_canary_status.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dsv41.ops import host_commands
from dsv41.ops.cli import main as ops_main
from dsv41.ops.host_commands import Result
from dsv41.ops.preflight import (Mount, Node, check_engram, format_results, fs_problem, local_checks,
                                 mount_of, parse_mountinfo, room_problem, run_preflight)
from conftest import free_port

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


# A model without Engram layers: the checks other than Engram's need no torch (the ops-only Nix check runs them).
NO_ENGRAM_CONFIG = json.dumps({"text_config": {"engram_layer_ids": []}})


def make_model(folder: Path, tokenizer: str = '{"model": "x"}') -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(NO_ENGRAM_CONFIG)
    (folder / "tokenizer.json").write_text(tokenizer)
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return folder


@pytest.fixture
def node_env(tmp_path):
    model = make_model(tmp_path / "model")
    sysfs = tmp_path / "sys"
    for device, state in (("rocep1s0f1", "4: ACTIVE"), ("roceP2p1s0f1", "4: ACTIVE")):
        port = sysfs / "class" / "infiniband" / device / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text(state + "\n")
    env = {"DSV41_MODEL": str(model), "DSV41_TP": "2",
           "DSV41_LOCAL_RANKS": "rank0", "DSV41_HOST": "127.0.0.1", "DSV41_PORT": str(free_port()),
           "DSV41_MASTER": f"127.0.0.1:{free_port()}", "DSV41_RDMA_PORTS": "rocep1s0f1:1 roceP2p1s0f1:1",
           "DSV41_MEM_GATE_GIB": "0.001",
           "PATH": os.environ.get("PATH", "")}
    return env, sysfs


def by_name(results):
    return {c.name: c for c in results}


def test_all_local_checks_pass(node_env):
    env, sysfs = node_env
    results = by_name(local_checks(Node(env, sysfs=sysfs)))
    assert results["model"].status == "pass"
    assert results["engram"].status == "skip"
    assert results["engram"].detail == "the model config lists no Engram layers"
    assert results["roce"].status == "pass"
    assert results["ports"].status == "pass"
    assert results["memory"].status == "pass"
    # no NVIDIA driver in CI: skipped with the reason; on a GPU host it is a real check
    assert results["gpus"].status in ("skip", "pass", "fail")


def test_each_check_fails_on_its_own(node_env, tmp_path):
    env, sysfs = node_env
    (sysfs / "class/infiniband/roceP2p1s0f1/ports/1/state").write_text("1: DOWN\n")
    listener = socket.socket()
    listener.bind(("127.0.0.1", int(env["DSV41_PORT"])))
    listener.listen()
    try:
        results = by_name(local_checks(Node({**env, "DSV41_MEM_GATE_GIB": "100000"}, sysfs=sysfs)))
    finally:
        listener.close()
    assert results["roce"].status == "fail" and "roceP2p1s0f1:1: 1: DOWN" in results["roce"].detail
    assert results["ports"].status == "fail" and env["DSV41_PORT"] in results["ports"].detail
    assert results["memory"].status == "fail" and "MemFree" in results["memory"].detail
    assert results["model"].status == "pass"  # independent: the others failing does not touch it


def test_missing_model(node_env):
    env, sysfs = node_env
    results = by_name(local_checks(Node({**env, "DSV41_MODEL": "/nonexistent/model"}, sysfs=sysfs)))
    assert results["model"].status == "fail" and "/nonexistent/model" in results["model"].detail


def test_busy_gpu_reported(node_env, tmp_path):
    """A real nvidia-smi stand-in on PATH printing one compute process makes the GPU check fail."""
    env, sysfs = node_env
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '4242, python3, 81920 MiB'\n")
    fake.chmod(0o755)
    old = os.environ["PATH"]
    os.environ["PATH"] = f"{bindir}:{old}"
    try:
        result = by_name(local_checks(Node(env, sysfs=sysfs)))["gpus"]
    finally:
        os.environ["PATH"] = old
    assert result.status == "fail" and "4242, python3" in result.detail


def worker_executor(worker_env_file: Path):
    """Runs the worker's `dsv41 preflight --local --json` as a real local process instead of over ssh."""
    def run(argv, host=None, timeout=None, input=None):
        if host is None:
            return host_commands.run(argv, timeout=timeout)
        assert argv[1:] == ["preflight", "--local", "--json"], argv
        proc = subprocess.run([PY, "-m", "dsv41.ops.cli", "preflight", "--local", "--json",
                               "--env-file", str(worker_env_file)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO / "src")}, timeout=120)
        return Result(proc.returncode, proc.stdout, proc.stderr)
    return run


def write_env(path: Path, env: dict) -> Path:
    path.write_text("".join(f"{k}={v}\n" for k, v in env.items() if k.startswith("DSV41_")))
    return path


def test_worker_checks_and_model_match(node_env, tmp_path):
    env, sysfs = node_env
    worker_model = make_model(tmp_path / "worker-model")
    worker_env = {**env, "DSV41_MODEL": str(worker_model), "DSV41_LOCAL_RANKS": "rank1", "DSV41_RDMA_PORTS": "",
                  "DSV41_MEM_GATE_GIB": "0"}
    env_file = write_env(tmp_path / "worker.env", worker_env)
    head_env = {**env, "DSV41_WORKER_SSH": "root@worker"}
    results = by_name(run_preflight(head_env, run=worker_executor(env_file), node=Node(head_env, sysfs=sysfs)))
    assert results["worker:engram"].status == "skip", results["worker:engram"].detail
    assert results["worker:ports"].status == "skip"  # the worker runs no rank 0
    assert results["model-match"].status == "pass"

    (worker_model / "tokenizer.json").write_text('{"model": "other"}')
    results = by_name(run_preflight(head_env, run=worker_executor(env_file), node=Node(head_env, sysfs=sysfs)))
    assert results["model-match"].status == "fail" and "tokenizer.json" in results["model-match"].detail


def test_unreachable_worker_fails_clearly(node_env):
    env, sysfs = node_env
    env = {**env, "DSV41_WORKER_SSH": "root@worker"}

    def unreachable(argv, host=None, timeout=None, input=None):
        return Result(255, "", "ssh: connect to host worker port 22: No route to host")

    results = by_name(run_preflight(env, run=unreachable, node=Node(env, sysfs=sysfs)))
    assert results["worker"].status == "fail" and "No route to host" in results["worker"].detail
    assert results["model-match"].status == "skip"


def test_preflight_cli_json_and_exit_status(node_env, tmp_path, capsys):
    env, _ = node_env
    env_file = write_env(tmp_path / "dsv41.env", {**env, "DSV41_RDMA_PORTS": "", "DSV41_MEM_GATE_GIB": "0"})
    assert ops_main(["preflight", "--local", "--json", "--env-file", str(env_file)]) == 0
    checks = json.loads(capsys.readouterr().out)
    assert {c["name"] for c in checks} == {"model", "engram", "prepared", "ports", "gpus", "roce", "memory"}
    assert all(c["status"] in ("pass", "skip") for c in checks)
    env_file.write_text(env_file.read_text().replace(env["DSV41_MODEL"], "/missing"))
    assert ops_main(["preflight", "--local", "--env-file", str(env_file)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^FAIL model: /missing: no such folder$", out, re.M)
    assert "SKIP engram: the model config is unreadable (see the model check)" in out
    assert out.rstrip().endswith("preflight: FAILED: model")


# ------------------------------------------------------------------------------------------ engram shard files

@pytest.fixture(scope="module")
def tiny_shards(tmp_path_factory):
    """The built-in tiny model (Engram layers 1 and 4) and its shard files for ranks 0 and 1 of 2, written once by
    `dsv41 engram pack`'s `pack_rank` from the model's in-checkpoint tables."""
    pytest.importorskip("torch", reason="the Engram shard format needs torch (not in the ops-only Nix check)")
    from dsv41.engram.pack import pack_rank
    from dsv41.tiny.model import default_model_dir

    model = default_model_dir()
    packed = tmp_path_factory.mktemp("packed")
    for rank in range(2):
        pack_rank(model, packed, rank, 2, progress=False)
    return model, packed


TINY_LAYERS = (1, 4)


@pytest.fixture
def engram_env(tiny_shards, tmp_path):
    """The tiny model with rank 0 of 2's files in a fresh folder (copies: the tests damage them)."""
    model, packed = tiny_shards
    folder = tmp_path / "engram"
    folder.mkdir()
    for layer in TINY_LAYERS:
        shutil.copyfile(packed / f"engram-l{layer}-r0of2.bin", folder / f"engram-l{layer}-r0of2.bin")
    env = {"DSV41_MODEL": str(model), "DSV41_ENGRAM_DIR": str(folder), "DSV41_TP": "2", "DSV41_LOCAL_RANKS": "rank0"}
    return env, folder, packed


def disk_problem(path: Path) -> str | None:
    """What the check says about the disk under `path` on this machine (None: a local block device)."""
    mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    return fs_problem(mount_of(path.resolve(), mounts), mounts)


def engram_lines(env: dict, proc: Path = Path("/proc")) -> tuple[str, list[str]]:
    check = check_engram(Node(env, proc=proc))
    return check.status, check.detail.splitlines()


def test_engram_passes_on_packed_files(engram_env):
    env, folder, _ = engram_env
    problem = disk_problem(folder)
    if problem:
        pytest.skip(f"the test folder is {problem}: the pass case needs a local disk")
    status, lines = engram_lines(env)
    assert status == "pass", lines
    assert lines[0].startswith("engram-l1-r0of2.bin, engram-l4-r0of2.bin: headers and sizes match the model config "
                               "for rank(s) 0 of 2; ")
    assert lines[0].endswith(", O_DIRECT reads ok")
    # the format's magic: the number 0x31344E4531565344, whose little-endian bytes spell "DSV1EN41"
    assert (folder / "engram-l1-r0of2.bin").read_bytes()[:8] == b"DSV1EN41"


def test_engram_missing_file_names_it_and_the_pack_command(engram_env):
    env, folder, _ = engram_env
    (folder / "engram-l1-r0of2.bin").unlink()
    status, lines = engram_lines(env)
    assert status == "fail"
    assert f"{folder}/engram-l1-r0of2.bin: missing (layer 1, rank 0 of 2); write it with `dsv41 engram pack " \
           f"--src ORIGINAL_CHECKPOINT --out {folder} --rank 0 --tp 2`" in lines
    assert not any("engram-l4" in line for line in lines)  # the other file is fine
    # a node running both ranks needs rank 1's files too: one line each
    status, lines = engram_lines({**env, "DSV41_LOCAL_RANKS": "rank0 rank1"})
    assert sum("missing" in line for line in lines) == 3 and f"{folder}/engram-l4-r1of2.bin: missing " \
        "(layer 4, rank 1 of 2)" in "\n".join(lines)
    nowhere = folder / "nowhere"
    status, lines = engram_lines({**env, "DSV41_ENGRAM_DIR": str(nowhere)})
    assert status == "fail" and lines == [f"{nowhere}: no such folder; write the files with `dsv41 engram pack "
                                          f"--src ORIGINAL_CHECKPOINT --out {nowhere} --rank 0 --tp 2`"]


def test_engram_wrong_ranks_file_under_the_name(engram_env):
    env, folder, packed = engram_env
    shutil.copyfile(packed / "engram-l4-r1of2.bin", folder / "engram-l4-r0of2.bin")
    status, lines = engram_lines(env)
    assert status == "fail" and len(lines) == 1, lines
    assert re.fullmatch(rf"{folder}/engram-l4-r0of2\.bin: header field 'lo' is \d+, expected 0 \(layer 4, rank 0 of "
                        r"2\)", lines[0]), lines
    # the same file is right for rank 1
    (folder / "engram-l4-r1of2.bin").write_bytes((folder / "engram-l4-r0of2.bin").read_bytes())
    shutil.copyfile(packed / "engram-l1-r1of2.bin", folder / "engram-l1-r1of2.bin")
    status, lines = engram_lines({**env, "DSV41_LOCAL_RANKS": "rank1"})
    assert status == "pass" or disk_problem(folder), lines


def test_engram_truncated_file(engram_env):
    env, folder, _ = engram_env
    path = folder / "engram-l1-r0of2.bin"
    size = path.stat().st_size
    os.truncate(path, size - 264)
    status, lines = engram_lines(env)
    assert status == "fail" and len(lines) == 1, lines
    assert lines[0].startswith(f"{path}: file is {size - 264} bytes, expected {size} (")
    os.truncate(path, 20)  # not even a whole header
    status, lines = engram_lines(env)
    assert lines == [f"{path}: truncated Engram shard header (20 bytes)"]


def test_engram_wrong_magic(engram_env):
    """The ASCII "DSV41EN1" the spec's prose names is not what real files carry: it is refused, as any other."""
    env, folder, _ = engram_env
    path = folder / "engram-l4-r0of2.bin"
    with path.open("r+b") as handle:
        handle.write(b"DSV41EN1")
    status, lines = engram_lines(env)
    assert status == "fail"
    assert lines == [f"{path}: not an Engram shard file (magic {int.from_bytes(b'DSV41EN1', 'little'):#018x}, "
                     f"expected 0x31344e4531565344)"]


def test_engram_leftover_partial_says_rerun_the_pack(engram_env):
    env, folder, _ = engram_env
    path = folder / "engram-l1-r0of2.bin"
    partial = folder / "engram-l1-r0of2.bin.partial"
    path.rename(partial)  # what an interrupted pack leaves: the rows so far, and their record
    os.truncate(partial, partial.stat().st_size // 2)
    (folder / "engram-l1-r0of2.bin.partial.json").write_text("{}")
    status, lines = engram_lines(env)
    assert status == "fail"
    assert lines[0] == (f"{folder}/engram-l1-r0of2.bin.partial, engram-l1-r0of2.bin.partial.json: left by an "
                        f"unfinished `dsv41 engram pack`; rerun the pack to resume: `dsv41 engram pack --src "
                        f"ORIGINAL_CHECKPOINT --out {folder} --rank 0 --tp 2`")
    assert lines[1].startswith(f"{path}: missing")
    # a leftover beside a complete file is named too (the rerun removes it)
    shutil.copyfile(engram_env[2] / "engram-l1-r0of2.bin", path)
    status, lines = engram_lines(env)
    assert status == "fail" and len(lines) == 1 and "left by an unfinished `dsv41 engram pack`" in lines[0]


def mountinfo_line(mount_id: int, mount_point: str, fstype: str, source: str, options: str = "rw") -> str:
    return f"{mount_id} 1 0:{mount_id} / {mount_point} rw,relatime shared:{mount_id} - {fstype} {source} {options}"


MOUNTS = "\n".join([
    mountinfo_line(27, "/", "ext4", "/dev/nvme0n1p2", "rw,errors=remount-ro"),
    mountinfo_line(30, "/mnt/nas", "nfs4", "nas:/export", "rw,vers=4.2,addr=10.0.0.5"),
    mountinfo_line(31, "/mnt/share", "cifs", "//nas/share", "rw,vers=3.1.1"),
    mountinfo_line(32, "/mnt/ssh", "fuse.sshfs", "user@host:/data", "rw,user_id=0"),
    mountinfo_line(33, "/mnt/host", "9p", "hostshare", "rw,trans=virtio"),
    mountinfo_line(34, "/dev/shm", "tmpfs", "tmpfs", "rw,size=65536k"),
    mountinfo_line(35, "/mnt/fast", "xfs", "/dev/nvme1n1", "rw,attr2"),
    mountinfo_line(36, "/mnt/fast/sub", "btrfs", "/dev/nvme2n1", "rw,subvol=/"),
    mountinfo_line(37, "/mnt/with\\040space", "ext4", "/dev/sdb1"),
    mountinfo_line(38, "/srv/ovl-net", "overlay", "overlay", "rw,lowerdir=/mnt/fast/lower,upperdir=/mnt/nas/up,"
                                                             "workdir=/mnt/nas/work"),
    mountinfo_line(39, "/srv/ovl-local", "overlay", "overlay", "rw,lowerdir=/mnt/fast/l1:/mnt/fast/l2,"
                                                               "upperdir=/mnt/fast/up,workdir=/mnt/fast/work"),
    mountinfo_line(40, "/mnt/stack", "ext4", "/dev/sdc1"),
    mountinfo_line(41, "/mnt/stack", "nfs", "other:/vol", "rw,vers=3"),  # stacked on the ext4: this one is seen
])


@pytest.mark.parametrize("path, verdict", [
    ("/var/lib/dsv41/engram", None),
    ("/mnt/nas/engram", "on nfs4 (nas:/export, mounted at /mnt/nas): a network filesystem"),
    ("/mnt/share/engram", "on cifs (//nas/share, mounted at /mnt/share): a network filesystem"),
    ("/mnt/ssh/engram", "on fuse.sshfs (user@host:/data, mounted at /mnt/ssh): a FUSE filesystem"),
    ("/mnt/host", "on 9p (hostshare, mounted at /mnt/host): a network filesystem"),
    ("/dev/shm/engram", "on tmpfs (tmpfs, mounted at /dev/shm): in memory, not on a disk"),
    ("/mnt/fast/sub/engram", None),
    ("/mnt/fastx/engram", None),  # not under /mnt/fast: on /
    ("/mnt/fast/engram", None),
    ("/mnt/stack/engram", "on nfs (other:/vol, mounted at /mnt/stack): a network filesystem"),
    ("/mnt/with space/engram", None),
    ("/srv/ovl-net/engram", "on overlay (mounted at /srv/ovl-net) over /mnt/nas/up, which is on nfs4"),
    ("/srv/ovl-local/engram", None),
])
def test_fs_type_decision(path, verdict):
    mounts = parse_mountinfo(MOUNTS)
    problem = fs_problem(mount_of(path, mounts), mounts)
    assert (problem is None) if verdict is None else (problem or "").startswith(verdict), problem


def test_fs_type_of_this_machines_tmp_path(tmp_path):
    mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    mount = mount_of(tmp_path.resolve(), mounts)
    assert isinstance(mount, Mount)
    findmnt = shutil.which("findmnt")
    if findmnt:  # util-linux reads the same table its own way
        out = subprocess.run([findmnt, "-n", "-o", "FSTYPE,TARGET", "-T", str(tmp_path)], capture_output=True,
                             text=True, check=True).stdout.split()
        assert [mount.fstype, mount.mount_point] == out
    problem = fs_problem(mount, mounts)
    print(f"{tmp_path}: {mount.fstype} on {mount.source} at {mount.mount_point}: {problem or 'a local disk'}")
    if mount.fstype in ("ext4", "xfs", "btrfs", "f2fs"):
        assert problem is None
    elif mount.fstype in ("tmpfs", "nfs", "nfs4", "cifs", "9p", "virtiofs") or mount.fstype.startswith("fuse"):
        assert problem and problem.startswith(f"on {mount.fstype} ({mount.source}, mounted at {mount.mount_point}): ")


def test_engram_on_a_network_mount_fails(engram_env, tmp_path):
    """The whole check, reading a mountinfo that puts the folder on NFS."""
    env, folder, _ = engram_env
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    at = folder.resolve()
    (proc / "self" / "mountinfo").write_text(
        mountinfo_line(27, "/", "ext4", "/dev/vda") + "\n" + mountinfo_line(50, str(at), "nfs4", "nas:/e"))
    status, lines = engram_lines(env, proc=proc)
    assert status == "fail" and lines == [f"{folder}: on nfs4 (nas:/e, mounted at {at}): a network filesystem, not "
                                          f"a local block device (every row read crosses the network)"]
    # a file linked in from another mount is judged by that mount
    other = (tmp_path / "other").resolve()
    other.mkdir()
    linked = folder / "engram-l4-r0of2.bin"
    linked.rename(other / linked.name)
    linked.symlink_to(other / linked.name)
    (proc / "self" / "mountinfo").write_text(
        mountinfo_line(27, "/", "ext4", "/dev/vda") + "\n" + mountinfo_line(51, str(other), "fuse.sshfs", "u@h:/"))
    status, lines = engram_lines(env, proc=proc)
    assert status == "fail" and len(lines) == 1 and lines[0].startswith(
        f"{linked}: on fuse.sshfs (u@h:/, mounted at {other}): a FUSE filesystem"), lines


def test_engram_without_torch_is_skipped_with_the_reason(tmp_path, monkeypatch):
    """An ops-only install (the Nix ops check) cannot import the format: a skip that says so, not a crash."""
    model = make_model(tmp_path / "model")
    (model / "config.json").write_text(json.dumps({"text_config": {"engram_layer_ids": [1, 14]}}))
    monkeypatch.setitem(sys.modules, "dsv41.engram.pack", None)  # importing it now raises ImportError
    check = check_engram(Node({"DSV41_MODEL": str(model), "DSV41_ENGRAM_DIR": str(tmp_path)}))
    assert check.status == "skip" and check.detail.startswith("the Engram shard format is not importable here (")


def test_room_arithmetic():
    gib = 2 ** 30
    still = {"engram-l1-r0of2.bin": 47 * gib, "engram-l14-r0of2.bin": 3 * gib}
    assert room_problem(Path("/e"), still, 50 * gib) is None  # exactly enough
    assert room_problem(Path("/e"), still, 50 * gib - 1) == (
        "/e: 50.00 GiB still to write for engram-l1-r0of2.bin, engram-l14-r0of2.bin, only 50.00 GiB free")
    assert room_problem(Path("/e"), {}, 0) is None


def test_engram_room_counts_the_missing_files_expected_sizes(engram_env):
    """The bytes still needed are the expected sizes of the missing files less what their .partial holds."""
    from dsv41.config import ModelConfig
    from dsv41.engram.hashing import EngramConstants
    from dsv41.engram.shards import expected_shard_header, shard_file_bytes

    env, folder, packed = engram_env
    constants = EngramConstants.from_config(ModelConfig.from_file(Path(env["DSV41_MODEL"]) / "config.json"))
    for layer in TINY_LAYERS:
        h = expected_shard_header(layer, constants, 1, 2)
        packed_size = (packed / f"engram-l{layer}-r1of2.bin").stat().st_size
        assert shard_file_bytes(h["lo"], h["hi"], h["row bytes"]) == packed_size


def test_engram_lines_print_one_per_problem(engram_env):
    env, folder, _ = engram_env
    for layer in TINY_LAYERS:
        (folder / f"engram-l{layer}-r0of2.bin").unlink()
    text = format_results([check_engram(Node(env))])
    assert text.splitlines()[:2] == [
        f"FAIL engram: {folder}/engram-l{layer}-r0of2.bin: missing (layer {layer}, rank 0 of 2); write it with "
        f"`dsv41 engram pack --src ORIGINAL_CHECKPOINT --out {folder} --rank 0 --tp 2`" for layer in TINY_LAYERS]


def test_worker_engram_checks_its_own_rank(engram_env, node_env, tmp_path):
    """Head rank 0 and worker rank 1, each with its own files; the worker's check runs as a real process."""
    env, folder, packed = engram_env
    base, sysfs = node_env
    worker_folder = tmp_path / "worker-engram"
    worker_folder.mkdir()
    for layer in TINY_LAYERS:
        shutil.copyfile(packed / f"engram-l{layer}-r1of2.bin", worker_folder / f"engram-l{layer}-r1of2.bin")
    head_env = {**base, **env, "DSV41_WORKER_SSH": "root@worker"}
    worker_env = {**head_env, "DSV41_ENGRAM_DIR": str(worker_folder), "DSV41_LOCAL_RANKS": "rank1",
                  "DSV41_RDMA_PORTS": "", "DSV41_MEM_GATE_GIB": "0"}
    results = by_name(run_preflight(head_env, run=worker_executor(write_env(tmp_path / "w.env", worker_env)),
                                    node=Node(head_env, sysfs=sysfs)))
    if disk_problem(folder):
        pytest.skip(f"the test folder is {disk_problem(folder)}")
    assert results["engram"].status == "pass", results["engram"].detail
    assert results["worker:engram"].status == "pass", results["worker:engram"].detail
    assert "rank(s) 1 of 2" in results["worker:engram"].detail
