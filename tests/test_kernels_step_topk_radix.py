"""The indexer's top-k (dsv41.kernels.step.indexer.topk_select): radix select of the k-th score against the
bisection it replaces and against the reference `Attention._select` (`model.topk.topk_lowest_index_ties`).

The two ways of finding the k-th largest score (4 passes of 8-bit histograms, or 32 counting steps of a bisection)
share everything after it, so the claim is bit for bit: the same ids (ascending, -1 picks first), the same masks.
Rows are built to reach every branch: many exact ties at the k-th value, -inf runs and -inf padding, -0.0 beside
+0.0, all-equal rows, rows with fewer finite scores than k (the skip) or exactly k, k = 1 and k = N, scores that
differ only in their lowest mantissa bits (every digit pass decides), +inf and subnormal scores, and a row longer
than one block of the passes (1,300 > TOPK_BLOCK entries).

CPU part: Triton's interpreter in one child process (this file as a script, as tests/test_kernels_step_indexer.py).
GPU part (`-m gpu`): a prefill slab's shape, 2,048 rows x 65,536 entries, k 512, radix == bisection bitwise.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from step_harness import interpreted, need_compiled_cuda  # noqa: E402

NINF = float("-inf")
N = 1300
KS = (1, 7, 64, 65, 700, N - 1, N)
SHAPES = ("128w1", "4096w8")  # many steps a row; the compiled default, one step over all of it


def _rows() -> torch.Tensor:
    """[16, N] fp32 scores, one row per case (see the module docstring)."""
    gen = torch.Generator().manual_seed(31)
    s = torch.randint(-3, 3, (16, N), generator=gen).float()  # row 0: integers, ties everywhere
    s[1, ::3] = NINF
    s[2] = 0.0
    s[2, ::2] = -0.0
    s[2, 100:140] = 1.0
    s[2, 900:905] = -1.0
    s[3] = 1.0  # all equal
    s[4, 5:] = NINF  # 5 finite: fewer than most k
    s[5, 64:] = NINF  # exactly 64 finite
    s[6] = NINF  # none finite
    s[7] = torch.randn(N, generator=gen)
    s[7, 1000:1100] = s[7, 3]  # a tie group across the block boundary, straddling a cut
    # scores one ulp apart: only the lowest digits tell them apart (positive and negative, with ties)
    one = torch.tensor(1.0).view(torch.int32)
    s[8] = (one + torch.randint(0, 600, (N,), generator=gen, dtype=torch.int32)).view(torch.float32)
    s[9] = -(one + torch.randint(0, 600, (N,), generator=gen, dtype=torch.int32)).view(torch.float32)
    s[10] = torch.randn(N, generator=gen) * 1e3
    s[10, ::7] = float("inf")
    s[10, 1::7] = 1e-42  # subnormal
    s[10, 2::7] = -1e-42
    s[10, 3::7] = -0.0
    s[11] = -torch.rand(N, generator=gen)  # negative only
    s[11, 1000:] = NINF  # padding: the row's entries end at 1,000
    s[12] = torch.randint(0, 2, (N,), generator=gen).float()
    s[12, 650:] = NINF
    s[13] = -0.0  # all -0.0: ties +0.0
    s[13, 1299] = 0.0
    s[14, :N - 1] = NINF
    s[14, N - 1] = 2.0  # one finite score, the last entry
    s[15] = torch.randn(N, generator=gen).round(decimals=1)  # ties among signed scores
    return s


def _interp_worker(out_path: str) -> None:
    from dsv41.kernels.step.indexer import topk_select

    s = _rows()
    out = {}
    for k in KS:
        for radix in (True, False):
            out[k, radix] = topk_select(s, k, radix=radix)
            out[k, radix, "mask"] = topk_select(s, k, mask=True, radix=radix)
    for k in (700,):  # other launch shapes (DSV41_TOPK_SHAPE): steps across and inside the row's 1,300 entries
        for shape in SHAPES:
            out[k, shape] = topk_select(s, k, shape=shape)
            out[k, shape, "mask"] = topk_select(s, k, mask=True, shape=shape)
    torch.save(out, out_path)


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "topk_radix")


@pytest.mark.parametrize("k", KS)
def test_interpreted_radix_select_is_the_bisection_and_the_reference(interp, k):
    """ids: radix == bisection == `Attention._select` bit for bit; masks: both the reference's picked set."""
    from dsv41.model.attention import Attention

    s = _rows()
    ref = Attention._select(s, k)
    radix, bisect = interp[k, True], interp[k, False]
    assert radix.dtype == torch.int64 and radix.shape == (s.shape[0], k)
    for r in range(s.shape[0]):
        assert torch.equal(radix[r], ref[r]), (k, r)
        assert torch.equal(bisect[r], ref[r]), (k, r)
    ref_mask = torch.zeros_like(s, dtype=torch.bool)
    for r in range(s.shape[0]):
        ref_mask[r, ref[r][ref[r] >= 0]] = True
    assert torch.equal(interp[k, True, "mask"], ref_mask), k
    assert torch.equal(interp[k, False, "mask"], ref_mask), k


