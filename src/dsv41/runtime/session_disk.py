"""This rank's NVMe tier of sessions: a session entry parked as one file (sessions/files.py) and loaded back into a
resuming sequence's ring slot and pages (docs/SESSIONS.md).

An entry's file holds its ring-slot snapshot (`KVPool.snapshot_slot`) and every page below its length
(`KVPool.page_bytes`: the compressed entries and index keys of every source), each a checksummed block. Each rank
parks and loads its own shards: rank 0 decides (the `Batch` carries the parks and loads), and a load counts only
where every rank read its file whole (`ModelRunner`), else the request prefills from the start on all ranks.

The tag under which files are written and read names everything that changes the bytes: the approximate knobs,
the checkpoint (its folder's files), the model's shape, the pool's layout, the code (a digest of the runtime's and
the model's sources) and the rank among the world: an entry computed under one is never resumed under another.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from ..sessions.files import SessionFiles


def code_digest() -> str:
    """A digest of the sources whose change could change a cached byte (model/, runtime/, kernels/)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.blake2b(digest_size=8)
    for sub in ("model", "runtime", "kernels"):
        for path in sorted((root / sub).rglob("*")):
            if path.suffix in (".py", ".cu", ".cuh", ".h") and path.is_file():
                h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def checkpoint_digest(folder) -> str:
    """The checkpoint's identity: its folder's files by name, size and modification time (not their bytes: a
    ~196 GiB pack is not read at start for this)."""
    h = hashlib.blake2b(digest_size=8)
    if folder is not None and Path(folder).is_dir():
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                st = path.stat()
                h.update(f"{path.relative_to(folder)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


# the pool's size (slots, pages, bytes in all) follows the memory free at start: a restart may size it a page or two
# otherwise, and an entry (its slot's bytes and its pages' bytes) loads into any pool of the same layout
POOL_SIZE_FIELDS = ("slots", "pages", "bytes_total")


def session_tag(*, knobs: str, checkpoint: str, cfg, pool, rank: int, world: int) -> str:
    """What an entry file must match to be resumed here: the approximate settings, the checkpoint, the model's
    shape and the pool's per-entry layout (page tokens, ring rows, slot and token bytes, codecs, sources; not its
    size), the code, the rank."""
    described = {k: v for k, v in pool.describe().items() if k not in POOL_SIZE_FIELDS}
    layout = repr(sorted(described.items())) + repr(sorted(pool.sources.items()))
    shape = hashlib.blake2b(repr(cfg).encode() + layout.encode(), digest_size=8).hexdigest()
    return f"knobs={knobs}|ckpt={checkpoint}|shape={shape}|code={code_digest()}|rank={rank}/{world}"


class SessionDisk:
    def __init__(self, files: SessionFiles, pool):
        self.files, self.pool = files, pool

    def park(self, key: str, ids: list[int], snapshot: torch.Tensor, pages: list[int]) -> bool:
        """Write the entry's file (False: not written; the store logged why)."""
        blocks = [("slot", snapshot.cpu().contiguous().numpy().data)]
        blocks += [(f"page{i}", self.pool.page_bytes(p).cpu().numpy().data) for i, p in enumerate(pages)]
        return self.files.write(key, ids, blocks, {"length": len(ids), "pages": len(pages),
                                                   "page_tokens": self.pool.page_tokens})

    def load(self, key: str, slot: int, pages: list[int]) -> bool:
        """Put the entry's slot and pages into `slot` and `pages` (its first pages); False when the file is gone,
        damaged (the store deleted it) or of another layout."""
        got = self.files.read(key)
        if got is None:
            return False
        ids, blocks, meta = got
        try:
            if meta.get("pages") != len(pages) or meta.get("page_tokens") != self.pool.page_tokens:
                raise ValueError(f"{meta.get('pages')} pages of {meta.get('page_tokens')} tokens, wanted "
                                 f"{len(pages)} of {self.pool.page_tokens}")
            device = self.pool.device
            self.pool.restore_slot(torch.frombuffer(blocks["slot"], dtype=torch.uint8).to(device), slot)
            for i, p in enumerate(pages):
                self.pool.load_page(torch.frombuffer(blocks[f"page{i}"], dtype=torch.uint8).to(device), p)
        except (KeyError, ValueError) as exc:
            self.files.remove(key)
            if self.files.log is not None:
                self.files.log.warning("session entry %s does not fit this pool (%s): dropped", key, exc)
            return False
        return True


def session_disk_for(args, pool, model, *, knobs: str, log=None) -> SessionDisk | None:
    """The NVMe tier of this rank under `--session-dir` (None without it, or with sessions off)."""
    directory = getattr(args, "session_dir", None)
    if not directory or getattr(args, "sessions", "on") == "off":
        return None
    comm = model.comm
    folder = getattr(args, "model", None)
    tag = session_tag(knobs=knobs, checkpoint=checkpoint_digest(folder), cfg=model.cfg, pool=pool,
                      rank=comm.rank, world=comm.world)
    files = SessionFiles(Path(directory) / f"rank{comm.rank}",
                         budget_bytes=int(getattr(args, "session_disk_gib", 64.0) * (1 << 30)),
                         min_tokens=getattr(args, "session_disk_min_tokens", 1024), tag=tag)
    if log is not None:
        s = files.stats()
        log(f"dsv41 engine: session files {os.fspath(Path(directory) / f'rank{comm.rank}')}: {s['entries']} "
            f"entries, {s['bytes'] / (1 << 30):.2f} of {s['budget_bytes'] / (1 << 30):.1f} GiB"
            + (" (off: the directory is not usable)" if s["disabled"] else ""))
    return SessionDisk(files, pool)
