"""The prefill attention core over key slots read in place: the slot index of a segment's rows (one launch for all
its rows) and `attention_indexed`, the core of kernels/step/attention.py reading each slot through it.

The reference's slot layout (`model.attention.window_slots` / `compressed_slots`, `FastAttention._slots`) for rows
t = 0..T-1 of one sequence at positions pos + t, over the window rows `win` [W, hd] (consecutive positions ending
at the segment's last one: row i holds position first + i, first = pos + T - W) and the source's entries:
- window slot j < window: key position kp = pos + t - window + 1 + j, live iff kp >= floor (0, or under CED
  bounded replay the replay segment's start for the decoder layers), window row
  max(kp - first, 0) (`FastAttention._core_blocked`'s clamp: a live slot before `first` reads row 0, as the
  gathered path does);
- compressed slot c = j - window < width: the top-k ids [T, K] (-1 first) left-padded with dead slots to `width`
  (the index top-k): slot c reads ids[t, c - (width - K)] when c >= width - K; id >= 0 is entry id, index W + id.
  With no entries (the source has none yet) every compressed slot is dead.
A dead slot is -1. The result is int32 [T, window + width] (or [T, window] for a window-only layer): 2,048 x 640 x
4 B = 5 MB at the full shape, against the gathered keys' 2,048 x 640 x 512 x 2 B = 1.3 GB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import HEAD_BLOCK, KEY_BLOCK, SPLIT_KEYS, _rows_launch

SLOT_BLOCK = 128  # slots per program


@triton.jit(do_not_specialize=["n_ids", "pos", "first", "floor", "sit", "sic", "S", "window", "width", "W"])
def _slot_index_kernel(ids_ptr, sit, sic, n_ids, out_ptr, S, pos, first, floor, window, width, W,
                       ENTRIES: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    kp = pos + t - window + 1 + j
    idx = tl.where(kp >= floor, tl.maximum(kp - first, 0), -1)
    if ENTRIES:
        at = j - window - (width - n_ids)
        has = (j >= window) & (j < window + width) & (at >= 0)
        eid = tl.load(ids_ptr + t * sit + tl.where(has, at, 0) * sic, mask=has, other=-1)
        idx = tl.where(j < window, idx, tl.where(eid >= 0, W + eid, -1))
    else:
        idx = tl.where(j < window, idx, -1)
    tl.store(out_ptr + t * S + j, idx.to(tl.int32), mask=j < S)


def prefill_slot_index(T: int, pos: int, W: int, window: int, *, width: int = 0, ids: torch.Tensor | None = None,
                       entries: int = 0, device=None, floor: int = 0) -> torch.Tensor:
    """The slot index [T, window + width] int32 of a segment's T rows at positions pos.. (module docstring): W
    window rows, `width` compressed slots (0: a window-only layer) filled from `ids` [T, K] (K <= width, any
    integer dtype; None: no selection) when the source holds `entries` > 0 entries; window slots before position
    `floor` are dead. One launch, no host sync."""
    if window < 1 or W < 1:
        raise ValueError(f"window ({window}) and the window rows ({W}) must be >= 1")
    device = ids.device if ids is not None else device
    S = window + width
    out = torch.empty(T, S, dtype=torch.int32, device=device)
    if W + entries >= 2 ** 31:
        raise ValueError(f"{W} window rows + {entries} entries do not fit an int32 index")
    use = ids is not None and entries > 0 and width > 0 and ids.shape[1] > 0
    if use and (ids.dim() != 2 or ids.shape[0] != T or ids.shape[1] > width):
        raise ValueError(f"ids must be [T={T}, K <= {width}], got {list(ids.shape)}")
    if T == 0:
        return out
    src = ids if use else out
    _slot_index_kernel[(T, triton.cdiv(S, SLOT_BLOCK))](
        src, src.stride(0) if use else 0, src.stride(1) if use else 0, ids.shape[1] if use else 0, out, S, int(pos),
        int(pos + T - W), max(int(floor), 0), window, width, W, ENTRIES=use, BLOCK=SLOT_BLOCK)
    return out


def indexed_sources(q: torch.Tensor, window_rows: torch.Tensor, entries: torch.Tensor | None,
                    slots: torch.Tensor) -> tuple:
    """(window_rows, entries, W, C, slots) of an indexed core's call, checked and with unit column strides (the
    entries' pointer is the window rows' when there are none: never read then)."""
    T, H, hd = q.shape
    if slots.dim() != 2 or slots.shape[0] != T or slots.dtype != torch.int32:
        raise ValueError(f"slots must be int32 [T={T}, S], got {slots.dtype} {list(slots.shape)}")
    for name, x in (("window_rows", window_rows), ("entries", entries)):
        if x is None:
            continue
        if x.dim() != 2 or x.shape[1] != hd or x.device != q.device or x.dtype != window_rows.dtype:
            raise ValueError(f"{name} must be [rows, {hd}] of window_rows' dtype on {q.device}, got {x.dtype} "
                             f"{list(x.shape)} on {x.device}")
    window_rows = window_rows if window_rows.stride(1) == 1 else window_rows.contiguous()
    ents = window_rows if entries is None else entries if entries.stride(1) == 1 else entries.contiguous()
    W, C = window_rows.shape[0], 0 if entries is None else entries.shape[0]
    if slots.stride(1) != 1:
        slots = slots.contiguous()
    return window_rows, ents, W, C, slots


def attention_indexed(q: torch.Tensor, window_rows: torch.Tensor, entries: torch.Tensor | None, slots: torch.Tensor,
                      sink: torch.Tensor, scale: float, *, keys_bf16: bool | None = None,
                      split_keys: int = SPLIT_KEYS, key_block: int = KEY_BLOCK, num_warps: int = 8,
                      head_block: int = HEAD_BLOCK, out: torch.Tensor | None = None) -> torch.Tensor:
    """`attention_core` over key slots read in place through an index, bit for bit the gathered call on
    keys = cat(window_rows, entries)[slots.clamp(min=0)], ok = slots >= 0 (same tiling arguments).

    q [T, H, hd]; window_rows [W, hd] and entries [C, hd] (None: C = 0) of one dtype, their rows contiguous
    (bf16 / fp16 / fp32, read as fp32); slots [T, S] int32: slot j of row t reads window row r = slots[t, j] when
    0 <= r < W, entry r - W when W <= r < W + C, and is dead when r < 0 (r >= W + C: dead too, never made by
    `prefill_slots.prefill_slot_index`). Why one index into two sources rather than a concatenation or one index
    per source: no [W + C, hd] copy of the entries, one int32 load a slot with the live flag in its sign, and the
    same slot layout as the gathered keys (so the same splits and blocks: the bits follow). `keys_bf16` as
    attention_core's (default: the rows' dtype is bf16). Returns o [T, H, hd] fp32 (written into `out` when given:
    contiguous fp32 [T, H, hd], e.g. the segment's rows of the layer's o: no copy); no host sync, one split launch
    and one combine launch whatever T (their scratch: T x splits x H x hd fp32)."""
    window_rows, ents, W, C, slots = indexed_sources(q, window_rows, entries, slots)
    t = slots
    pool = (t, 0, 0, 1, t, t, W, ents, 0, ents.stride(0), t, 0, 0, 1, t, 0, 0, W + C)
    return _rows_launch(q, sink, scale, slots.shape[1],
                        (window_rows, 0, window_rows.stride(0), slots, slots.stride(0)), pool, dict(INDEXED=True),
                        window_rows.dtype == torch.bfloat16 if keys_bf16 is None else keys_bf16, split_keys,
                        key_block, num_warps, head_block, out)
