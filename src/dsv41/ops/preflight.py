"""`dsv41 preflight [--json]`: is this pair ready to start? Each check is independent and prints one line (a
failing check one line per problem).

Status per check: pass, fail (start would fail or hurt) or skip (not configured / not applicable, with the
reason). The head runs its checks locally and the worker's through `ssh worker dsv41 preflight --local --json`,
then compares the model files of both.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from dsv41.ops import host_commands
from dsv41.ops.host_commands import CommandRunner
from dsv41.ops.knobs import PROFILE, ops_number, ops_value, tp_ranks

MODEL_FILES_HASHED = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json")


@dataclass
class Check:
    name: str
    status: str  # pass | fail | skip
    detail: str
    data: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Node:
    """Where a node's checks read from; tests point the roots at temporary trees."""

    env: Mapping[str, str]
    run: CommandRunner = host_commands.run
    sysfs: Path = Path("/sys")
    proc: Path = Path("/proc")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_model(node: Node) -> Check:
    folder = ops_value_or(node.env, "DSV41_MODEL")
    if not folder:
        return Check("model", "skip", "DSV41_MODEL is empty: the built-in tiny model")
    path = Path(folder)
    if not path.is_dir():
        return Check("model", "fail", f"{path}: no such folder")
    missing = [name for name in ("config.json", "tokenizer.json") if not (path / name).is_file()]
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        missing.append("*.safetensors")
    if missing:
        return Check("model", "fail", f"{path}: missing {', '.join(missing)}")
    hashes = {name: _sha256(path / name) for name in MODEL_FILES_HASHED if (path / name).is_file()}
    try:
        json.loads((path / "config.json").read_text())
    except ValueError as exc:
        return Check("model", "fail", f"{path / 'config.json'}: not JSON ({exc})")
    return Check("model", "pass", f"{path}: config, tokenizer and {len(shards)} shard(s)", {"sha256": hashes})


def engram_layers(env: Mapping[str, str]) -> list[int] | None:
    """The model's Engram layer ids; None when the config cannot be read (the model check reports why)."""
    folder = ops_value_or(env, "DSV41_MODEL")
    if not folder:
        return []
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)
    return [int(layer) for layer in config.get("engram_layer_ids") or []]


# Filesystem types that are not a local block device. tmpfs/ramfs hold their files in memory, which on GB10 is the
# memory the model lives in; the others put a network (or a FUSE process) under every row read.
MEMORY_FS_TYPES = frozenset({"tmpfs", "ramfs", "devtmpfs"})
NETWORK_FS_TYPES = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "virtiofs", "sshfs", "ceph", "glusterfs",
                              "lustre", "gpfs", "afs", "davfs", "beegfs", "orangefs", "ocfs2", "gfs2"})
