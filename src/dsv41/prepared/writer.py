"""`dsv41 prepare`: write one rank's built FastModel as a prepared folder, resumably; `--check` re-verifies one.

The model is built by the serving builder itself (`runtime.build.build_fast_model`, through its `sink=` seam) on the
device it will serve on, so the folder holds exactly what a start from the checkpoint would place there (and the
launch records resolved for that GPU). Each block is stored as soon as it is built, as one skeleton part after its
tensors; the manifest is rewritten (atomically, after an fsync of data.bin) at the end of every part, so an
interrupted prepare keeps every finished part: the next run re-hashes them, truncates what follows the last good
one, and neither reads nor builds the kept blocks again.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from dsv41.errors import DSV41Error

from . import manifest as mf
from .skeleton import BlockRef, Storages, dump_part

# the modules that decide what the builder stores (names, slices, stacking), besides the skeleton's classes: a change
# in any of them refuses folders written before it
BUILD_MODULES = ("dsv41.runtime.build", "dsv41.runtime.synthetic", "dsv41.model.loader", "dsv41.weights.linear",
                 "dsv41.weights.exl3", "dsv41.weights.safetensors_io")
COPY_CHUNK = 256 << 20  # device -> host copies of a large storage, a piece at a time
HASH_CHUNK = 64 << 20


def build_settings(device: torch.device, dtype: torch.dtype, fake_quant: bool) -> dict:
    """The settings a built model depends on besides its source and rank."""
    return {"dtype": str(dtype).removeprefix("torch."), "fake_quant": bool(fake_quant),
            **mf.launch_environment(torch.device(device))}


def _u8(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _host_pieces(storage: torch.UntypedStorage):
    """The storage's bytes as host memoryviews, COPY_CHUNK at a time."""
    flat = _u8(storage)
    if storage.device.type == "cpu":
        yield memoryview(flat.numpy())
        return
    for at in range(0, flat.numel(), COPY_CHUNK):
        yield memoryview(flat[at:at + COPY_CHUNK].cpu().numpy())


def hash_range(handle, offset: int, nbytes: int) -> str:
    digest = hashlib.sha256()
    handle.seek(offset)
    left = nbytes
    while left:
        chunk = handle.read(min(left, HASH_CHUNK))
        if not chunk:
            break
        digest.update(chunk)
        left -= len(chunk)
    return digest.hexdigest()


