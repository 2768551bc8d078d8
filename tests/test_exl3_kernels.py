"""EXL3 Triton kernels (dsv41.kernels.exl3) against the pure-torch reference (dsv41.weights.exl3) and the golden layers.

CPU part: the kernels run in Triton's interpreter. TRITON_INTERPRET must be set before the kernels are decorated,
and setting it in this process would turn every other Triton kernel of the test session into an interpreted one,
so the interpreted checks run in one child process (this file run as a script) that reports measured numbers as
JSON; the tests below judge those numbers. GPU part (`-m gpu`): the same properties on the pack's real shapes,
in-process, compiled for the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures" / "exl3"
# Integer-K golden layers (the kernels take integer K; half-integer K stays on the reference path).
FIXTURE_NAMES = sorted(p.stem for p in FIXTURES.glob("*.safetensors") if "p5" not in p.stem)
CODEBOOKS = ("3inst", "mcg", "mul1")
PACK_SHAPES = [
    # (k, n, K): expert gate/up K=3 and K=2, expert down, shared expert K=5, wq_b, wo_b, head slice (K=6)
    (5120, 2304, 3),
    (5120, 2304, 2),
    (2304, 5120, 3),
    (5120, 2304, 5),
    (1280, 32768, 5),
    (8192, 5120, 5),
    (5120, 16384, 6),
]


# ---------------------------------------------------------------------------------------------------------------
# interpreted worker (runs in the child process)
# ---------------------------------------------------------------------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _max_elem(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest element difference in units of the reference's RMS."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.pow(2).mean().sqrt())


def _codebook_of(name: str) -> str:
    return name.split("_")[0]


def _random_group(gen, k, n, K, device="cpu"):
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), generator=gen, dtype=torch.int32)
    suh = (torch.randn(k, generator=gen) * 0.02).half()
    svh = torch.randn(n, generator=gen).half()
    return trellis.to(torch.int16).to(device), suh.to(device), svh.to(device)


def _worker_fixtures(results: dict) -> None:
    from safetensors.torch import load_file

    from dsv41.kernels.exl3.matmul import MatmulConfig, fused_matmul
    from dsv41.kernels.exl3.reconstruct import prefill_matmul, reconstruct
    from dsv41.kernels.exl3.layout import Exl3Tensor
    from dsv41.weights import exl3

    for name in FIXTURE_NAMES:
        t = load_file(str(FIXTURES / f"{name}.safetensors"))
        cb = _codebook_of(name)
        w = Exl3Tensor.from_group(t["layer.trellis"], t["layer.suh"], t["layer.svh"], cb)
        wq = reconstruct(w, rotate=False)
        ref_wq = exl3.decode_rotated(t["layer.trellis"], cb)
        weff = reconstruct(w, torch.float32)
        x = t["ref.x"]
        y64 = x.double() @ t["ref.w_eff"].double()
        # splits=2 exercises the split-K arrival counter; the fixtures are only 2 k-blocks deep.
        y = fused_matmul(x, w, config=MatmulConfig(splits=2))
        y1 = fused_matmul(x, w, config=MatmulConfig(splits=1))
        yp = prefill_matmul(x, w)
        results[f"fixture/{name}"] = {
            "decode_equal_golden": bool(torch.equal(wq.view(torch.int16), t["ref.w_q"].view(torch.int16))),
            "decode_equal_reference": bool(torch.equal(wq.view(torch.int16), ref_wq.view(torch.int16))),
            "weff_rel": _rel(weff, t["ref.w_eff"]),
            "matmul_rel_fp64": _rel(y, y64),
            "matmul_max_elem_fp64": _max_elem(y, y64),
            "matmul_rel_library": _rel(y, t["ref.y"]),
            "splits_rel": _rel(y1, y),
            "prefill_rel_fp64": _rel(yp, y64),
        }


def _worker_random(results: dict) -> None:
    """Every codebook x K = 1..8 on random trellises: two row blocks, split-K over three 128-blocks (uneven)."""
    from dsv41.kernels.exl3.matmul import MatmulConfig, fused_matmul
    from dsv41.kernels.exl3.layout import Exl3Tensor
    from dsv41.weights import exl3

    gen = torch.Generator().manual_seed(6)
    for cb in CODEBOOKS:
        for K in range(1, 9):
            trellis, suh, svh = _random_group(gen, 384, 128, K)
            w = Exl3Tensor.from_group(trellis, suh, svh, cb)
            x = torch.randn(20, 384, generator=gen).half()
            y = fused_matmul(x, w, config=MatmulConfig(splits=2, block_k=64))
            y64 = x.double() @ exl3.effective_weight(trellis, suh, svh, cb, torch.float64)
            results[f"random/{cb}/K{K}"] = {"matmul_rel_fp64": _rel(y, y64), "matmul_max_elem_fp64": _max_elem(y, y64)}


def _worker_rows_in_other_batches(results: dict) -> None:
    """Rows run in other batches (alone, in subsets, reordered, beside other rows, with the input pre-rotated):
    the largest per-row error against fp64. The bits are not compared here: the interpreter's tl.dot is numpy's
    BLAS, whose kernels (and so the fp32 summation order of a row) depend on the shape, the row's place in the
    block and the CPU. Bitwise row invariance is asserted on the GPU, where it is defined."""
    from dsv41.kernels.exl3.matmul import MatmulConfig, fused_matmul
    from dsv41.kernels.exl3.layout import Exl3Tensor
    from dsv41.weights import exl3

    gen = torch.Generator().manual_seed(7)
    for cb, K in (("mul1", 3), ("3inst", 5)):
        trellis, suh, svh = _random_group(gen, 256, 256, K)
        w = Exl3Tensor.from_group(trellis, suh, svh, cb)
        w64 = exl3.effective_weight(trellis, suh, svh, cb, torch.float64)
        x = torch.randn(20, 256, generator=gen).half()
        other = torch.randn(20, 256, generator=gen).half()
        other[4] = x[4]  # the same row among other, different rows
        batches = [(x[rows], rows) for rows in ([5], [0, 3], [15, 2, 9, 4, 11, 7, 1], list(range(16)), [19, 16, 0])]
        batches += [(x, list(range(20))), (other[[4]], [4])]
        rel, elem = 0.0, 0.0
        for prerotate in (False, True):
            for xb, rows in batches:
                y = fused_matmul(xb, w, config=MatmulConfig(splits=2, prerotate=prerotate))
                y64 = xb.double() @ w64
                for i in range(len(rows)):
                    rel, elem = max(rel, _rel(y[i], y64[i])), max(elem, _max_elem(y[i], y64[i]))
        results[f"rows/{cb}/K{K}"] = {"row_rel_fp64": rel, "row_max_elem_fp64": elem}


def _moe_reference(x, ids, weights, groups, cb, limit):
    """Per row, per slot, in fp64 from the reference effective weights: clamped SwiGLU, routing weight, down."""
    from dsv41.weights import exl3

    (t1, u1, v1), (t3, u3, v3), (t2, u2, v2) = groups
    out = torch.zeros(x.shape[0], t2.shape[2] * 16, dtype=torch.float64, device=x.device)
    cache = {}

    def weff(tr, su, sv, e):
        key = (tr.data_ptr(), e)
        if key not in cache:
            cache[key] = exl3.effective_weight(tr[e], su[e], sv[e], cb, torch.float64)
        return cache[key]

    for t in range(x.shape[0]):
        for i in range(ids.shape[1]):
            e = int(ids[t, i])
            g = x[t].double() @ weff(t1, u1, v1, e)
            u = x[t].double() @ weff(t3, u3, v3, e)
            h = g.clamp(max=limit) * torch.sigmoid(g.clamp(max=limit)) * u.clamp(-limit, limit) * float(weights[t, i])
            out[t] += h @ weff(t2, u2, v2, e)
    return out


def _moe_case(gen, experts, hidden, inter, K, cb, device="cpu"):
    from dsv41.kernels.exl3.layout import Exl3ExpertStack

    groups = []
    for k, n in ((hidden, inter), (hidden, inter), (inter, hidden)):
        trellis = torch.randint(-32768, 32768, (experts, k // 16, n // 16, 16 * K), generator=gen, dtype=torch.int32)
        suh = (torch.randn(experts, k, generator=gen) * 0.03).half()
        svh = torch.randn(experts, n, generator=gen).half()
        groups.append((trellis.to(torch.int16).to(device), suh.to(device), svh.to(device)))
    stacks = [Exl3ExpertStack.from_stacked(*g, cb) for g in groups]
    return groups, stacks


def _worker_moe(results: dict) -> None:
    from dsv41.kernels.exl3.moe import MoeConfig, moe_forward

    gen = torch.Generator().manual_seed(8)
    groups, (w1, w3, w2) = _moe_case(gen, experts=6, hidden=256, inter=256, K=3, cb="mul1")
    T, topk = 4, 3
    x = torch.randn(T, 256, generator=gen).half()
    ids = torch.stack([torch.randperm(6, generator=gen)[:topk] for _ in range(T)])
    weights = torch.rand(T, topk, generator=gen)
    cfg = MoeConfig(splits_gate_up=2, splits_down=2)
    y = moe_forward(x, ids, weights, w1, w3, w2, config=cfg)
    ref = _moe_reference(x, ids, weights, groups, "mul1", 10.0)
    # row 2 alone: its experts' blocks hold only it (bitwise equality with the batch is a GPU test, as above)
    alone = moe_forward(x[2:3], ids[2:3], weights[2:3], w1, w3, w2, config=cfg)
    results["moe/mul1/K3"] = {
        "rel_fp64": _rel(y, ref),
        "max_elem_fp64": _max_elem(y, ref),
        "row2_alone_rel_fp64": _rel(alone[0], ref[2]),
        "row2_alone_max_elem_fp64": _max_elem(alone[0], ref[2]),
        "shared_experts": int(T * topk - len(set(ids.flatten().tolist()))),
    }
    # an addend (the shared experts' output): the sum, then one add of it, bit for bit
    a = torch.randn(T, 256, generator=gen).bfloat16()
    got = moe_forward(x, ids, weights, w1, w3, w2, config=cfg, addend=a)
    results["moe/mul1/K3"]["addend_is_one_add_after"] = bool(torch.equal(got, y + a.float()))


def _interp_worker(out_path: str) -> None:
    results: dict = {}
    for part in (_worker_fixtures, _worker_random, _worker_rows_in_other_batches, _worker_moe):
        try:
            part(results)
        except Exception as exc:  # report, so every test shows the worker's error instead of a bare failure
            results[f"error/{part.__name__}"] = f"{type(exc).__name__}: {exc}"
    Path(out_path).write_text(json.dumps(results, indent=1))


# ---------------------------------------------------------------------------------------------------------------
# CPU tests (judge the interpreted worker's numbers)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    if not FIXTURE_NAMES:
        pytest.skip(f"EXL3 golden fixtures not found in {FIXTURES}")
    out = tmp_path_factory.mktemp("exl3_interp") / "results.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(
        [sys.executable, __file__, "--interp-worker", str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"interpreted worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads(out.read_text())
    errors = {k: v for k, v in results.items() if k.startswith("error/")}
    assert not errors, f"interpreted worker raised: {errors}"
    return results


def test_fixture_list_covers_every_codebook_and_k():
    if not FIXTURE_NAMES:
        pytest.skip(f"EXL3 golden fixtures not found in {FIXTURES}")
    have = {(_codebook_of(n), n.split("_")[1]) for n in FIXTURE_NAMES}
    assert have == {(cb, f"k{K}") for cb in CODEBOOKS for K in range(1, 9)}


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_interpreted_decode_is_bit_exact(interp, name):
    r = interp[f"fixture/{name}"]
    assert r["decode_equal_golden"], "decoded W_q differs from ExLlamaV3's reconstruct"
    assert r["decode_equal_reference"], "decoded W_q differs from dsv41.weights.exl3.decode_rotated"


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_interpreted_reconstruct_with_rotations(interp, name):
    # fp32 W_eff from the fused reconstruct kernel (tensor-core rotations on exact fp16 splits).
    assert interp[f"fixture/{name}"]["weff_rel"] <= 1e-6


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_interpreted_matmul_matches_fp64_and_library(interp, name):
    r = interp[f"fixture/{name}"]
    # fp16 rotated input and fp16 weights, fp32 accumulation (METHOD.md: fp16 operands land near 3e-4).
    assert r["matmul_rel_fp64"] <= 1e-3, r
    assert r["matmul_max_elem_fp64"] <= 3e-3, r
    assert r["matmul_rel_library"] <= 1e-3, r
    # Only the fp32 summation order of the k slices differs between split counts.
    assert r["splits_rel"] <= 1e-6, r
    assert r["prefill_rel_fp64"] <= 1.5e-3, r


@pytest.mark.parametrize("cb", CODEBOOKS)
@pytest.mark.parametrize("K", range(1, 9))
def test_interpreted_matmul_random_trellis(interp, cb, K):
    r = interp[f"random/{cb}/K{K}"]
    assert r["matmul_rel_fp64"] <= 1e-3, r
    # 2,560 outputs per case (vs 1,024-1,536 in a golden layer), so the largest fp16-rounding outlier is larger.
    assert r["matmul_max_elem_fp64"] <= 4e-3, r


@pytest.mark.parametrize("case", ["mul1/K3", "3inst/K5"])
def test_interpreted_rows_in_any_batch_stay_within_fp16_rounding(interp, case):
    # The bounds of the whole-matrix checks above, per row (its own norm and RMS): a row that picked up another
    # row's values or lost part of its k slices would be off by far more.
    r = interp[f"rows/{case}"]
    assert r["row_rel_fp64"] <= 1e-3, r
    assert r["row_max_elem_fp64"] <= 4e-3, r


def test_interpreted_moe(interp):
    r = interp["moe/mul1/K3"]
    assert r["shared_experts"] > 0, "the case must have rows sharing an expert"
    # Two fp16 roundings of activations (input, h) and two fp16-weight products.
    assert r["rel_fp64"] <= 2e-3, r
    assert r["max_elem_fp64"] <= 1e-2, r
    assert r["row2_alone_rel_fp64"] <= 2e-3 and r["row2_alone_max_elem_fp64"] <= 1e-2, r
    assert r["addend_is_one_add_after"], r


# ---------------------------------------------------------------------------------------------------------------
# CPU tests of the host side (no kernel runs): launch shapes, dispatch, the layout's checks, imports
# ---------------------------------------------------------------------------------------------------------------


def _zero_layout(k, n, K=3, cb="mul1", experts=None):
    from dsv41.kernels.exl3.layout import Exl3ExpertStack, Exl3Tensor

    lead = () if experts is None else (experts,)
    group = (torch.zeros(*lead, k // 16, n // 16, 16 * K, dtype=torch.int16),
             torch.ones(*lead, k, dtype=torch.float16), torch.ones(*lead, n, dtype=torch.float16))
    return Exl3Tensor.from_group(*group, cb) if experts is None else Exl3ExpertStack.from_stacked(*group, cb)


class _LaunchSpy:
    """Stands in for a Triton kernel: records each launch's grid and arguments instead of running it."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launches.append((tuple(grid), args, meta))


