"""Argument checks of `attention.attention_pool` (kept apart: the kernel module stays one screenful of kernels and
launchers). Each names the argument and what it should be; none launches anything."""

from __future__ import annotations

import os

import torch

from .codecs import codec_id
from .rowops import _DTYPES


def int_vector(name: str, x: torch.Tensor, B: int) -> None:
    if x.shape != (B,) or x.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32/int64 [B={B}], got {x.dtype} {list(x.shape)}")


def check_store(name: str, store: torch.Tensor, codec, hd: int) -> None:
    if store.dtype != torch.uint8 or store.dim() != 3:
        raise ValueError(f"{name} must be uint8 [n, rows, row_bytes], got {store.dtype} {list(store.shape)}")
    if codec.dim != hd or store.shape[2] != codec.row_bytes:
        raise ValueError(f"{name} rows of {store.shape[2]} bytes do not hold the codec {codec.name!r} "
                         f"({codec.row_bytes} bytes of {codec.dim} values) at head_dim {hd}")
    if store.stride(2) != 1:
        raise ValueError(f"{name} must be contiguous within a row (stride(2) == 1), got {store.stride()}")


def entry_args(q: torch.Tensor, window: int, pos: torch.Tensor, entry_store, entry_codec, pages, per_page, ids,
               width) -> tuple:
    """(S slots, the split kernel's entry arguments, entry codec id or -1) of the compressed slots, checked."""
    hd, B = q.shape[2], q.shape[0]
    if entry_store is None:
        if any(x is not None for x in (entry_codec, pages, ids)) or width:
            raise ValueError("entry_codec / pages / ids / width given without entry_store")
        S = window
        ents = (q, 0, 0, q, 0, 0, 1, q, 0, 0, 0)
        ecodec = -1
    else:
        if entry_codec is None or pages is None:
            raise ValueError("entry_store needs entry_codec and pages")
        check_store("entry_store", entry_store, entry_codec, hd)
        ecodec = codec_id(entry_codec)
        per_page, width = int(per_page), int(width)
        if per_page != entry_store.shape[1]:
            raise ValueError(f"per_page {per_page} is not the entry store's {entry_store.shape[1]} rows per page")
        if pages.dim() != 2 or pages.shape[0] != B or pages.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"pages must be int32/int64 [B={B}, P], got {pages.dtype} {list(pages.shape)}")
        if ids is None:
            ids = torch.empty(B, 0, dtype=torch.int64, device=q.device)
        if ids.dim() != 2 or ids.shape[0] != B or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"ids must be int64 [B={B}, K], got {ids.dtype} {list(ids.shape)}")
        K = ids.shape[1]
        if width < K:
            raise ValueError(f"width {width} < K = {K} selected ids")
        for name, x in (("entry_store", entry_store), ("pages", pages), ("ids", ids)):
            if x.device != q.device:
                raise ValueError(f"{name} is on {x.device}, q on {q.device}")
        if pages.stride(1) != 1:
            pages = pages.contiguous()
        if ids.stride(1) != 1:
            ids = ids.contiguous()
        S = window + width
        # an empty ids / pages is never read (no slot addresses it): any valid pointer stands in
        ids_arg, pages_arg = (ids if K else pos), (pages if pages.shape[1] else pos)
        ents = (entry_store, entry_store.stride(0), entry_store.stride(1), pages_arg, pages.stride(0),
                pages.shape[1], per_page, ids_arg, ids.stride(0), K, width)
    return S, ents, ecodec


