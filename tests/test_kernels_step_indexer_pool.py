"""Index scores read from the KV pool's pages in place (dsv41.kernels.step.indexer `index_scores_pool`).

A real KVPool's index-key pages (FP4 and raw stores, shuffled page ids) read in place must give bit for bit
`index_scores` over the keys gathered and decoded in torch (`read_entries`), rows alone == together, and the padded
column bucket's ids / candidate pools those of each row's own columns; interpreted at a tiny shape (one child
process, tests/step_harness.py), and on the GPU also at the release's shape and under a CUDA graph replay.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

from step_harness import interpreted, need_compiled_cuda  # noqa: E402

_need_cuda = need_compiled_cuda


POOL_CASES = ("fp4", "fp4_allow", "raw")
POOL_K, POOL_BLOCK, POOL_TOPK_BLOCKS = 8, 4, 3  # index top-k, candidate block, candidate blocks kept


def _pool_case(name: str, dev, full: bool = False):
    """A real KVPool (one KV source, layer 2) whose index keys hold sequences at shuffled, non-sequential pages,
    and the rows of one step over them: per sequence consecutive rows with growing n_vis (a verify window), rows
    crossing a BLOCK_C boundary, a sequence of 0 entries (n_vis 0, an empty page table), one of 1 entry.
    fp4*: the release's FP4 index-key codec (bf16 pool, quantised q), 'raw': fake_quant=False (bf16 rows, hd 48 so
    hd is not a power of two), pages int32 there. full: the release's 32 heads x 128, per_page 16, C up to 4,096.
    Returns the pool, the layer, per sequence (page ids, C), and per row q, w, pages [B, P], n_vis, C, allow."""
    from dsv41.model.quant import fp4_block_ue8m0
    from dsv41.runtime.kv_pool import KVPool, SourceLayout

    gen = torch.Generator().manual_seed(sum(map(ord, name)) + 17 + full)
    raw = name.startswith("raw")
    if full:
        H, hd, per_page, ncols = 32, 128, 16, 8192
        seqs = ((4096, (4089, 4090, 4091, 4092, 4093, 4094, 4095, 4096)), (1000, (1000,)), (513, (510, 511, 512, 513)),
                (7, (7,)), (0, (0,)), (2049, (2049, 2000)))
    else:
        H, hd, per_page, ncols = 5, (48 if raw else 64), (8 if raw else 4), 200
        seqs = ((13, (10, 11, 12, 13)), (70, (63, 64, 65, 66, 70)), (4, (4,)), (0, (0,)), (1, (1, 0)))
    n_pages = [-(-C // per_page) for C, _ in seqs]
    num_pages = sum(n_pages) + 5
    perm = torch.randperm(num_pages, generator=gen).tolist()
    pool = KVPool(num_slots=1, num_pages=num_pages, page_tokens=per_page, ring_rows=4, window_layers=[],
                  sources=[SourceLayout(2, 1, per_page, True)], head_dim=64, index_head_dim=hd,
                  dtype=torch.bfloat16, fake_quant=not raw, device=dev)
    tables, at = [], 0
    for (C, _), n in zip(seqs, n_pages):
        ids = perm[at:at + n]
        at += n
        tables.append(ids)
        if C:
            keys = torch.randn(C, hd, generator=gen) * torch.logspace(-2, 1, C)[:, None]
            keys = keys.bfloat16().to(dev)
            half = C // 2  # written in two steps, as a prefill then a decode would
            pool.write_entries(2, ids, 0, torch.zeros(half, 64, device=dev), keys[:half])
            pool.write_entries(2, ids, half, torch.zeros(C - half, 64, device=dev), keys[half:])
    P = max(n_pages)
    pages, n_vis, own = [], [], []
    for (C, vis), ids in zip(seqs, tables):
        for v in vis:
            pages.append(ids + [-1] * (P - len(ids)))  # padding past a row's pages is never read
            n_vis.append(v)
            own.append(C)
    B = len(n_vis)
    q = torch.randn(B, H, hd, generator=gen)
    q = (q.bfloat16() if raw else fp4_block_ue8m0(q.bfloat16(), 32, True)).to(dev)
    w = (torch.randn(B, H, generator=gen) * (hd * H) ** -0.5).to(dev)
    idt = torch.int32 if raw else torch.int64
    allow = (torch.rand(B, ncols, generator=gen) < 0.7).to(dev) if name.endswith("allow") else None
    return SimpleNamespace(pool=pool, layer=2, seqs=[(ids, C) for ids, (C, _) in zip(tables, seqs)], q=q, w=w,
                           pages=torch.tensor(pages, dtype=idt, device=dev), per_page=per_page,
                           n_vis=torch.tensor(n_vis, dtype=idt, device=dev), own=own, ncols=ncols, allow=allow)


def _pool_reference_inputs(case):
    """index_scores's inputs: each sequence's keys gathered from its pages and decoded in torch (`read_entries`),
    concatenated; per row the offset of its sequence (q_row = arange)."""
    keys, offs, at = [], {}, 0
    for ids, C in case.seqs:
        offs[tuple(ids)] = at
        if C:
            keys.append(case.pool.read_entries(case.layer, ids, C)[1])
            at += C
    dev = case.q.device
    key_off = []
    for r in range(case.q.shape[0]):
        ids = [p for p in case.pages[r].tolist() if p >= 0]
        key_off.append(offs[tuple(ids)])
    return torch.cat(keys), torch.tensor(key_off, device=dev)


def _pool_outputs(name: str, dev, full: bool = False) -> dict:
    """The pool kernel over all rows, each row alone (the bucket and its own C columns), the reference launch,
    and top-k / candidate pools of the bucket and of each row's own columns."""
    from dsv41.kernels.step.indexer import candidate_mask, index_scores, index_scores_pool, topk_select

    c = _pool_case(name, dev, full)
    store, codec = c.pool.stores[("index_k", c.layer)], c.pool.index_codec
    keys, key_off = _pool_reference_inputs(c)
    B = c.q.shape[0]

    def pool_rows(rows, ncols, allow):
        return index_scores_pool(c.q[rows], c.w[rows], store, codec, c.pages[rows], c.per_page, c.n_vis[rows], ncols,
                                 allow)

    got = pool_rows(slice(None), c.ncols, c.allow)
    ref = index_scores(c.q, c.w, keys, torch.arange(B, device=dev), key_off, c.n_vis, c.ncols, c.allow)
    alone = [pool_rows(slice(i, i + 1), c.ncols, None if c.allow is None else c.allow[i:i + 1]) for i in range(B)]
    own = [pool_rows(slice(i, i + 1), C, None if c.allow is None else c.allow[i:i + 1, :C])
           for i, C in enumerate(c.own)]
    k = min(POOL_K, c.ncols)
    return {"got": got, "ref": ref, "alone": alone, "own": own, "n_vis": c.n_vis.cpu(), "C": c.own,
            "allow": None if c.allow is None else c.allow.cpu(), "codec": codec.name,
            "ids": topk_select(got, k), "cand": candidate_mask(got, c.n_vis, POOL_BLOCK, POOL_TOPK_BLOCKS),
            "ids_own": [topk_select(o, min(POOL_K, C)) for o, C in zip(own, c.own)],
            "cand_own": [candidate_mask(o, c.n_vis[i:i + 1], POOL_BLOCK, POOL_TOPK_BLOCKS) if C else None
                         for i, (o, C) in enumerate(zip(own, c.own))]}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _judge_pool(out: dict, ncols: int) -> None:
    """Bit for bit index_scores over the torch-gathered keys; -inf exactly where c >= n_vis or not allowed; every
    row alone (bucket or own columns) == among the others; ids / candidate pools of the bucket == the row's own."""
    got, ref = out["got"].cpu(), out["ref"].cpu()
    assert got.shape == (len(out["C"]), ncols) and got.dtype == torch.float32
    assert torch.equal(_bits(got), _bits(ref))
    live = torch.arange(ncols)[None] < out["n_vis"][:, None].long()
    if out["allow"] is not None:
        live &= out["allow"]
    assert torch.equal(torch.isfinite(got), live) and bool(torch.isneginf(got[~live]).all())
    k = min(POOL_K, ncols)
    for i, C in enumerate(out["C"]):
        assert torch.equal(_bits(out["alone"][i][0].cpu()), _bits(got[i])), i
        assert torch.equal(_bits(out["own"][i][0].cpu()), _bits(got[i, :C])), i
        kc = min(POOL_K, C)
        ids = out["ids"][i].cpu()
        assert torch.equal(ids[k - kc:], out["ids_own"][i][0].cpu()), i
        assert bool((ids[:k - kc] == -1).all()), i
        if C:
            assert torch.equal(out["cand"][i, :C].cpu(), out["cand_own"][i][0].cpu()), i
        assert not out["cand"][i, -(-C // POOL_BLOCK) * POOL_BLOCK:].any(), i  # past its last block: never kept


def _interp_worker(out_path: str) -> None:
    torch.save({"pool_" + name: _pool_outputs(name, "cpu") for name in POOL_CASES}, out_path)


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "indexer_pool")


@pytest.mark.parametrize("name", POOL_CASES)
def test_interpreted_pool_scores_equal_the_gathered_keys_bit_for_bit(interp, name):
    """`index_scores_pool` reading the index keys in place from a real KVPool's pages (shuffled page ids, entries
    over several pages, a verify window of rows, rows across a BLOCK_C boundary, n_vis 0, an allow mask, the raw
    store) == `index_scores` over the keys gathered and decoded in torch, bit for bit; each row alone (in the
    200-column bucket or at its own C) has its bits among the others; the bucket's ids are the row's own top-k's
    (its last min(k, C) columns, -1 before) and its candidate pool agrees with the row's own on the first C columns."""
    out = interp["pool_" + name]
    assert out["codec"] == ("raw-bfloat16" if name == "raw" else "fp4-e2m1/ue8m0-32")
    _judge_pool(out, 200)


def test_pool_scores_reject_bad_inputs():
    """Clear ValueErrors (before any launch) for shapes, dtypes and codecs that do not fit."""
    from dsv41.kernels.step.indexer import index_scores_pool
    from dsv41.runtime.kv_pool import Fp8Ue8m0

    c = _pool_case("fp4", "cpu")
    store, codec = c.pool.stores[("index_k", c.layer)], c.pool.index_codec
    args = dict(q=c.q, w=c.w, key_store=store, key_codec=codec, pages=c.pages, per_page=c.per_page, n_vis=c.n_vis,
                ncols=c.ncols)
    B = c.q.shape[0]
    bad = [dict(q=c.q[0]), dict(q=c.q.long()), dict(w=c.w[:, :2]), dict(w=c.w[1:]), dict(key_store=store.float()),
           dict(key_store=store[:, :2]), dict(per_page=c.per_page * 2), dict(key_store=store[..., :-1]),
           dict(key_codec=Fp8Ue8m0(64)), dict(key_codec=SimpleNamespace(name="nope", dim=64, row_bytes=34)),
           dict(pages=c.pages.float()), dict(pages=c.pages[1:]), dict(pages=c.pages[:, 0]),
           dict(n_vis=c.n_vis.float()), dict(n_vis=c.n_vis[1:]), dict(ncols=-1), dict(per_page=0),
           dict(allow=torch.ones(B, c.ncols + 1, dtype=torch.bool)), dict(allow=torch.ones(B, c.ncols))]
    for change in bad:
        with pytest.raises(ValueError):
            index_scores_pool(**{**args, **change})


@pytest.mark.gpu
@pytest.mark.parametrize("name", POOL_CASES)
def test_gpu_pool_scores_equal_the_gathered_keys_bit_for_bit(name):
    """The interpreted test's pools, compiled: `index_scores_pool` == `index_scores` over the torch-gathered keys,
    bit for bit, rows alone == together, the bucket's ids / candidate pools == each row's own."""
    _need_cuda()
    _judge_pool(_pool_outputs(name, torch.device("cuda")), 200)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp4", "raw"])
def test_gpu_pool_scores_full_shape_and_graph_capture(name):
    """The release's shape (32 index heads x 128, per_page 16, sequences of up to 4,096 entries over shuffled
    pages, an 8,192-column bucket): bit for bit the gathered keys' `index_scores`, rows alone == together; then
    one CUDA graph of `index_scores_pool` replayed after changing n_vis and the page tables in place gives the
    eager bits (no host sync, no data-dependent allocation)."""
    _need_cuda()
    from dsv41.kernels.step.indexer import index_scores_pool

    dev = torch.device("cuda")
    _judge_pool(_pool_outputs(name, dev, full=True), 8192)
    c = _pool_case(name, dev, full=True)
    store, codec = c.pool.stores[("index_k", c.layer)], c.pool.index_codec
    pages, n_vis = c.pages.clone(), c.n_vis.clone()

    def run():
        return index_scores_pool(c.q, c.w, store, codec, pages, c.per_page, n_vis, c.ncols)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = run()
    gen = torch.Generator(device="cpu").manual_seed(5)
    for _ in range(2):
        n_vis.copy_((c.n_vis.cpu() * torch.rand(n_vis.shape[0], generator=gen)).to(n_vis.dtype))
        rows = torch.randperm(pages.shape[0], generator=gen)
        pages.copy_(c.pages[rows.to(dev)])  # other rows' tables (their n_vis fits: the longest C's rows)
        n_vis.copy_(torch.minimum(n_vis, c.n_vis[rows.to(dev)]))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(_bits(static), _bits(run()))


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    _interp_worker(sys.argv[2])
