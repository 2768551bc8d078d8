"""The prefill index scores on the tensor cores (dsv41.kernels.step.index_tiles) against the reference.

Reference: `FastAttention._scores` (the reference's index scores). The operands are FP4-fake-quantised values
(exact in bf16), so every product is exact and only the fp32 sums' order is the kernel's: bound per row 1e-5 x the
row's largest sum_h |w_h| sum_d |q_hd k_d| (tests/test_kernels_step_indexer.py says why). On integer q, k and dyadic
w every sum is exact in fp32: there the scores are bitwise the reference's. CPU: Triton's interpreter in a child
process (TRITON_INTERPRET is read when the kernels are decorated); bits across launches are compared on the GPU
only (the interpreter's tl.dot is numpy's BLAS). GPU: the full shape, rows alone == among others, bitwise.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from step_harness import interpreted, need_compiled_cuda  # noqa: E402


def _case(exact: bool, H=4, hd=32, C=150, R=11, dev="cpu", seed=5):
    from dsv41.model.quant import fp4_block_ue8m0

    gen = torch.Generator(device=dev).manual_seed(seed)
    if exact:
        q = torch.randint(-2, 3, (R, H, hd), generator=gen, device=dev).float()
        k = torch.randint(-2, 3, (C, hd), generator=gen, device=dev).float()
        w = torch.randint(-4, 5, (R, H), generator=gen, device=dev).float() / 4
    else:
        q = fp4_block_ue8m0(torch.randn(R, H, hd, generator=gen, device=dev), 32, True)
        k = fp4_block_ue8m0(torch.randn(C, hd, generator=gen, device=dev), 32, True)
        w = torch.randn(R, H, generator=gen, device=dev)
    # causal visibility of a prefill chunk at the end of the entries, one row seeing none
    n_vis = torch.arange(C - R + 1, C + 1, device=dev)
    n_vis[0] = 0
    return q, w, k, n_vis


def _reference(q, w, k, n_vis, ncols):
    from dsv41.runtime.layers.attention import FastAttention

    C = k.shape[0]
    out = torch.full((q.shape[0], ncols), float("-inf"), device=q.device)
    visible = torch.arange(C, device=q.device)[None] < n_vis[:, None]
    out[:, :C] = FastAttention._scores(q, w, SimpleNamespace(index_k=k), visible)
    return out


def _bound(q, w, k, n_vis):
    per = (w.double().abs()[:, :, None] * (q.double().abs() @ k.double().abs().t())).sum(1)
    return 1e-5 * float(per.max())


def _worker(out_path: str) -> None:
    from dsv41.kernels.step.index_tiles import index_scores_tiles

    res = {}
    for exact in (True, False):
        q, w, k, n_vis = _case(exact)
        ncols = k.shape[0] + 20  # columns past C: -inf
        got = index_scores_tiles(q, w, k, n_vis, ncols, w_scales=(0.5, 2.0))
        ref = _reference(q, w * 0.5 * 2.0, k, n_vis, ncols)
        fin = torch.isfinite(ref)
        allow = torch.rand(q.shape[0], ncols, generator=torch.Generator().manual_seed(2)) > 0.3
        masked = index_scores_tiles(q, w, k, n_vis, ncols, allow=allow)
        res["exact" if exact else "fp4"] = {
            "same_inf": bool(torch.equal(torch.isneginf(got), torch.isneginf(ref))),
            "max_err": float((got[fin] - ref[fin]).abs().max()),
            "bound": _bound(q, w, k, n_vis),
            "bitwise": bool(torch.equal(got, ref)),
            "allow_ok": bool(torch.equal(masked, torch.where(allow, index_scores_tiles(q, w, k, n_vis, ncols),
                                                             torch.full_like(masked, float("-inf"))))),
            # the programs of several entry blocks (the queries loaded once): the one-block programs' products
            "sub_same": bool(torch.equal(index_scores_tiles(q, w, k, n_vis, ncols, w_scales=(0.5, 2.0),
                                                            tile="128x64s4w8"), got)),
            "sub_masked_same": bool(torch.equal(index_scores_tiles(q, w, k, n_vis, ncols, allow=allow,
                                                                   tile="128x64s4w8"), masked)),
        }
    torch.save(res, out_path)


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "index_tiles")


def test_interpreted_integer_scores_are_the_reference_bitwise(interp):
    r = interp["exact"]
    assert r["bitwise"] and r["same_inf"], r


def test_interpreted_fp4_scores_within_fp32_sum_rounding(interp):
    r = interp["fp4"]
    assert r["same_inf"], r
    assert r["max_err"] <= r["bound"], r


def test_interpreted_candidate_pool_masks_scores(interp):
    assert interp["exact"]["allow_ok"] and interp["fp4"]["allow_ok"]


def test_interpreted_programs_of_several_entry_blocks_are_the_one_block_programs(interp):
    assert all(interp[c]["sub_same"] and interp[c]["sub_masked_same"] for c in ("exact", "fp4")), interp


def test_the_tile_knob_names_a_shape_and_rejects_others(monkeypatch):
    from dsv41.kernels.step import index_tiles

    monkeypatch.delenv(index_tiles.TILE_ENV, raising=False)
    assert index_tiles.index_tile() == index_tiles.TILES[index_tiles.DEFAULT_TILE]
    # the default runs the one-block programs' products in programs of several blocks (the same bits)
    assert index_tiles.index_tile().sub > 1 and index_tiles.index_tile().tile_m == index_tiles.IndexTile().tile_m
    monkeypatch.setenv(index_tiles.TILE_ENV, "128x64s8w8")
    assert index_tiles.index_tile().sub == 8
    monkeypatch.setenv(index_tiles.TILE_ENV, "99x1")
    with pytest.raises(ValueError, match="DSV41_INDEX_TILE"):
        index_tiles.index_tile()


@pytest.mark.gpu
def test_gpu_full_shape_rows_are_chunk_invariant():
    need_compiled_cuda()
    from dsv41.kernels.step.index_tiles import index_scores_tiles

    q, w, k, n_vis = _case(False, H=32, hd=128, C=4096, R=700, dev="cuda")
    ncols = 4096
    got = index_scores_tiles(q, w, k, n_vis, ncols)
    ref = _reference(q, w, k, n_vis, ncols)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref))
    assert float((got[fin] - ref[fin]).abs().max()) <= _bound(q, w, k, n_vis)
    for rows in (slice(0, 1), slice(3, 10), slice(256, 700)):
        part = index_scores_tiles(q[rows], w[rows], k, n_vis[rows], ncols)
        assert torch.equal(part.view(torch.int32), got[rows].view(torch.int32)), rows
    perm = torch.randperm(700, device="cuda")
    assert torch.equal(index_scores_tiles(q[perm], w[perm], k, n_vis[perm], ncols).view(torch.int32),
                       got[perm].view(torch.int32))


@pytest.mark.gpu
def test_gpu_every_tile_shape_is_row_invariant_and_within_the_bound():
    """Each launch shape of `TILES`: within the reference's bound, rows alone / reordered == the batch's, and
    whether its bits are the default shape's (printed; the one-block shapes' products in programs of several
    blocks must be)."""
    need_compiled_cuda()
    from dsv41.kernels.step.index_tiles import TILES, index_scores_tiles

    q, w, k, n_vis = _case(False, H=32, hd=128, C=4096, R=700, dev="cuda")
    ref = _reference(q, w, k, n_vis, 4096)
    fin = torch.isfinite(ref)
    base = index_scores_tiles(q, w, k, n_vis, 4096, tile="128x64s1w8")
    perm = torch.randperm(700, device="cuda")
    for name, cfg in TILES.items():
        got = index_scores_tiles(q, w, k, n_vis, 4096, tile=name)
        same = torch.equal(got.view(torch.int32), base.view(torch.int32))
        print(f"index tile {name}: same bits as the default {same}")
        assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), name
        assert float((got[fin] - ref[fin]).abs().max()) <= _bound(q, w, k, n_vis), name
        if cfg.tile_m == 128 and cfg.block_c == 64 and cfg.num_warps == 8:
            assert same, name
        part = index_scores_tiles(q[3:10], w[3:10], k, n_vis[3:10], 4096, tile=name)
        assert torch.equal(part.view(torch.int32), got[3:10].view(torch.int32)), name
        shuf = index_scores_tiles(q[perm], w[perm], k, n_vis[perm], 4096, tile=name)
        assert torch.equal(shuf.view(torch.int32), got[perm].view(torch.int32)), name


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    _worker(sys.argv[2])
