"""The packed per-rank Engram shard files (EXL3-ENGRAM.md §5.3-5.4) and the FP8 row format they hold.

`engram-l{L}-r{rank}of{world}.bin`: a 4096-byte header (magic, layer, lo, hi, total rows, row bytes as
little-endian u64, zero padded), then rows `[lo, hi)` of the layer's table, each row its e4m3 values followed
by one UE8M0 scale per 32 values. `[lo, hi)` are the rows of the rank's hash columns (`head_shard`).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dsv41.errors import CheckpointError
from dsv41.weights.formats import FP8_MAX, e4m3_to_float, e8m0_to_float, power_of_two_scale_byte

from .hashing import EngramConstants, head_shard

# One UE8M0 scale per this many values of an FP8 table row.
ROW_SCALE_BLOCK = 32

# EXL3-ENGRAM.md §5.4 calls this ASCII "DSV41EN1", but written little-endian its bytes are "DSV1EN41"; the number
# is what the public packers write and check, so the number is what we use.
SHARD_MAGIC = 0x31344E4531565344
SHARD_HEADER_BYTES = 4096
_SHARD_HEADER = struct.Struct("<QQQQQQ")  # magic, layer, lo, hi, total rows, row bytes
SHARD_HEADER_FIELDS = ("layer", "lo", "hi", "total rows", "row bytes")
_SHARD_NAME = re.compile(r"engram-l(\d+)-r(\d+)of(\d+)\.bin")


def shard_file_name(layer_id: int, rank: int, world: int) -> str:
    return f"engram-l{layer_id}-r{rank}of{world}.bin"


def parse_shard_file_name(name: str) -> tuple[int, int, int] | None:
    """(layer, rank, world) of an `engram-l{L}-r{rank}of{world}.bin` name, None for any other name."""
    match = _SHARD_NAME.fullmatch(name)
    return tuple(int(g) for g in match.groups()) if match else None


def fp8_row_bytes(head_dim: int) -> int:
    """Bytes of one packed FP8 row: the e4m3 values then one UE8M0 scale per 32 values."""
    return head_dim + -(-head_dim // ROW_SCALE_BLOCK)


def shard_header(layer_id: int, lo: int, hi: int, total_rows: int, row_bytes: int) -> bytes:
    """The whole 4096-byte header block of a shard file (the six fields, then zeros)."""
    fields = _SHARD_HEADER.pack(SHARD_MAGIC, layer_id, lo, hi, total_rows, row_bytes)
    return fields + bytes(SHARD_HEADER_BYTES - len(fields))


def shard_file_bytes(lo: int, hi: int, row_bytes: int) -> int:
    return SHARD_HEADER_BYTES + (hi - lo) * row_bytes


def expected_shard_header(layer_id: int, constants: EngramConstants, rank: int, world: int) -> dict:
    """The header fields of the file holding `rank`'s hash columns of one layer (as `read_shard_header` gives them)."""
    lo, hi = constants.row_range(layer_id, *head_shard(constants.n_cols, rank, world))
    return {"layer": layer_id, "lo": lo, "hi": hi, "total rows": constants.num_rows[constants.layer_index(layer_id)],
            "row bytes": fp8_row_bytes(constants.head_dim)}


def check_shard_file(path: str | Path, layer_id: int, constants: EngramConstants, rank: int, world: int) -> dict:
    """Open-time validation of one rank's shard file: magic, every header field against the config's layout
    and the file size. Returns the header; a mismatch is a `CheckpointError` naming the file and the field."""
    path = Path(path)
    expected = expected_shard_header(layer_id, constants, rank, world)
    header = read_shard_header(path)
    for field, want in expected.items():
        if header[field] != want:
            raise CheckpointError(f"{path}: header field '{field}' is {header[field]}, expected {want} "
                                  f"(layer {layer_id}, rank {rank} of {world})")
    size = path.stat().st_size
    want_size = shard_file_bytes(header["lo"], header["hi"], header["row bytes"])
    if size != want_size:
        raise CheckpointError(f"{path}: file is {size} bytes, expected {want_size} ({header['hi'] - header['lo']} "
                              f"rows of {header['row bytes']} bytes after the {SHARD_HEADER_BYTES}-byte header)")
    return header


def read_shard_header(path: str | Path) -> dict:
    """The six header fields of an Engram shard file (magic checked)."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            head = handle.read(_SHARD_HEADER.size)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open Engram shard ({exc.strerror})") from None
    if len(head) < _SHARD_HEADER.size:
        raise CheckpointError(f"{path}: truncated Engram shard header ({len(head)} bytes)")
    magic, layer, lo, hi, total, row_bytes = _SHARD_HEADER.unpack(head)
    if magic != SHARD_MAGIC:
        raise CheckpointError(f"{path}: not an Engram shard file (magic {magic:#018x}, expected {SHARD_MAGIC:#018x})")
    return dict(zip(SHARD_HEADER_FIELDS, (layer, lo, hi, total, row_bytes)))


def dequant_fp8_rows(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes `[n, head_dim]` and UE8M0 bytes `[n, ceil(head_dim/32)]` -> float32 `[n, head_dim]` on their
    device: `e4m3 × 2^(scale − 127)` per 32 values (byte 0 -> 0). Every reader of FP8 rows uses this one."""
    out = e4m3_to_float(values)
    return out * e8m0_to_float(scales).repeat_interleave(ROW_SCALE_BLOCK, dim=-1)[..., : out.shape[-1]]