def test_triton_matmul_launch_treats_every_row_alike_at_any_m(monkeypatch):
    """What makes a row's bits independent of the batch on the GPU (a tensor core computes each row of its product
    on its own): for every m the launch has the same column blocks, k splits and compile-time shape, and row r is
    row r % 16 of row block r // 16 (the last block masked, never narrower)."""
    from dsv41.kernels.exl3 import matmul

    spy = _LaunchSpy()
    monkeypatch.setattr(matmul, "_exl3_matmul_kernel", spy)
    for k, n, K in PACK_SHAPES[:2] + [(256, 384, 5)]:
        w = _zero_layout(k, n, K)
        for m in range(1, 41):
            matmul.fused_matmul(torch.zeros(m, k, dtype=torch.float16), w)
        grids = [launch[0] for launch in spy.launches]
        shapes = {(launch[1][11:], tuple(sorted(launch[2].items()))) for launch in spy.launches}  # after M, k, n
        assert {g[:2] for g in grids} == {(n // 128, matmul.default_config(w).splits)}, (k, n)
        assert [g[2] for g in grids] == [-(-m // matmul.BLOCK_M) for m in range(1, 41)] and matmul.BLOCK_M == 16
        assert [launch[1][8] for launch in spy.launches] == list(range(1, 41))  # M: the mask of the last block
        assert len(shapes) == 1, shapes  # strides, split count, K, codebook, BK, warps, stages: one launch shape
        spy.launches.clear()


def test_triton_moe_launches_depend_on_the_matrices_not_on_the_window(monkeypatch):
    """The two MoE launches: only the number of expert programs (and the routing table's scan width) follows the
    window; column blocks, k splits and the compile-time shape of the arithmetic do not."""
    from dsv41.kernels.exl3 import moe

    spies = {name: _LaunchSpy() for name in ("_moe_gate_up_kernel", "_moe_down_kernel")}
    for name, spy in spies.items():
        monkeypatch.setattr(moe, name, spy)
    w1, w3, w2 = _zero_layout(256, 384, experts=8), _zero_layout(256, 384, experts=8), _zero_layout(384, 256, experts=8)
    gen = torch.Generator().manual_seed(3)
    for T in (1, 2, 5, 16, 17):
        ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(T)])
        moe.moe_forward(torch.zeros(T, 256, dtype=torch.float16), ids, torch.rand(T, 3, generator=gen), w1, w3, w2)
    for name, spy in spies.items():
        assert len({launch[0][1:] for launch in spy.launches}) == 1, name
        meta = {tuple((key, v) for key, v in sorted(launch[2].items()) if key != "SLOTS") for launch in spy.launches}
        assert len(meta) == 1, (name, meta)
        assert all(launch[0][0] <= min(3 * 16, 8) for launch in spy.launches), name


def test_linear_takes_the_fused_kernel_up_to_its_row_limit_and_reconstruct_above(monkeypatch):
    from dsv41.kernels.exl3 import linear

    calls = []

    def path(name):
        def run(rows, weight, out_dtype):
            calls.append((name, tuple(rows.shape)))
            return rows[:, :1].float().expand(-1, weight.n)  # each output row carries its input row's first value
        return run

    monkeypatch.setattr(linear, "fused_matmul", path("fused"))
    monkeypatch.setattr(linear, "prefill_matmul", path("prefill"))
    w = _zero_layout(128, 256)
    small = torch.arange(16 * 128, dtype=torch.float16).reshape(2, 8, 128)  # 16 rows in a batched shape
    large = torch.arange((linear.FUSED_MAX_ROWS + 1) * 128, dtype=torch.float32).reshape(-1, 128)
    y = linear.exl3_linear(small, w)
    assert y.shape == (2, 8, 256) and torch.equal(y[..., 3], small[..., 0].float())
    assert linear.exl3_linear(large, w).shape == (linear.FUSED_MAX_ROWS + 1, 256)
    assert calls == [("fused", (16, 128)), ("prefill", (linear.FUSED_MAX_ROWS + 1, 128))]


# ---------------------------------------------------------------------------------------------------------------
# GPU tests: the pack's real shapes, compiled kernels (inline PTX on and off)
# ---------------------------------------------------------------------------------------------------------------

def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: GPU kernel tests run on the H200 (pytest -m gpu)")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: GPU tests need compiled kernels")


@pytest.fixture(params=["asm", "portable"])
def asm_mode(request, monkeypatch):
    if request.param == "portable":
        monkeypatch.setenv("DSV41_EXL3_NO_ASM", "1")
    else:
        monkeypatch.delenv("DSV41_EXL3_NO_ASM", raising=False)
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("cb", CODEBOOKS)
def test_gpu_decode_bit_exact_all_codebooks(cb, asm_mode):
    _need_cuda()
    from dsv41.kernels.exl3.reconstruct import reconstruct
    from dsv41.kernels.exl3.layout import Exl3Tensor
    from dsv41.weights import exl3

    gen = torch.Generator().manual_seed(11)
    for K in range(1, 9):
        trellis, suh, svh = _random_group(gen, 1024, 512, K, "cuda")
        wq = reconstruct(Exl3Tensor.from_group(trellis, suh, svh, cb), rotate=False)
        assert torch.equal(wq.view(torch.int16), exl3.decode_rotated(trellis, cb).view(torch.int16)), (cb, K)


@pytest.mark.gpu
@pytest.mark.parametrize("prerotate", [False, True])
@pytest.mark.parametrize("k,n,K", PACK_SHAPES)
def test_gpu_pack_shapes_matmul_decode_and_row_invariance(k, n, K, asm_mode, prerotate):
    _need_cuda()
    from dsv41.kernels.exl3.matmul import MatmulConfig, default_config, fused_matmul
    from dsv41.kernels.exl3.reconstruct import prefill_matmul, reconstruct
    from dsv41.kernels.exl3.layout import Exl3Tensor
    from dsv41.weights import exl3

    gen = torch.Generator().manual_seed(k + n + K)
    trellis, suh, svh = _random_group(gen, k, n, K, "cuda")
    w = Exl3Tensor.from_group(trellis, suh, svh, "mul1")
    assert torch.equal(
        reconstruct(w, rotate=False).view(torch.int16), exl3.decode_rotated(trellis, "mul1").view(torch.int16)
    )
    w64 = exl3.effective_weight(trellis, suh, svh, "mul1", torch.float64)
    x = torch.randn(16, k, generator=gen).half().cuda()
    base = default_config(w)
    cfg = MatmulConfig(base.splits, 32, 8, prerotate=True) if prerotate else base
    y = fused_matmul(x, w, config=cfg)
    y64 = x.double() @ w64
    # Up to 16 x 32768 outputs: the largest fp16-rounding outlier grows with the count (seen 3.7e-3 at 524k).
    assert _rel(y, y64) <= 1e-3 and _max_elem(y, y64) <= 6e-3
    yp = prefill_matmul(torch.randn(200, k, device="cuda").half(), w)
    assert torch.isfinite(yp).all()
    # Row invariance of the Triton kernel, bitwise (the CPU tests can only bound it): every m in 1..16, rows in
    # another order, a row among other rows, 40 rows as 16 + 16 + 8, a deterministic repeat; and the input rotated
    # in its own launch gives the bits of the fused rotation.
    assert torch.equal(fused_matmul(x, w, config=cfg).view(torch.int32), y.view(torch.int32)), "repeat differs: race?"
    perm = torch.randperm(16, generator=gen)
    for m in range(1, 17):
        rows = perm[:m].cuda()
        part = fused_matmul(x[rows], w, config=cfg)
        assert torch.equal(part.view(torch.int32), y[rows].view(torch.int32)), f"m={m}"
    other = torch.randn(40, k, generator=gen).half().cuda()
    other[[4, 21, 37]] = x[[4, 5, 6]]
    assert torch.equal(fused_matmul(other, w, config=cfg)[[4, 21, 37]].view(torch.int32), y[4:7].view(torch.int32))
    twin = MatmulConfig(cfg.splits, cfg.block_k, cfg.num_warps, prerotate=not cfg.prerotate)
    assert torch.equal(fused_matmul(x, w, config=twin).view(torch.int32), y.view(torch.int32)), "prerotate"


@pytest.mark.gpu
def test_gpu_prefill_matches_fp64():
    _need_cuda()
    from dsv41.kernels.exl3.reconstruct import prefill_matmul
    from dsv41.kernels.exl3.layout import Exl3Tensor
    from dsv41.weights import exl3

    gen = torch.Generator().manual_seed(12)
    trellis, suh, svh = _random_group(gen, 5120, 2304, 3, "cuda")
    w = Exl3Tensor.from_group(trellis, suh, svh, "mul1")
    x = torch.randn(256, 5120, generator=gen).half().cuda()
    y64 = x.double() @ exl3.effective_weight(trellis, suh, svh, "mul1", torch.float64)
    assert _rel(prefill_matmul(x, w), y64) <= 1.5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 16])
