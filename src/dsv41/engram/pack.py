"""`dsv41 engram pack`: copy one rank's rows of the original checkpoint's Engram tables into its shard files
(EXL3-ENGRAM.md §5.3-5.5).

A table's weight `[N, 256]` and scale `[N, 8]` are two tensors ~98 GB apart in one source shard; the shard file
puts each row's 256 value bytes and 8 scale bytes side by side (one read per row at serving time). Bytes are
copied verbatim, chunk by chunk:

- memory stays bounded: one set of source buffers and two output buffers of `chunk_rows` rows (~104 MiB at the
  default), whatever the table size; the peak resident set is sampled after every chunk and reported;
- the page cache is dropped behind both sides (`posix_fadvise DONTNEED` after each read, and after each write
  once `fdatasync` has made the pages clean): on GB10 the page cache is the GPU's memory;
- reading the next chunk overlaps writing the last one (a writer thread);
- a restart continues where the last run stopped: after every chunk is on disk, `<file>.partial.json` records
  how many rows `<file>.partial` holds; a new run checks that the record describes the same job (layer, rows,
  source file, size, mtime, offsets), cuts the partial file back to that length and goes on. The result is the
  same file byte for byte, however often the packer was killed;
- the finished file is renamed into place atomically (`os.replace`, then the folder is synced), so a shard file
  under its final name is always complete.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dsv41.errors import CheckpointError

from .shards import (SHARD_HEADER_BYTES, expected_shard_header, read_shard_header, shard_file_bytes, shard_file_name,
                     shard_header)
from .source import OriginalCheckpoint, TableSpan

CHUNK_ROWS = 1 << 17  # 33 MiB of output a chunk
STATE_SUFFIX = ".partial.json"
PARTIAL_SUFFIX = ".partial"


@dataclass
class PackReport:
    """What one `pack_rank` run did (the CLI prints it; tests and the bench read it)."""

    files: list[Path] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)  # already complete before this run
    resumed_rows: int = 0  # rows found on disk from an earlier run
    bytes_written: int = 0
    seconds: float = 0.0
    buffer_bytes: int = 0
    start_rss: int = 0
    peak_rss: int = 0  # the largest resident set sampled during the run

    @property
    def rate(self) -> float:
        return self.bytes_written / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        mib = 2 ** 20
        return (f"wrote {self.bytes_written / mib:.1f} MiB in {self.seconds:.1f} s ({self.rate / mib:.1f} MiB/s); "
                f"{len(self.files)} file(s) done, {len(self.skipped)} already complete, {self.resumed_rows} rows "
                f"resumed; peak RSS {self.peak_rss / mib:.0f} MiB ({(self.peak_rss - self.start_rss) / mib:+.0f} "
                f"MiB during the pack; buffers {self.buffer_bytes / mib:.0f} MiB; process high-water mark "
                f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pack_rank(src: str | Path | OriginalCheckpoint, out_dir: str | Path, rank: int, world: int,
              layers: list[int] | None = None, chunk_rows: int = CHUNK_ROWS, max_rate: float | None = None,
              progress: bool | None = None) -> PackReport:
    """Write `engram-l{L}-r{rank}of{world}.bin` for every Engram layer (or `layers`) into `out_dir`.

    `max_rate` (bytes/s) paces the copy (to pack beside a running server); `progress`: a tqdm bar with rate and
    ETA on stderr (None: only when stderr is a terminal).
    """
    src = src if isinstance(src, OriginalCheckpoint) else OriginalCheckpoint(src)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    c = src.constants
    layers = list(c.layer_ids if layers is None else layers)
    if not 0 <= rank < world:
        raise CheckpointError(f"rank {rank} is outside a tensor-parallel world of {world}")
    if chunk_rows < 1:
        raise CheckpointError(f"chunk rows must be positive, got {chunk_rows}")
    jobs = []
    for layer_id in layers:
        span = src.span(layer_id)
        header = expected_shard_header(layer_id, c, rank, world)
        if span.row_bytes != header["row bytes"]:
            raise CheckpointError(f"{span.file}: layer {layer_id} rows are {span.row_bytes} bytes, the config "
                                  f"gives {header['row bytes']}")
        jobs.append(_LayerJob(span, header, out_dir / shard_file_name(layer_id, rank, world)))

    report = PackReport(start_rss=rss_bytes())
    report.peak_rss = report.start_rss
    todo = [job for job in jobs if not job.complete(report)]
    done_rows = {id(job): job.resume_rows() for job in todo}
    need = sum(job.file_bytes - SHARD_HEADER_BYTES - done_rows[id(job)] * job.row_bytes for job in todo)
    free = _free_bytes(out_dir)
    if need > free:
        raise CheckpointError(f"{out_dir}: {need / 2**30:.2f} GiB still to write, {free / 2**30:.2f} GiB free")
    total = sum(job.data_bytes for job in todo)
    initial = sum(done_rows[id(job)] * job.row_bytes for job in todo)
    start = time.monotonic()
    with tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024, smoothing=0.1,
              desc=f"engram r{rank}of{world}", disable=None if progress is None else not progress) as bar:
        pace = _Pace(max_rate)
        for job in todo:
            job.run(done_rows[id(job)], chunk_rows, bar, pace, report)
    report.seconds = time.monotonic() - start
    return report


def _free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


class _Pace:
    """Sleeps so that at most `rate` bytes/s are copied (None: no limit)."""

    def __init__(self, rate: float | None):
        self.rate, self.start, self.bytes = rate, time.monotonic(), 0

    def add(self, nbytes: int) -> None:
        self.bytes += nbytes
        if self.rate:
            ahead = self.start + self.bytes / self.rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)


class _LayerJob:
    """One output file: `span` (the source table) rows `[lo, hi)` into `path`."""

    def __init__(self, span: TableSpan, header: dict, path: Path):
        self.span, self.header, self.path = span, header, path
        self.lo, self.hi, self.row_bytes = header["lo"], header["hi"], header["row bytes"]
        self.rows = self.hi - self.lo
        self.file_bytes = shard_file_bytes(self.lo, self.hi, self.row_bytes)
        self.data_bytes = self.rows * self.row_bytes
        self.partial = path.with_name(path.name + PARTIAL_SUFFIX)
        self.state_path = path.with_name(path.name + STATE_SUFFIX)
        st = span.file.stat()
        self.identity = {**header, "source": str(span.file.resolve()), "source bytes": st.st_size,
                         "source mtime_ns": st.st_mtime_ns, "weight offset": span.weight_offset,
                         "scale offset": span.scale_offset}

    def complete(self, report: PackReport) -> bool:
        """True when the final file is already there with this job's header and size (left alone)."""
        if not self.path.exists():
            return False
        header = read_shard_header(self.path)
        if header != self.header or self.path.stat().st_size != self.file_bytes:
            raise CheckpointError(f"{self.path}: exists but is not this rank's file (header {header}, "
                                  f"{self.path.stat().st_size} bytes; expected {self.header}, {self.file_bytes} "
                                  "bytes); remove it to pack again")
        for stale in (self.partial, self.state_path):
            stale.unlink(missing_ok=True)
        report.skipped.append(self.path)
        return True

    def resume_rows(self) -> int:
        """Rows a previous run left complete on disk (0 unless its record matches this job and the file)."""
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return 0
        if not isinstance(state, dict) or state.get("job") != self.identity:
            return 0
        rows = state.get("rows done")
        if not isinstance(rows, int) or not 0 <= rows <= self.rows or not self.partial.is_file():
            return 0
        if self.partial.stat().st_size < SHARD_HEADER_BYTES + rows * self.row_bytes:
            return 0
        return rows

    def _save_state(self, rows: int) -> None:
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        with open(tmp, "w") as handle:
            json.dump({"job": self.identity, "rows done": rows}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.state_path)

    def run(self, done: int, chunk_rows: int, bar, pace: _Pace, report: PackReport) -> None:
        span, rb, hd = self.span, self.row_bytes, self.span.head_dim
        n = min(chunk_rows, max(self.rows, 1))
        values = np.empty(n * hd, dtype=np.uint8)
        scales = np.empty(n * span.scale_cols, dtype=np.uint8)
        outs = [np.empty((n, rb), dtype=np.uint8) for _ in range(2)]
        report.buffer_bytes = max(report.buffer_bytes, values.nbytes + scales.nbytes + 2 * outs[0].nbytes)
        mode = os.O_WRONLY | os.O_CREAT
        if not done:
            self.state_path.unlink(missing_ok=True)  # a fresh start: no record may speak for the new file
        out = os.open(self.partial, mode if done else mode | os.O_TRUNC, 0o644)
        try:
            src = os.open(span.file, os.O_RDONLY)
        except OSError as exc:
            os.close(out)
            raise CheckpointError(f"{span.file}: cannot open ({exc.strerror})") from None
        report.resumed_rows += done
        try:
            os.ftruncate(out, SHARD_HEADER_BYTES + done * rb)  # drop whatever a killed run wrote after its record
            if not done:
                _write_all(out, shard_header(self.header["layer"], self.lo, self.hi, self.header["total rows"], rb),
                           0, self.partial)
            with ThreadPoolExecutor(1, thread_name_prefix="engram-pack-write") as writer:
                inflight = deque()
                for i, start in enumerate(range(self.lo + done, self.hi, n)):
                    stop = min(start + n, self.hi)
                    k = stop - start
                    if len(inflight) == 2:
                        inflight.popleft().result()  # its buffer is the one filled next
                    read_exact(src, values[:k * hd], span.weight_offset + start * hd, span.file)
                    read_exact(src, scales[:k * span.scale_cols], span.scale_offset + start * span.scale_cols,
                                span.file)
                    block = outs[i % 2][:k]
                    block[:, :hd] = values[:k * hd].reshape(k, hd)
                    block[:, hd:] = scales[:k * span.scale_cols].reshape(k, span.scale_cols)
                    inflight.append(writer.submit(self._write_chunk, out, block, start, stop, bar, report))
                    pace.add(k * rb)
                for future in inflight:
                    future.result()
            if not self.rows:
                os.fdatasync(out)
        finally:
            os.close(src)
            os.close(out)
        os.replace(self.partial, self.path)
        _sync_dir(self.path.parent)
        self.state_path.unlink(missing_ok=True)
        report.files.append(self.path)

    def _write_chunk(self, out: int, block: np.ndarray, start: int, stop: int, bar, report: PackReport) -> None:
        offset = SHARD_HEADER_BYTES + (start - self.lo) * self.row_bytes
        _write_all(out, block, offset, self.partial)
        os.fdatasync(out)  # clean pages can be dropped; the record below may only count rows on disk
        os.posix_fadvise(out, offset, block.nbytes, os.POSIX_FADV_DONTNEED)
        self._save_state(stop - self.lo)
        report.bytes_written += block.nbytes
        report.peak_rss = max(report.peak_rss, rss_bytes())
        bar.update(block.nbytes)


def read_exact(fd: int, buf: np.ndarray, offset: int, path: Path) -> None:
    """Fill `buf` from file bytes at `offset` (a short read is an error naming the file), then drop the pages."""
    view, got = memoryview(buf), 0
    while got < buf.nbytes:
        try:
            n = os.preadv(fd, [view[got:]], offset + got)
        except OSError as exc:
            raise CheckpointError(f"{path}: read of {buf.nbytes} bytes at offset {offset} failed ({exc.strerror})"
                                  ) from None
        if n == 0:
            raise CheckpointError(f"{path}: short read at offset {offset + got} ({got} of {buf.nbytes} bytes)")
        got += n
    os.posix_fadvise(fd, offset, buf.nbytes, os.POSIX_FADV_DONTNEED)


def _write_all(fd: int, data, offset: int, path: Path) -> None:
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):
        try:
            done += os.pwrite(fd, view[done:], offset + done)
        except OSError as exc:
            raise CheckpointError(f"{path}: write at offset {offset + done} failed ({exc.strerror})") from None


def _sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
