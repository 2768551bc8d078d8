"""Chunked prefill on the fast path is one-shot, bit for bit, at the full shape (issue 31; GPU only).

A 16K-token prompt prefilled into one sequence of the full-shape synthetic rank (`runtime/synthetic.py`) in 2K-row
chunks and in 4K-row chunks: every stored cache byte of the sequence (each layer's window, compressed entries, index
keys, open groups) and the logits of the rows both runs return are the same bits. Every op of a prefill chunk is
row-invariant (the tile kernels, the router's tiled logits, the index score tiles, the per-row step kernels), so the
cut never shows. The first 21 layers hold every layer role (SWA only, ratio 2 and ratio 1 KV sources, the indexer,
the candidate source at layer 20, both Engram layers); on the CPU the same claim is
tests/test_engine_batched.py's (the pool forward over the reference).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv41.parallel.comm import Comm

import os

LAYERS = int(os.environ.get("DSV41_TEST_PREFILL_LAYERS", "21"))  # fewer for a quick look; 21 holds every role
PROMPT = 16384


class _HalfOfTwo(Comm):
    """Rank 0 of TP=2 without its peer: partials summed with themselves, shards concatenated with themselves."""

    rank, world = 0, 2
    graph_safe = True

    def sum_partials(self, x):
        return x + x

    def gather_cat(self, x, dim):
        return torch.cat((x, x), dim=dim)


def _tensors(obj, path="state"):
    """Every tensor the sequence state holds, by path."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name), f"{path}.{f.name}")
    elif isinstance(obj, dict):
        for k in sorted(obj):
            yield from _tensors(obj[k], f"{path}[{k}]")


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32,
                                                                        8: torch.int64}[t.element_size()])


# chunk lengths in order, the last repeated: 2K chunks (the default), and the cuts a resumed session makes (a cut at
# the prompt's mark S, anywhere: inside a ratio-2 group, one open row carried across it), against 4K chunks
SCHEMES = {"2K chunks": [2048], "odd cuts inside ratio-2 groups": [2047, 1, 3, 2045, 2048]}


def _prefill(model, ids, cuts: list[int]):
    """The prompt in chunks of `cuts` (the last length repeated): the state, and a few rows' logits of each chunk."""
    st, rows, a, i = model.new_state(), {}, 0, 0
    while a < ids.numel():
        n = min(cuts[min(i, len(cuts) - 1)], ids.numel() - a)
        logits = model.forward([(st, ids[a:a + n])], "prefill", logits="all")
        for r in {0, n // 2 + 1, n - 1} & set(range(n)):
            rows[a + r] = logits[r].cpu()
        a, i = a + n, i + 1
    return st, rows


@pytest.fixture(scope="module")
def full_shape():
    """The full-shape synthetic rank's first LAYERS layers, a 16K prompt and its prefill in 4K chunks."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the full-shape synthetic rank)")
    from dsv41.runtime.synthetic import synthetic_rank

    model = synthetic_rank(None, rank=0, world=2, device="cuda", dtype=torch.bfloat16, comm=_HalfOfTwo(),
                           layers=LAYERS)
    ids = torch.randint(0, model.cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(16))
    return model, ids, _prefill(model, ids, [4096])


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_gpu_full_shape_16k_prompt_chunked_is_4k_chunks_bitwise(full_shape, scheme):
    model, ids, (st4, lg4) = full_shape
    st2, lg2 = _prefill(model, ids, SCHEMES[scheme])
    assert st2.pos == st4.pos == PROMPT
    a, b = dict(_tensors(st2)), dict(_tensors(st4))
    assert a.keys() == b.keys() and len(a) > LAYERS  # each layer's window, the sources' entries and keys
    differ = []
    for path in a:
        assert a[path].shape == b[path].shape and a[path].dtype == b[path].dtype, path
        rows = (_bits(a[path]) != _bits(b[path])).reshape(a[path].shape[0], -1).any(dim=1).nonzero().flatten()
        if rows.numel():
            differ.append(f"{path}: {rows.numel()} of {a[path].shape[0]} rows, first {int(rows[0])}")
    assert not differ, differ
    common = sorted(lg2.keys() & lg4.keys())
    assert len(common) >= 4
    for r in common:
        assert torch.equal(_bits(lg2[r]), _bits(lg4[r])), f"logits of row {r}"