def test_gpu_moe_real_shapes(T, asm_mode):
    """The Triton MoE (a config selects it; the CUDA one: tests/test_exl3_cuda.py), rows bitwise as alone."""
    _need_cuda()
    from dsv41.kernels.exl3.moe import MoeConfig, moe_forward

    gen = torch.Generator().manual_seed(13 + T)
    experts, topk = 24, 6
    groups, (w1, w3, w2) = _moe_case(gen, experts, 5120, 2304, 3, "mul1", "cuda")
    x = torch.randn(T, 5120, generator=gen).half().cuda()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(T)]).cuda()
    weights = torch.rand(T, topk, generator=gen).cuda()
    cfg = MoeConfig()
    y = moe_forward(x, ids, weights, w1, w3, w2, config=cfg)
    ref = _moe_reference(x, ids, weights, groups, "mul1", 10.0)
    assert _rel(y, ref) <= 2e-3 and _max_elem(y, ref) <= 1e-2
    assert torch.equal(moe_forward(x, ids, weights, w1, w3, w2, config=cfg).view(torch.int32), y.view(torch.int32))
    for t in range(T):
        alone = moe_forward(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], w1, w3, w2, config=cfg)
        assert torch.equal(alone[0].view(torch.int32), y[t].view(torch.int32)), f"row {t}"


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    _interp_worker(sys.argv[2])
