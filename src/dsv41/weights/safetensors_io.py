"""Lazy, validated reader for safetensors checkpoints (one file or an index + shards).

Only shard headers are read up front. A tensor (or a row / column slice of it) is read by mapping just the
file range that holds it, copying the wanted bytes out and unmapping again, so no other byte of the
checkpoint is touched and nothing stays mapped (resident-set size grows by the tensors the caller keeps).

Every damage we can see from the headers (bad header length or JSON, offsets outside the data, a dtype/shape
that disagrees with its byte count, a truncated or padded file, an index naming a missing file or a tensor
its shard does not have) is a `CheckpointError` naming the file and, where there is one, the tensor.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dsv41.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit

# safetensors dtype -> (torch dtype the bytes are viewed as, bytes per element).
# F8_E8M0 scales are kept as raw uint8 bytes; weights/formats.py decodes them.
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "F8_E8M0": (torch.uint8, 1),
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors dtype string, e.g. "BF16", "F8_E8M0"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the first element in the file
    nbytes: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one safetensors file's header; returns (tensors by name, __metadata__)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, no header length)")
            header_len = int.from_bytes(prefix, "little")
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(
                    f"{path}: bad or truncated safetensors header (header length {header_len}, file {size} bytes)"
                )
            raw = f.read(header_len)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read shard ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")

    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    tensors: dict[str, TensorInfo] = {}
    data_end = 0
    for name, entry in header.items():
        info = _parse_entry(path, name, entry, data_start)
        tensors[name] = info
        data_end = max(data_end, info.offset + info.nbytes - data_start)
    expected_size = data_start + data_end
    if size < expected_size:
        raise CheckpointError(f"{path}: truncated shard: header describes {expected_size} bytes, file has {size}")
    if size > expected_size:
        raise CheckpointError(f"{path}: file has {size - expected_size} bytes beyond the data its header describes")
    return tensors, metadata


def _parse_entry(path: Path, name: str, entry: object, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{path}: tensor {name!r}: header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r}: unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(f"{path}: tensor {name!r}: bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointError(f"{path}: tensor {name!r}: bad data_offsets {offsets!r}")
    nbytes = offsets[1] - offsets[0]
    expected = math.prod(shape) * DTYPES[dtype][1]
    if nbytes != expected:
        raise CheckpointError(
            f"{path}: tensor {name!r}: {dtype} {shape} needs {expected} bytes, data_offsets span {nbytes}"
        )
    return TensorInfo(name, path, dtype, tuple(shape), data_start + offsets[0], nbytes)


class Checkpoint:
    """A checkpoint folder: `model.safetensors.index.json` + shards, or a single `model.safetensors`."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self._tensors: dict[str, TensorInfo] = {}
        self._claimed: set[str] = set()  # names looked up so far, to find tensors a model never asked for
        self.metadata: dict[str, dict[str, str]] = {}  # per shard file name
        index_path = self.folder / INDEX_FILE
        if index_path.is_file():
            self._load_index(index_path)
        elif (self.folder / SINGLE_FILE).is_file():
            tensors, meta = read_header(self.folder / SINGLE_FILE)
            self._tensors = tensors
            self.metadata[SINGLE_FILE] = meta
        else:
            raise CheckpointError(f"{self.folder}: no {INDEX_FILE} or {SINGLE_FILE} found")

    def _load_index(self, index_path: Path) -> None:
        try:
            index = json.loads(index_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index_path}: cannot parse ({e})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: field 'weight_map' missing or not an object")
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or "/" in file or file in ("", ".", ".."):
                raise CheckpointError(f"{index_path}: tensor {name!r} maps to invalid file name {file!r}")
            by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            path = self.folder / file
            if not path.is_file():
                raise CheckpointError(
                    f"{index_path}: shard {file} (holding {names[0]!r} and {len(names) - 1} more) does not exist"
                )
            tensors, meta = read_header(path)
            self.metadata[file] = meta
            for name in names:
                if name not in tensors:
                    raise CheckpointError(f"{path}: tensor {name!r} listed in {INDEX_FILE} is not in this shard")
                self._tensors[name] = tensors[name]

    # ---- lookup ------------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        try:
            info = self._tensors[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {self.folder}") from None
        self._claimed.add(name)
        return info

    def unclaimed(self) -> list[str]:
        """Tensors never looked up (info/shape/dtype/expect/get): after loading a model, its extra tensors."""
        return [name for name in self._tensors if name not in self._claimed]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype(self, name: str) -> str:
        """The safetensors dtype string ("BF16", "F8_E4M3", "F8_E8M0", ...)."""
        return self.info(name).dtype

    def expect(
        self, name: str, shape: tuple[int, ...] | None = None, dtypes: tuple[str, ...] | None = None
    ) -> TensorInfo:
        """Check a tensor exists with the given shape / one of the given dtypes, or raise naming it."""
        info = self.info(name)
        if shape is not None and info.shape != tuple(shape):
            raise CheckpointError(f"tensor {name!r}: shape {list(info.shape)}, expected {list(shape)}")
        if dtypes is not None and info.dtype not in dtypes:
            raise CheckpointError(f"tensor {name!r}: dtype {info.dtype}, expected one of {', '.join(dtypes)}")
        return info

    # ---- reading -----------------------------------------------------------------------------------------

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor, as a fresh CPU tensor (F8_E8M0 comes back as uint8 bytes)."""
        info = self.info(name)
        raw = _copy_rows(info.file, info.offset, 1, info.nbytes, 0, info.nbytes)
        return _as_tensor(raw, info, info.shape)

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Elements `start:stop` along `dim` (0 or 1), reading only those bytes from disk."""
        info = self.info(name)
        shape = list(info.shape)
        if dim not in (0, 1) or dim >= len(shape):
            raise CheckpointError(f"tensor {name!r}: cannot slice dim {dim} of shape {shape}")
        if not 0 <= start <= stop <= shape[dim]:
            raise CheckpointError(f"tensor {name!r}: slice {start}:{stop} out of range for dim {dim} of {shape}")
        inner = math.prod(shape[dim + 1 :]) * info.itemsize  # bytes per index step along dim
        out_shape = shape[:dim] + [stop - start] + shape[dim + 1 :]
        if dim == 0:
            length = (stop - start) * inner
            raw = _copy_rows(info.file, info.offset + start * inner, 1, length, 0, length)
        else:
            raw = _copy_rows(info.file, info.offset, shape[0], shape[1] * inner, start * inner, stop * inner)
        return _as_tensor(raw, info, tuple(out_shape))


_CHUNK_BYTES = 8 * 1024 * 1024


def _copy_rows(path: Path, offset: int, rows: int, row_bytes: int, lo: int, hi: int) -> np.ndarray:
    """Bytes `[lo, hi)` of each of `rows` rows of `row_bytes` starting at `offset`, copied out of a mapping.

    Only the file range holding the rows is mapped; the copy walks it in chunks and drops each chunk's
    pages from this process right after (MADV_DONTNEED: they stay in the page cache), so the resident set
    grows by the copy alone and nothing stays mapped afterwards.
    """
    out = np.empty((rows, hi - lo), dtype=np.uint8)
    if out.size == 0:
        return out.reshape(-1)
    length = rows * row_bytes
    aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
    rows_per_chunk = max(1, _CHUNK_BYTES // row_bytes)
    try:
        with open(path, "rb") as f, mmap.mmap(
            f.fileno(), offset + length - aligned, offset=aligned, access=mmap.ACCESS_READ
        ) as mm:
            grid = np.frombuffer(mm, dtype=np.uint8, count=length, offset=offset - aligned).reshape(rows, row_bytes)
            try:
                if lo == 0 and hi == row_bytes:  # whole rows: one contiguous range, copied in byte chunks
                    flat_out, flat_in = out.reshape(-1), grid.reshape(-1)
                    for b0 in range(0, length, _CHUNK_BYTES):
                        b1 = min(length, b0 + _CHUNK_BYTES)
                        flat_out[b0:b1] = flat_in[b0:b1]
                        _drop_pages(mm, offset - aligned + b0, b1 - b0)
                    del flat_in
                else:
                    for r0 in range(0, rows, rows_per_chunk):
                        r1 = min(rows, r0 + rows_per_chunk)
                        out[r0:r1] = grid[r0:r1, lo:hi]
                        _drop_pages(mm, offset - aligned + r0 * row_bytes, (r1 - r0) * row_bytes)
            finally:
                del grid  # the mapping can only close once no array points into it
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read bytes {offset}..{offset + length} ({e})") from None
    return out.reshape(-1)


def _drop_pages(mm: mmap.mmap, start: int, length: int) -> None:
    if not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return  # the mapping is closed right after the copy anyway
    page = mmap.PAGESIZE
    first = start - start % page
    mm.madvise(mmap.MADV_DONTNEED, first, min(len(mm), start + length) - first)


def _as_tensor(raw: np.ndarray, info: TensorInfo, shape: tuple[int, ...]) -> torch.Tensor:
    torch_dtype = DTYPES[info.dtype][0]
    flat = torch.from_numpy(raw) if raw.size else torch.empty(0, dtype=torch.uint8)
    return flat.view(torch_dtype).reshape(shape)
