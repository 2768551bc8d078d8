"""EXL3 reference decoder: bit-exact trellis decode, codebooks, 128-point Hadamard, effective weight.

Pure torch, CPU or GPU. This is the oracle the GPU kernels are tested against, so every step follows
`spec/EXL3-ENGRAM.md` §1-2 literally (section numbers below refer to that file). Orientation is the
format's own: the stored matrix is `[k, n]` = `[in_features, out_features]` and the layer computes
`y = x @ W`. Converting to torch's `[out, in]` convention is `weights/linear.py`'s job.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from dsv41.errors import CheckpointError

CODEBOOKS = ("3inst", "mcg", "mul1")  # in the order of the kernels' codebook ids (kernels/cuda_build.py)

# Marker tensors hold the codebook multiplier's bit pattern as a signed int32 (§1.1).
MARKER_VALUES = {"mcg": -877912083, "mul1": -2082680531}  # 0xCBAC1FED, 0x83DCD12D

_MASK32 = 0xFFFFFFFF
_HALF_K_SUPPORTED = (1.5, 2.5, 3.5)


# --------------------------------------------------------------------------------------------------------------
# §2.1 codebooks
# --------------------------------------------------------------------------------------------------------------


def _fp16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Reinterpret the low 16 bits of an int64 tensor as IEEE half."""
    signed = bits & 0xFFFF
    signed = torch.where(signed >= 0x8000, signed - 0x10000, signed)
    return signed.to(torch.int16).view(torch.float16)


@functools.lru_cache(maxsize=None)
def _codebook_table_cpu(codebook: str) -> torch.Tensor:
    s = torch.arange(65536, dtype=torch.int64)
    if codebook in ("3inst", "mcg"):
        if codebook == "3inst":
            x = (s * 89226354 + 64248484) & _MASK32
        else:
            x = (s * 0xCBAC1FED) & _MASK32
        x = (x & 0x8FFF8FFF) ^ 0x3B603B60
        lo = _fp16_from_bits(x).float()
        hi = _fp16_from_bits(x >> 16).float()
        # One fp16 addition == exact fp32 sum rounded once (both halves lie in ±[0.125, 2)).
        return (lo + hi).to(torch.float16)
    if codebook == "mul1":
        x = (s * 0x83DCD12D) & _MASK32
        byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
        h = (1024 + byte_sum).float()
        scale = _fp16_from_bits(torch.tensor(0x1EEE)).float()
        bias = _fp16_from_bits(torch.tensor(0xC931)).float()
        # The kernel does one fused multiply-add rounded to fp16; in fp32 the product and sum are exact,
        # so a single final cast reproduces it (two fp16 roundings would not).
        return (h * scale + bias).to(torch.float16)
    raise ValueError(f"unknown EXL3 codebook {codebook!r}; expected one of {CODEBOOKS}")


def codebook_table(codebook: str, device: torch.device | str | None = None) -> torch.Tensor:
    """The 65,536-entry fp16 table mapping a 16-bit trellis state to its value (cached per codebook)."""
    table = _codebook_table_cpu(codebook)
    return table if device is None else table.to(device)


# --------------------------------------------------------------------------------------------------------------
# §1.3 bit stream and states
# --------------------------------------------------------------------------------------------------------------


def _check_k(K: float) -> float:
    K = float(K)
    if K in _HALF_K_SUPPORTED or (K.is_integer() and 1 <= K <= 8):
        return K
    raise CheckpointError(f"EXL3 trellis with unsupported bits per weight K={K:g} (need 1..8 or 1.5/2.5/3.5)")


def _trellis_k(shape: tuple[int, ...], lead: int, what: str) -> float:
    """K of a trellis of `shape` `[lead..., k/16, n/16, 16K]`; `what` names it in the error."""
    if len(shape) != 3 + lead:
        layout = "[E, k/16, n/16, 16K]" if lead else "[k/16, n/16, 16K]"
        raise CheckpointError(f"{what} must be {3 + lead}-d {layout}, got shape {list(shape)}")
    K = shape[-1] / 16
    try:
        return _check_k(K)
    except CheckpointError:
        raise CheckpointError(f"{what}: last dim {shape[-1]} = 16*K for K={K:g}, not a supported K "
                              "(1..8 or 1.5/2.5/3.5)") from None


def bits_per_weight(trellis: torch.Tensor) -> float:
    """K of a trellis tensor `[k/16, n/16, 16K]` (the last dim is 16·K int16 words)."""
    return _trellis_k(tuple(trellis.shape), 0, "EXL3 trellis")