PAGE_CACHE_NOTE = "the reader would fall back to the page cache, which on GB10 is the memory the model lives in"


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo: where it is mounted, the filesystem type, the source, the super options."""

    mount_point: str
    fstype: str
    source: str
    options: str


def _unescape(field_text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_text)


def parse_mountinfo(text: str) -> list[Mount]:
    """`ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS` per line."""
    mounts = []
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or not rest:
            continue
        mounts.append(Mount(_unescape(fields[4]), rest[0], _unescape(rest[1]) if len(rest) > 1 else "",
                            rest[2] if len(rest) > 2 else ""))
    return mounts


def mount_of(path: str | Path, mounts: list[Mount]) -> Mount | None:
    """The mount a (resolved) path lies on: the longest mount point above it; of stacked mounts, the last."""
    path = str(path)
    best = None
    for mount in mounts:
        mp = mount.mount_point
        if path == mp or path.startswith(mp.rstrip("/") + "/"):
            if best is None or len(mp) >= len(best.mount_point):
                best = mount
    return best


def fs_problem(mount: Mount, mounts: list[Mount], _seen: tuple[Mount, ...] = ()) -> str | None:
    """Why the filesystem of `mount` is not a local block device for the Engram reader, or None when it is.

    An overlay is judged by the mounts its upper and lower folders lie on (where those are visible here)."""
    kind = mount.fstype
    where = f"{kind} ({mount.source}, mounted at {mount.mount_point})"
    if kind.split(".")[0] in ("fuse", "fuseblk"):
        return f"on {where}: a FUSE filesystem, not a local block device (every read goes through a process)"
    if kind in NETWORK_FS_TYPES:
        return f"on {where}: a network filesystem, not a local block device (every row read crosses the network)"
    if kind in MEMORY_FS_TYPES:
        return f"on {where}: in memory, not on a disk (on GB10 that is the memory the model lives in)"
    if kind == "overlay":
        layers = re.findall(r"(?:^|,)(?:upperdir|lowerdir)=([^,]*)", mount.options)
        for folder in (part for value in layers for part in value.split(":") if part):
            under = mount_of(_unescape(folder), mounts)
            if under is not None and under.mount_point != mount.mount_point and under not in _seen:
                problem = fs_problem(under, mounts, (*_seen, mount))
                if problem:
                    return f"on overlay (mounted at {mount.mount_point}) over {folder}, which is {problem}"
    return None


def direct_read_problem(path: Path, nbytes: int = 4096) -> str | None:
    """None when `path` opens with O_DIRECT and its first `nbytes` (a multiple of any sector size) read into an
    aligned buffer, as the Engram reader does; else why not."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return f"{path}: this system has no O_DIRECT; {PAGE_CACHE_NOTE}"
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError as exc:
        return f"{path}: the filesystem refuses an O_DIRECT open ({exc.strerror}); {PAGE_CACHE_NOTE}"
    buf = mmap.mmap(-1, nbytes)  # page-aligned
    try:
        got = os.preadv(fd, [buf], 0)
    except OSError as exc:
        return f"{path}: an aligned O_DIRECT read of {nbytes} bytes failed ({exc.strerror}); {PAGE_CACHE_NOTE}"
    finally:
        buf.close()
        os.close(fd)
    if got != nbytes:
        return f"{path}: an O_DIRECT read of {nbytes} bytes returned {got}; {PAGE_CACHE_NOTE}"
    return None


def room_problem(folder: Path, still_to_write: Mapping[str, int], free: int) -> str | None:
    """`still_to_write`: file name -> bytes its pack has still to write; a problem line when they exceed `free`."""
    need = sum(still_to_write.values())
    if need <= free:
        return None
    gib = 2 ** 30
    return (f"{folder}: {need / gib:.2f} GiB still to write for {', '.join(sorted(still_to_write))}, only "
            f"{free / gib:.2f} GiB free")


