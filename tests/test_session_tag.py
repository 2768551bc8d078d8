"""The NVMe tier's tag (runtime/session_disk.session_tag): what a parked entry must match to be resumed.

A restart sizes the KV pool from the memory free at that moment, so it may come back with another page count; the
entries it parked before load into any pool of the same per-entry layout, so the pool's size is not in the tag,
while its layout (page tokens, ring rows, codecs, sources), the checkpoint, the knobs and the rank are."""

from __future__ import annotations

from types import SimpleNamespace

from dsv41.runtime.kv_pool import KVPool, SourceLayout
from dsv41.runtime.session_disk import session_tag


def _pool(*, slots=3, pages=4, page_tokens=16, ring_rows=8, fake_quant=True):
    return KVPool(num_slots=slots, num_pages=pages, page_tokens=page_tokens, ring_rows=ring_rows,
                  window_layers=[0, 1], sources=[SourceLayout(1, 4, 4, True)], head_dim=64, index_head_dim=32,
                  fake_quant=fake_quant)


def _tag(pool, **kw):
    args = dict(knobs="", checkpoint="ckpt", cfg=SimpleNamespace(hidden_size=64), pool=pool, rank=0, world=1)
    return session_tag(**{**args, **kw})


def test_the_pool_size_is_not_in_the_tag():
    assert _tag(_pool()) == _tag(_pool(pages=5)) == _tag(_pool(slots=2, pages=400))


def test_the_layout_checkpoint_knobs_and_rank_are():
    base = _tag(_pool())
    others = [_tag(_pool(page_tokens=32)), _tag(_pool(ring_rows=16)), _tag(_pool(fake_quant=False)),
              _tag(_pool(), checkpoint="other"), _tag(_pool(), knobs="prefill=replay"), _tag(_pool(), rank=1, world=2),
              _tag(_pool(), cfg=SimpleNamespace(hidden_size=128))]
    assert all(t != base for t in others) and len(set(others)) == len(others)
