"""The KV pool stores the release's rounding exactly: decode(encode(x)) == fake_quant(x) bit for bit for every cache
kind, in fp32 and bf16, edge cases included (zeros, values under the amax floors, e2m1 ties, huge and tiny
scales); and its ring slots and pages put every row back where a sequence looks for it."""

from __future__ import annotations

import pytest
import torch

from dsv41.model.quant import fp4_block_e4m3, fp4_block_ue8m0, fp8_block_ue8m0
from dsv41.runtime.kv_pool import KVPool, Raw, SourceLayout, codec_for

KINDS = {"window": (fp8_block_ue8m0, 32), "kv": (fp4_block_e4m3, 16), "index_k": (fp4_block_ue8m0, 32)}


def nasty_rows(dim: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    rows = [torch.randn(64, dim, generator=g) * torch.logspace(-30, 30, 64)[:, None],
            torch.zeros(2, dim), torch.full((2, dim), 1e-38), torch.full((2, dim), -3e38),
            torch.randn(4, dim, generator=g) * 1e-6]
    # exact e2m1 ties and midpoints after the block scale (amax 6 -> scale 1 for the FP4 kinds)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.75, -5.0, 0.0, -0.0,
                         0.5, 6.0]).repeat(dim // 16)
    rows += [ties[None], (ties * 2.0 ** -20)[None], (ties * 448 / 6)[None]]
    return torch.cat(rows).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(KINDS))
def test_stored_codes_and_scales_dequantise_to_the_fake_quantised_values(kind, dtype):
    fake, block = KINDS[kind]
    x = nasty_rows(128, dtype)
    codec = codec_for(kind, 128, dtype, fake_quant=True)
    raw = codec.encode(x)
    assert raw.dtype == torch.uint8 and raw.shape == (x.shape[0], codec.row_bytes)
    bits = 8 if kind == "window" else 4
    assert codec.row_bytes == 128 * bits // 8 + 128 // block
    got, want = codec.decode(raw, dtype), fake(x, block)
    assert got.dtype == dtype and torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                              want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_skipped_quantisers_store_the_compute_values():
    x = torch.randn(5, 40)
    for kind in KINDS:
        codec = codec_for(kind, 40, torch.float32, fake_quant=True)  # 40 is no multiple of 16 or 32
        assert isinstance(codec, Raw) and torch.equal(codec.decode(codec.encode(x), torch.float32), x)
        off = codec_for(kind, 128, torch.bfloat16, fake_quant=False)
        y = torch.randn(3, 128).bfloat16()
        assert isinstance(off, Raw) and torch.equal(off.decode(off.encode(y), torch.bfloat16), y)


def test_ring_slots_and_pages_round_trip_through_one_allocation():
    sources = [SourceLayout(2, 2, 8, True), SourceLayout(6, 1, 16, False)]
    pool = KVPool(num_slots=3, num_pages=5, page_tokens=16, ring_rows=10, window_layers=[0, 2, 6],
                  sources=sources, head_dim=128, index_head_dim=128)
    views = [t.untyped_storage().data_ptr() for t in pool.stores.values()]
    assert all(v == pool.buffer.untyped_storage().data_ptr() for v in views)  # views of the one buffer
    assert pool.bytes_per_slot == 3 * 10 * (128 + 4) + 1 * 2 * 128 * 4
    assert pool.bytes_per_token == ((64 + 8) + (64 + 4)) / 2 + (64 + 8)
    # ring: 25 positions through a 10-row ring; the last 10 are there, in order
    rows = fp8_block_ue8m0(torch.randn(25, 128))
    pool.write_ring("window", 2, 1, 0, rows[:7])
    pool.write_ring("window", 2, 1, 7, rows[7:])
    assert torch.equal(pool.read_ring("window", 2, 1, 15, 25), rows[15:])
    assert pool.read_ring("window", 2, 1, 4, 4) is None
    # pages: entries of a page table [4, 0, 3], written in two pieces
    kv, ik = fp4_block_e4m3(torch.randn(20, 128)), fp4_block_ue8m0(torch.randn(20, 128))
    pool.write_entries(2, [4, 0, 3], 0, kv[:5], ik[:5])
    pool.write_entries(2, [4, 0, 3], 5, kv[5:], ik[5:])
    got_kv, got_ik = pool.read_entries(2, [4, 0, 3], 20)
    assert torch.equal(got_kv, kv) and torch.equal(got_ik, ik)
    assert pool.read_entries(6, [1], 0) == (None, None)
    assert pool.read_entries(6, [1], 1)[1] is None  # a source without index keys
    # open compressor group (fp32 rows)
    v, s = torch.randn(1, 128), torch.randn(1, 128)
    pool.write_open(2, 2, v, s)
    assert all(torch.equal(a, b) for a, b in zip(pool.read_open(2, 2, 1), (v, s)))
    assert pool.read_open(2, 2, 0) == (None, None)


def test_load_and_store_keeps_entries_whose_fake_quantiser_is_not_idempotent():
    """A compressed entry block with its amax in the e4m3 scale's band (~0.0176-0.0195): fake_quant(fake_quant(x))
    != fake_quant(x) there, so a pool that encoded the fake-quantised rows would read back other values than the
    step's attention read. The load-and-store path (PoolSequence) stores the entries as they were before their FP4:
    the pool then holds exactly fake_quant(x), for those blocks and for ordinary ones, across two steps."""
    from types import SimpleNamespace

    from dsv41.runtime.pool_forward import PoolSequence

    sources = [SourceLayout(2, 2, 8, True)]
    pool = KVPool(num_slots=2, num_pages=4, page_tokens=16, ring_rows=10, window_layers=[2], sources=sources,
                  head_dim=128, index_head_dim=128)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 128, generator=g)
    blocks = x.view(6, 8, 16)
    blocks[:3] *= 0.0185 / blocks[:3].abs().amax(dim=-1, keepdim=True)  # rows 0-2: every block in the band
    fq = fp4_block_e4m3(x, 16)
    again = pool.kv_codec.decode(pool.kv_codec.encode(fq), torch.float32)
    assert not torch.equal(again[:3], fq[:3]), "the case must hit the non-idempotent band"
    cfg = SimpleNamespace(sliding_window=8)
    ik = fp4_block_ue8m0(torch.randn(6, 128, generator=g))
    for first, rows in ((0, slice(0, 4)), (8, slice(4, 6))):  # two steps: 4 entries at positions 0-7, then 2
        n = rows.stop - rows.start
        row = SimpleNamespace(slot=0, page_ids=[3, 1], start_pos=first, token_ids=[0] * (2 * n), replay_start=0)
        view = PoolSequence(pool, row, cfg, decoder_from=99)
        src = view.source(2)
        src.append_entries(x[rows], fp4_block_e4m3(x[rows], 16))
        src.index_k = ik[rows] if src.index_k is None else torch.cat((src.index_k, ik[rows]))
        view.store()
    kv, index_k = pool.read_entries(2, [3, 1], 6)
    assert torch.equal(kv, fq) and torch.equal(index_k, ik)