def _free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def check_engram(node: Node) -> Check:
    """Each local rank's `engram-l{L}-r{rank}of{world}.bin` for every Engram layer: there, header and size matching
    the model's config (`engram.shards.check_shard_file`), no leftovers of an unfinished pack, on a local block
    device that takes O_DIRECT reads, with room for the files still missing. One problem per line of the detail."""
    layers = engram_layers(node.env)
    if layers is None:
        return Check("engram", "skip", "the model config is unreadable (see the model check)")
    if not layers:
        return Check("engram", "skip", "the model config lists no Engram layers")
    folder_text = ops_value_or(node.env, "DSV41_ENGRAM_DIR")
    if not folder_text:  # as `dsv41 serve` without --engram-dir: the tables inside the model folder
        return Check("engram", "skip", f"DSV41_ENGRAM_DIR is empty: the server reads the Engram tables of layers "
                                       f"{layers} from the model folder")
    world = int(ops_value_or(node.env, "DSV41_TP") or 1)
    ranks = [int(r.removeprefix("rank")) for r in ops_value(node.env, "DSV41_LOCAL_RANKS").split()] or [0]
    folder = Path(folder_text)
    pack_hint = f"`dsv41 engram pack --src ORIGINAL_CHECKPOINT --out {folder} --rank {{rank}} --tp {world}`"

    # the format's one implementation, imported here so that the other checks stay light (no torch)
    try:
        from dsv41.config import ModelConfig
        from dsv41.engram.hashing import EngramConstants
        from dsv41.engram.pack import PARTIAL_SUFFIX, STATE_SUFFIX
        from dsv41.engram.shards import check_shard_file, expected_shard_header, shard_file_bytes, shard_file_name
        from dsv41.errors import DSV41Error
    except ImportError as exc:  # an ops-only install (no torch): the engine's hosts have it
        return Check("engram", "skip", f"the Engram shard format is not importable here ({exc})")

    config_path = Path(ops_value_or(node.env, "DSV41_MODEL")) / "config.json"
    try:
        constants = EngramConstants.from_config(ModelConfig.from_file(config_path))
    except DSV41Error as exc:
        return Check("engram", "fail", f"{config_path}: {exc}")
    bad_ranks = [rank for rank in ranks if not 0 <= rank < world]
    if bad_ranks:
        return Check("engram", "fail", f"rank(s) {bad_ranks} outside a tensor-parallel world of {world} (DSV41_TP)")
    if not folder.is_dir():
        return Check("engram", "fail", f"{folder}: no such folder; write the files with "
                                       + ", ".join(pack_hint.format(rank=rank) for rank in ranks))

    problems, found, present, still = [], [], [], {}
    for rank in ranks:
        for layer in layers:
            path = folder / shard_file_name(layer, rank, world)
            partial = path.with_name(path.name + PARTIAL_SUFFIX)
            leftovers = [p.name for p in (partial, path.with_name(path.name + STATE_SUFFIX)) if p.exists()]
            if leftovers:
                problems.append(f"{folder}/{', '.join(leftovers)}: left by an unfinished `dsv41 engram pack`; rerun "
                                f"the pack to resume: {pack_hint.format(rank=rank)}")
            if not path.is_file():
                problems.append(f"{path}: missing (layer {layer}, rank {rank} of {world}); write it with "
                                f"{pack_hint.format(rank=rank)}")
                header = expected_shard_header(layer, constants, rank, world)
                size = shard_file_bytes(header["lo"], header["hi"], header["row bytes"])
                done = partial.stat().st_size if partial.is_file() else 0
                still[path.name] = max(0, size - done)
                continue
            present.append(path)
            try:
                check_shard_file(path, layer, constants, rank, world)
            except DSV41Error as exc:
                problems.append(str(exc))
                continue
            problem = direct_read_problem(path)
            if problem:
                problems.append(problem)
                continue
            found.append(path.name)

    disk = "the disk is not checked"
    mountinfo = node.proc / "self" / "mountinfo"
    try:
        mounts = parse_mountinfo(mountinfo.read_text())
    except OSError as exc:
        problems.append(f"{mountinfo}: unreadable ({exc.strerror}): cannot tell whether {folder} is on a local disk")
    else:
        judged = set()  # the folder's mount, and any other a file reaches through a link
        for where in (folder, *present):
            mount = mount_of(where.resolve(), mounts)
            if mount is None:
                problems.append(f"{where}: no mount in {mountinfo} holds it: cannot tell whether it is on a local disk")
                continue
            if where == folder:
                disk = f"{mount.fstype} on {mount.source}"
            if mount not in judged:
                judged.add(mount)
                problem = fs_problem(mount, mounts)
                if problem:
                    problems.append(f"{where}: {problem}")
    if still:
        problem = room_problem(folder, still, _free_bytes(folder))
        if problem:
            problems.append(problem)
    data = {"files": found, "fs": disk}
    if problems:
        return Check("engram", "fail", "\n".join(problems), data)
    return Check("engram", "pass", f"{', '.join(found)}: headers and sizes match the model config for rank(s) "
                                   f"{', '.join(map(str, ranks))} of {world}; {disk}, O_DIRECT reads ok", data)


