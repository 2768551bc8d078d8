"""`dsv41 preflight [--json]`: is this pair ready to start? Each check is independent and prints one line.

Status per check: pass, fail (start would fail or hurt) or skip (not configured / not applicable, with the
reason). The head runs its checks locally and the worker's through `ssh worker dsv41 preflight --local --json`,
then compares the model files of both.
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from dsv41.ops import host_commands
from dsv41.ops.host_commands import CommandRunner
from dsv41.ops.knobs import PROFILE, ops_number, ops_value

ENGRAM_MAGIC = b"DSV41EN1"
ENGRAM_HEADER = 4096
ENGRAM_ROW_BYTES = 264
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


def read_engram_header(path: Path) -> dict:
    """Validate an engram-l{L}-r{R}of{W}.bin header and size (EXL3-ENGRAM.md §5.4); raises ValueError."""
    with path.open("rb") as handle:
        header = handle.read(48)
    if len(header) < 48:
        raise ValueError(f"{path.name}: {len(header)} bytes, shorter than the 48-byte header")
    magic, layer, lo, hi, total, row_bytes = struct.unpack("<8s5Q", header)
    if magic != ENGRAM_MAGIC:
        raise ValueError(f"{path.name}: magic {magic!r}, expected {ENGRAM_MAGIC!r}")
    if row_bytes != ENGRAM_ROW_BYTES:
        raise ValueError(f"{path.name}: row bytes {row_bytes}, expected {ENGRAM_ROW_BYTES}")
    if not lo < hi <= total:
        raise ValueError(f"{path.name}: row range [{lo}, {hi}) not inside 0..{total}")
    size, expected = path.stat().st_size, ENGRAM_HEADER + (hi - lo) * row_bytes
    if size != expected:
        raise ValueError(f"{path.name}: {size} bytes, expected {expected} for rows [{lo}, {hi})")
    return {"layer": layer, "lo": lo, "hi": hi, "total": total}


def check_engram(node: Node) -> Check:
    layers = engram_layers(node.env)
    if layers is None:
        return Check("engram", "skip", "the model config is unreadable (see the model check)")
    if not layers:
        return Check("engram", "skip", "the model config lists no Engram layers")
    folder = ops_value_or(node.env, "DSV41_ENGRAM_DIR")
    if not folder:
        return Check("engram", "fail", f"the model has Engram layers {layers} but DSV41_ENGRAM_DIR is empty")
    world = int(ops_value_or(node.env, "DSV41_TP") or 1)
    ranks = [int(r.removeprefix("rank")) for r in ops_value(node.env, "DSV41_LOCAL_RANKS").split()] or [0]
    problems, found = [], []
    for rank in ranks:
        for layer in layers:
            path = Path(folder) / f"engram-l{layer}-r{rank}of{world}.bin"
            if not path.is_file():
                problems.append(f"{path}: missing")
                continue
            try:
                header = read_engram_header(path)
            except (OSError, ValueError) as exc:
                problems.append(str(exc))
                continue
            if header["layer"] != layer:
                problems.append(f"{path.name}: header says layer {header['layer']}")
                continue
            found.append(path.name)
    if problems:
        return Check("engram", "fail", "; ".join(problems))
    return Check("engram", "pass", f"{', '.join(found)}: headers and sizes ok")


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
        if master:
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


LOCAL_CHECKS: tuple[Callable[[Node], Check], ...] = (
    check_model, check_engram, check_ports, check_gpus, check_rdma, check_memory)


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
    lines = [f"{c.status.upper():4} {c.name}: {c.detail}" for c in results]
    failed = [c.name for c in results if c.status == "fail"]
    lines.append(f"preflight: {'FAILED: ' + ', '.join(failed) if failed else 'ok'}")
    return "\n".join(lines)


def exit_status(results: list[Check]) -> int:
    return 1 if any(c.status == "fail" for c in results) else 0


def ops_value_or(env: Mapping[str, str], name: str) -> str:
    """A serve knob's value ('' when unset): serve knobs have no ops default."""
    return env.get(name, "").strip()
