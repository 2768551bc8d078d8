"""The paged KV pool: every sequence's cache at the model's own precision, in one allocation (docs/ENGINE.md §3).

Two kinds of store, cut as views out of one uint8 buffer:
- ring slots (one per live request): the window KV of every layer (and of every DSpark stage) in `ring_rows`
  rows (the sliding window + the largest verify window, so a rejected draft rolls back by moving the write head;
  position p lives in row p mod ring_rows), and the open compressor group of each ratio > 1 KV source
  (fp32 value and gate rows: fewer than the ratio, or with verify rows a ring over the last ratio - 1 + verify
  rows positions, so that rejected drafts roll back without a copy);
- pages of `page_tokens` positions: the compressed entries and index keys of each KV source
  (page_tokens / ratio entries per page); a sequence's page table addresses all of them, entry e of a source lives
  in page `page_ids[e // per_page]` at row `e % per_page`.

Each stored vector is one row of bytes: the codes and then the scales of the release's fake quantiser for that
cache kind, so `decode(encode(x)) == fake_quant(x)` bit for bit (tests/test_runtime_pool.py):
window KV FP8 e4m3 + one ue8m0 scale per 32, compressed KV FP4 e2m1 + one e4m3 scale per 16, index keys FP4 e2m1 +
one ue8m0 scale per 32. Where the reference skips its quantiser (`--no-fake-quant`, or a width that is not a
multiple of the block) the row holds the compute-dtype values themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..weights.formats import (FP4_MAX, FP8_MAX, e2m1_to_float, e8m0_to_float, nearest_e2m1_code,
                               power_of_two_scale_byte, unpack_e2m1)

ALIGN = 256


# ---------------------------------------------------------------------------------------------------- codecs
class Codec:
    """How one cache kind stores a vector of `dim` values as `row_bytes` bytes."""

    name = "raw"

    def __init__(self, dim: int):
        self.dim = dim

    row_bytes: int

    def encode(self, x: torch.Tensor) -> torch.Tensor:  # [n, dim] -> uint8 [n, row_bytes]
        raise NotImplementedError

    def decode(self, raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # uint8 [n, row_bytes] -> [n, dim]
        raise NotImplementedError


class Raw(Codec):
    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__(dim)
        self.dtype = dtype
        self.name = f"raw-{str(dtype).removeprefix('torch.')}"
        self.row_bytes = dim * torch.empty(0, dtype=dtype).element_size()

    def encode(self, x):
        return x.to(self.dtype).contiguous().view(torch.uint8).reshape(x.shape[0], self.row_bytes)

    def decode(self, raw, dtype):
        return raw.contiguous().view(self.dtype).reshape(raw.shape[0], self.dim).to(dtype)


class _Blocked(Codec):
    """Codes of `code_bits` per value, then one scale byte per `block` values."""

    block: int
    code_bits: int

    def __init__(self, dim: int):
        super().__init__(dim)
        if dim % self.block:
            raise ValueError(f"{self.name} needs a width divisible by {self.block}, got {dim}")
        self.code_bytes = dim * self.code_bits // 8
        self.row_bytes = self.code_bytes + dim // self.block

    def _scale_byte(self, amax: torch.Tensor) -> torch.Tensor: ...

    def _scale_value(self, byte: torch.Tensor) -> torch.Tensor: ...

    def _codes(self, scaled: torch.Tensor) -> torch.Tensor: ...

    def _values(self, codes: torch.Tensor) -> torch.Tensor: ...

    def encode(self, x):
        n = x.shape[0]
        b = x.float().reshape(n, self.dim // self.block, self.block)
        byte = self._scale_byte(b.abs().amax(dim=-1, keepdim=True))
        codes = self._codes(b / self._scale_value(byte)).reshape(n, -1)
        return torch.cat((codes, byte.reshape(n, -1)), dim=1)

    def decode(self, raw, dtype):
        n = raw.shape[0]
        values = self._values(raw[:, :self.code_bytes]).reshape(n, self.dim // self.block, self.block)
        scale = self._scale_value(raw[:, self.code_bytes:].reshape(n, -1, 1))
        return (values * scale).reshape(n, self.dim).to(dtype)


def _ue8m0_byte(amax: torch.Tensor, floor: float, qmax: float) -> torch.Tensor:
    # model/quant.py's _pow2_ceil: the ratio rounded to fp32 first, then 2^ceil(log2(.)) exactly
    return power_of_two_scale_byte(amax.clamp(min=floor).float() / qmax, 1.0)


def _pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


class Fp8Ue8m0(_Blocked):
    """Window KV: FP8 e4m3, one power-of-two scale per 32 values (amax floor 1e-4)."""

    name, block, code_bits = "fp8-e4m3/ue8m0-32", 32, 8

    def _scale_byte(self, amax):
        return _ue8m0_byte(amax, 1e-4, FP8_MAX)

    def _scale_value(self, byte):
        return e8m0_to_float(byte)

    def _codes(self, scaled):
        return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)

    def _values(self, codes):
        return codes.contiguous().view(torch.float8_e4m3fn).float()


class Fp4E4m3(_Blocked):
    """Compressed KV: FP4 e2m1, one e4m3 scale per 16 values (amax floor 6 * 2^-9)."""

    name, block, code_bits = "fp4-e2m1/e4m3-16", 16, 4

    def _scale_byte(self, amax):
        scale = amax.clamp(min=FP4_MAX * 2.0 ** -9) / FP4_MAX
        return scale.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)

    def _scale_value(self, byte):
        return byte.contiguous().view(torch.float8_e4m3fn).float()

    def _codes(self, scaled):
        return _pack_e2m1(nearest_e2m1_code(scaled.clamp(-FP4_MAX, FP4_MAX)).reshape(scaled.shape[0], -1))

    def _values(self, codes):
        return e2m1_to_float(unpack_e2m1(codes))


class Fp4Ue8m0(Fp4E4m3):
    """Index keys: FP4 e2m1, one power-of-two scale per 32 values (MXFP4 style; amax floor 6 * 2^-126)."""

    name, block, code_bits = "fp4-e2m1/ue8m0-32", 32, 4

    def _scale_byte(self, amax):
        return _ue8m0_byte(amax, FP4_MAX * 2.0 ** -126, FP4_MAX)

    def _scale_value(self, byte):
        return e8m0_to_float(byte)


def codec_for(kind: str, dim: int, dtype: torch.dtype, fake_quant: bool) -> Codec:
    """The store of one cache kind ("window" | "kv" | "index_k"), as the reference forward rounds it."""
    cls = {"window": Fp8Ue8m0, "kv": Fp4E4m3, "index_k": Fp4Ue8m0}[kind]
    return cls(dim) if fake_quant and dim % cls.block == 0 else Raw(dim, dtype)


# ---------------------------------------------------------------------------------------------------- the pool
@dataclass(frozen=True)
class SourceLayout:
    layer: int
    ratio: int
    per_page: int  # entries per page
    has_index_k: bool


class KVPool:
    def __init__(self, *, num_slots: int, num_pages: int, page_tokens: int, ring_rows: int, window_layers,
                 sources: list[SourceLayout], head_dim: int, index_head_dim: int, dspark_stages: int = 0,
                 dtype: torch.dtype = torch.float32, fake_quant: bool = True, device="cpu", verify_rows: int = 0):
        self.num_slots, self.num_pages, self.page_tokens, self.ring_rows = num_slots, num_pages, page_tokens, ring_rows
        self.verify_rows = verify_rows
        self.dtype, self.device, self.head_dim = dtype, torch.device(device), head_dim
        self.window_codec = codec_for("window", head_dim, dtype, fake_quant)
        self.kv_codec = codec_for("kv", head_dim, dtype, fake_quant)
        self.index_codec = codec_for("index_k", index_head_dim, dtype, fake_quant)
        self.open_codec = Raw(2 * head_dim, torch.float32)  # an open group's (value, gate) row, as stored
        self.sources = {s.layer: s for s in sources}
        plan: list[tuple[tuple, tuple, torch.dtype]] = []  # (key, shape, dtype)
        for L in window_layers:
            plan.append((("window", L), (num_slots, ring_rows, self.window_codec.row_bytes), torch.uint8))
        for s in range(dspark_stages):
            plan.append((("dspark", s), (num_slots, ring_rows, self.window_codec.row_bytes), torch.uint8))
        for s in sources:
            if s.ratio > 1:
                plan.append((("open", s.layer), (num_slots, self.open_rows(s.ratio), 2, head_dim), torch.float32))
            plan.append((("kv", s.layer), (num_pages, s.per_page, self.kv_codec.row_bytes), torch.uint8))
            if s.has_index_k:
                plan.append((("index_k", s.layer), (num_pages, s.per_page, self.index_codec.row_bytes), torch.uint8))
        sizes = [_aligned(_numel(shape) * torch.empty(0, dtype=dt).element_size()) for _, shape, dt in plan]
        self.buffer = torch.zeros(sum(sizes), dtype=torch.uint8, device=self.device)  # the one allocation
        self.stores: dict[tuple, torch.Tensor] = {}
        offset = 0
        for (key, shape, dt), size in zip(plan, sizes):
            nbytes = _numel(shape) * torch.empty(0, dtype=dt).element_size()
            self.stores[key] = self.buffer[offset:offset + nbytes].view(dt).view(shape)
            offset += size
        ring = [k for k, _, _ in plan if k[0] in ("window", "dspark", "open")]
        self.bytes_per_slot = sum(self.stores[k].numel() * self.stores[k].element_size() for k in ring) // num_slots
        self.bytes_per_page = sum(self.stores[k].numel() * self.stores[k].element_size()
                                  for k in self.stores if k not in ring) // num_pages
        self.bytes_per_token = self.bytes_per_page / page_tokens

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def describe(self) -> dict:
        return {"slots": self.num_slots, "pages": self.num_pages, "page_tokens": self.page_tokens,
                "ring_rows": self.ring_rows, "bytes_per_slot": self.bytes_per_slot,
                "bytes_per_token": round(self.bytes_per_token, 2), "bytes_total": self.nbytes,
                "stores": {"window": self.window_codec.name, "kv": self.kv_codec.name,
                           "index_k": self.index_codec.name}}

    # ------------------------------------------------------------------ ring slots
    def _ring_rows(self, positions: torch.Tensor) -> torch.Tensor:
        return positions % self.ring_rows

    def read_ring(self, kind: str, layer: int, slot: int, first: int, end: int) -> torch.Tensor | None:
        """Window rows of positions [first, end) (the caller keeps end - first <= ring_rows), in compute dtype."""
        if end <= first:
            return None
        rows = self._ring_rows(torch.arange(first, end, device=self.device))
        return self.window_codec.decode(self.stores[(kind, layer)][slot].index_select(0, rows), self.dtype)

    def write_ring(self, kind: str, layer: int, slot: int, first: int, rows: torch.Tensor) -> None:
        """Store `rows` (already fake-quantised by the forward) at positions first, first + 1, ..."""
        if rows.shape[0] == 0:
            return
        idx = self._ring_rows(torch.arange(first, first + rows.shape[0], device=self.device))
        self.stores[(kind, layer)][slot].index_copy_(0, idx, self.window_codec.encode(rows))

    # The open-group store is a ring over positions: position p's (value, gate) row lives in row p mod
    # `open_modulus(r)`. Without verify rows that is p mod r, the row's place in its group (r - 1 rows: a group's
    # last member closes it and is never stored). With verify rows the ring holds r - 1 + verify_rows positions
    # (rounded up to whole groups), so a rejected draft's rows never overwrite the kept group's earlier members:
    # rolling back moves the sequence's length only (docs/ENGINE.md §3).
    def open_modulus(self, ratio: int) -> int:
        return ratio * -(-(ratio - 1 + self.verify_rows) // ratio)

    def open_rows(self, ratio: int) -> int:
        return ratio - 1 if self.verify_rows == 0 else self.open_modulus(ratio)

    def _open_index(self, ratio: int, first: int, end: int) -> torch.Tensor:
        return torch.arange(first, end, device=self.device) % self.open_modulus(ratio)

    def read_open(self, layer: int, slot: int, start: int):
        """The (value, gate) rows, fp32, of the group open at `start` (positions start // r * r .. start - 1);
        (None, None) when empty."""
        r = self.sources[layer].ratio
        first = start // r * r
        if first == start:
            return None, None
        group = self.stores[("open", layer)][slot].index_select(0, self._open_index(r, first, start))
        return group[:, 0].clone(), group[:, 1].clone()

    def write_open(self, layer: int, slot: int, v: torch.Tensor | None, s: torch.Tensor | None,
                   end: int | None = None) -> None:
        """Store the (value, gate) rows of positions end - n .. end - 1 (n = rows given, at most the ring's last
        ones). `end` None: the rows are an open group's first members (a pool without verify rows only)."""
        if v is None or not v.shape[0]:
            return
        r = self.sources[layer].ratio
        n = min(v.shape[0], self.open_rows(r))
        if end is None:
            if self.verify_rows or n != v.shape[0]:
                raise ValueError("write_open without `end` stores an open group's first rows (no verify rows)")
            idx = torch.arange(n, device=self.device)
        else:
            idx = self._open_index(r, end - n, end)
        self.stores[("open", layer)][slot].index_copy_(0, idx, torch.stack((v[-n:].float(), s[-n:].float()), dim=1))

    def copy_slot(self, src: int, dst: int) -> None:
        """A fork: ring slot `dst` becomes a copy of `src` (window rows, DSpark rings, open compressor groups)."""
        for (kind, _), store in self.stores.items():
            if kind in ("window", "dspark", "open"):
                store[dst].copy_(store[src])

    def _slot_stores(self):
        return [store for (kind, _), store in self.stores.items() if kind in ("window", "dspark", "open")]

    def snapshot_slot(self, slot: int) -> torch.Tensor:
        """A session entry's copy of ring slot `slot` (window rows, DSpark rings, open groups): uint8
        [bytes_per_slot], on the pool's device."""
        return torch.cat([store[slot].reshape(-1).view(torch.uint8) for store in self._slot_stores()])

    def restore_slot(self, snapshot: torch.Tensor, slot: int) -> None:
        """Ring slot `slot` becomes the snapshot's bytes (`snapshot_slot`'s layout)."""
        if snapshot.numel() != self.bytes_per_slot:
            raise ValueError(f"a slot snapshot of {snapshot.numel()} bytes, this pool's slots hold "
                             f"{self.bytes_per_slot}")
        at = 0
        for store in self._slot_stores():
            view = store[slot].reshape(-1).view(torch.uint8)
            view.copy_(snapshot[at:at + view.numel()])
            at += view.numel()

    def _page_stores(self):
        return [store for (kind, _), store in self.stores.items() if kind in ("kv", "index_k")]

    def page_bytes(self, page: int) -> torch.Tensor:
        """Page `page`'s bytes in every store (compressed entries and index keys of every source): uint8
        [bytes_per_page] (a parked session entry's block)."""
        return torch.cat([store[page].reshape(-1) for store in self._page_stores()])

    def load_page(self, data: torch.Tensor, page: int) -> None:
        """Page `page` becomes `page_bytes`' layout of `data`."""
        if data.numel() != self.bytes_per_page:
            raise ValueError(f"a page of {data.numel()} bytes, this pool's pages hold {self.bytes_per_page}")
        at = 0
        for store in self._page_stores():
            view = store[page].reshape(-1)
            view.copy_(data[at:at + view.numel()])
            at += view.numel()

    def copy_page(self, src: int, dst: int) -> None:
        """A fork: page `dst` becomes a copy of `src` (every source's compressed entries and index keys)."""
        for (kind, _), store in self.stores.items():
            if kind in ("kv", "index_k"):
                store[dst].copy_(store[src])

    # ------------------------------------------------------------------ pages
    def _entry_index(self, layer: int, page_ids: list[int], first: int, end: int) -> torch.Tensor:
        per = self.sources[layer].per_page
        e = torch.arange(first, end, device=self.device)
        table = torch.tensor(page_ids, dtype=torch.long, device=self.device)
        return table[e // per] * per + e % per

    def read_entries(self, layer: int, page_ids: list[int], n: int):
        """Entries [0, n) of a KV source: (compressed KV [n, head_dim], index keys [n, index_head_dim] or None)."""
        if n == 0:
            return None, None
        idx = self._entry_index(layer, page_ids, 0, n)
        kv = self.kv_codec.decode(self.stores[("kv", layer)].flatten(0, 1).index_select(0, idx), self.dtype)
        ik = None
        if ("index_k", layer) in self.stores:
            ik = self.index_codec.decode(self.stores[("index_k", layer)].flatten(0, 1).index_select(0, idx),
                                         self.dtype)
        return kv, ik

    def write_entries(self, layer: int, page_ids: list[int], first: int, kv: torch.Tensor,
                      index_k: torch.Tensor | None) -> None:
        if kv.shape[0] == 0:
            return
        idx = self._entry_index(layer, page_ids, first, first + kv.shape[0])
        self.stores[("kv", layer)].flatten(0, 1).index_copy_(0, idx, self.kv_codec.encode(kv))
        if index_k is not None and ("index_k", layer) in self.stores:
            self.stores[("index_k", layer)].flatten(0, 1).index_copy_(0, idx, self.index_codec.encode(index_k))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pool_for_model(model, *, num_slots: int, num_pages: int, page_tokens: int, verify_rows: int = 0,
                   device=None) -> KVPool:
    """A pool shaped for `model` (a reference `Model`): its layers, KV sources, widths, dtype and quantisers."""
    cfg = model.cfg
    sources = []
    for block in model.blocks:
        role = block.attn.role
        if role.compresses:
            if page_tokens % role.compress_ratio:
                raise ValueError(f"--page-tokens {page_tokens} is not a multiple of layer {role.index}'s ratio")
            sources.append(SourceLayout(role.index, role.compress_ratio, page_tokens // role.compress_ratio,
                                        block.attn.p.compressor.index_wk is not None))
    fake_quant = all(b.attn.fake_quant for b in model.blocks)
    stages = len(model.dspark.blocks) if model.dspark is not None else 0
    return KVPool(num_slots=num_slots, num_pages=num_pages, page_tokens=page_tokens, verify_rows=verify_rows,
                  ring_rows=cfg.sliding_window + verify_rows, window_layers=[b.index for b in model.blocks],
                  sources=sources, head_dim=cfg.head_dim, index_head_dim=cfg.index_head_dim, dspark_stages=stages,
                  dtype=model.dtype, fake_quant=fake_quant, device=device or model.device)