class FolderWriter:
    """Appends parts to one rank's folder and keeps its manifest current (the build's `BlockSink`)."""

    def __init__(self, folder: Path, header: dict, log: Callable[[str], None], bar=None):
        self.folder, self.header, self.log, self.bar = folder, header, log, bar
        self.entries: list[dict] = []
        self.parts: list[dict] = []
        self.kept: set[str] = set()
        self.modules: dict[str, str] = mf.module_digests(BUILD_MODULES)
        self.storages = Storages()
        self.workspace_numel = 0

    # ------------------------------------------------------------------ resume
    def open(self) -> None:
        """Keep the verified parts of an interrupted run with the same header; otherwise start afresh."""
        self.folder.mkdir(parents=True, exist_ok=True)
        data = self.folder / mf.DATA
        try:
            old = mf.read_manifest(self.folder)
        except mf.PreparedMismatch:
            old = None
        # resume only an unfinished run of the same preparation (a finished folder got here because it does not fit)
        same = old is not None and not old.get("complete") and all(old.get(k) == v for k, v in self.header.items())
        code = old.get("code", {}) if old else {}
        if same:
            same = code.get("torch") == torch.__version__ and mf.module_digests(code.get("modules", {})) == \
                code.get("modules", {})
        if old is not None and not same:
            self.log(f"prepare: {self.folder} holds another preparation: starting afresh")
        if same and data.is_file():
            self._keep_verified(old, data)
        with open(data, "ab") as handle:
            handle.truncate(self._end())
        self.storages.count = len(self.entries)
        self._journal()

    def _keep_verified(self, old: dict, data: Path) -> None:
        entries = old.get("entries", [])
        with open(data, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            for part in old.get("parts", []):
                lo, hi = part["entries"]
                mine = entries[lo:hi]
                if lo != len(self.entries) or any(e["offset"] + e["nbytes"] > size or
                                                  hash_range(handle, e["offset"], e["nbytes"]) != e["sha256"]
                                                  for e in mine):
                    break
                self.entries.extend(mine)
                self.parts.append(part)
                self.kept.add(part["name"])
                self.workspace_numel = max(self.workspace_numel, part.get("workspace_numel", 0))
                self.modules.update(part.get("modules", {}))
        if self.kept:
            self.log(f"prepare: resuming {self.folder}: {len(self.kept)} part(s) already written and verified")

    def _end(self) -> int:
        if not self.entries:
            return 0
        last = self.entries[-1]
        return last["offset"] + last["nbytes"]

    # ------------------------------------------------------------------ the build's sink
    def skip(self, index: int) -> BlockRef | None:
        if f"block.{index}" in self.kept:
            if self.bar is not None:
                self.bar.update(1)
            return BlockRef(index)
        return None

    def built(self, index: int, block) -> BlockRef:
        self.write_part(f"block.{index}", block)
        return BlockRef(index)

    # ------------------------------------------------------------------ writing
    def write_part(self, name: str, obj) -> None:
        skeleton, pickler = dump_part(obj, name, self.storages)
        lo = len(self.entries)
        data = self.folder / mf.DATA
        with open(data, "r+b") as handle:
            at = self._end()
            for pending in self.storages.take_pending():
                storage = pending.pop("storage")
                at = self._append(handle, at, {**pending, "part": name, "kind": "tensor"}, _host_pieces(storage))
            self._append(handle, at, {"index": len(self.entries), "name": f"{name}.skeleton", "part": name,
                                      "kind": "skeleton", "device": "cpu", "dtype": "uint8",
                                      "shape": [len(skeleton)]}, [memoryview(skeleton)])
            self.storages.count = len(self.entries)  # the skeleton took the next index
            handle.flush()
            os.fsync(handle.fileno())
        digests = mf.module_digests(pickler.modules)
        self.modules.update(digests)
        self.workspace_numel = max(self.workspace_numel, pickler.workspace_numel)
        self.parts.append({"name": name, "entries": [lo, len(self.entries)], "skeleton": len(self.entries) - 1,
                           "workspace_numel": pickler.workspace_numel, "modules": digests})
        self._journal()
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"{self._end() / 2**30:.2f} GiB")

    def _append(self, handle, at: int, entry: dict, pieces) -> int:
        offset = -(-at // mf.ALIGN) * mf.ALIGN
        handle.seek(offset)
        digest, nbytes = hashlib.sha256(), 0
        for piece in pieces:
            handle.write(piece)
            digest.update(piece)
            nbytes += piece.nbytes
        if entry["index"] != len(self.entries):
            raise AssertionError(f"entry {entry['index']} written as the {len(self.entries)}th")
        self.entries.append({**entry, "offset": offset, "nbytes": nbytes, "sha256": digest.hexdigest()})
        return offset + nbytes

    def _manifest(self, complete: bool, **extra) -> dict:
        return {"format": mf.FORMAT, **self.header, "complete": complete,
                "code": {"torch": torch.__version__, "modules": dict(sorted(self.modules.items()))},
                "data": {"file": mf.DATA, "bytes": self._end(), "align": mf.ALIGN},
                "workspace_numel": self.workspace_numel, "parts": self.parts, "entries": self.entries, **extra}

    def _journal(self) -> None:
        mf.write_manifest(self.folder, self._manifest(False))

    def finish(self, **extra) -> dict:
        manifest = self._manifest(True, **extra)
        mf.write_manifest(self.folder, manifest)
        return manifest

    def write_model(self, model) -> None:
        """A model already built (a synthetic rank): each block as its own part, then the model part."""
        blocks = model.blocks
        try:
            model.blocks = []
            for block in blocks:
                if f"block.{block.index}" not in self.kept:
                    self.write_part(f"block.{block.index}", block)
                model.blocks.append(BlockRef(block.index))
            self.write_part("model", model)
        finally:
            model.blocks = blocks


def check_room(folder: Path, need: int) -> None:
    """Refuse before building when the folder's filesystem cannot take `need` more bytes (+2%)."""
    probe = folder
    while not probe.exists():
        probe = probe.parent
    data = folder / mf.DATA
    free = shutil.disk_usage(probe).free + (data.stat().st_size if data.exists() else 0)  # it is rewritten
    if need * 1.02 > free:
        raise DSV41Error(f"{folder}: about {need / 2**30:.1f} GiB to write, only {free / 2**30:.1f} GiB free there "
                         f"(choose --out on a larger disk)")


def _bar(total: int, what: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=what, unit=" part", file=sys.stderr, disable=not sys.stderr.isatty())


def _header(source: dict, world: int, rank: int, build: dict) -> dict:
    return {"layout_version": mf.LAYOUT_VERSION, "tp": {"world": world, "rank": rank}, "build": build,
            "source": source}


def _already(folder: Path, header: dict, log) -> dict | None:
    try:
        old = mf.read_manifest(folder)
    except mf.PreparedMismatch:
        return None
    reason = mf.mismatch(old, source=header["source"], world=header["tp"]["world"], rank=header["tp"]["rank"],
                         build=header["build"])
    if reason is None:
        log(f"prepare: {folder} is already prepared ({len(old['entries'])} entries, "
            f"{old['data']['bytes'] / 2**30:.2f} GiB); `dsv41 prepare --check` re-verifies it")
        return old
    return None


def prepare(model_dir: str | Path, out: str | Path, *, rank: int = 0, world: int = 1, device="cpu",
            dtype: torch.dtype = torch.float32, fake_quant: bool = True, engram_dir: str | Path | None = None,
            comm=None, log: Callable[[str], None] | None = None, force: bool = False) -> Path:
    """Prepare rank `rank` of TP `world` from the checkpoint `model_dir` into `out` (its `rank{R}-of-{W}` folder
    unless `out` is itself a prepared folder). Returns the folder."""
    from dsv41.config import ModelConfig
    from dsv41.runtime.build import build_fast_model

    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    model_dir, device = Path(model_dir), torch.device(device)
    folder = mf.rank_folder(out, rank, world)
    header = _header(mf.source_identity(model_dir), world, rank, build_settings(device, dtype, fake_quant))
    if not force and _already(folder, header, log):
        return folder
    if force and folder.exists():
        shutil.rmtree(folder)
    shards = sum(size for size, *_ in header["source"]["shards"].values())
    check_room(folder, shards // world)  # a rank holds about its share of the checkpoint
    start = time.perf_counter()
    layers = ModelConfig.from_file(model_dir).num_hidden_layers
    bar = _bar(layers + 1, f"prepare rank {rank}/{world}")
    writer = FolderWriter(folder, header, log, bar)
    writer.open()
    # the DSpark drafter whenever the checkpoint has it (it rides in the model part): a start that does not draft
    # drops it (prepared/start.py), one that does finds it here instead of drafting nothing
    model = build_fast_model(model_dir, device=device, dtype=dtype, rank=rank, world=world, comm=comm,
                             fake_quant=fake_quant, engram_dir=engram_dir, sink=writer, dspark=None)
    writer.write_part("model", model)
    del model
    bar.close()
    hashes = mf.shard_hashes(model_dir)
    manifest = writer.finish(source_files_sha256=hashes)
    log(f"prepare: wrote {folder} ({len(manifest['entries'])} entries, {manifest['data']['bytes'] / 2**30:.2f} GiB) "
        f"in {time.perf_counter() - start:.1f} s")
    return folder


def prepare_model(model, out: str | Path, source: dict, *, rank: int, world: int,
                  log: Callable[[str], None] | None = None) -> Path:
    """Prepare an already built FastModel (the synthetic rank of bench/start.py) described by `source`."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    folder = mf.rank_folder(out, rank, world)
    header = _header(source, world, rank, build_settings(model.device, model.dtype, model.fake_quant))
    if _already(folder, header, log):
        return folder
    check_room(folder, model.stored_bytes())
    bar = _bar(len(model.blocks) + 1, f"prepare rank {rank}/{world}")
    writer = FolderWriter(folder, header, log, bar)
    writer.open()
    writer.write_model(model)
    bar.close()
    writer.finish()
    return folder


def check_folder(folder: str | Path, progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Every entry of data.bin re-hashed against the manifest: the problems, one line each ([] = sound)."""
    folder = Path(folder)
    manifest = mf.read_manifest(folder)
    problems = []
    if not manifest.get("complete"):
        problems.append(f"{folder}: incomplete (prepare was interrupted): run `dsv41 prepare` again")
    data = folder / mf.DATA
    try:
        size = data.stat().st_size
    except OSError:
        return problems + [f"{folder}: {mf.DATA} is missing"]
    want = manifest.get("data", {}).get("bytes")
    if size != want:
        problems.append(f"{data}: {size} bytes, the manifest says {want}")
    entries = manifest.get("entries", [])
    total = sum(e["nbytes"] for e in entries)
    done = 0
    with open(data, "rb") as handle:
        for e in entries:
            if e["offset"] + e["nbytes"] > size or hash_range(handle, e["offset"], e["nbytes"]) != e["sha256"]:
                problems.append(f"{data}: entry {e['name']} (offset {e['offset']}, {e['nbytes']} bytes) is damaged "
                                f"(sha256 differs)")
            done += e["nbytes"]
            if progress:
                progress(done, total)
    return problems
