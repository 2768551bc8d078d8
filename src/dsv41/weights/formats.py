"""Dequantisation (and, for writing checkpoints, quantisation) of the non-EXL3 weight formats.

Formats (spec/MODEL.md §4, §4.2), all in torch `[out, in]` layout:

- native: BF16 / F16 / F32 tensors, used as they are;
- FP8 block: `F8_E4M3` weight `[out, in]` + `F8_E8M0` scale `[ceil(out/32), ceil(in/32)]`, one power of two per
  32x32 block: `w = e4m3(q) * 2^(e - 127)`;
- MXFP4: `I8` weight `[out, in/2]` holding two e2m1 codes per byte, the LOW nibble is the even column, and an
  `F8_E8M0` scale `[out, in/32]` (one per 32 consecutive inputs of a row).

Scale bytes (UE8M0): byte b means 2^(b-127) for b = 1..254. Byte 0 is read as 0 (what the release's
readers do, spec/EXL3-ENGRAM.md §5.1 and §7.5; true UE8M0 would be 2^-127, a difference below 1e-36 for any
e4m3 value). Byte 255 is UE8M0's NaN encoding and dequantises to NaN, so a damaged scale is visible
instead of silently huge. The quantisers below never emit 0 or 255.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite e4m3fn value
FP4_MAX = 6.0  # largest e2m1 value
BLOCK = 32

# e2m1 code -> value, bit 3 is the sign (spec/MODEL.md §4.2).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------------------------------
# element decoders
# --------------------------------------------------------------------------------------------------------------


def as_uint8(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a 1-byte tensor (uint8 / int8 / float8 / e8m0) as uint8, without conversion."""
    if t.element_size() != 1:
        raise TypeError(f"expected a 1-byte dtype, got {t.dtype}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scale bytes -> float32 powers of two (byte 0 -> 0, byte 255 -> NaN; see module notes)."""
    b = as_uint8(scale).to(torch.int32)
    # Placing the byte in an fp32 exponent field gives 2^(b-127) exactly, and 0.0 for byte 0.
    value = (b << 23).view(torch.float32)
    return torch.where(b == 255, torch.full_like(value, float("nan")), value)


def e4m3_to_float(q: torch.Tensor) -> torch.Tensor:
    """F8_E4M3 (fn variant: no infinities, 0x7F/0xFF are NaN) bytes or tensor -> float32."""
    return as_uint8(q).view(torch.float8_e4m3fn).float()


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (0..15, any integer dtype) -> float32."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


# --------------------------------------------------------------------------------------------------------------
# dequantisers
# --------------------------------------------------------------------------------------------------------------


def dequant_native(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if not weight.is_floating_point() or weight.element_size() == 1:
        raise TypeError(f"native weights are bf16/fp16/fp32, got {weight.dtype}")
    return weight.to(dtype)


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block: int = BLOCK) -> torch.Tensor:
    """float32 `[ceil(rows/b), ceil(cols/b)]` block scales -> one scale per element `[rows, cols]`."""
    full = scale.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return full[:rows, :cols]


def dequant_fp8_block(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, block: int = BLOCK
) -> torch.Tensor:
    """FP8 e4m3 `[out, in]` with UE8M0 `[ceil(out/b), ceil(in/b)]` block scales -> dense `[out, in]`."""
    rows, cols = weight.shape
    expected = (_ceil_div(rows, block), _ceil_div(cols, block))
    if tuple(scale.shape) != expected:
        raise ValueError(f"FP8 scale shape {list(scale.shape)} != {list(expected)} for weight {[rows, cols]}")
    w = e4m3_to_float(weight)
    scale = e8m0_to_float(scale)
    if rows % block == 0 and cols % block == 0:
        # Broadcast over a blocked view instead of expanding the scales to a full-size tensor.
        w.view(rows // block, block, cols // block, block).mul_(scale[:, None, :, None])
    else:
        w.mul_(expand_block_scale(scale, rows, cols, block))
    return w.to(dtype)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """I8 `[out, in/2]` -> e2m1 codes `[out, in]` (int64); low nibble = even column, high nibble = odd."""
    b = as_uint8(packed).to(torch.int64)
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 `[out, in/2]` bytes with UE8M0 `[out, in/32]` scales -> dense `[out, in]`."""
    rows, half = packed.shape
    cols = half * 2
    if tuple(scale.shape) != (rows, _ceil_div(cols, BLOCK)):
        raise ValueError(
            f"MXFP4 scale shape {list(scale.shape)} != {[rows, _ceil_div(cols, BLOCK)]} for {cols} inputs"
        )
    values = e2m1_to_float(unpack_e2m1(packed))
    scales = e8m0_to_float(scale).repeat_interleave(BLOCK, dim=1)[:, :cols]
    return (values * scales).to(dtype)


# --------------------------------------------------------------------------------------------------------------
# quantisers (used to write checkpoints: the tiny model and tests)
# --------------------------------------------------------------------------------------------------------------


def power_of_two_scale_byte(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest UE8M0 scale byte with amax / 2^(b-127) <= qmax (i.e. 2^ceil(log2(amax/qmax))); uint8.

    frexp gives the exponent exactly (no float log2 rounding); all-zero blocks get scale 1 (byte 127).
    """
    ratio = amax.double() / qmax
    mantissa, exponent = torch.frexp(ratio)  # ratio = m * 2^e, m in [0.5, 1)
    ceil_log2 = exponent - (mantissa == 0.5).to(exponent.dtype)
    ceil_log2 = torch.where(ratio > 0, ceil_log2, torch.zeros_like(ceil_log2))
    return (ceil_log2 + 127).clamp(1, 254).to(torch.uint8)


def _block_amax(w: torch.Tensor, block: int) -> torch.Tensor:
    rows, cols = w.shape
    padded = torch.zeros(_ceil_div(rows, block) * block, _ceil_div(cols, block) * block, dtype=w.dtype)
    padded[:rows, :cols] = w.abs()
    br, bc = padded.shape[0] // block, padded.shape[1] // block
    return padded.view(br, block, bc, block).amax(dim=(1, 3))


def quantize_fp8_block(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense `[out, in]` -> (float8_e4m3fn weight `[out, in]`, uint8 UE8M0 scale `[ceil(out/b), ceil(in/b)]`)."""
    w = w.float()
    scale_byte = power_of_two_scale_byte(_block_amax(w, block), FP8_MAX)
    scaled = w / expand_block_scale(e8m0_to_float(scale_byte), *w.shape, block)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale_byte


def nearest_e2m1_code(x: torch.Tensor) -> torch.Tensor:
    """Round |x| <= 6 to the nearest e2m1 magnitude, ties to the even code (as a float cast would); sign in bit 3."""
    a = x.abs()
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=a.dtype, device=a.device)
    code = torch.bucketize(a, midpoints)  # a tie lands on the lower code
    odd_lower_ties = (a == 0.75) | (a == 1.75) | (a == 3.5)  # the lower neighbour's code is odd there
    code = code + odd_lower_ties.to(code.dtype)
    negative = (x < 0) & (code > 0)
    return code + 8 * negative.to(code.dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense `[out, in]` (in a multiple of 32) -> (int8 packed `[out, in/2]`, uint8 UE8M0 scale `[out, in/32]`)."""
    w = w.float()
    rows, cols = w.shape
    if cols % BLOCK != 0:
        raise ValueError(f"MXFP4 needs in_features divisible by {BLOCK}, got {cols}")
    blocks = w.view(rows, cols // BLOCK, BLOCK)
    scale_byte = power_of_two_scale_byte(blocks.abs().amax(dim=-1), FP4_MAX)
    scaled = blocks / e8m0_to_float(scale_byte).unsqueeze(-1)
    codes = nearest_e2m1_code(scaled.reshape(rows, cols))
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed.view(torch.int8), scale_byte
