"""Engram table rows (MODEL.md §4.1, EXL3-ENGRAM.md §5): one layer's table restricted to a rank's hash
columns, read lazily from the checkpoint tensors or from a packed shard file (`shards`).

The tables stay in host memory (memory-mapped: the release's are ~94 GiB each); `gather` reads only the rows
it is asked for and hands them to the compute device, wherever the row ids came from.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dsv41.errors import CheckpointError
from dsv41.weights.formats import e4m3_to_float, e8m0_to_float
from dsv41.weights.safetensors_io import Checkpoint, TensorInfo, read_header

from .hashing import EngramConstants, head_shard
from .shards import ROW_SCALE_BLOCK, SHARD_HEADER_BYTES, fp8_row_bytes, read_shard_header

_SAFETENSORS_DTYPES = {  # name -> (numpy storage dtype, bytes per element, kind)
    "F8_E4M3": (np.uint8, 1, "fp8"),
    "BF16": (np.uint16, 2, "bf16"),
    "F16": (np.float16, 2, "f16"),
    "F32": (np.float32, 4, "f32"),
}


class _RowSource:
    """Rows `[base, base + n)` of one layer's table as (memory-mapped) numpy arrays, dequantised on demand."""

    def __init__(self, values: np.ndarray, scales: np.ndarray | None, kind: str, base: int, keepalive=None):
        self.values, self.scales, self.kind, self.base = values, scales, kind, base
        self._keepalive = keepalive  # the mmap object behind the arrays

    def read(self, local_rows: np.ndarray, device: torch.device) -> torch.Tensor:
        """float32 `[len(local_rows), head_dim]` on `device`. Only the pages of those rows are touched, and only
        their stored bytes travel to the device, where they are dequantised."""
        raw = torch.from_numpy(np.ascontiguousarray(self.values[local_rows]))
        if self.kind == "bf16":
            raw = raw.view(torch.bfloat16)
        raw = raw.to(device)
        if self.kind != "fp8":
            return raw.float()
        values = e4m3_to_float(raw)
        scales = e8m0_to_float(torch.from_numpy(np.ascontiguousarray(self.scales[local_rows])).to(device))
        return values * scales.repeat_interleave(ROW_SCALE_BLOCK, dim=-1)[..., : values.shape[-1]]


