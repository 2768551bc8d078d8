"""Engram rows from a packed shard file on local NVMe, around the page cache (RECIPE.md §2.9).

A step's rows are known as soon as its tokens are, so reading is split in two: `ShardRows.submit(rows)` plans and
starts the reads, `PendingRead.wait(device)` collects them right before the Engram layer needs them.

The plan: the requested rows, sorted and made unique, become sector-aligned byte extents of the file; extents
closer than `merge_gap` bytes are read as one (a hole of a few KiB costs less than another request). Each extent
is one `pread` with O_DIRECT (no page cache: on GB10 it would be the GPU's memory) into an aligned host buffer,
on a thread pool that lives as long as the process (`os.preadv` releases the GIL, so the reads run in parallel
and the queue depth is the pool's size). `wait_bytes` copies each requested row's bytes out of the buffer, in the
requested order; `wait` sends them from pinned memory with a non-blocking copy and dequantises them there.

Where a filesystem refuses O_DIRECT (tmpfs) the file is read through the page cache and the pages read are
dropped again (`posix_fadvise DONTNEED`). Every I/O failure names the file, the offset and the length.
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dsv41.errors import CheckpointError

from .shards import SHARD_HEADER_BYTES, RowBytes

SECTOR_SIZES = (512, 4096)  # O_DIRECT alignments tried at open, smallest first
MERGE_GAP = 4096  # holes up to this many bytes are read rather than split into two requests
MAX_EXTENT = 256 * 1024  # longer runs are split, so a dense prompt chunk still spreads over the threads
DEFAULT_THREADS = 32  # the recipe's prefill pool size; also the queue depth a decode step can reach
_FREE_BUFFERS = 4  # read buffers kept for reuse per file


class ReadPool:
    """The persistent thread pool shared by the shard readers of a process."""

    def __init__(self, threads: int = DEFAULT_THREADS):
        self.threads = threads
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="engram-read")

    def close(self) -> None:
        self.executor.shutdown(wait=True)


_default_pool: ReadPool | None = None
_default_lock = threading.Lock()


def default_pool() -> ReadPool:
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            _default_pool = ReadPool()
        return _default_pool


@dataclass(frozen=True)
class ReadPlan:
    """Where `rows` (sorted, unique, local to the file) are read from and land: extent `i` is file bytes
    `[starts[i], starts[i] + lengths[i])` into buffer bytes from `buf_starts[i]`; row `j` sits at
    `row_pos[j]` of the buffer."""

    starts: np.ndarray
    lengths: np.ndarray
    buf_starts: np.ndarray
    row_pos: np.ndarray
    total: int


def plan_reads(rows: np.ndarray, row_bytes: int, align: int, merge_gap: int = MERGE_GAP,
               max_extent: int = MAX_EXTENT, data_offset: int = SHARD_HEADER_BYTES) -> ReadPlan:
    """Sector-aligned extents for sorted unique local `rows`, merged across holes of up to `merge_gap` bytes and
    split where a run grows past `max_extent` bytes."""
    rows = np.asarray(rows, dtype=np.int64)
    first = data_offset + rows * row_bytes
    a = first // align * align
    b = -(-(first + row_bytes) // align) * align
    if rows.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return ReadPlan(empty, empty, empty, empty, 0)
    new = np.ones(rows.size, dtype=bool)
    new[1:] = a[1:] > b[:-1] + merge_gap
    run = np.cumsum(new) - 1
    run_start = a[new][run]
    # split long runs by their rows' distance from the run start; a run's pieces may share a boundary sector
    piece = (a - run_start) // max_extent
    new[1:] |= (run[1:] == run[:-1]) & (piece[1:] != piece[:-1])
    ext = np.cumsum(new) - 1
    heads = np.flatnonzero(new)
    starts = a[heads]
    ends = np.maximum.reduceat(b, heads)
    lengths = ends - starts
    buf_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    row_pos = buf_starts[ext] + (first - starts[ext])
    return ReadPlan(starts, lengths, buf_starts, row_pos, int(lengths.sum()))


class ShardRows:
    """The rows of one shard file, read on demand: local row `r` is file bytes
    `SHARD_HEADER_BYTES + r·row_bytes` onwards. The caller has validated the header (`shards.check_shard_file`)."""

    def __init__(self, path: str | Path, n_rows: int, row_bytes: int, head_dim: int, pool: ReadPool | None = None,
                 direct: bool = True, merge_gap: int = MERGE_GAP, max_extent: int = MAX_EXTENT):
        self.path = Path(path)
        self.n_rows, self.row_bytes, self.head_dim = n_rows, row_bytes, head_dim
        self.pool = pool or default_pool()
        self.merge_gap, self.max_extent = merge_gap, max_extent
        self.size = SHARD_HEADER_BYTES + n_rows * row_bytes
        self.fd, self.align, self.direct = self._open(direct)
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def _open(self, direct: bool) -> tuple[int, int, bool]:
        """(fd, alignment, O_DIRECT?): the smallest sector size O_DIRECT accepts, else buffered."""
        flag = getattr(os, "O_DIRECT", 0)
        if direct and flag:
            try:
                fd = os.open(self.path, os.O_RDONLY | flag)
            except OSError:
                fd = None  # the filesystem refuses O_DIRECT at open (tmpfs before Linux 6.6)
            if fd is not None:
                probe = mmap.mmap(-1, max(SECTOR_SIZES))
                for align in SECTOR_SIZES:
                    try:
                        os.preadv(fd, [memoryview(probe)[:align]], 0)
                        probe.close()
                        return fd, align, True
                    except OSError:
                        continue
                probe.close()
                os.close(fd)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot open Engram shard ({exc.strerror})") from None
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd, 1, False

    def close(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()

    # --- reads --------------------------------------------------------------------------------------------------
    def submit(self, rows: np.ndarray) -> "PendingRead":
        """Start reading local `rows` (any order, repeats allowed, each in `[0, n_rows)`); returns at once."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        unique, inverse = np.unique(rows, return_inverse=True)
        plan = plan_reads(unique, self.row_bytes, self.align, self.merge_gap, self.max_extent)
        buf = self._take_buffer(plan.total)
        extents = list(zip(plan.starts.tolist(), plan.lengths.tolist(), plan.buf_starts.tolist()))
        per_task = max(1, -(-len(extents) // (2 * self.pool.threads)))
        futures = [self.pool.executor.submit(self._read_extents, buf, extents[i:i + per_task])
                   for i in range(0, len(extents), per_task)]
        return PendingRead(self, futures, buf, plan, inverse)

    def _read_extents(self, buf: mmap.mmap, extents: list[tuple[int, int, int]]) -> None:
        view, fd, size = memoryview(buf), self.fd, self.size
        for start, length, at in extents:
            need = min(start + length, size) - start  # the last sector may run past the end of the file
            try:
                got = os.preadv(fd, [view[at:at + length]], start)
            except OSError as exc:
                raise CheckpointError(f"{self.path}: read of {length} bytes at offset {start} failed "
                                      f"({exc.strerror})") from None
            if got < need:
                raise CheckpointError(f"{self.path}: short read at offset {start}: {got} of {need} bytes "
                                      f"(file {os.fstat(fd).st_size} bytes, expected {size})")
            if not self.direct:
                os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)

    def _take_buffer(self, nbytes: int) -> mmap.mmap:
        """A page-aligned buffer of at least `nbytes` (O_DIRECT needs aligned memory), reused across steps."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= nbytes:
                    return self._free.pop(i)
        return mmap.mmap(-1, max(mmap.PAGESIZE, -(-nbytes // (1 << 20)) * (1 << 20)))

    def _give_buffer(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > _FREE_BUFFERS:
                self._free.sort(key=len)
                self._free.pop(0)  # closed when the last view of it goes


class PendingRead:
    """Reads in flight for one `submit`; `wait(device)` gives float32 `[n, head_dim]` in the requested order."""

    def __init__(self, rows: ShardRows, futures: list[Future], buf: mmap.mmap, plan: ReadPlan,
                 inverse: np.ndarray):
        self._rows, self._futures, self._buf, self._plan, self._inverse = rows, futures, buf, plan, inverse
        self._done = False

    def wait_io(self) -> None:
        """Block until every read has finished; the first failure is raised (naming file and offset)."""
        for future in self._futures:
            exc = future.exception()
            if exc is not None:
                raise exc  # the buffer is dropped, not reused: the failed frame may still reference it

    def wait_bytes(self) -> RowBytes:
        """The rows' stored bytes `[n, row_bytes]` in the requested order (once per read)."""
        if self._done:
            raise RuntimeError("PendingRead.wait called twice")
        self._done = True
        src, rb = self._rows, self._rows.row_bytes
        self.wait_io()  # every read has finished before the buffer is touched
        host = np.empty((self._inverse.size, rb), dtype=np.uint8)
        if host.size:  # each row's bytes out of the read buffer: a sliding-window view, rows picked by offset
            window = np.lib.stride_tricks.sliding_window_view(
                np.frombuffer(self._buf, dtype=np.uint8, count=self._plan.total), rb)
            host[:] = window[self._plan.row_pos[self._inverse]]  # numpy: no intra-op threads to wake on a busy host
            del window
        src._give_buffer(self._buf)
        self._buf = None
        return RowBytes(host, "fp8", src.head_dim)

    def wait(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """float32 `[n, head_dim]` on `device` (`RowBytes.decode`: pinned memory, a non-blocking copy, the
        dequantisation there)."""
        return self.wait_bytes().decode(device)
