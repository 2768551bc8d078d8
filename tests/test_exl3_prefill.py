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


@pytest.mark.parametrize("experts,rows,topk,bm", [(6, 40, 3, 16), (384, 2048, 6, 64), (8, 1, 2, 64), (5, 300, 5, 16)])
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


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    _interp_worker(sys.argv[2])