def rope_args(rope: tuple, B: int, hd: int, device) -> tuple:
    """((positions, inv_freq, rope_dim), dtype) of `attention_pool`'s `rope=`, checked."""
    positions, inv_freq, rope_dim, dtype = rope
    rope_dim = int(rope_dim)
    if dtype not in _DTYPES:
        raise ValueError(f"rope dtype must be one of {list(_DTYPES)}, got {dtype}")
    if not 0 < rope_dim <= hd or rope_dim % 2:
        raise ValueError(f"rope_dim must be even in (0, {hd}], got {rope_dim}")
    if inv_freq.shape != (rope_dim // 2,) or inv_freq.dtype != torch.float32 or inv_freq.device != device:
        raise ValueError(f"inv_freq must be fp32 [{rope_dim // 2}] on {device}, got {inv_freq.dtype} "
                         f"{list(inv_freq.shape)} on {inv_freq.device}")
    if (positions.dim() != 1 or positions.shape[0] < B or positions.dtype not in (torch.int32, torch.int64)
            or positions.device != device):
        raise ValueError(f"rope positions must be int32/int64 [>= {B}] on {device}, got {positions.dtype} "
                         f"{list(positions.shape)} on {positions.device}")
    return (positions.contiguous(), inv_freq.contiguous(), rope_dim), dtype


# "split_keys,key_block,num_warps[,head_block]": the tiling of decode / verify rows (the pool's and the gathered core's
# alike: `attention.decode_tiling`); unset: the module's defaults. A developer switch until a GPU A/B picks one
TILING_ENV = "DSV41_DECODE_CORE_TILING"


def decode_tiling(split_keys: int, key_block: int, num_warps: int, head_block: int) -> dict:
    """The decode / verify tiling: the defaults given, or the four (the head block optional) of `TILING_ENV`, read at
    each launch as the other switches (a captured graph keeps the tiling it was captured with). Split and block
    boundaries and the head block fix the bits, so every launch of decode and verify rows, in place or gathered,
    takes its tiling from here: drafted == serial and pool == gathered hold at any setting."""
    text = os.environ.get(TILING_ENV, "").strip()
    if text:
        try:
            vals = [int(v) for v in text.split(",")]
        except ValueError:
            vals = []
        if len(vals) not in (3, 4):
            raise ValueError(f"{TILING_ENV}={text!r}: expected split_keys,key_block,num_warps[,head_block]")
        split_keys, key_block, num_warps = vals[:3]
        head_block = vals[3] if len(vals) == 4 else head_block
    return check_tiling(split_keys, key_block, num_warps, head_block)


def check_tiling(split_keys: int, key_block: int, num_warps: int, head_block: int) -> dict:
    """The tiling as a dict, checked: key and head blocks powers of two >= 16, a split a whole number of key
    blocks, warps a power of two."""
    pow2 = lambda v, lo: v >= lo and not v & (v - 1)  # noqa: E731
    if not (pow2(key_block, 16) and split_keys % key_block == 0 and pow2(head_block, 16) and pow2(num_warps, 1)):
        raise ValueError(f"decode tiling split_keys={split_keys} key_block={key_block} num_warps={num_warps} "
                         f"head_block={head_block}: key and head blocks powers of two >= 16, splits a whole "
                         f"number of key blocks, warps a power of two")
    return dict(split_keys=split_keys, key_block=key_block, num_warps=num_warps, head_block=head_block)


def core_io(q: torch.Tensor, sink: torch.Tensor, out: torch.Tensor | None, out_dtype: torch.dtype = torch.float32):
    """The attention cores' q (unit stride over hd), sink (fp32 [H]) and o (`out_dtype` [T, H, hd]: `out` checked, or
    a fresh one), for the split launches (attention.py) and the one-pass prefill core (prefill_core.py)."""
    T, H, hd = q.shape
    if sink.shape != (H,):
        raise ValueError(f"sink {list(sink.shape)} must be [H={H}]")
    sink = sink.float().contiguous()
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(T, H, hd, dtype=out_dtype, device=q.device)
    elif out.shape != (T, H, hd) or out.dtype != out_dtype or not out.is_contiguous() or out.device != q.device:
        raise ValueError(f"out must be contiguous {out_dtype} [{T}, {H}, {hd}] on {q.device}, got {out.dtype} "
                         f"{list(out.shape)} on {out.device}")
    return q, sink, out
