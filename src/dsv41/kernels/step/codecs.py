"""The KV pool's stored rows read inside a kernel: a row's bytes -> its fp32 values, bit for bit `Codec.decode`.

A pool row (runtime/kv_pool.py) is the fake quantiser's codes, then its scale bytes:
- `FP8_UE8M0` (window KV): `dim` e4m3 codes, then one ue8m0 byte per 32 values;
- `FP4_E4M3` (compressed KV): `dim / 2` bytes of e2m1 pairs (low nibble = even value), then one e4m3 byte per 16;
- `FP4_UE8M0` (index keys): the same pairs, then one ue8m0 byte per 32;
- `RAW_*` (no fake quantiser): the compute-dtype values themselves.

`Codec.decode` computes code value x scale in fp32 and rounds to the compute dtype. Every such product is exact in
fp32 and in bf16 / fp16 (an e4m3 or e2m1 value times a power of two or an e4m3 scale has at most 6 significant
bits, and the scales the encoders write stay inside the normal range), so the fp32 product here is the value the
torch decode gives, read back as fp32 (tests/test_kernels_step_codecs.py walks every code and scale byte).

The code tables are built from the bits (no table in memory, no float exp2): e4m3 is 1-4-3 with bias 7 and
subnormals, e2m1 is 1-2-1 with bias 1; ue8m0 byte b is 2^(b - 127) put into an fp32 exponent field (byte 0 gives
0.0, as `e8m0_to_float`; the pool's amax floors never write it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_UE8M0, FP4_E4M3, FP4_UE8M0, RAW_BF16, RAW_FP16, RAW_FP32 = 0, 1, 2, 3, 4, 5
CODEC_IDS = {"fp8-e4m3/ue8m0-32": FP8_UE8M0, "fp4-e2m1/e4m3-16": FP4_E4M3, "fp4-e2m1/ue8m0-32": FP4_UE8M0,
             "raw-bfloat16": RAW_BF16, "raw-float16": RAW_FP16, "raw-float32": RAW_FP32}


def codec_id(codec) -> int:
    """The constexpr of a pool codec (`kv_pool.Codec`), by its name; a clear error for one no kernel reads."""
    try:
        return CODEC_IDS[codec.name]
    except KeyError:
        raise ValueError(f"no kernel reads the pool codec {codec.name!r}") from None


@triton.jit
def _with_sign(mag, sign):
    """mag (fp32, >= 0) with the sign bit `sign` (0 / 1, int32): -0.0 for a negative zero code, as torch decodes."""
    return (mag.to(tl.int32, bitcast=True) | (sign << 31)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_value(code):
    """e4m3fn code (int32 0..255, never the NaN codes) -> fp32."""
    e = (code >> 3) & 15
    m = code & 7
    sub = m.to(tl.float32) * 0.001953125  # m * 2^-9
    norm = (8 + m).to(tl.float32) * (((e - 10) + 127) << 23).to(tl.float32, bitcast=True)
    return _with_sign(tl.where(e == 0, sub, norm), (code >> 7) & 1)


@triton.jit
def e2m1_value(code):
    """e2m1 code (int32 0..15) -> fp32."""
    e = (code >> 1) & 3
    m = code & 1
    sub = m.to(tl.float32) * 0.5
    norm = (2 + m).to(tl.float32) * (((e - 2) + 127) << 23).to(tl.float32, bitcast=True)
    return _with_sign(tl.where(e == 0, sub, norm), (code >> 3) & 1)


@triton.jit
def ue8m0_value(byte):
    """ue8m0 byte (int32 0..254) -> 2^(byte - 127) as fp32 (0.0 for byte 0)."""
    return (byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def load_values(row_ptr, col, mask, DIM, CODEC: tl.constexpr):
    """fp32 values of stored rows: `row_ptr` uint8 pointers to each row's first byte (any shape that broadcasts
    with `col`), `col` the value columns (< DIM), `mask` which to read (others 0.0). DIM: values per row."""
    if CODEC == 0:  # FP8_UE8M0
        code = tl.load(row_ptr + col, mask=mask, other=0).to(tl.int32)
        scale = tl.load(row_ptr + DIM + col // 32, mask=mask, other=0).to(tl.int32)
        v = e4m3_value(code) * ue8m0_value(scale)
    elif CODEC == 1 or CODEC == 2:  # FP4 pairs, then e4m3 / 16 or ue8m0 / 32
        byte = tl.load(row_ptr + col // 2, mask=mask, other=0).to(tl.int32)
        code = (byte >> ((col % 2) * 4)) & 15
        if CODEC == 1:
            scale = e4m3_value(tl.load(row_ptr + DIM // 2 + col // 16, mask=mask, other=0).to(tl.int32))
        else:
            scale = ue8m0_value(tl.load(row_ptr + DIM // 2 + col // 32, mask=mask, other=0).to(tl.int32))
        v = e2m1_value(code) * scale
    elif CODEC == 3:
        v = tl.load(row_ptr.to(tl.pointer_type(tl.bfloat16)) + col, mask=mask, other=0.0).to(tl.float32)
    elif CODEC == 4:
        v = tl.load(row_ptr.to(tl.pointer_type(tl.float16)) + col, mask=mask, other=0.0).to(tl.float32)
    else:
        v = tl.load(row_ptr.to(tl.pointer_type(tl.float32)) + col, mask=mask, other=0.0)
    return tl.where(mask, v, 0.0)


@triton.jit
def _decode_kernel(raw_ptr, out_ptr, row_bytes, DIM, CODEC: tl.constexpr, DP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, DP)
    ok = col < DIM
    tl.store(out_ptr + r * DIM + col, load_values(raw_ptr + r * row_bytes, col, ok, DIM, CODEC), mask=ok)


def decode_rows(raw, codec):
    """Stored rows uint8 [n, row_bytes] -> fp32 [n, dim] through `load_values` (what the kernels read; tests)."""
    raw = raw.contiguous()
    out = torch.empty(raw.shape[0], codec.dim, dtype=torch.float32, device=raw.device)
    if raw.shape[0]:
        _decode_kernel[(raw.shape[0],)](raw, out, raw.shape[1], codec.dim, CODEC=codec_id(codec),
                                        DP=triton.next_power_of_2(codec.dim))
    return out
