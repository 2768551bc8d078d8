"""The NVMe tier's file store: one file per session entry, written crash-safe, read back verified.

An entry is the token ids it stands for plus named byte blocks (what the bytes mean is the runtime's business; this
module is torch-free). The on-disk format and the reasons behind it: docs/SESSIONS.md, "NVMe tier: the entry file".
One directory belongs to one process (each rank its own): temporary files found at start are taken as left by a
crash and removed.
"""

from __future__ import annotations

import array
import errno
import hashlib
import json
import logging
import os
import secrets
import struct
import sys
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("dsv41.sessions")

MAGIC = b"DSV41SES"
FORMAT_VERSION = 1
# magic, format version, header length, crc32 of (the 16 bytes before it + the header), 4 reserved bytes
PREAMBLE = struct.Struct("<8sIII4x")
ALIGN = 4096  # every block starts on a page boundary: a later O_DIRECT reader needs it, a plain one does not mind
CHAIN_TOKENS = 256  # the ids are keyed per page of 256 tokens (the KV pool's page) by a chain of digests
MAX_HEADER_BYTES = 16 << 20  # a header is a few KiB; a larger length read from a file is damage, not a header
SUFFIX = ".ses"
TEMP_SUFFIX = ".tmp"
START_LOG_LINES = 5  # files dropped at start: this many lines, then one line with the count of the rest

assert array.array("I").itemsize == 4, "token ids are stored as 32-bit unsigned integers"


class Corrupt(Exception):
    """An entry file that cannot be trusted: it is deleted."""


