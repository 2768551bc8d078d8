"""Engram table rows (MODEL.md §4.1, EXL3-ENGRAM.md §5): one layer's table restricted to a rank's hash
columns, read lazily from the checkpoint tensors or from a packed shard file (`shards`).

Checkpoint tensors stay memory-mapped (the tiny model and the test fixtures keep their tables there); a packed
shard file is read with O_DIRECT on a thread pool (`reader`: the release's tables are ~94 GiB each and never
enter memory). `submit` starts reading a step's rows as soon as its ids are known, `wait` hands them to the
compute device; `gather` is the two in one.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dsv41.errors import CheckpointError
from dsv41.weights.safetensors_io import Checkpoint, TensorInfo, read_header

from .hashing import EngramConstants, head_shard
from .reader import ReadPool, ShardRows
from .shards import ROW_SCALE_BLOCK, RowBytes, check_shard_file

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
        self.n_rows = values.shape[0]
        self._keepalive = keepalive  # the mmap object behind the arrays

    def submit(self, local_rows: np.ndarray) -> "_CopiedRows":
        """Copy the rows' stored bytes out of the mapping now (only their pages are touched)."""
        values = np.ascontiguousarray(self.values[local_rows])
        scales = None if self.scales is None else np.ascontiguousarray(self.scales[local_rows])
        return _CopiedRows(values, scales, self.kind, self.values.shape[-1])


class _CopiedRows:
    """Rows already copied to the host, as stored (values, and per row their scales for FP8)."""

    def __init__(self, values: np.ndarray, scales: np.ndarray | None, kind: str, head_dim: int):
        self.values, self.scales, self.kind, self.head_dim = values, scales, kind, head_dim

    def wait_bytes(self) -> RowBytes:
        raw = self.values.view(np.uint8)
        if self.kind == "fp8":
            raw = np.concatenate([raw, self.scales.view(np.uint8)], axis=-1)
        return RowBytes(raw, self.kind, self.head_dim)


class _ShardSource:
    """A shard file's rows `[base, base + n)` behind the `_RowSource` interface."""

    def __init__(self, rows: ShardRows, base: int):
        self.rows, self.base, self.n_rows = rows, base, rows.n_rows

    def submit(self, local_rows: np.ndarray):
        return self.rows.submit(local_rows)


class PendingRows:
    """One `EngramTable.submit`: `wait(device)` gives float32 `[*row_ids.shape, head_dim]`; `wait_bytes()` the
    rows as stored (`RowBytes` `[*row_ids.shape, row_bytes]`, for a step that decodes them inside its graph)."""

    def __init__(self, pending, shape: tuple[int, ...], head_dim: int, device: torch.device):
        self._pending, self._shape, self._head_dim, self.device = pending, shape, head_dim, device

    def wait_bytes(self) -> RowBytes:
        rows = self._pending.wait_bytes()
        return RowBytes(rows.data.reshape(*self._shape, rows.data.shape[-1]), rows.kind, rows.head_dim)

    def wait(self, device: torch.device | str | None = None) -> torch.Tensor:
        return self.wait_bytes().decode(self.device if device is None else device)


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
        n_source = source.n_rows
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
                        constants: EngramConstants | None = None, pool: ReadPool | None = None,
                        direct: bool = True) -> "EngramTable":
        """From a packed `engram-l{L}-r{rank}of{world}.bin` file: every header field and the size are checked
        here; rows are then read with O_DIRECT on `pool` (`reader`), never mapped."""
        constants = constants or EngramConstants.from_config(config)
        header = check_shard_file(path, layer_id, constants, rank, world)
        rows = ShardRows(path, header["hi"] - header["lo"], header["row bytes"], constants.head_dim, pool=pool,
                         direct=direct)
        return cls(layer_id, constants, _ShardSource(rows, header["lo"]), rank, world, where=str(path))

    # --- lookup -----------------------------------------------------------------------------------------------
    def submit(self, row_ids: torch.Tensor) -> PendingRows:
        """Start reading the rows for this rank's hash columns: `row_ids` `[T, n_cols]` (all columns, as the
        hasher gives them) or `[T, c1-c0]` (already restricted). `wait(device)` on the result gives float32
        `[T, c1-c0, head_dim]` on `device` (default: the row ids' device). The ids may live on any device; they
        are read on the host, where the table is."""
        c0, c1 = self.cols
        row_ids = torch.as_tensor(row_ids)
        device = row_ids.device
        row_ids = row_ids.to(device="cpu", dtype=torch.int64)
        if row_ids.shape[-1] == self.constants.n_cols and (c1 - c0) != self.constants.n_cols:
            row_ids = row_ids[..., c0:c1]
        if row_ids.shape[-1] != c1 - c0:
            raise ValueError(f"row ids have {row_ids.shape[-1]} columns, expected {self.constants.n_cols} or {c1 - c0}")
        if row_ids.numel() and (int(row_ids.min()) < self.lo or int(row_ids.max()) >= self.hi):
            bad = row_ids[(row_ids < self.lo) | (row_ids >= self.hi)][0]
            raise ValueError(f"{self.where}: row id {int(bad)} outside this rank's rows [{self.lo}, {self.hi}) "
                             f"(layer {self.layer_id}, rank {self.rank} of {self.world})")
        flat = (row_ids.reshape(-1) - self._source.base).numpy()
        return PendingRows(self._source.submit(flat), tuple(row_ids.shape), self.head_dim, device)

    def gather(self, row_ids: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
        """`submit(row_ids).wait(device)`: the rows, read now."""
        return self.submit(row_ids).wait(device)


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