@functools.lru_cache(maxsize=None)
def _window_starts(K: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per stream position p: index of the 16-bit stream unit its window starts in, the next unit, bit offset.

    The stream read MSB first, cut into 16-bit units, is the int16 words with each pair swapped (the
    words pair up as little-endian uint32s, each read from its high half). A 16-bit window starting at
    bit `start` lies inside units `start//16` and the one after it (mod the tile: tail-biting).
    """
    bits_total = int(256 * K)
    units = bits_total // 16
    p = torch.arange(256, dtype=torch.int64)
    if float(K).is_integer():
        end = (p + 1) * int(K)
    else:
        # Half-integer K = KA + 1/2: positions alternate KA and KA+1 new bits, odd positions take the extra bit.
        ka = int(K - 0.5)
        end = ((p + 1) * (2 * ka + 1) - ((p + 1) % 2)) // 2
    start = (end - 16) % bits_total  # tail-biting: the first windows wrap into the stream's end
    first = start // 16
    return first, (first + 1) % units, (start % 16).to(torch.int32)


def _states(trellis: torch.Tensor, K: float, order: torch.Tensor | None) -> torch.Tensor:
    first, second, offset = _window_starts(K)
    if order is not None:
        first, second, offset = first[order], second[order], offset[order]
    device = trellis.device
    swap = torch.arange(trellis.shape[-1], device=device) ^ 1
    units = trellis[..., swap].to(torch.int32) & 0xFFFF
    pair = (units[..., first.to(device)] << 16) | units[..., second.to(device)]
    # int32 wraps on the left shift; bits 16..31 of (pair << offset) are exactly the window.
    return ((pair << offset.to(device)) >> 16) & 0xFFFF


def decode_states(trellis: torch.Tensor, K: float | None = None) -> torch.Tensor:
    """16-bit trellis states `[k/16, n/16, 256]` (int32) in stream order (§1.3)."""
    K = bits_per_weight(trellis) if K is None else _check_k(K)
    if trellis.shape[-1] != int(16 * K):
        raise CheckpointError(f"EXL3 trellis last dim {trellis.shape[-1]} does not match K={K:g}")
    return _states(trellis, K, None)


# --------------------------------------------------------------------------------------------------------------
# §1.4 in-tile permutation, decode to the rotated-domain matrix
# --------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def tile_position_map() -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) inside the 16x16 tile of each stream position p = 0..255 (the tensor-core permutation)."""
    p = torch.arange(256, dtype=torch.int64)
    lane, j = p // 8, p % 8
    row = 2 * (lane % 4) + (j & 1) + 8 * ((j >> 1) & 1)
    col = lane // 4 + 8 * (j >> 2)
    return row, col


@functools.lru_cache(maxsize=None)
def _row_major_from_stream() -> torch.Tensor:
    """Index vector: element r*16+c of a row-major tile comes from stream position perm[r*16+c]."""
    row, col = tile_position_map()
    perm = torch.empty(256, dtype=torch.int64)
    perm[row * 16 + col] = torch.arange(256)
    return perm


def decode_rotated(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """W_q: the decoded rotated-domain matrix `[k, n]` fp16, no rotations or scales (bit-exact)."""
    # Reading the windows in row-major tile order directly saves a separate permutation pass.
    states = _states(trellis, bits_per_weight(trellis), _row_major_from_stream())
    tiles = codebook_table(codebook, trellis.device)[states]  # [k/16, n/16, 256], row-major in each tile
    tk, tn = trellis.shape[:2]
    return tiles.view(tk, tn, 16, 16).permute(0, 2, 1, 3).reshape(tk * 16, tn * 16)


# --------------------------------------------------------------------------------------------------------------
# §2.2 Hadamard, §2.3 effective weight, §2.5 kernel-order forward
# --------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _hadamard_cpu(dtype: torch.dtype) -> torch.Tensor:
    idx = torch.arange(128)
    popcount = torch.zeros(128, 128, dtype=torch.int64)
    both = idx[:, None] & idx[None, :]
    for bit in range(7):
        popcount += (both >> bit) & 1
    signs = 1.0 - 2.0 * (popcount % 2).to(torch.float64)
    return (signs / math.sqrt(128)).to(dtype)


def hadamard_128(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """128x128 Sylvester Hadamard `H[i,j] = (-1)^popcount(i&j) / sqrt(128)` (symmetric, its own inverse)."""
    h = _hadamard_cpu(dtype)
    return h if device is None else h.to(device)


def rotate_blocks(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Apply H/sqrt(128) to every 128-wide block of `x` along `dim` (in x's dtype)."""
    dim = dim % x.dim()
    size = x.shape[dim]
    if size % 128 != 0:
        raise CheckpointError(f"EXL3 dimension {size} is not a multiple of the 128-wide Hadamard block")
    h = hadamard_128(x.dtype, x.device)
    moved = x.movedim(dim, -1).contiguous()
    # one 2-D GEMM over all blocks: a batched matmul on a strided view is ~100x slower on CPU
    blocks = moved.reshape(-1, 128) @ h
    return blocks.reshape(moved.shape).movedim(-1, dim)


def effective_weight(
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: str,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W_eff = diag(suh) · H · W_q · H · diag(svh), `[k, n]`, computed in `dtype` (fp32 or fp64)."""
    w = decode_rotated(trellis, codebook).to(dtype)
    k, n = w.shape
    if suh.shape != (k,) or svh.shape != (n,):
        raise CheckpointError(
            f"EXL3 scales do not fit trellis [{k}, {n}]: suh {list(suh.shape)}, svh {list(svh.shape)}"
        )
    w = rotate_blocks(w, 0) * suh.to(dtype)[:, None]
    return rotate_blocks(w, 1) * svh.to(dtype)[None, :]


def reference_matmul(
    x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str
) -> torch.Tensor:
    """`y = x @ W_eff` (fp32 out) in the kernels' order and precision (§2.5).

    The input is scaled by suh in fp16, rotated in fp32 and rounded once to fp16; the fp16 W_q product
    accumulates in fp32; the output rotation and svh run on the fp32 accumulator.
    """
    xs = x.to(torch.float16) * suh.to(torch.float16)
    xh = rotate_blocks(xs.float(), -1).to(torch.float16)
    acc = xh.float() @ decode_rotated(trellis, codebook).float()
    return rotate_blocks(acc, -1) * svh.float()


# --------------------------------------------------------------------------------------------------------------
# §1.1 marker → codebook
# --------------------------------------------------------------------------------------------------------------


def codebook_from_group(tensors: dict, name: str = "EXL3 group") -> str:
    """Codebook of one EXL3 group from its tensors (keys are part names or full names ending in them).

    Presence of `mul1` / `mcg` selects the codebook, neither means 3INST; a marker with the wrong value or
    shape, or both markers at once, is a damaged checkpoint.
    """
    parts = {key.rsplit(".", 1)[-1]: value for key, value in tensors.items()}
    found = [cb for cb in ("mcg", "mul1") if cb in parts]
    if len(found) > 1:
        raise CheckpointError(f"{name}: both codebook markers mcg and mul1 present")
    if not found:
        return "3inst"
    codebook = found[0]
    marker = parts[codebook]
    if isinstance(marker, torch.Tensor):
        if marker.numel() != 1:
            raise CheckpointError(f"{name}.{codebook}: marker must be a scalar, got shape {list(marker.shape)}")
        value = int(marker.reshape(()).item())
    else:
        value = int(marker)
    if value != MARKER_VALUES[codebook]:
        raise CheckpointError(
            f"{name}.{codebook}: marker value {value} != expected {MARKER_VALUES[codebook]} "
            f"(0x{MARKER_VALUES[codebook] & _MASK32:08X})"
        )
    return codebook


# --------------------------------------------------------------------------------------------------------------
# §1.1-1.3 a group's tensors: the one check the loader and the kernels' layout share
# --------------------------------------------------------------------------------------------------------------


class GroupDims(NamedTuple):
    """What one EXL3 group's tensors say about it: bits per weight and the matrix `[k, n]`."""

    K: float
    k: int
    n: int


# safetensors dtype names, so that tensors and checkpoint entries (TensorInfo) are checked alike
_DTYPE_NAMES = {torch.int16: "I16", torch.int32: "I32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.float32: "F32", torch.float64: "F64"}


def _shape_and_dtype(t) -> tuple[tuple[int, ...], str]:
    if isinstance(t, torch.Tensor):
        return tuple(t.shape), _DTYPE_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch."))
    return tuple(t.shape), t.dtype


def check_group(name: str, trellis, suh, svh, codebook: str | None = None, lead: int = 0) -> GroupDims:
    """The one check of an EXL3 group: trellis `[lead..., k/16, n/16, 16K]` int16, suh `[lead..., k]` and svh
    `[lead..., n]` fp16, k and n whole 128-wide Hadamard blocks, K in 1..8 or 1.5/2.5/3.5, a known codebook.

    Takes tensors or checkpoint entries (anything with `.shape` and a safetensors `.dtype` name), so the loader
    checks a group before reading it and the kernels' layout (kernels/exl3/layout.py) checks what it is given,
    with the same rules and messages; every error is a CheckpointError naming the tensor `name.part`.
    """
    if codebook is not None and codebook not in CODEBOOKS:
        raise CheckpointError(f"{name}: unknown EXL3 codebook {codebook!r}; expected one of {CODEBOOKS}")
    shape, dtype = _shape_and_dtype(trellis)
    if dtype != "I16":
        raise CheckpointError(f"tensor '{name}.trellis': dtype {dtype}, expected I16")
    K = _trellis_k(shape, lead, f"tensor '{name}.trellis'")
    k, n = shape[-3] * 16, shape[-2] * 16
    if k % 128 or n % 128:
        raise CheckpointError(f"tensor '{name}.trellis': k={k}, n={n} must both be multiples of 128 (Hadamard blocks)")
    for part, t, size in (("suh", suh, k), ("svh", svh, n)):
        got, dtype = _shape_and_dtype(t)
        if got != shape[:lead] + (size,):
            raise CheckpointError(f"tensor '{name}.{part}': shape {list(got)}, expected {list(shape[:lead]) + [size]}")
        if dtype != "F16":
            raise CheckpointError(f"tensor '{name}.{part}': dtype {dtype}, expected F16")
    return GroupDims(K, k, n)