class OtherVersion(Exception):
    """An entry file of another format version (an older or newer build): kept like another tag's, never read."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def ids_array(ids) -> array.array:
    """Token ids as uint32 (an id outside 0..2^32-1 raises OverflowError: a caller's bug, not a disk error)."""
    return array.array("I", ids)


def _little_endian(ids: array.array) -> bytes:
    if sys.byteorder != "little":
        ids = array.array("I", ids)
        ids.byteswap()
    return ids.tobytes()


def page_chain(ids_le: bytes | memoryview, pages: int) -> list[bytes]:
    """d[0] = b"", d[k] = blake2b-128(d[k-1] + the k-th page's ids): d[k] names the first k pages at once, so a
    lookup compares one digest per page length instead of the ids. 128 bits: a collision is out of reach."""
    view, step, chain = memoryview(ids_le), CHAIN_TOKENS * 4, [b""]
    for k in range(pages):
        h = hashlib.blake2b(chain[-1], digest_size=16)
        h.update(view[k * step:(k + 1) * step])
        chain.append(h.digest())
    return chain


def file_name(tag: str, key: str) -> str:
    """Keys and tags are opaque strings: the file is named by a digest of both, so any key is a safe name and two
    tags never share a file."""
    return hashlib.blake2b(f"{tag}\0{key}".encode(), digest_size=16).hexdigest() + SUFFIX


def read_header(f) -> tuple[dict, int]:
    """The header of an entry file open for reading, checked (magic, version, checksum, fields, the file's length);
    and the offset its payload starts at."""
    pre = f.read(PREAMBLE.size)
    if len(pre) < PREAMBLE.size:
        raise Corrupt("shorter than its preamble")
    magic, version, header_len, header_crc = PREAMBLE.unpack(pre)
    if magic != MAGIC:
        raise Corrupt("no entry-file magic")
    if version != FORMAT_VERSION:
        raise OtherVersion(f"format version {version}")
    if header_len > MAX_HEADER_BYTES:
        raise Corrupt(f"header length {header_len} out of range")
    raw = f.read(header_len)
    if len(raw) < header_len:
        raise Corrupt("truncated in its header")
    if zlib.crc32(raw, zlib.crc32(pre[:16])) != header_crc:
        raise Corrupt("header checksum mismatch")
    try:
        header = json.loads(raw)
        pages, rest = divmod(header["length"], CHAIN_TOKENS)
        if not (isinstance(header["key"], str) and isinstance(header["tag"], str) and isinstance(header["meta"], dict)
                and len(header["tail"]) == rest and len(bytes.fromhex(header["chain"])) == (16 if pages else 0)):
            raise ValueError("fields of the wrong type or length")
        table = [header["ids"], *header["blocks"]]
        numbers = [block[field] for block in table for field in ("offset", "bytes", "crc32")]
        if not all(isinstance(n, int) and n >= 0 for n in numbers + [header["payload_bytes"]]) or \
                not all(isinstance(block["name"], str) for block in header["blocks"]):
            raise ValueError("a block table entry of the wrong type")
    except (ValueError, KeyError, TypeError) as e:
        raise Corrupt(f"malformed header ({e})") from None
    start = _align(PREAMBLE.size + header_len)
    size = os.fstat(f.fileno()).st_size
    if size != start + header["payload_bytes"]:
        raise Corrupt(f"{size} bytes long, its header says {start + header['payload_bytes']} (truncated?)")
    return header, start


def _read_block(f, start: int, block: dict, what: str) -> bytearray:
    """One block read straight into its own buffer (no intermediate copies of a large payload) and verified."""
    buf = bytearray(block["bytes"])
    view, got = memoryview(buf), 0
    f.seek(start + block["offset"])
    while got < len(buf):
        n = f.readinto(view[got:])
        if not n:
            raise Corrupt(f"{what} truncated")
        got += n
    if zlib.crc32(buf) != block["crc32"]:
        raise Corrupt(f"{what} checksum mismatch")
    return buf


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while len(view):
        view = view[os.write(fd, view):]  # a write may be partial (and Linux caps one call at ~2 GiB)


def _quiet_unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


@dataclass(slots=True)
class _Entry:
    """What the index keeps of an entry: enough to answer a lookup without touching the file (not every id)."""
    key: str
    path: Path
    nbytes: int
    length: int
    chain: bytes  # digest of the full pages (b"" when there are none)
    tail: tuple[int, ...]  # the ids after the last full page (< CHAIN_TOKENS of them)


class SessionFiles:
    """Session entries parked in one directory, under a byte budget, least recently used evicted first.

    Never raises for the disk's sake: an unusable directory turns the store off, a failed write returns False, a
    damaged or unreadable entry is deleted and read returns None; each kind of failure is logged once."""

    def __init__(self, directory: str | Path, *, budget_bytes: int, min_tokens: int, tag: str, log=None):
        self.directory = Path(directory)
        self.budget_bytes = budget_bytes
        self.min_tokens = min_tokens
        self.tag = tag
        self.log = log or logger
        self._lock = threading.Lock()  # guards the index and counters; file IO runs outside it
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._by_chain: dict[bytes, set[str]] = {}  # chain digest of an entry's full pages -> keys
        self._foreign: dict[Path, int] = {}  # other tags' / versions' files -> bytes, oldest first (evicted first)
        self._writing: set[str] = set()
        self._bytes = 0  # every indexed file plus the writes in flight
        self._logged: set[str] = set()
        self._last_ns = 0
        self.counters = dict(writes=0, write_failures=0, too_large=0, reads=0, read_failures=0, evictions=0, hits=0,
                             read_bytes=0, read_ns=0)
        self.disabled = False
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            probe = self.directory / f".probe-{secrets.token_hex(4)}{TEMP_SUFFIX}"  # can we create files here?
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
            os.unlink(probe)
            self._rebuild()
        except OSError as e:
            self.log.warning("session directory %s is not usable (%s): the NVMe session tier is off", directory, e)
            self.disabled = True
            self._entries.clear()
            self._by_chain.clear()
            self._foreign.clear()
            self._bytes = 0

    # ---- start: the index from the files' headers ----

    def _rebuild(self) -> None:
        found, dropped = [], []
        for item in os.scandir(self.directory):
            path = Path(item.path)
            if item.name.endswith(TEMP_SUFFIX):
                _quiet_unlink(path)
                dropped.append((item.name, "temporary file of an interrupted write"))
                continue
            if not item.name.endswith(SUFFIX) or not item.is_file(follow_symlinks=False):
                continue
            try:
                with open(path, "rb", buffering=0) as f:
                    st = os.fstat(f.fileno())
                    header, _ = read_header(f)
                if item.name != file_name(header["tag"], header["key"]):
                    raise Corrupt("its name is not its key's")
            except OtherVersion:
                found.append((st.st_mtime_ns, path, None, st.st_size))
            except (Corrupt, OSError) as e:
                _quiet_unlink(path)
                dropped.append((item.name, str(e)))
            else:
                found.append((st.st_mtime_ns, path, header, st.st_size))
        for _, path, header, size in sorted(found, key=lambda x: (x[0], x[1].name)):  # mtime = last use
            self._bytes += size
            if header is None or header["tag"] != self.tag:
                self._foreign[path] = size
            else:
                self._index(_Entry(header["key"], path, size, header["length"], bytes.fromhex(header["chain"]),
                                   tuple(header["tail"])))
        with self._lock:
            self._make_room(0)  # a budget lowered since the last run holds from the start
        for name, why in dropped[:START_LOG_LINES]:
            self.log.warning("session file %s removed at start: %s", name, why)
        if len(dropped) > START_LOG_LINES:
            self.log.warning("... and %d more session files removed at start", len(dropped) - START_LOG_LINES)

    def _index(self, entry: _Entry) -> None:
        self._entries[entry.key] = entry
        self._by_chain.setdefault(entry.chain, set()).add(entry.key)

    def _forget(self, key: str) -> _Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes
            keys = self._by_chain[entry.chain]
            keys.discard(key)
            if not keys:
                del self._by_chain[entry.chain]
        return entry

    # ---- write ----

    def write(self, key: str, ids, blocks: list[tuple[str, bytes | memoryview]], meta: dict) -> bool:
        """Park an entry; False when it was not stored (store off, too short, larger than the budget, a write
        error). Blocks are written from the caller's buffers: nothing is copied."""
        if self.disabled or len(ids) < self.min_tokens:
            return False
        ids = ids_array(ids)
        ids_le = _little_endian(ids)
        views = [(name, memoryview(data).cast("B")) for name, data in blocks]
        if len({name for name, _ in views}) != len(views):
            raise ValueError("block names must be distinct")
        pages = len(ids) // CHAIN_TOKENS
        offsets, end = [], 0
        for n in [len(ids_le)] + [v.nbytes for _, v in views]:
            offsets.append(_align(end) if n else end)
            end = offsets[-1] + n
        # crc32 (zlib): ~4 GB/s a core where SHA-256 does 1.8, so verifying keeps up with the NVMe (6-9 GB/s) on
        # two threads; it guards against torn writes, truncation and media damage (every burst up to 32 bits, a random
        # corruption passes with 2^-32), not against someone who can write the service's 0700 directory.
        header = {"key": key, "tag": self.tag, "length": len(ids), "chain": page_chain(ids_le, pages)[-1].hex(),
                  "tail": ids[pages * CHAIN_TOKENS:].tolist(), "meta": meta,
                  "ids": {"offset": offsets[0], "bytes": len(ids_le), "crc32": zlib.crc32(ids_le)},
                  "blocks": [{"name": name, "offset": off, "bytes": v.nbytes, "crc32": zlib.crc32(v)}
                             for (name, v), off in zip(views, offsets[1:])],
                  "payload_bytes": end}
        raw = json.dumps(header, separators=(",", ":")).encode()
        pre = PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(raw), 0)[:16]
        head = PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(raw), zlib.crc32(raw, zlib.crc32(pre))) + raw
        start = _align(len(head))
        total = start + end
        with self._lock:
            if total > self.budget_bytes:
                self.counters["too_large"] += 1
                self._warn_once("too large", "session entry of %d bytes not parked: larger than the whole budget "
                                "(%d bytes); logged once", total, self.budget_bytes)
                return False
            if key in self._writing:
                return False  # the same entry is being written by another thread
            self._remove_locked(key)  # a rewrite replaces the old file
            if not self._make_room(total):
                self.counters["write_failures"] += 1
                return False
            self._writing.add(key)
            self._bytes += total  # reserved while writing
        path = self.directory / file_name(self.tag, key)
        ok = False
        try:
            ok = self._write_file(path, head, [start + off for off in offsets], [ids_le] + [v for _, v in views])
        finally:
            with self._lock:
                self._writing.discard(key)
                if not ok:
                    self._bytes -= total  # the reservation goes back
                else:
                    self._index(_Entry(key, path, total, len(ids), bytes.fromhex(header["chain"]),
                                       tuple(header["tail"])))
                self.counters["writes" if ok else "write_failures"] += 1
        return ok

    def _write_file(self, path: Path, head: bytes, offsets: list[int], pieces: list) -> bool:
        """Temporary name, fsync, rename, fsync the directory: after a crash the final name holds a whole entry
        or nothing, and a leftover temporary file is removed at the next start."""
        tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        fd, renamed = -1, False
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            _write_all(fd, head)
            pos = len(head)
            for off, piece in zip(offsets, pieces):
                _write_all(fd, bytes(off - pos))  # alignment padding, < 4 KiB
                _write_all(fd, piece)
                pos = off + len(piece)
            os.utime(fd, ns=(self._now_ns(),) * 2)  # mtime = last use, so LRU order survives a restart
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, path)
            renamed = True
            self._fsync_directory()
            return True
        except OSError as e:
            self._warn_once(f"write {errno.errorcode.get(e.errno, e.errno)}", "session entry not parked in %s: %s "
                            "(this kind of write error is logged once, counted in write_failures)", self.directory, e)
            if renamed:
                _quiet_unlink(path)
            return False
        finally:
            if fd >= 0:
                os.close(fd)
            if not renamed:
                _quiet_unlink(tmp)

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)  # the rename itself is durable only once the directory is
        finally:
            os.close(fd)

    def _make_room(self, nbytes: int) -> bool:
        """Evict until nbytes more fit: other tags' files first (never usable here), then least recently used."""
        while self._bytes + nbytes > self.budget_bytes:
            if self._foreign:
                path = next(iter(self._foreign))
                self._bytes -= self._foreign.pop(path)
            elif self._entries:
                path = self._forget(next(iter(self._entries))).path
            else:
                return False  # only writes in flight hold the budget
            self.counters["evictions"] += 1
            self._unlink(path, "evict")
        return True

    def _unlink(self, path: Path, what: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._warn_once(f"{what} {errno.errorcode.get(e.errno, e.errno)}", "session file %s not removed (%s); "
                            "logged once", path, e)

    # ---- read and lookup ----

    def read(self, key: str) -> tuple[list[int], dict[str, bytearray], dict] | None:
        """The entry's ids, blocks (each in its own bytearray, e.g. for torch.frombuffer) and meta, every byte
        verified; None when absent or damaged (then the file is deleted). Marks the entry recently used."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            return None
        began = time.perf_counter_ns()
        try:
            with open(entry.path, "rb", buffering=0) as f:
                header, start = read_header(f)
                if header["key"] != key or header["tag"] != self.tag:
                    raise Corrupt("holds another entry")
                ids = array.array("I", _read_block(f, start, header["ids"], "ids"))
                if sys.byteorder != "little":
                    ids.byteswap()
                pages = len(ids) // CHAIN_TOKENS
                if (len(ids) != entry.length or tuple(ids[pages * CHAIN_TOKENS:]) != entry.tail
                        or page_chain(_little_endian(ids), pages)[-1] != entry.chain):
                    raise Corrupt("ids disagree with the index")
                blocks = {b["name"]: _read_block(f, start, b, f"block {b['name']!r}") for b in header["blocks"]}
        except FileNotFoundError:
            with self._lock:  # evicted or removed while we looked: a miss, not damage
                if self._entries.get(key) is entry:
                    self._forget(key)
            return None
        except (Corrupt, OSError) as e:
            self.log.warning("session entry %s dropped: %s", entry.path.name, e)
            with self._lock:
                self.counters["read_failures"] += 1
                if self._entries.get(key) is entry:
                    self._forget(key)
            self._unlink(entry.path, "drop")
            return None
        with self._lock:
            self.counters["reads"] += 1
            self.counters["read_bytes"] += sum(len(b) for b in blocks.values()) + 4 * len(ids)
            self.counters["read_ns"] += time.perf_counter_ns() - began  # read and verified (the checksums)
            if self._entries.get(key) is entry:
                self._entries.move_to_end(key)
        try:
            os.utime(entry.path, ns=(self._now_ns(),) * 2)
        except OSError:
            pass  # the order after a restart is a hint; a read that worked stays a read that worked
        return ids.tolist(), blocks, header["meta"]

    def longest_prefix(self, prompt, max_len: int) -> str | None:
        """The key of the longest entry whose ids are a prefix of prompt, at most max_len of them. Costs one
        hashing pass over the prompt's pages (~1 ms per 100K tokens) and one dict lookup per page, whatever the
        number of entries: the longest matching full-page chain wins, then the longest tail that matches."""
        limit = min(len(prompt), max_len)
        if self.disabled or limit <= 0 or not self._entries:
            return None
        head = prompt[:limit]
        chain = page_chain(_little_endian(ids_array(head)), limit // CHAIN_TOKENS)
        with self._lock:
            for pages in range(len(chain) - 1, -1, -1):
                at, best = pages * CHAIN_TOKENS, None
                for key in self._by_chain.get(chain[pages], ()):
                    tail = self._entries[key].tail
                    if (best is None or len(tail) > len(best[1])) and at + len(tail) <= limit \
                            and tuple(head[at:at + len(tail)]) == tail:
                        best = (key, tail)
                if best is not None:  # any entry ending in a later page would be longer than every one here
                    self.counters["hits"] += 1
                    return best[0]
        return None

    # ---- the rest ----

    def remove(self, key: str) -> None:
        with self._lock:
            self._remove_locked(key)

    def _remove_locked(self, key: str) -> None:
        entry = self._forget(key)
        if entry is not None:
            self._unlink(entry.path, "remove")

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def length(self, key: str) -> int | None:
        """How many ids the entry `key` holds (None when there is no such entry)."""
        entry = self._entries.get(key)
        return None if entry is None else entry.length

    def keys(self) -> list[str]:
        """This tag's keys, least recently used first (e.g. for the ranks to agree on the entries all of them hold)."""
        with self._lock:
            return list(self._entries)

    def stats(self) -> dict:
        with self._lock:
            return dict(entries=len(self._entries), bytes=self._bytes, budget_bytes=self.budget_bytes,
                        foreign_files=len(self._foreign), disabled=self.disabled, **self.counters)

    def _warn_once(self, kind: str, message: str, *args) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            self.log.warning(message, *args)

    def _now_ns(self) -> int:
        """Strictly increasing: file times from the coarse kernel clock would tie between quick writes."""
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        return self._last_ns
