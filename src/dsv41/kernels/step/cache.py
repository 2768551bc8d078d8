"""The KV pool's cache writes in one launch: x [B, dim] encoded by a pool codec into rows `dest` of a store.

`store_rows(store, x, dest, codec)` writes into flat row dest[b] of `store` (its bytes seen as rows of
`codec.row_bytes`) exactly the bytes `codec.encode(x[b:b + 1])` gives (runtime/kv_pool.py):
- `Fp8Ue8m0` (window KV): `dim` e4m3fn codes, then one ue8m0 byte per 32 values;
- `Fp4E4m3` (compressed KV): `dim / 2` bytes of e2m1 pairs (low nibble = even column), then one e4m3 byte per 16;
- `Fp4Ue8m0` (index keys): the same pairs, then one ue8m0 byte per 32;
- `Raw` (no fake quantiser, and the fp32 open compressor groups): the values rounded to the codec's dtype.

Why bit for bit: the pool must hold what the reference's fake quantiser produces, `decode(encode(x)) ==
fake_quant(x)`, and a step that writes through this kernel must leave the pool as the torch writes do. So the
arithmetic is the torch encoder's, op for op: the amax floors, the fp32 ratio amax / qmax and then 2^ceil(log2) by
its bits for ue8m0, e4m3(amax / 6) for the FP4 e4m3 scale, IEEE division by the scale (`div_rn`: Triton's `/` is
approximate on GPUs), nearest with ties to even (e2m1 keeps no negative zero, e4m3 keeps the sign of zero), and
the clamps. The rounding device functions are `rowops`' (the same ones the in-kernel fake quantisers use); the codes
are then read off the rounded value's fp32 bits (no fp8 dtype: the interpreter and the GPU run the same integer
ops). The encoder (`rowops.encode_pairs`) is shared with the row ops, which store the window KV they produce
straight into the ring (`norm_rope_rows(store=)`): the same bytes, one launch fewer. The forward hands the pool
already fake-quantised rows; re-encoding them is exact for FP8 / ue8m0 and FP4 / ue8m0, and for FP4 / e4m3
except a block amax in about [0.0176, 0.0195) (a property of the quantiser, which the kernel shares with `encode`;
tests/test_kernels_step_cache.py).

dest[b] == -1 (any negative) writes nothing: a fixed-size batch (a CUDA graph) pads with such rows. Other dests are
the caller's guarantee: distinct and inside the store (no check here, which would sync with the host). One program
per row, no allocation, no host sync: the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch as pdl_launch, wait_previous

from .codecs import codec_id
from .rowops import CODEC_BLOCK as _BLOCKS, _cast, encode_pairs



@triton.jit
def _load_x(ptr, mask, XBITS: tl.constexpr):
    """x values as fp32; XBITS: x is bf16 passed as its int16 bits, widened by a shift (exact, where the
    interpreter's own bf16 -> fp32 conversion gets subnormals wrong)."""
    if XBITS:
        bits = tl.load(ptr, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_rows_kernel(store_ptr, x_ptr, stride_xr, stride_xc, dest_ptr, stride_d, row_bytes, DIM,
                       CODEC: tl.constexpr, XBITS: tl.constexpr, NB: tl.constexpr, HB: tl.constexpr,
                       DP: tl.constexpr, PDL: tl.constexpr = False):
    """Program b: x[b] encoded into row dest[b]. Quantised codecs see the row as [NB, HB] tiles of the even and the
    odd members of each block (so an e2m1 pair is one byte of one program); Raw as one [DP] tile."""
    wait_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    d = tl.load(dest_ptr + b * stride_d).to(tl.int64)
    keep = d >= 0
    row = store_ptr + tl.maximum(d, 0) * row_bytes  # a -1 row still gets an address, every access masked off
    xrow = x_ptr + b * stride_xr
    if CODEC >= 3:  # Raw
        col = tl.arange(0, DP)
        ok = (col < DIM) & keep
        v = _load_x(xrow + col * stride_xc, ok, XBITS)
        if CODEC == 3:
            bits = _cast(v, tl.bfloat16).to(tl.uint32, bitcast=True) >> 16
            tl.store(row.to(tl.pointer_type(tl.uint16)) + col, bits.to(tl.uint16), mask=ok)
        elif CODEC == 4:
            tl.store(row.to(tl.pointer_type(tl.float16)) + col, v.to(tl.float16), mask=ok)
        else:
            tl.store(row.to(tl.pointer_type(tl.float32)) + col, v, mask=ok)
    else:
        blk = tl.arange(0, NB)
        col = blk[:, None] * (2 * HB) + 2 * tl.arange(0, HB)[None, :]  # the even member's column
        ok = (col < DIM) & keep
        ev = _load_x(xrow + col * stride_xc, ok, XBITS)
        od = _load_x(xrow + (col + 1) * stride_xc, ok, XBITS)
        encode_pairs(row, ev, od, col, ok, blk, (blk < DIM // (2 * HB)) & keep, DIM, CODEC)


def store_rows(store: torch.Tensor, x: torch.Tensor, dest: torch.Tensor, codec) -> None:
    """Row dest[b] of `store` (its bytes as rows of `codec.row_bytes`) := `codec.encode(x[b:b + 1])`, for every b
    with dest[b] >= 0 (-1: nothing written). store: a contiguous pool store (any dtype); x: [B, codec.dim]
    bf16 / fp16 / fp32 on its device; dest: int32 / int64 [B] on its device. One launch; nothing for B == 0."""
    cid = codec_id(codec)
    if not store.is_contiguous():
        raise ValueError(f"store must be contiguous, got strides {store.stride()} for shape {list(store.shape)}")
    nbytes = store.numel() * store.element_size()
    if nbytes % codec.row_bytes:
        raise ValueError(f"store holds {nbytes} bytes, not a whole number of {codec.name} rows "
                         f"({codec.row_bytes} bytes each)")
    if x.dim() != 2 or x.shape[1] != codec.dim:
        raise ValueError(f"x must be [rows, {codec.dim}] for {codec.name}, got {list(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16 / fp16 / fp32, got {x.dtype}")
    if dest.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"dest must be int32 or int64, got {dest.dtype}")
    if dest.shape != (x.shape[0],):
        raise ValueError(f"dest must be [{x.shape[0]}] (one row per x row), got {list(dest.shape)}")
    if x.device != store.device or dest.device != store.device:
        raise ValueError(f"store, x and dest must share a device, got {store.device}, {x.device}, {dest.device}")
    if x.shape[0] == 0:
        return
    rows = store.view(torch.uint8).view(-1)
    block = _BLOCKS.get(cid, 32)
    nb = triton.next_power_of_2(codec.dim // block) if cid in _BLOCKS else 1
    xbits = x.dtype == torch.bfloat16
    _store_rows_kernel[(x.shape[0],)](
        rows, x.view(torch.int16) if xbits else x, x.stride(0), x.stride(1), dest, dest.stride(0),
        codec.row_bytes, codec.dim,
        CODEC=cid, XBITS=xbits, NB=nb, HB=block // 2, DP=triton.next_power_of_2(codec.dim),
        num_warps=1 if codec.dim <= 256 else 4, enable_fp_fusion=False, **pdl_launch(x.device))


__all__ = ["store_rows"]