class EngramTable:
    """One Engram layer's table rows, for the hash columns `[c0, c1)` this rank owns.

    Nothing is read until `gather`; the backing file is memory-mapped, so only the touched rows' pages are
    read (the release's tables are ~94 GiB each).
    """

    def __init__(self, layer_id: int, constants: EngramConstants, source: _RowSource, rank: int, world: int,
                 where: str):
        self.layer_id = layer_id
        self.constants = constants
        self.rank, self.world = rank, world
        self.cols = head_shard(constants.n_cols, rank, world)
        self.lo, self.hi = constants.row_range(layer_id, *self.cols)
        self.total_rows = constants.num_rows[constants.layer_index(layer_id)]
        self.head_dim = constants.head_dim
        self.where = where
        self._source = source
        n_source = source.values.shape[0]
        if source.base > self.lo or source.base + n_source < self.hi:
            raise CheckpointError(f"{where}: holds rows [{source.base}, {source.base + n_source}) of layer "
                                  f"{layer_id}, rank {rank}/{world} needs [{self.lo}, {self.hi})")

    # --- constructors -----------------------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, source, layer_id: int, config, rank: int = 0, world: int = 1,
                        constants: EngramConstants | None = None) -> "EngramTable":
        """From `layers.{L}.engram.embed.weight` (+ `.scale` when FP8) of a checkpoint: a `Checkpoint`, a folder
        (`model.safetensors.index.json` + shards, or a single `model.safetensors`), or one .safetensors file.
        Headers are parsed and validated by `weights.safetensors_io`; the rows stay memory-mapped."""
        constants = constants or EngramConstants.from_config(config)
        lookup = _tensor_lookup(source)
        name = f"layers.{layer_id}.engram.embed.weight"
        weight_info = lookup(name)
        rows = constants.num_rows[constants.layer_index(layer_id)]
        if weight_info.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{weight_info.file}: tensor {name} has dtype {weight_info.dtype}, expected one "
                                  f"of {sorted(_SAFETENSORS_DTYPES)}")
        np_dtype, _, kind = _SAFETENSORS_DTYPES[weight_info.dtype]
        _check_shape(weight_info, [rows, constants.head_dim])
        values, mm = _map_rows(weight_info, np_dtype)
        scales = None
        if kind == "fp8":
            scale_info = lookup(f"layers.{layer_id}.engram.embed.scale")
            if scale_info.dtype not in ("F8_E8M0", "U8"):
                raise CheckpointError(f"{scale_info.file}: tensor {scale_info.name} has dtype {scale_info.dtype}, "
                                      "expected F8_E8M0")
            _check_shape(scale_info, [rows, -(-constants.head_dim // ROW_SCALE_BLOCK)])
            scales, scale_mm = _map_rows(scale_info, np.uint8)
            mm = (mm, scale_mm)
        source = _RowSource(values, scales, kind, base=0, keepalive=mm)
        return cls(layer_id, constants, source, rank, world, where=f"{weight_info.file}: {name}")

    @classmethod
    def from_shard_file(cls, path: str | Path, layer_id: int, config, rank: int = 0, world: int = 1,
                        constants: EngramConstants | None = None) -> "EngramTable":
        """From a packed `engram-l{L}-r{rank}of{world}.bin` file; every header field is checked."""
        constants = constants or EngramConstants.from_config(config)
        path = Path(path)
        li = constants.layer_index(layer_id)
        lo, hi = constants.row_range(layer_id, *head_shard(constants.n_cols, rank, world))
        row_bytes = fp8_row_bytes(constants.head_dim)
        expected = {"layer": layer_id, "lo": lo, "hi": hi, "total rows": constants.num_rows[li],
                    "row bytes": row_bytes}
        header = read_shard_header(path)
        for field, want in expected.items():
            if header[field] != want:
                raise CheckpointError(f"{path}: header field '{field}' is {header[field]}, expected {want} "
                                      f"(layer {layer_id}, rank {rank} of {world})")
        size = path.stat().st_size
        want_size = SHARD_HEADER_BYTES + (hi - lo) * row_bytes
        if size != want_size:
            raise CheckpointError(f"{path}: file is {size} bytes, expected {want_size} "
                                  f"({hi - lo} rows of {row_bytes} bytes after the {SHARD_HEADER_BYTES}-byte header)")
        with open(path, "rb") as handle:
            mm = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        rows = np.ndarray((hi - lo, row_bytes), dtype=np.uint8, buffer=mm, offset=SHARD_HEADER_BYTES)
        source = _RowSource(rows[:, : constants.head_dim], rows[:, constants.head_dim:], "fp8", base=lo,
                            keepalive=mm)
        return cls(layer_id, constants, source, rank, world, where=str(path))

    # --- lookup -----------------------------------------------------------------------------------------------
    def gather(self, row_ids: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
        """Rows for this rank's hash columns: `row_ids` `[T, n_cols]` (all columns, as the hasher gives them)
        or `[T, c1-c0]` (already restricted) -> float32 `[T, c1-c0, head_dim]` on `device` (default: the row
        ids' device). The ids may live on any device; they are read on the host, where the table is."""
        c0, c1 = self.cols
        row_ids = torch.as_tensor(row_ids)
        device = row_ids.device if device is None else torch.device(device)
        row_ids = row_ids.to(device="cpu", dtype=torch.int64)
        if row_ids.shape[-1] == self.constants.n_cols and (c1 - c0) != self.constants.n_cols:
            row_ids = row_ids[..., c0:c1]
        if row_ids.shape[-1] != c1 - c0:
            raise ValueError(f"row ids have {row_ids.shape[-1]} columns, expected {self.constants.n_cols} or {c1 - c0}")
        if row_ids.numel() and (int(row_ids.min()) < self.lo or int(row_ids.max()) >= self.hi):
            raise ValueError(f"{self.where}: row id outside this rank's rows [{self.lo}, {self.hi})")
        flat = (row_ids.reshape(-1) - self._source.base).numpy()
        return self._source.read(flat, device).reshape(*row_ids.shape, self.head_dim)


def _tensor_lookup(source) -> Callable[[str], "TensorInfo"]:
    """name -> validated TensorInfo, for a Checkpoint, a checkpoint folder or a single .safetensors file."""
    if isinstance(source, (str, Path)) and Path(source).is_file():
        infos, _ = read_header(Path(source))

        def lookup(name: str) -> TensorInfo:
            if name not in infos:
                raise CheckpointError(f"{source}: tensor {name} is missing")
            return infos[name]

        return lookup
    ckpt = source if isinstance(source, Checkpoint) else Checkpoint(source)
    return ckpt.info


def _check_shape(info: "TensorInfo", want: list[int]) -> None:
    if list(info.shape) != want:
        raise CheckpointError(f"{info.file}: tensor {info.name} has shape {list(info.shape)}, expected {want}")


def _map_rows(info: "TensorInfo", np_dtype) -> tuple[np.ndarray, mmap.mmap]:
    """A read-only [rows, cols] view of the tensor's bytes; pages are read only when rows are gathered."""
    try:
        with open(info.file, "rb") as handle:
            mm = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise CheckpointError(f"{info.file}: cannot open ({exc.strerror})") from None
    return np.ndarray(info.shape, dtype=np_dtype, buffer=mm, offset=info.offset), mm

