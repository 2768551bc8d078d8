"""The prefill EXL3 kernels (dsv41.kernels.exl3.prefill): routed experts as grouped GEMMs and dense projections as
tiled GEMMs, each weight tile decoded once per tile of rows.

CPU part: the tile table in plain torch, and the kernels in Triton's interpreter (a child process, as in
test_exl3_kernels.py: TRITON_INTERPRET must be set before the kernels are decorated) against the fp64 reference of
the same function. Bits are compared on the GPU only: the interpreter's tl.dot is numpy's BLAS, whose summation
order may follow a row's place in the block and the CPU. GPU part (`-m gpu`): the pack's real shapes, rows bitwise
the same in any chunk, alone, reordered, and against the decode kernels within fp16 rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_exl3_kernels import _max_elem, _moe_case, _moe_reference, _random_group, _rel  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------------
# the tile table (plain torch)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("experts,rows,topk,bm", [(6, 40, 3, 16), (384, 2048, 6, 64), (8, 1, 2, 64), (5, 300, 5, 16),
                                                  (384, 2048, 6, 128), (7, 500, 3, 128)])
def test_tile_table_covers_every_pair_once_in_expert_order(experts, rows, topk, bm):
    from dsv41.kernels.exl3.prefill import max_tiles, tile_table

    gen = torch.Generator().manual_seed(rows + experts)
    # skewed routing: a few experts take most pairs (tiles of several BM), some none
    weights = torch.rand(experts, generator=gen) ** 4
    ids = torch.stack([torch.multinomial(weights, topk, generator=gen) for _ in range(rows)])
    order, pair_e, table = tile_table(ids, experts, bm)
    flat = ids.reshape(-1)
    assert table.shape == (max_tiles(rows * topk, experts, bm), 3) and table.dtype == torch.int32
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert torch.equal(pair_e.long(), flat[order])
    seen = torch.zeros(rows * topk, dtype=torch.int64)
    for e, first, count in table.tolist():
        assert 0 <= count <= bm
        if count:
            assert (pair_e[first:first + count] == e).all(), "a tile holds one expert's pairs"
            seen[first:first + count] += 1
    assert (seen == 1).all(), "every sorted pair in exactly one tile"
    real = table[:, 2] > 0
    assert not real[real.long().sum():].any(), "the spare tiles come last"
    # within an expert, its pairs keep (row, slot) order: the reference's summation order of rows
    for e in range(experts):
        assert torch.equal(order[pair_e == e], (flat == e).nonzero().flatten())


def test_tile_tables_of_64_and_128_rows_hold_the_same_pairs_in_the_same_order():
    """The 128-row table is the 64-row one with each expert's tiles merged two by two: the same sorted pairs, each
    expert's pairs in the same places (so the CUDA kernels' only difference is which rows share a decode)."""
    from dsv41.kernels.exl3.prefill import tile_table

    gen = torch.Generator().manual_seed(128)
    weights = torch.rand(384, generator=gen) ** 4
    ids = torch.stack([torch.multinomial(weights, 6, generator=gen) for _ in range(1500)])
    o64, e64, t64 = tile_table(ids, 384, 64)
    o128, e128, t128 = tile_table(ids, 384, 128)
    assert torch.equal(o64, o128) and torch.equal(e64, e128)

    def spans(table):
        real = table[table[:, 2] > 0].tolist()
        return {(e, first + i) for e, first, count in real for i in range(count)}

    assert spans(t64) == spans(t128)
    real64, real128 = t64[t64[:, 2] > 0], t128[t128[:, 2] > 0]
    # per expert: ceil(c / 128) tiles instead of ceil(c / 64), the full ones first
    counts = torch.bincount(ids.reshape(-1), minlength=384)
    assert len(real128) == int(((counts + 127) // 128).sum()) < len(real64) == int(((counts + 63) // 64).sum())
    assert (real128[:, 2] <= 128).all() and (real64[:, 2] <= 64).all()


def test_cuda_tile_rows_follow_the_switch_and_the_shared_memory(monkeypatch):
    """`DSV41_PREFILL_TILE_ROWS` picks 64 or 128 (read once) wherever that kernel fits: both keep two blocks an SM
    on Hopper at every K, GB10's 99 KB holds r64 up to K = 6 and r128 at every K; where 128 does not fit, 64; a bad
    value a clear error."""
    from dsv41.kernels.exl3 import prefill_cuda

    # cudaDevAttrMaxSharedMemoryPerBlockOptin of the H100 / H200 and of GB10; an SM of Hopper holds 228 KiB, 1 KiB
    # of it reserved per block
    hopper, hopper_sm, gb10 = 232448, 233472, 101376
    limit = {"cuda:0": hopper}
    monkeypatch.setattr(prefill_cuda, "_shared_limit", lambda device: limit[str(device)])
    dev = torch.device("cuda:0")
    for K in range(1, 9):
        for rows in (64, 128):
            assert prefill_cuda.fits(K, dev, rows) and prefill_cuda.tile_rows(dev, (K,), rows) == rows, (K, rows)
            assert 2 * (prefill_cuda.shared_bytes(K, rows) + 1024) <= hopper_sm, f"two blocks an SM: K={K} r{rows}"
            assert prefill_cuda.shared_bytes(K, rows) >= rows * 132 * 4, "the epilogue's fp32 tile fits"
    limit["cuda:0"] = gb10
    assert [K for K in range(1, 9) if prefill_cuda.fits(K, dev, 64)] == list(range(1, 7))
    assert all(prefill_cuda.fits(K, dev, 128) for K in range(1, 9))
    limit["cuda:0"] = 90000  # a device between the two: r128 up to K = 5, r64 up to K = 4
    assert prefill_cuda.tile_rows(dev, (3, 5), 128) == 128 and prefill_cuda.tile_rows(dev, (3, 6), 128) == 64
    with pytest.raises(ValueError, match="64 or 128"):
        prefill_cuda.tile_rows(dev, (3,), 96)
    for raw, want in (("", 128), ("64", 64), ("128", 128), ("96", None)):
        prefill_cuda.configured_rows.cache_clear()
        monkeypatch.setenv(prefill_cuda.ROWS_ENV, raw)
        if want is None:
            with pytest.raises(ValueError, match="DSV41_PREFILL_TILE_ROWS='96'"):
                prefill_cuda.configured_rows()
        else:
            assert prefill_cuda.configured_rows() == want
    monkeypatch.setenv(prefill_cuda.ROWS_ENV, "128")
    prefill_cuda.configured_rows.cache_clear()
    limit["cuda:0"] = hopper
    assert prefill_cuda.tile_rows(dev, (3,)) == 128
    monkeypatch.setenv(prefill_cuda.ROWS_ENV, "64")
    assert prefill_cuda.tile_rows(dev, (3,)) == 128, "read once"
    prefill_cuda.configured_rows.cache_clear()
    for raw, want in (("", True), ("tiles", False), ("columns", True), ("rows", None)):
        prefill_cuda.configured_columns_first.cache_clear()
        monkeypatch.setenv(prefill_cuda.ORDER_ENV, raw)
        if want is None:
            with pytest.raises(ValueError, match="DSV41_PREFILL_TILE_ORDER"):
                prefill_cuda.configured_columns_first()
        else:
            assert prefill_cuda.configured_columns_first() is want
    prefill_cuda.configured_columns_first.cache_clear()


def test_b_operand_order_is_the_cuda_kernels_b_word_pos():
    """The rotate kernels' PERMUTE order is `b_word_pos` of cuda/exl3_fused.cu (read from the source text), one
    fp16 pair at a time, and a permutation of the 128 columns."""
    import re

    from dsv41.kernels.cuda_build import EXL3_SOURCE

    src = EXL3_SOURCE.read_text()
    body = re.search(r"int b_word_pos\(int w\) \{(.*?)\n\}", src, re.S).group(1)
    decl, ret = re.search(r"const int (.*?);\s*return (.*?);", body, re.S).groups()
    env = {}
    for part in decl.split(","):
        name, expr = part.split("=")
        env[name.strip()] = expr.strip()

    def b_word_pos(w):
        vals = {"w": w}
        for name, expr in env.items():
            vals[name] = eval(expr, {}, vals)  # noqa: S307 - C integer expressions of w, from our own source
        return eval(ret, {}, vals)  # noqa: S307

    code = f"""