def test_interpreted_radix_rows_reach_every_branch(interp):
    """The rows are what the docstring says: some rows skip (at most k finite: leading -1 where k exceeds them),
    some cut inside a tie group, and row 8's k-th differs from its neighbour score in the last bit only."""
    s = _rows()
    assert torch.equal(interp[7, True][4], torch.tensor([-1, -1, 0, 1, 2, 3, 4]))  # 5 finite, k 7
    assert torch.equal(interp[64, True][5], torch.arange(64))  # exactly k finite
    assert bool((interp[N, True][6] == -1).all())
    assert torch.equal(interp[7, True][3], torch.arange(7))  # all equal: the lowest ids
    assert torch.equal(interp[7, True][13], torch.arange(7))  # -0.0 ties +0.0: the lowest ids, not the +0.0
    top = s[8].sort(descending=True).values
    bits = top.view(torch.int32)
    assert int(bits[699] - bits[700]) <= 1 and int((s[8] == top[699]).sum()) > 1  # ties at the cut, 1 ulp apart
    assert int((s[0] == s[0].sort(descending=True).values[699]).sum()) > 100  # a large tie group at the cut


@pytest.mark.parametrize("k", (700,))
def test_interpreted_launch_shapes_pick_the_same_ids(interp, k):
    """DSV41_TOPK_SHAPE's steps and warps change no pick: ids and masks == the default shape's, bit for bit."""
    for shape in SHAPES:
        assert torch.equal(interp[k, shape], interp[k, True]), (k, shape)
        assert torch.equal(interp[k, shape, "mask"], interp[k, True, "mask"]), (k, shape)


def test_topk_shape_knob_reads_and_refuses(monkeypatch):
    from dsv41.kernels.step import indexer

    from dsv41.kernels.exl3.backend import interpreting

    default = indexer.INTERPRETED_TOPK if interpreting() else (indexer.TOPK_BLOCK, indexer.TOPK_WARPS)
    monkeypatch.delenv(indexer.SHAPE_ENV, raising=False)
    assert indexer.topk_shape() == default
    monkeypatch.setenv(indexer.SHAPE_ENV, "2048w8")
    assert indexer.topk_shape() == (2048, 8) and indexer.topk_shape("") == default
    for bad in ("2048", "1000w4", "64w4", "2048w3", "w8"):
        with pytest.raises(ValueError, match=indexer.SHAPE_ENV):
            indexer.topk_shape(bad)


def test_topk_radix_switch_reads_the_environment(monkeypatch):
    from dsv41.kernels.step import indexer

    monkeypatch.delenv(indexer.RADIX_ENV, raising=False)
    assert indexer.radix_on()  # on by default since a GPU run checked it
    monkeypatch.setenv(indexer.RADIX_ENV, "1")
    assert indexer.radix_on()
    monkeypatch.setenv(indexer.RADIX_ENV, "0")
    assert not indexer.radix_on()


