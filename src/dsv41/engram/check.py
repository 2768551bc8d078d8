"""`dsv41 engram pack --check DIR`: compare packed shard files with the original checkpoint they came from.

Per file: the whole 4096-byte header block against the one the config's layout gives (each field named, the
magic and the zero padding included), the size, then rows: a seeded sample (always the first and the last row)
or, with `full`, every row, each against the source's weight and scale bytes. Every mismatch is reported with the
file, the global row, the file offset and the byte; reads drop their pages from the cache behind them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dsv41.errors import CheckpointError

from .pack import CHUNK_ROWS, read_exact
from .shards import (SHARD_HEADER_BYTES, expected_shard_header, parse_shard_file_name, read_shard_header,
                     shard_file_bytes, shard_file_name, shard_header)
from .source import OriginalCheckpoint, TableSpan

SAMPLE_ROWS = 4096


@dataclass
class CheckReport:
    passed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and bool(self.passed)


def check_pack(src: str | Path | OriginalCheckpoint, folder: str | Path, rank: int | None = None,
               world: int | None = None, sample: int = SAMPLE_ROWS, full: bool = False, seed: int = 0) -> CheckReport:
    """Check every `engram-l*-r*of*.bin` in `folder` (only `rank`/`world`'s when given; then each of that rank's
    files must be there)."""
    src = src if isinstance(src, OriginalCheckpoint) else OriginalCheckpoint(src)
    folder = Path(folder)
    report = CheckReport()
    found = {}
    for path in sorted(folder.glob("engram-l*-r*of*.bin")):
        parsed = parse_shard_file_name(path.name)
        if parsed and (rank is None or parsed[1] == rank) and (world is None or parsed[2] == world):
            found[parsed] = path
    if rank is not None and world is not None:
        for layer_id in src.constants.layer_ids:
            if (layer_id, rank, world) not in found:
                report.problems.append(f"{folder / shard_file_name(layer_id, rank, world)}: missing")
    if not found and not report.problems:
        report.problems.append(f"{folder}: no engram-l*-r*of*.bin shard files")
    for (layer_id, r, w), path in found.items():
        try:
            problem = _check_file(src, path, layer_id, r, w, sample, full, seed)
        except CheckpointError as exc:
            problem = str(exc)
        if problem:
            report.problems.append(problem)
        else:
            report.passed.append(f"{path}: header, size and {'all' if full else 'sampled'} rows match "
                                 f"{src.table_file(layer_id)}")
    return report


def _check_file(src: OriginalCheckpoint, path: Path, layer_id: int, rank: int, world: int, sample: int,
                full: bool, seed: int) -> str | None:
    c = src.constants
    if layer_id not in c.layer_ids:
        return f"{path}: layer {layer_id} is not an Engram layer of the config ({list(c.layer_ids)})"
    want = expected_shard_header(layer_id, c, rank, world)
    header = read_shard_header(path)  # the magic is checked here
    for name, value in want.items():
        if header[name] != value:
            return f"{path}: header field '{name}' is {header[name]}, expected {value}"
    with open(path, "rb") as handle:
        block = handle.read(SHARD_HEADER_BYTES)
    if block != shard_header(layer_id, want["lo"], want["hi"], want["total rows"], want["row bytes"]):
        return f"{path}: header padding (bytes 48..{SHARD_HEADER_BYTES}) is not zero"
    size, want_size = path.stat().st_size, shard_file_bytes(want["lo"], want["hi"], want["row bytes"])
    if size != want_size:
        return f"{path}: file is {size} bytes, expected {want_size}"
    span = src.span(layer_id)
    lo, hi = want["lo"], want["hi"]
    fd_out, fd_src = os.open(path, os.O_RDONLY), os.open(span.file, os.O_RDONLY)
    try:
        if full:
            for start in range(lo, hi, CHUNK_ROWS):
                rows = np.arange(start, min(start + CHUNK_ROWS, hi))
                got = _pread(fd_out, SHARD_HEADER_BYTES + (start - lo) * span.row_bytes, rows.size * span.row_bytes,
                             path).reshape(rows.size, span.row_bytes)
                problem = _compare(path, span, lo, rows, got, _source_rows(fd_src, span, start, rows.size))
                if problem:
                    return problem
            return None
        rng = np.random.default_rng(seed)
        rows = np.unique(np.concatenate([[lo, hi - 1], rng.integers(lo, hi, size=sample)])) if hi > lo else []
        got = np.stack([_pread(fd_out, SHARD_HEADER_BYTES + (g - lo) * span.row_bytes, span.row_bytes, path)
                        for g in rows]) if len(rows) else np.zeros((0, span.row_bytes), np.uint8)
        want_rows = (np.concatenate([_source_rows(fd_src, span, int(g), 1) for g in rows]) if len(rows)
                     else got)
        return _compare(path, span, lo, np.asarray(rows), got, want_rows)
    finally:
        os.close(fd_out)
        os.close(fd_src)


def _source_rows(fd: int, span: TableSpan, start: int, n: int) -> np.ndarray:
    """Source rows `[start, start + n)` laid out as the shard file holds them: `[n, row_bytes]`."""
    out = np.empty((n, span.row_bytes), dtype=np.uint8)
    out[:, :span.head_dim] = _pread(fd, span.weight_offset + start * span.head_dim, n * span.head_dim,
                                    span.file).reshape(n, span.head_dim)
    out[:, span.head_dim:] = _pread(fd, span.scale_offset + start * span.scale_cols, n * span.scale_cols,
                                    span.file).reshape(n, span.scale_cols)
    return out


def _compare(path: Path, span: TableSpan, lo: int, rows: np.ndarray, got: np.ndarray, want: np.ndarray
             ) -> str | None:
    bad = np.flatnonzero((got != want).any(axis=1))
    if not bad.size:
        return None
    i = int(bad[0])
    byte = int(np.flatnonzero(got[i] != want[i])[0])
    g = int(rows[i])
    part = f"value byte {byte}" if byte < span.head_dim else f"scale byte {byte - span.head_dim}"
    return (f"{path}: row {g} (file offset {SHARD_HEADER_BYTES + (g - lo) * span.row_bytes + byte}, {part}) is "
            f"{got[i, byte]:#04x}, the source {span.file.name} has {want[i, byte]:#04x}; {bad.size} of "
            f"{rows.size} checked rows differ")


def _pread(fd: int, offset: int, nbytes: int, path: Path) -> np.ndarray:
    buf = np.empty(nbytes, dtype=np.uint8)
    read_exact(fd, buf, offset, path)
    return buf
