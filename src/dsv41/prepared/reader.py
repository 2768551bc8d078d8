"""Start from a prepared folder: the manifest checked, data.bin read once front to back, the skeleton unpickled.

No per-tensor parsing or validation beyond the manifest: each entry is one byte range going to one new storage.
On CUDA the file is read in CHUNK-sized pieces by READ_THREADS threads into a ring of pinned buffers while the
main thread issues the (asynchronous) copies of the previous pieces to the device; elsewhere each entry is read
straight into its storage. Reads go through the page cache (the warm unit may have filled it; ops/warm.py); on a
GPU that shares the host's memory (GB10) each piece is dropped from the page cache once read, so the file does not
take a second copy of the weights' memory (`drop_page_cache`, DSV41_PREPARED_PAGE_CACHE).

`verify` ("sample" by default, DSV41_PREPARED_VERIFY): the skeleton parts always, plus every 16th tensor entry and
the last are re-hashed as they stream by; "full" re-hashes all (as `dsv41 prepare --check` does), "off" none.
A folder that does not fit (another checkpoint, rank, layout version, build setting or code) raises
`PreparedMismatch` with the one-line reason before anything is read.
"""

from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from . import manifest as mf
from .skeleton import load_part, tensor_view
from .writer import build_settings

CHUNK = 64 << 20
READ_THREADS = 4
RING = 6  # pinned buffers in flight (READ_THREADS being filled + copies draining)
VERIFY_MODES = ("sample", "full", "off")
SAMPLE_EVERY = 16


class StartPhases:
    """Each start phase's seconds, logged as it ends (and passed to `notify(line)`, e.g. a systemd STATUS=)."""

    def __init__(self, log: Callable[[str], None] | None = None, notify: Callable[[str], None] | None = None):
        self.log, self.notify = log, notify
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def running(self) -> float:
        """Seconds of the phase under way so far."""
        return time.perf_counter() - self._t

    def add(self, phase: str, seconds: float) -> None:
        """A phase that ended before this timeline began (e.g. the imports, timed from the process's spawn)."""
        self.seconds[phase] = seconds

    def done(self, phase: str, detail: str = "") -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._t
        self._t = now
        line = f"start: {phase} {self.seconds[phase]:.2f} s" + (f" ({detail})" if detail else "")
        if self.log:
            self.log(line)
        if self.notify:
            self.notify(line)


def _to_verify(entries: list[dict], mode: str) -> set[int]:
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {mode!r}")
    if mode == "off":
        return set()
    tensors = [e["index"] for e in entries if e["kind"] == "tensor"]
    picked = set(tensors) if mode == "full" else set(tensors[::SAMPLE_EVERY]) | set(tensors[-1:])
    return picked | {e["index"] for e in entries if e["kind"] == "skeleton"}


def _damaged(folder: Path, entry: dict) -> mf.PreparedMismatch:
    return mf.PreparedMismatch(f"{folder}: entry {entry['name']} of {mf.DATA} is damaged (sha256 differs): run "
                               f"`dsv41 prepare` again")


def _read_plain(path: Path, entries: list[dict], dests: list[torch.Tensor], check: set[int], folder: Path,
                progress) -> None:
    total, done = sum(e["nbytes"] for e in entries), 0
    with open(path, "rb", buffering=0) as handle:
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for e, dst in zip(entries, dests):
            view = memoryview(dst.numpy())
            handle.seek(e["offset"])
            got = 0
            while got < e["nbytes"]:
                n = handle.readinto(view[got:])
                if not n:
                    raise mf.PreparedMismatch(f"{folder}: {mf.DATA} ends inside entry {e['name']}")
                got += n
            if e["index"] in check and hashlib.sha256(view).hexdigest() != e["sha256"]:
                raise _damaged(folder, e)
            done += e["nbytes"]
            if progress:
                progress(done, total)


def _pread_full(fd: int, view: memoryview, offset: int, drop: bool = False) -> int:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    if drop:  # unified memory: the page cache would hold a second copy of what goes to the device
        os.posix_fadvise(fd, offset, got, os.POSIX_FADV_DONTNEED)
    return got


def drop_page_cache(device: torch.device) -> bool:
    """Whether the read drops each piece from the page cache once copied: DSV41_PREPARED_PAGE_CACHE=drop|keep, by
    default drop on a GPU that shares the host's memory (GB10: the page cache is the memory the weights go to)."""
    choice = os.environ.get("DSV41_PREPARED_PAGE_CACHE", "").strip() or "auto"
    if choice not in ("auto", "drop", "keep"):
        raise ValueError(f"DSV41_PREPARED_PAGE_CACHE={choice!r}: expected auto, drop or keep")
    if choice != "auto":
        return choice == "drop"
    return device.type == "cuda" and bool(getattr(torch.cuda.get_device_properties(device), "is_integrated", False))