def _port_free(host: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            return f"{host}:{port} in use ({exc.strerror})"
    return None


def check_ports(node: Node) -> Check:
    ports = []
    local = ops_value(node.env, "DSV41_LOCAL_RANKS").split() or ["rank0"]
    if "rank0" in local:
        ports.append((ops_value_or(node.env, "DSV41_HOST") or "127.0.0.1", int(ops_value_or(node.env, "DSV41_PORT") or 8000)))
        master = ops_value_or(node.env, "DSV41_MASTER")
        if master and len(tp_ranks(node.env)) > 1:  # at DSV41_TP=1 serve hosts no rendezvous
            host, _, port = master.rpartition(":")
            ports.append(("0.0.0.0", int(port)))
    if not ports:
        return Check("ports", "skip", "this node does not run rank 0 (the worker listens on no fixed port)")
    busy = [msg for host, port in ports if (msg := _port_free(host, port))]
    if busy:
        return Check("ports", "fail", "; ".join(busy))
    return Check("ports", "pass", "free: " + ", ".join(f"{h}:{p}" for h, p in ports))


def check_gpus(node: Node) -> Check:
    result = node.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"])
    if result.rc == 127:
        return Check("gpus", "skip", "nvidia-smi not found (no NVIDIA driver on this host)")
    if not result.ok:
        return Check("gpus", "fail", f"nvidia-smi failed: {result.stderr.strip()[:200]}")
    busy = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    if busy:
        return Check("gpus", "fail", "GPU busy: " + "; ".join(busy))
    return Check("gpus", "pass", "no compute processes on the GPU")


def check_rdma(node: Node) -> Check:
    wanted = ops_value(node.env, "DSV41_RDMA_PORTS").split()
    if not wanted:
        return Check("roce", "skip", "DSV41_RDMA_PORTS is empty")
    problems, good = [], []
    for item in wanted:
        device, _, port = item.partition(":")
        state_file = node.sysfs / "class" / "infiniband" / device / "ports" / (port or "1") / "state"
        try:
            state = state_file.read_text().strip()
        except OSError:
            problems.append(f"{item}: no such RDMA port ({state_file})")
            continue
        (good if "ACTIVE" in state else problems).append(f"{item}: {state}")
    if problems:
        return Check("roce", "fail", "; ".join(problems))
    return Check("roce", "pass", "; ".join(good))


def mem_free_gib(proc: Path) -> float:
    for line in (proc / "meminfo").read_text().splitlines():
        if line.startswith("MemFree:"):
            return int(line.split()[1]) / (1 << 20)
    raise ValueError("MemFree missing from meminfo")


def check_memory(node: Node) -> Check:
    gate = ops_number(node.env, "DSV41_MEM_GATE_GIB")
    if gate <= 0:
        return Check("memory", "skip", "DSV41_MEM_GATE_GIB is 0 (gate off)")
    free = mem_free_gib(node.proc)
    # MemFree, not MemAvailable: on GB10's unified memory, page cache is not free for CUDA.
    if free < gate:
        return Check("memory", "fail", f"MemFree {free:.1f} GiB < gate {gate:g} GiB (drop caches or stop other work)")
    return Check("memory", "pass", f"MemFree {free:.1f} GiB >= {gate:g} GiB")


def check_prepared(node: Node) -> Check:
    """Each local rank's prepared folder under DSV41_PREPARED (`prepared.manifest.folder_problems`)."""
    root = ops_value_or(node.env, "DSV41_PREPARED")
    if not root:
        return Check("prepared", "skip", "DSV41_PREPARED is empty: the ranks build from the checkpoint")
    from dsv41.prepared.manifest import folder_problems

    world = int(ops_value_or(node.env, "DSV41_TP") or 1)
    ranks = [int(r.removeprefix("rank")) for r in ops_value(node.env, "DSV41_LOCAL_RANKS").split()] or [0]
    problems, data = [], {}
    for rank in ranks:
        found, summary = folder_problems(root, rank, world, ops_value_or(node.env, "DSV41_MODEL") or None)
        problems += found
        data[f"rank{rank}"] = summary
    if problems:
        return Check("prepared", "fail", "\n".join(problems), data)
    sizes = ", ".join(f"{k} {v['bytes'] / 2**30:.1f} GiB" for k, v in data.items())
    return Check("prepared", "pass", f"{root}: {sizes}, matching the model and this code", data)


LOCAL_CHECKS: tuple[Callable[[Node], Check], ...] = (
    check_model, check_engram, check_prepared, check_ports, check_gpus, check_rdma, check_memory)


def local_checks(node: Node) -> list[Check]:
    results = []
    for check in LOCAL_CHECKS:
        try:
            results.append(check(node))
        except Exception as exc:  # one broken check must not hide the others
            results.append(Check(check.__name__.removeprefix("check_"), "fail", f"check crashed: {exc!r}"))
    return results


def worker_checks(env: Mapping[str, str], run: CommandRunner) -> list[Check]:
    worker = ops_value(env, "DSV41_WORKER_SSH")
    if len(tp_ranks(env)) == 1:
        return [Check("worker", "skip", "DSV41_TP=1: one node, no worker")]
    if not worker:
        return [Check("worker", "skip", "DSV41_WORKER_SSH is empty (single node)")]
    result = run([f"{PROFILE}/bin/dsv41", "preflight", "--local", "--json"], host=worker, timeout=300)
    try:
        remote = [Check(**item) for item in json.loads(result.stdout)]
    except (ValueError, TypeError):
        return [Check("worker", "fail", f"{worker}: preflight did not run (rc {result.rc}: "
                                        f"{(result.stderr or result.stdout).strip()[:200]})")]
    return [Check(f"worker:{c.name}", c.status, c.detail, c.data) for c in remote]


def check_model_match(head: list[Check], worker: list[Check]) -> Check:
    def hashes(results: list[Check], name: str) -> dict | None:
        for c in results:
            if c.name == name and c.status == "pass":
                return c.data.get("sha256")
        return None

    mine, theirs = hashes(head, "model"), hashes(worker, "worker:model")
    if mine is None or theirs is None:
        return Check("model-match", "skip", "model files not checked on both nodes")
    differ = sorted(name for name in set(mine) | set(theirs) if mine.get(name) != theirs.get(name))
    if differ:
        return Check("model-match", "fail", f"head and worker differ in {', '.join(differ)}")
    return Check("model-match", "pass", f"{len(mine)} file(s) identical on both nodes")


def run_preflight(env: Mapping[str, str], remote: bool = True, run: CommandRunner = host_commands.run,
                  node: Node | None = None) -> list[Check]:
    head = local_checks(node or Node(env, run))
    if not remote:
        return head
    worker = worker_checks(env, run)
    return head + worker + [check_model_match(head, worker)]


def format_results(results: list[Check]) -> str:
    # a detail of several lines (one problem each) prints each under the check's status and name
    lines = [f"{c.status.upper():4} {c.name}: {line}" for c in results for line in c.detail.splitlines() or [""]]
    failed = [c.name for c in results if c.status == "fail"]
    lines.append(f"preflight: {'FAILED: ' + ', '.join(failed) if failed else 'ok'}")
    return "\n".join(lines)


def exit_status(results: list[Check]) -> int:
    return 1 if any(c.status == "fail" for c in results) else 0


def ops_value_or(env: Mapping[str, str], name: str) -> str:
    """A serve knob's value ('' when unset): serve knobs have no ops default."""
    return env.get(name, "").strip()