def decode_row_bytes(raw: torch.Tensor, kind: str, head_dim: int) -> torch.Tensor:
    """Stored rows as bytes `[..., row_bytes]` (uint8, on any device) -> float32 `[..., head_dim]` there. `kind`
    "fp8": the values then their scales (`fp8_row_bytes`), decoded by `dequant_fp8_rows`; "bf16" / "f16" / "f32":
    the values' little-endian bytes. Pure tensor ops with no host sync, so it runs inside a CUDA graph."""
    if kind == "fp8":
        return dequant_fp8_rows(raw[..., :head_dim], raw[..., head_dim:fp8_row_bytes(head_dim)])
    dtypes = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
    if kind not in dtypes:
        raise ValueError(f"Engram rows of kind {kind!r}: expected fp8, bf16, f16 or f32")
    width = head_dim * dtypes[kind].itemsize
    return raw[..., :width].contiguous().view(dtypes[kind]).float()


@dataclass
class RowBytes:
    """Rows as stored: `data` uint8 `[..., row_bytes]` on the host, in the order they were asked for."""

    data: np.ndarray
    kind: str
    head_dim: int

    def decode(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """float32 `[..., head_dim]` on `device` (bytes sent from pinned memory to a GPU, decoded there)."""
        device = torch.device(device)
        host = torch.from_numpy(np.ascontiguousarray(self.data))
        if device.type == "cuda":
            host = host.pin_memory()
        return decode_row_bytes(host.to(device, non_blocking=True), self.kind, self.head_dim)


def quantize_rows_fp8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float `[n, head_dim]` -> (uint8 e4m3 bytes `[n, head_dim]`, uint8 UE8M0 `[n, ceil(head_dim/32)]`),
    one power-of-two scale per 32 values of a row (the release's Engram table format)."""
    rows = rows.float()
    n, dim = rows.shape
    n_blocks = -(-dim // ROW_SCALE_BLOCK)
    padded = torch.zeros(n, n_blocks * ROW_SCALE_BLOCK, device=rows.device)
    padded[:, :dim] = rows.abs()
    scale_bytes = power_of_two_scale_byte(padded.view(n, n_blocks, ROW_SCALE_BLOCK).amax(-1), FP8_MAX)
    scales = e8m0_to_float(scale_bytes).repeat_interleave(ROW_SCALE_BLOCK, dim=1)[:, :dim]
    values = (rows / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return values, scale_bytes


def write_engram_shard(path: str | Path, layer_id: int, lo: int, hi: int, total_rows: int,
                       values: np.ndarray | torch.Tensor, scales: np.ndarray | torch.Tensor,
                       chunk_rows: int = 1 << 18) -> None:
    """Write one shard file: header, then rows `[lo, hi)` of `values` (e4m3 bytes `[total_rows, head_dim]`) and
    `scales` (UE8M0 bytes `[total_rows, head_dim/32]`), each row's values followed by its scales.

    `values`/`scales` may be memory-mapped: they are copied in chunks, never materialised whole.
    """
    values = values.view(torch.uint8).numpy() if isinstance(values, torch.Tensor) else values
    scales = scales.view(torch.uint8).numpy() if isinstance(scales, torch.Tensor) else scales
    head_dim = values.shape[1]
    row_bytes = head_dim + scales.shape[1]
    if scales.shape[1] != -(-head_dim // ROW_SCALE_BLOCK) or values.shape[0] != scales.shape[0]:
        raise ValueError(f"values {values.shape} and scales {scales.shape} do not form FP8 Engram rows")
    if not 0 <= lo <= hi <= values.shape[0]:
        raise ValueError(f"rows [{lo}, {hi}) outside a table of {values.shape[0]} rows")
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as out:
        out.write(shard_header(layer_id, lo, hi, total_rows, row_bytes))
        for start in range(lo, hi, chunk_rows):
            stop = min(start + chunk_rows, hi)
            block = np.empty((stop - start, row_bytes), dtype=np.uint8)
            block[:, :head_dim] = values[start:stop]
            block[:, head_dim:] = scales[start:stop]
            out.write(block.tobytes())
    os.replace(tmp, path)


def write_engram_shards(out_dir: str | Path, layer_id: int, values, scales, config, world: int,
                        constants: EngramConstants | None = None) -> list[Path]:
    """Split one layer's FP8 table into the `world` rank files of EXL3-ENGRAM.md §5.3/§5.4; returns the paths."""
    constants = constants or EngramConstants.from_config(config)
    total = constants.num_rows[constants.layer_index(layer_id)]
    if values.shape[0] != total:
        raise ValueError(f"layer {layer_id} table has {values.shape[0]} rows, expected {total}")
    paths = []
    for rank in range(world):
        lo, hi = constants.row_range(layer_id, *head_shard(constants.n_cols, rank, world))
        path = Path(out_dir) / shard_file_name(layer_id, rank, world)
        write_engram_shard(path, layer_id, lo, hi, total, values, scales)
        paths.append(path)
    return paths