def _pieces(entries: list[dict], at: int, c0: int, n: int) -> tuple[int, list[tuple[int, int, int]]]:
    """The (entry position, start, stop) byte ranges of chunk [c0, c0 + n) in file order, and the first entry that
    may still reach a later chunk."""
    while at < len(entries) and entries[at]["offset"] + entries[at]["nbytes"] <= c0:
        at += 1
    out, j = [], at
    while j < len(entries) and entries[j]["offset"] < c0 + n:
        e = entries[j]
        a, b = max(e["offset"], c0), min(e["offset"] + e["nbytes"], c0 + n)
        if b > a:
            out.append((j, a, b))
        j += 1
    return at, out


def _read_pipelined(path: Path, entries: list[dict], dests: list[torch.Tensor], check: set[int], folder: Path,
                    progress, device: torch.device) -> None:
    """READ_THREADS threads fill a ring of RING chunk buffers (pinned on CUDA) ahead of the main thread, which issues
    each chunk's copies into the entries' storages (asynchronous on CUDA) while the next chunks are read; a buffer
    is refilled once its copies (a CUDA event) and its sampled hashing (one hashing thread, in file order) are done.
    """
    cuda, drop = device.type == "cuda", drop_page_cache(device)
    end = max((e["offset"] + e["nbytes"] for e in entries), default=0)
    starts = list(range(0, end, CHUNK))
    ring = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=cuda) for _ in range(max(min(RING, len(starts)), 2))]
    views = [memoryview(b.numpy()) for b in ring]
    busy: list[tuple] = [(None, None)] * len(ring)  # per buffer: (copies' CUDA event, hashing future)
    hashers = {e["index"]: hashlib.sha256() for e in entries if e["index"] in check}
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="prepared-read") as pool, \
                ThreadPoolExecutor(1, thread_name_prefix="prepared-hash") as hashing:
            def read(i: int):
                slot = i % len(ring)
                event, hashed = busy[slot]
                if event is not None:
                    event.synchronize()
                if hashed is not None:
                    hashed.result()
                n = min(CHUNK, end - starts[i])
                return pool.submit(_pread_full, fd, views[slot][:n], starts[i], drop)

            def hash_pieces(view, pieces):
                for j, a, b in pieces:
                    hashers[entries[j]["index"]].update(view[a:b])

            ahead = len(ring) - 1  # reads in flight; the last buffer is the one being copied out
            futures = {i: read(i) for i in range(min(ahead, len(starts)))}
            at = 0
            for i, c0 in enumerate(starts):
                n = min(CHUNK, end - c0)
                if futures.pop(i).result() != n:
                    raise mf.PreparedMismatch(f"{folder}: {mf.DATA} is shorter than its manifest says")
                slot = i % len(ring)
                buf, view = ring[slot], views[slot]
                at, pieces = _pieces(entries, at, c0, n)
                for j, a, b in pieces:
                    e = entries[j]
                    dests[j][a - e["offset"]:b - e["offset"]].copy_(buf[a - c0:b - c0], non_blocking=cuda)
                sampled = [(j, a - c0, b - c0) for j, a, b in pieces if entries[j]["index"] in hashers]
                event = None
                if cuda:
                    event = torch.cuda.Event()
                    event.record()
                busy[slot] = (event, hashing.submit(hash_pieces, view, sampled) if sampled else None)
                if progress:
                    progress(c0 + n, end)
                if i + ahead < len(starts):
                    futures[i + ahead] = read(i + ahead)  # into the buffer of chunk i - 1
            for _, hashed in busy:
                if hashed is not None:
                    hashed.result()
        if cuda:
            torch.cuda.current_stream(device).synchronize()
    finally:
        os.close(fd)
    for e in entries:
        if e["index"] in hashers and hashers[e["index"]].hexdigest() != e["sha256"]:
            raise _damaged(folder, e)


def read_entries(folder: Path, manifest: dict, device: torch.device, verify: str = "sample",
                 progress: Callable[[int, int], None] | None = None, pipelined: bool = False
                 ) -> list[torch.UntypedStorage]:
    """Every entry of data.bin in a new storage (tensor entries on `device` or the CPU, as they were stored;
    skeleton entries on the CPU). CUDA always reads through the pipeline; `pipelined` takes it on the CPU too
    (tests: the same chunk walk without a GPU)."""
    entries = manifest["entries"]
    path = folder / mf.DATA
    size = path.stat().st_size if path.is_file() else None
    if size != manifest["data"]["bytes"]:
        raise mf.PreparedMismatch(f"{folder}: {mf.DATA} is {size} bytes, the manifest says "
                                  f"{manifest['data']['bytes']} (a partial copy?)")
    cpu = torch.device("cpu")
    dests = [torch.empty(e["nbytes"], dtype=torch.uint8, device=device if e["device"] == device.type else cpu)
             for e in entries]
    check = _to_verify(entries, verify)
    if device.type == "cuda" or pipelined:
        _read_pipelined(path, entries, dests, check, folder, progress, device)
    else:
        _read_plain(path, entries, dests, check, folder, progress)
    return [d.untyped_storage() for d in dests]