import torch, triton, triton.language as tl
from dsv41.kernels.exl3.prefill import _b_operand_columns
@triton.jit
def k(out_ptr):
    c = tl.arange(0, 128)
    tl.store(out_ptr + c, _b_operand_columns(c))
o = torch.empty(128, dtype=torch.int32)
k[(1,)](o)
print(o.tolist())
"""
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(got) == list(range(128))
    assert got == [2 * b_word_pos(c // 2) + c % 2 for c in range(128)]


# ---------------------------------------------------------------------------------------------------------------
# interpreted worker (runs in the child process)
# ---------------------------------------------------------------------------------------------------------------


def _worker(results: dict) -> None:
    from dsv41.kernels.exl3.layout import Exl3Tensor
    from dsv41.kernels.exl3.moe import MoeConfig, moe_forward
    from dsv41.kernels.exl3.prefill import prefill_linear, prefill_moe
    from dsv41.weights import exl3

    gen = torch.Generator().manual_seed(31)
    for cb, K in (("mul1", 3), ("3inst", 5), ("mcg", 2)):
        trellis, suh, svh = _random_group(gen, 256, 384, K)
        w = Exl3Tensor.from_group(trellis, suh, svh, cb)
        x = torch.randn(37, 256, generator=gen).bfloat16()
        y64 = x.double() @ exl3.effective_weight(trellis, suh, svh, cb, torch.float64)
        y = prefill_linear(x, w, out_dtype=torch.float32)
        # rows 5..11 alone: another tile split and another place of each row in its tile
        part = prefill_linear(x[5:12], w, out_dtype=torch.float32)
        results[f"linear/{cb}/K{K}"] = {"rel_fp64": _rel(y, y64), "max_elem_fp64": _max_elem(y, y64),
                                        "part_rel_fp64": _rel(part, y64[5:12]), "dtype": str(y.dtype)}
    groups, (w1, w3, w2) = _moe_case(gen, experts=6, hidden=256, inter=256, K=3, cb="mul1")
    T, topk = 40, 3
    x = torch.randn(T, 256, generator=gen).bfloat16()
    # skewed: expert 0 in every row (three tiles of 16), expert 5 in none
    ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(4, generator=gen)[:topk - 1]])
                       for _ in range(T)])
    weights = torch.rand(T, topk, generator=gen)
    addend = torch.randn(T, 256, generator=gen).bfloat16()
    y = prefill_moe(x, ids, weights, w1, w3, w2)
    ref = _moe_reference(x, ids, weights, groups, "mul1", 10.0)
    decode = moe_forward(x, ids, weights, w1, w3, w2, config=MoeConfig(splits_gate_up=1, splits_down=1))
    with_addend = prefill_moe(x, ids, weights, w1, w3, w2, addend=addend)
    part = prefill_moe(x[7:30], ids[7:30], weights[7:30], w1, w3, w2)
    results["moe/mul1/K3"] = {
        "rel_fp64": _rel(y, ref), "max_elem_fp64": _max_elem(y, ref),
        "decode_rel": _rel(y, decode), "part_rel_fp64": _rel(part, ref[7:30]),
        "addend_is_one_add_after": bool(torch.equal(with_addend, y + addend.float())),
    }


def _interp_worker(out_path: str) -> None:
    results: dict = {}
    try:
        _worker(results)
    except Exception as exc:  # reported so the tests show the worker's error
        results["error"] = f"{type(exc).__name__}: {exc}"
    Path(out_path).write_text(json.dumps(results, indent=1))


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    out = tmp_path_factory.mktemp("exl3_prefill") / "results.json"
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, __file__, "--interp-worker", str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"interpreted worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads(out.read_text())
    assert "error" not in results, results.get("error")
    return results


@pytest.mark.parametrize("case", ["mul1/K3", "3inst/K5", "mcg/K2"])
def test_interpreted_prefill_linear_matches_fp64(interp, case):
    r = interp[f"linear/{case}"]
    # fp16 rounding of the rotated input and of bf16 x: the decode kernels' tolerance (test_exl3_kernels.py)
    assert r["rel_fp64"] <= 1.5e-3 and r["max_elem_fp64"] <= 1e-2, r
    assert r["part_rel_fp64"] <= 1.5e-3, r
    assert r["dtype"] == "torch.float32"


def test_interpreted_prefill_moe_matches_fp64_and_the_decode_kernel(interp):
    r = interp["moe/mul1/K3"]
    assert r["rel_fp64"] <= 2e-3 and r["max_elem_fp64"] <= 1e-2, r
    assert r["part_rel_fp64"] <= 2e-3, r
    # the same function as the decode kernel (h in fp16 in both): only the summation order differs
    assert r["decode_rel"] <= 1e-3, r
    assert r["addend_is_one_add_after"], r


# ---------------------------------------------------------------------------------------------------------------
# GPU: the pack's shapes, bits
# ---------------------------------------------------------------------------------------------------------------


def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the prefill kernels compiled for it)")


@pytest.fixture(params=["cuda", "triton"])
def backend(request, monkeypatch):
    """Both prefill backends on the GPU: the CUDA tile kernel (default there) and the Triton tiles."""
    monkeypatch.setenv("DSV41_EXL3_BACKEND", request.param)
    return request.param


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,K", [(5120, 1152, 5), (1152, 5120, 4), (1280, 16384, 5), (5120, 512, 6)])
def test_gpu_prefill_linear_rows_are_chunk_invariant(k, n, K, backend):
    _need_cuda()
    from dsv41.kernels.exl3.layout import Exl3Tensor
    from dsv41.kernels.exl3.prefill import prefill_linear
    from dsv41.weights import exl3

    gen = torch.Generator().manual_seed(k + n + K)
    trellis, suh, svh = _random_group(gen, k, n, K, "cuda")
    w = Exl3Tensor.from_group(trellis, suh, svh, "mul1")
    x = torch.randn(700, k, generator=gen).bfloat16().cuda()
    y = prefill_linear(x, w, out_dtype=torch.float32)
    y64 = x.double() @ exl3.effective_weight(trellis, suh, svh, "mul1", torch.float64)
    assert _rel(y, y64) <= 1.5e-3
    for rows in (slice(0, 1), slice(3, 10), slice(64, 192), slice(600, 700)):
        assert torch.equal(_bits(prefill_linear(x[rows], w, out_dtype=torch.float32)), _bits(y[rows])), rows
    perm = torch.randperm(700, generator=gen).cuda()
    assert torch.equal(_bits(prefill_linear(x[perm], w, out_dtype=torch.float32)), _bits(y[perm]))
    assert torch.equal(_bits(prefill_linear(x, w, out_dtype=torch.bfloat16).float()),
                       _bits(y.bfloat16().float())), "the bf16 output is the fp32 one rounded once"


@pytest.mark.gpu
def test_gpu_prefill_moe_real_shapes_chunk_invariant(backend):
    _need_cuda()
    from dsv41.kernels.exl3.moe import MoeConfig, moe_forward
    from dsv41.kernels.exl3.prefill import prefill_moe

    gen = torch.Generator().manual_seed(41)
    experts, topk, T = 24, 6, 300
    groups, (w1, w3, w2) = _moe_case(gen, experts, 5120, 1152, 3, "mul1", "cuda")
    x = torch.randn(T, 5120, generator=gen).bfloat16().cuda()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(T)]).cuda()
    weights = torch.rand(T, topk, generator=gen).cuda()
    add = torch.randn(T, 5120, generator=gen).bfloat16().cuda()
    y = prefill_moe(x, ids, weights, w1, w3, w2, addend=add)
    ref = _moe_reference(x[:8], ids[:8], weights[:8], groups, "mul1", 10.0)
    assert _rel(y[:8] - add[:8].float(), ref) <= 2e-3
    dec = moe_forward(x[:16], ids[:16], weights[:16], w1, w3, w2, config=MoeConfig(), addend=add[:16])
    assert _rel(y[:16], dec) <= 1e-3
    for rows in (slice(0, 1), slice(5, 12), slice(100, 300)):
        got = prefill_moe(x[rows], ids[rows], weights[rows], w1, w3, w2, addend=add[rows])
        assert torch.equal(_bits(got), _bits(y[rows])), rows
    perm = torch.randperm(T, generator=gen).cuda()
    got = prefill_moe(x[perm], ids[perm], weights[perm], w1, w3, w2, addend=add[perm])
    assert torch.equal(_bits(got), _bits(y[perm]))


def _need_128_rows(*Ks):
    from dsv41.kernels.exl3 import prefill_cuda

    dev = torch.device("cuda")
    if prefill_cuda.tile_rows(dev, Ks, 128) != 128:
        pytest.skip(f"the 128-row prefill tiles need {prefill_cuda.shared_bytes(max(Ks), 128)} B of shared memory a "
                    f"block, this GPU allows {prefill_cuda._shared_limit(dev)} B")


def expert_case(E, hidden, inter, K, topk, T, seed):
    """A layer's routed experts on the GPU (random trellis, mul1) and T rows routed with a router's skew (each row's
    top-k distinct, log-normal expert popularity: Gumbel top-k): (w1, w3, w2), ids, x, weights, addend, generator."""
    from dsv41.kernels.exl3.layout import Exl3ExpertStack

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    stacks = []
    for k, n in ((hidden, inter), (hidden, inter), (inter, hidden)):
        trellis = torch.randint(-32768, 32768, (E, k // 16, n // 16, 16 * K), generator=g, device=dev,
                                dtype=torch.int32).to(torch.int16)
        suh = (torch.randn(E, k, generator=g, device=dev) * 0.03).half()
        svh = torch.randn(E, n, generator=g, device=dev).half()
        stacks.append(Exl3ExpertStack.from_stacked(trellis, suh, svh, "mul1"))
    popularity = torch.randn(E, generator=g, device=dev) * 0.8
    gumbel = -torch.log(-torch.log(torch.rand(T, E, generator=g, device=dev).clamp_(1e-20, 1 - 1e-7)))
    ids = (popularity[None, :] + gumbel).topk(topk, dim=1).indices.int()
    x = torch.randn(T, hidden, generator=g, device=dev).bfloat16()
    wts = torch.rand(T, topk, generator=g, device=dev)
    add = torch.randn(T, hidden, generator=g, device=dev).bfloat16()
    return stacks, ids, x, wts, add, g


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    """Where two results differ, for a failure message: how many rows, the first few, the largest difference."""
    bad = (_bits(got) != _bits(want)).reshape(got.shape[0], -1).any(dim=1).nonzero().flatten()
    diff = float((got.double() - want.double()).abs().max())
    return f"{bad.numel()} of {got.shape[0]} rows differ (first {bad[:8].tolist()}), max |diff| {diff:.3g}"


@pytest.mark.gpu
def test_gpu_prefill_tiles_of_128_rows_are_the_64_row_bits_for_the_experts(monkeypatch):
    """The routed experts of one full-shape layer (384 x [5120, 1152] K=3, top-6) at 8,192 rows with a skewed
    routing (experts from a few rows to several 128-row tiles): the 128-row tiles give the 64-row tiles' bits, in
    both launch orders, and a 128-row tile's rows alone or reordered are the batch's rows."""
    _need_cuda()
    monkeypatch.setenv("DSV41_EXL3_BACKEND", "cuda")
    _need_128_rows(3)
    from dsv41.kernels.exl3.prefill import prefill_moe

    E, T = 384, 8192
    (w1, w3, w2), ids, x, wts, add, g = expert_case(E, 5120, 1152, 3, 6, T, seed=31)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
    # the cases of the tile shapes: experts of one partial tile (< 64 rows), of several 128-row tiles (> 256)
    assert int(counts.max()) > 256 and int(((counts > 0) & (counts < 64)).sum()) > 10, sorted(counts.tolist())
    ref = prefill_moe(x, ids, wts, w1, w3, w2, addend=add, tile_rows=64, columns_first=False)
    assert torch.isfinite(ref).all()
    for cols in (False, True):
        got = prefill_moe(x, ids, wts, w1, w3, w2, addend=add, tile_rows=128, columns_first=cols)
        assert torch.equal(_bits(got), _bits(ref)), f"128 vs 64 rows, columns_first={cols}: {_mismatch(got, ref)}"
    got = prefill_moe(x, ids, wts, w1, w3, w2, addend=add, tile_rows=64, columns_first=True)
    assert torch.equal(_bits(got), _bits(ref)), f"64 rows, columns first vs tiles first: {_mismatch(got, ref)}"
    for rows in (slice(0, 1), slice(100, 117), slice(1000, 3000)):
        got = prefill_moe(x[rows], ids[rows], wts[rows], w1, w3, w2, addend=add[rows], tile_rows=128)
        assert torch.equal(_bits(got), _bits(ref[rows])), \
            f"rows {rows} alone, 128-row tiles: {_mismatch(got, ref[rows])}"
    perm = torch.randperm(T, generator=g, device=x.device)[:2000]
    got = prefill_moe(x[perm], ids[perm], wts[perm], w1, w3, w2, addend=add[perm], tile_rows=128)
    assert torch.equal(_bits(got), _bits(ref[perm])), \
        f"2,000 rows reordered, 128-row tiles: {_mismatch(got, ref[perm])}"


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,K", [(5120, 1152, 5), (1152, 5120, 4)])
def test_gpu_prefill_tiles_of_128_rows_are_the_64_row_bits_for_a_dense_matrix(k, n, K, monkeypatch):
    """A dense matrix through the CUDA tiles (not the decode-once GEMM) at 8,000 rows (the last 128-row tile holds
    64 rows: two of its four parts): 128-row tiles == 64-row tiles bitwise, both launch orders; rows alone, in
    slices that cut 128-row tiles anywhere, and reordered, == the batch's rows."""
    _need_cuda()
    monkeypatch.setenv("DSV41_EXL3_BACKEND", "cuda")
    _need_128_rows(K)
    from dsv41.kernels.exl3.layout import Exl3Tensor
    from dsv41.kernels.exl3.prefill import prefill_linear

    gen = torch.Generator().manual_seed(k + n + K + 128)
    trellis, suh, svh = _random_group(gen, k, n, K, "cuda")
    w = Exl3Tensor.from_group(trellis, suh, svh, "mul1")
    x = torch.randn(8000, k, generator=gen).bfloat16().cuda()

    def run(rows, xs, cols=None):
        return prefill_linear(xs, w, out_dtype=torch.float32, dense_gemm=False, tile_rows=rows, columns_first=cols)

    ref = run(64, x, False)
    for cols in (False, True):
        got = run(128, x, cols)
        assert torch.equal(_bits(got), _bits(ref)), f"128 vs 64 rows, columns_first={cols}: {_mismatch(got, ref)}"
    for rows in (slice(0, 1), slice(3, 40), slice(64, 192), slice(100, 229), slice(7900, 8000)):
        got = run(128, x[rows])
        assert torch.equal(_bits(got), _bits(ref[rows])), \
            f"rows {rows} alone, 128-row tiles: {_mismatch(got, ref[rows])}"
    perm = torch.randperm(8000, generator=gen).cuda()
    got = run(128, x[perm])
    assert torch.equal(_bits(got), _bits(ref[perm])), f"rows reordered, 128-row tiles: {_mismatch(got, ref[perm])}"


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    _interp_worker(sys.argv[2])