@pytest.mark.gpu
def test_gpu_topk_radix_is_the_bisection_at_a_prefill_slab():
    """2,048 rows x 65,536 entries (a 128K prompt's ratio-2 rows), k 512, compiled: radix == bisection bitwise, ids
    and mask; random rows, rows of few distinct values (ties at the cut), -inf padding of different lengths, rows
    with fewer finite scores than k; and each row alone the same as among the others."""
    need_compiled_cuda()
    from dsv41.kernels.step.indexer import topk_select

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(7)
    R, C, k = 2048, 65536, 512
    s = torch.randn(R, C, generator=gen, device=dev)
    s[::4] = torch.randint(-8, 8, (R // 4, C), generator=gen, device=dev).float() * 0.5  # ties
    vis = torch.randint(1, C + 1, (R,), generator=gen, device=dev)
    vis[1::8] = torch.randint(1, k, (R // 8,), generator=gen, device=dev)  # fewer finite than k
    s[torch.arange(C, device=dev)[None, :] >= vis[:, None]] = NINF
    z = s[3::16]  # signed zeros among the finite scores
    s[3::16] = torch.where(torch.isfinite(z), torch.where(z > 0, torch.zeros_like(z), -torch.zeros_like(z)), z)
    radix, bisect = topk_select(s, k, radix=True), topk_select(s, k, radix=False)
    assert torch.equal(radix, bisect)
    assert torch.equal(topk_select(s, k, mask=True, radix=True), topk_select(s, k, mask=True, radix=False))
    for r in (0, 1, 3, 4, 1023, 2047):
        assert torch.equal(topk_select(s[r:r + 1], k, radix=True)[0], radix[r]), r
    from dsv41.model.attention import Attention

    rows = torch.arange(0, R, 97, device=dev)  # the reference's stable sort on a sample of rows
    assert torch.equal(radix[rows], Attention._select(s[rows], k))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 6, 16])
def test_gpu_topk_radix_is_the_bisection_at_decode_rows(rows):
    """The decode step's shapes: a few rows, each with its own visible length (from under k to 64K entries), k 512
    and 64, random scores and scores of few values; radix == bisection bitwise, ids and mask, the reference on every
    row. Timed beside (printed): the decode rows' top-k must not get slower for the prefill slab's gain."""
    need_compiled_cuda()
    from dsv41.kernels.step.indexer import topk_select
    from dsv41.model.attention import Attention

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(rows)
    for C in (300, 8192, 65536):
        s = torch.randn(rows, C, generator=gen, device=dev)
        s[1::2] = torch.randint(-4, 4, (rows // 2, C), generator=gen, device=dev).float()
        vis = torch.randint(1, C + 1, (rows,), generator=gen, device=dev)
        s[torch.arange(C, device=dev)[None, :] >= vis[:, None]] = NINF
        for k in (64, 512):
            if k > C:
                continue
            radix, bisect = topk_select(s, k, radix=True), topk_select(s, k, radix=False)
            assert torch.equal(radix, bisect), (C, k)
            assert torch.equal(topk_select(s, k, mask=True, radix=True), topk_select(s, k, mask=True, radix=False))
            assert torch.equal(radix, Attention._select(s, k)), (C, k)
        ms = {}
        for radix in (True, False):
            for _ in range(3):
                topk_select(s, min(512, C), radix=radix)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                topk_select(s, min(512, C), radix=radix)
            end.record()
            torch.cuda.synchronize()
            ms[radix] = start.elapsed_time(end) / 50
        print(f"decode top-k rows {rows} entries {C}: radix {ms[True] * 1e3:.1f} us, bisection {ms[False] * 1e3:.1f} us")


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    _interp_worker(sys.argv[2])