class _Resolver:
    """The skeleton's references, resolved for this process."""

    def __init__(self, storages, parts: dict[str, bytes], device, comm, workspace, tokenizer, tables):
        self.storages, self.parts, self.device = storages, parts, device
        self.comm, self.workspace, self.tokenizer, self.tables = comm, workspace, tokenizer, tables
        self.blocks: dict[int, object] = {}

    def __call__(self, pid):
        kind = pid[0]
        if kind == "t":
            _, index, dtype, offset, shape, stride = pid
            return tensor_view(self.storages[index], dtype, offset, shape, stride)
        if kind == "device":
            return self.device if pid[1] == self.device.type else torch.device(pid[1])
        if kind == "block":
            index = pid[1]
            if index not in self.blocks:
                self.blocks[index] = load_part(self.parts[f"block.{index}"], f"block.{index}", self)
            return self.blocks[index]
        if kind == "comm":
            return self.comm
        if kind == "workspace":
            return self.workspace
        if kind == "tokenizer":
            return self.tokenizer()
        if kind == "engram_table":
            return self.tables(pid[1])
        raise mf.PreparedMismatch(f"skeleton reference {pid!r} unknown to this code: run `dsv41 prepare` again")


def open_checkpoint_table(model_dir: Path, engram_dir, cfg, rank: int, world: int):
    """`layer -> EngramTable` as the builder opens them (model/loader.py `_load_engram`)."""
    from dsv41.engram.hashing import EngramConstants
    from dsv41.engram.shards import shard_file_name
    from dsv41.engram.tables import EngramTable
    from dsv41.errors import CheckpointError

    constants = EngramConstants.from_config(cfg)

    def table(layer: int):
        shard = Path(engram_dir or model_dir) / shard_file_name(layer, rank, world)
        if engram_dir is not None and not shard.is_file():
            raise CheckpointError(f"{engram_dir}: Engram shard file {shard.name} (layer {layer}, rank {rank} of "
                                  f"{world}) is missing")
        if shard.is_file():
            return EngramTable.from_shard_file(shard, layer, cfg, rank, world, constants=constants)
        from dsv41.weights import Checkpoint

        return EngramTable.from_checkpoint(Checkpoint(model_dir), layer, cfg, rank, world, constants=constants)

    return table


def load_prepared(root: str | Path, model_dir: str | Path | None, *, device="cpu", dtype=torch.float32,
                  rank: int = 0, world: int = 1, comm=None, fake_quant: bool = True, engram_dir=None,
                  verify: str | None = None, source: dict | None = None, phases: StartPhases | None = None,
                  progress: Callable[[int, int, str], None] | None = None):
    """This rank's FastModel from the prepared folder under `root` (see `manifest.rank_folder`). `model_dir`: the
    checkpoint it must have been prepared from (config, tokenizer and Engram tables are read there); `source`
    instead for a synthetic rank. Raises PreparedMismatch (one line) for a folder that does not fit."""
    from dsv41.parallel.comm import LocalComm
    from dsv41.runtime.layers.linear import PrefillWorkspace

    device = torch.device(device)
    phases = phases or StartPhases()
    verify = verify or os.environ.get("DSV41_PREPARED_VERIFY", "").strip() or "sample"
    folder = mf.rank_folder(root, rank, world)
    manifest = mf.read_manifest(folder)
    if source is None:
        source = mf.source_identity(model_dir)
    reason = mf.mismatch(manifest, source=source, world=world, rank=rank,
                         build=build_settings(device, dtype, fake_quant))
    if reason:
        raise mf.PreparedMismatch(f"{folder}: {reason}")
    phases.done("manifest", f"{folder}")

    mib = manifest["data"]["bytes"] / 2**20
    storages = read_entries(folder, manifest, device, verify,
                            progress and (lambda done, total: progress(done >> 20, max(total >> 20, 1), "MiB")))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = max(phases.running(), 1e-9)
    phases.done("read", f"{mib / 1024:.2f} GiB, {mib / 1024 / seconds:.2f} GiB/s, verify {verify}")

    cache: dict = {}

    def tokenizer():
        if "tok" not in cache:
            from dsv41.tokenizer import Tokenizer

            cache["tok"] = Tokenizer.from_dir(model_dir) if model_dir is not None else None
        return cache["tok"]

    def tables(layer: int):
        if "open" not in cache:
            from dsv41.config import ModelConfig

            cache["open"] = open_checkpoint_table(Path(model_dir), engram_dir, ModelConfig.from_file(model_dir),
                                                  rank, world)
        return cache["open"](layer)

    workspace = PrefillWorkspace(device)
    workspace.numel = manifest["workspace_numel"]
    parts = {}
    for part in manifest["parts"]:
        parts[part["name"]] = bytes(memoryview(torch.empty(0, dtype=torch.uint8).set_(
            storages[part["skeleton"]]).numpy()))
    resolve = _Resolver(storages, parts, device, comm or LocalComm(), workspace, tokenizer, tables)
    model = load_part(parts["model"], "model", resolve)  # its ("block", L) references load the block parts
    workspace.allocate()
    phases.done("skeleton", f"{len(manifest['parts'])} parts")
    return model
