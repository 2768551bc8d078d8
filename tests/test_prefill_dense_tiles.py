"""The dense prefill GEMM's launch shapes (`prefill_dense.TILES`, DSV41_PREFILL_DENSE_TILE) and the group launches
(`kernels/exl3/prefill_group.py`, DSV41_PREFILL_DENSE_GROUP): issue 31.

CPU part (Triton's interpreter, a child process: TRITON_INTERPRET must be set before the kernels are decorated):
every launch shape's kernel code (BN 256 with a masked last half, BM 64 / 256, 128-deep k, the program orders)
against the fp64 reference and the default shape, its rows bitwise the same alone / as a prefix / permuted /
chunked; the group launch's outputs bitwise the members' own (one x, two output dtypes, inputs side by side, inputs
apart, concatenated, at BN 256 too), row invariant; the runtime's LinearGroup with the switch on == off bitwise and
its runs within the workspace; the bench's dense sweep as a dry run. sm_90 compile (no GPU): the group kernel
pipelines into wgmma; the early-Hadamard shape runs the default's float ops in order. GPU part (`-m gpu`): every
launch shape row invariant at 2,048 and 8,192 rows and its distance to the default; the group launches == the
members bitwise.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_harness import interpreted  # noqa: E402
from test_exl3_kernels import _max_elem, _random_group, _rel  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENVS = ("DSV41_PREFILL_DENSE_GEMM", "DSV41_PREFILL_DENSE_GROUP", "DSV41_PREFILL_DENSE_TILE")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return bool(torch.equal(a.contiguous().view(bits), b.contiguous().view(bits)))


def _cpu_timer(fn):
    fn()
    return 1.0, "cpu"


def _matrix(gen, k, n, K=3):
    from dsv41.kernels.exl3.layout import Exl3Tensor

    trellis, suh, svh = _random_group(gen, k, n, K)
    return Exl3Tensor.from_group(trellis, suh, svh, "mul1"), (trellis, suh, svh)


# ---------------------------------------------------------------------------------------------------------------
# interpreted worker (runs in the child process)
# ---------------------------------------------------------------------------------------------------------------


def _tiles_worker(results: dict) -> None:
    from dsv41.kernels.exl3 import prefill_dense as D
    from dsv41.kernels.exl3.prefill import _rotate
    from dsv41.weights import exl3

    gen = torch.Generator().manual_seed(31)
    w, (trellis, suh, svh) = _matrix(gen, 256, 384)  # three 128-column blocks: BN 256's last half is masked
    x = torch.randn(70, 256, generator=gen).bfloat16()
    y64 = x.double() @ exl3.effective_weight(trellis, suh, svh, "mul1", torch.float64)
    xh, _ = _rotate(x, w.suh, 256)
    wq = D.decode_into(w)

    def gemm(rows, cfg):
        a = xh[rows].contiguous()
        return D.gemm_rotated(a, wq, w, torch.empty(a.shape[0], 384), cfg)

    ref = gemm(slice(None), D.INTERPRETED)
    perm = torch.randperm(70, generator=gen)
    shapes = {}
    for name, cfg in D.TILES.items():  # the interpreter runs warps / stages alike: one run a tile shape and order
        launch_only = ("num_warps", "num_stages", "shared_kb")
        shapes.setdefault(tuple(v for f, v in cfg.__dict__.items() if f not in launch_only), name)
    for name in shapes.values():
        cfg = D.TILES[name]
        y = gemm(slice(None), cfg)
        inv = {f"first_{n}": _same(gemm(slice(0, n), cfg), y[:n]) for n in (1, 33)}
        inv["row_69_alone"] = _same(gemm(slice(69, 70), cfg), y[69:70])
        inv["permuted"] = _same(gemm(perm, cfg), y[perm])
        inv["chunks"] = _same(torch.cat([gemm(slice(0, 17), cfg), gemm(slice(17, 70), cfg)]), y)
        results[f"tile/{name}"] = {"rel_fp64": _rel(y, y64), "max_elem": _max_elem(y, y64), "rel_default": _rel(y, ref),
                                   "invariance": inv}
    # the knob: read at each launch where GEMM runs (the interpreter keeps its own shape)
    os.environ["DSV41_PREFILL_DENSE_TILE"] = "128x256x64w8s3"
    results["knob_named"] = D.tile_named() is D.TILES["128x256x64w8s3"]
    os.environ["DSV41_PREFILL_DENSE_TILE"] = "nonsense"
    try:
        D.tile_named()
        results["knob_rejects"] = False
    except ValueError:
        results["knob_rejects"] = True
    os.environ.pop("DSV41_PREFILL_DENSE_TILE")
    results["knob_default"] = D.tile_named() is D.TILES[D.DEFAULT_TILE]


def _group_worker(results: dict) -> None:
    from dsv41.kernels.exl3 import prefill_dense as D
    from dsv41.kernels.exl3.prefill import prefill_linear
    from dsv41.kernels.exl3.prefill_group import DenseGroup, prefill_linear_group

    gen = torch.Generator().manual_seed(32)
    ws = [_matrix(gen, 128, n)[0] for n in (384, 128)]
    x = torch.randn(20, 128, generator=gen).bfloat16()
    f32, bf16 = torch.float32, torch.bfloat16
    dtypes = [f32, bf16]
    alone = [prefill_linear(x, w, out_dtype=d, dense_gemm=True) for w, d in zip(ws, dtypes)]
    got = {}
    got["one_x_two_dtypes"] = all(map(_same, prefill_linear_group([x] * 2, ws, dtypes), alone))
    # inputs side by side in one tensor (wo_a's groups), concatenated outputs (u)
    o = torch.randn(20, 2 * 128, generator=gen).bfloat16()
    xs = [o[:, i * 128:(i + 1) * 128] for i in range(2)]
    alone_o = [prefill_linear(xi, w, out_dtype=bf16, dense_gemm=True) for xi, w in zip(xs, ws)]
    got["side_by_side"] = all(map(_same, prefill_linear_group(xs, ws, [bf16] * 2), alone_o))
    got["concat"] = _same(prefill_linear_group(xs, ws, [bf16] * 2, concat=True), torch.cat(alone_o, dim=1))
    # inputs apart (one rotation launch a member)
    apart = [torch.randn(20, 128, generator=gen).bfloat16() for _ in ws]
    alone_a = [prefill_linear(xi, w, out_dtype=f32, dense_gemm=True) for xi, w in zip(apart, ws)]
    got["apart"] = all(map(_same, prefill_linear_group(apart, ws, [f32] * 2), alone_a))
    # BN 256 members (384: an odd number of 128-column blocks) == the single launch at the same shape
    cfg = D.TILES["128x256x64w8s3"]
    from dsv41.kernels.exl3.prefill import _rotate

    single = [D.workspace_matmul(_rotate(x, w.suh, 128)[0], w, torch.empty(20, w.n), cfg=cfg) for w in ws]
    got["bn256"] = all(map(_same, prefill_linear_group([x] * 2, ws, [f32] * 2, cfg=cfg), single))
    cfg = D.TILES["128x128x64w8s3hp2"]
    single = [D.workspace_matmul(_rotate(x, w.suh, 128)[0], w, torch.empty(20, w.n), cfg=cfg) for w in ws]
    got["h_early_two_parts"] = all(map(_same, prefill_linear_group([x] * 2, ws, [f32] * 2, cfg=cfg), single))
    # row invariance of the group launch itself, and a workspace with stale values
    group = DenseGroup(ws)
    full = group([x] * 2, [f32] * 2)
    for n in (1, 17):
        got[f"first_{n}"] = all(_same(a, b[:n]) for a, b in zip(group([x[:n]] * 2, [f32] * 2), full))
    got["row_19_alone"] = all(_same(a, b[19:]) for a, b in zip(group([x[19:]] * 2, [f32] * 2), full))
    stale = torch.full((group.numel + 100,), float("nan"), dtype=torch.float16)
    got["workspace"] = all(map(_same, group([x] * 2, [f32] * 2, stale), full))
    got["empty"] = [tuple(t.shape) for t in group([x[:0]] * 2, [f32] * 2)] == [(0, 384), (0, 128)]
    xh16 = group.rotate([x] * 2)
    got["rotate_is_prefill_rotate"] = all(_same(xh16[i], _rotate(x, w.suh, 128)[0]) for i, w in enumerate(ws))
    got["rotate_rows64"] = _same(group.rotate([x] * 2, rows=64), xh16)
    got["rotate_rows64_alone"] = _same(group.rotate([x[5:6]] * 2, rows=64), xh16[:, 5:6])
    results["group"] = got


def _runtime_worker(results: dict) -> None:
    from dsv41.runtime.layers.linear import Exl3Linear, LinearGroup, PrefillWorkspace

    gen = torch.Generator().manual_seed(33)
    space = PrefillWorkspace(torch.device("cpu"))
    lins = [Exl3Linear(_matrix(gen, 128, n)[0], space, f"m{i}") for i, n in enumerate((256, 128, 128, 384))]
    big = Exl3Linear(_matrix(gen, 128, 512)[0], space, "big")  # reserves 128 x 512: the first three fit together
    x = torch.randn(20, 128, generator=gen).bfloat16()
    group = LinearGroup(lins + [big])
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    os.environ["DSV41_PREFILL_DENSE_GROUP"] = "0"
    off = group([x] * 5, 20, "prefill", dtypes)
    os.environ["DSV41_PREFILL_DENSE_GROUP"] = "1"
    on = group([x] * 5, 20, "prefill", dtypes)
    r = {"same_bits": all(map(_same, on, off)),
         "runs": [run for run, _ in group.dense_batches()],
         "runs_fit": all(g.numel <= space.numel for _, g in group.dense_batches())}
    o = torch.randn(20, 3 * 128, generator=gen).bfloat16()
    wo = LinearGroup(lins[:3])
    xs = [o[:, i * 128:(i + 1) * 128] for i in range(3)]
    u = wo.prefill_concat(xs, "prefill")
    r["concat"] = u is not None and _same(u, torch.cat([lin(xi, phase="prefill") for lin, xi in zip(lins, xs)], 1))
    os.environ["DSV41_PREFILL_DENSE_GROUP"] = "0"
    r["concat_off"] = wo.prefill_concat(xs, "prefill") is None
    os.environ.pop("DSV41_PREFILL_DENSE_GROUP")
    results["runtime"] = r
    # the bench's dense sweep on a stand-in layer, timed by the CPU clock (its structure and its bits checks)
    sys.path.insert(0, str(REPO / "bench"))
    from prefill_dense_sweep import dense_sweep

    from dsv41.kernels.exl3.prefill_dense import TILES

    attn = SimpleNamespace(linears=lambda: lins[:3], x_group=LinearGroup(lins[:2]), qr_group=LinearGroup([big]),
                           wo_a_group=LinearGroup(lins[1:3]))
    model = SimpleNamespace(blocks=[SimpleNamespace(attn=attn, moe=SimpleNamespace(shared=[], shared_gate_up=[]))],
                            workspace=space)
    tiles = {name: TILES[name] for name in ("128x128x64w8s3", "128x256x64w8s3")}
    out = dense_sweep(model, rows_list=(20,), device="cpu", timer=_cpu_timer, tiles=tiles)
    rows = out["rows"]["20"]
    results["sweep"] = {"tiles_invariant": all(t.get("row_invariant") for t in rows["tiles"].values()),
                        "default_same": rows["tiles"]["128x128x64w8s3"]["same_bits"],
                        "errors": [t.get("error") for t in rows["tiles"].values() if "error" in t],
                        "groups_same": [g.get("same_bits") for g in rows["groups"]],
                        "best": rows.get("best_tile")}


def _interp_worker(out_path: str) -> None:
    results: dict = {}
    try:
        for part in (_tiles_worker, _group_worker, _runtime_worker):
            part(results)
    except Exception as exc:  # reported so the tests show the worker's error
        import traceback

        results["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    results = interpreted(tmp_path_factory, __file__, "dense_tiles", timeout=600, env={"OMP_NUM_THREADS": "1"},
                          drop_env=ENVS)
    assert "error" not in results, results.get("error")
    return results


def test_interpreted_every_tile_shape_is_the_linear_and_row_invariant(interp):
    names = [key for key in interp if key.startswith("tile/")]
    assert len(names) >= 6, names  # BN 128 / 256, BM 64 / 128 / 256, BK 64 / 128, the program orders
    for key in names:
        r = interp[key]
        assert r["rel_fp64"] <= 1.5e-3 and r["max_elem"] <= 1e-2, (key, r)
        assert r["rel_default"] <= 1e-5, (key, r)  # the same fp16 products, the fp32 sums in another order at most
        assert all(r["invariance"].values()), (key, r["invariance"])


def test_the_tile_knob_names_a_shape_rejects_others_and_defaults_to_the_default_tile(interp):
    assert interp["knob_named"] and interp["knob_rejects"] and interp["knob_default"], interp


def test_interpreted_group_launch_is_each_members_bits_and_row_invariant(interp):
    r = interp["group"]
    assert all(r.values()), {k: v for k, v in r.items() if not v}


def test_interpreted_runtime_group_is_the_members_one_by_one_within_the_workspace(interp):
    r = interp["runtime"]
    assert r["same_bits"] and r["runs_fit"] and r["concat"] and r["concat_off"], r
    assert r["runs"] and all(len(run) >= 2 for run in r["runs"]), r["runs"]  # the big one runs alone


def test_interpreted_bench_dense_sweep_dry_run(interp):
    r = interp["sweep"]
    assert not r["errors"] and r["tiles_invariant"] and r["default_same"], r
    assert r["groups_same"] and all(r["groups_same"]), r
    assert r["best"] in ("128x128x64w8s3", "128x256x64w8s3"), r


def test_group_switch_is_on_by_default_and_turns_off(monkeypatch):
    from dsv41.kernels.exl3.prefill_group import group_enabled

    monkeypatch.delenv("DSV41_PREFILL_DENSE_GROUP", raising=False)
    assert group_enabled()
    monkeypatch.setenv("DSV41_PREFILL_DENSE_GROUP", "0")
    assert not group_enabled()


# ---------------------------------------------------------------------------------------------------------------
# compiled for sm_90 without a GPU: Triton's ahead-of-time compile
# ---------------------------------------------------------------------------------------------------------------


def _sm90(fn, cfg, **extra):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = dict(BM=cfg.block_m, BK=cfg.block_k, GROUP_M=cfg.group_m, BN=cfg.block_n, H_EARLY=cfg.h_early,
                 PARTS=cfg.rotate_parts, **extra)
    const.update({"TMA": cfg.tma} if "TMA" in fn.arg_names else {})
    ptrs = {"xh_ptr": "*fp16", "w_ptr": "*fp16", "svh_ptr": "*fp16", "had_ptr": "*fp16", "out_ptr": "*fp32",
            "out_a_ptr": "*bf16", "out_b_ptr": "*fp32", "meta_ptr": "*i64"}
    sig = {a: "constexpr" if a in const else ptrs.get(a, "i32") for a in fn.arg_names}
    sixteen = {*ptrs, "k", "n", "stride_out"}  # as a launch on torch's tensors specialises them
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in sixteen}
    try:
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=aligned),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    except RuntimeError as exc:  # no ptxas for this target in this Triton
        pytest.skip(f"Triton cannot compile for sm_90 here: {exc}")


def _float_ops(ptx: str) -> list[str]:
    """The opcodes that touch a float value, in program order (the arithmetic a launch's bits follow from)."""
    keys = ("mma", "cvt", "fma", ".f32", ".f16", "max")
    return [line.split()[0] for line in ptx.splitlines() if line.strip() and any(t in line.split()[0] for t in keys)]


def test_sm90_group_kernel_pipelines_and_the_early_hadamard_keeps_the_default_arithmetic():
    """The group GEMM at the default shape compiles for sm_90 pipelined into wgmma within the default's shared memory;
    the early-Hadamard shape (`128x128x64w8s3h`) runs the default kernel's float ops in the same order (only the
    Hadamard's load moves before the k loop): the same bits, so it could be the default on a measured win."""
    from dsv41.kernels.exl3 import prefill_dense as D
    from dsv41.kernels.exl3 import prefill_group as G

    group = _sm90(G._gemm_group_kernel, D.GEMM, MEMBERS=4, CONCAT=False, TWO=True)
    assert group.metadata.shared <= D.GEMM.shared_kb * 1024, group.metadata.shared
    assert "async_copy_global_to_local" in group.asm["ttgir"] and "warp_group_dot" in group.asm["ttgir"]
    base = _sm90(D._gemm_rotate_kernel, D.GEMM).asm["ptx"]
    early = _sm90(D._gemm_rotate_kernel, D.TILES["128x128x64w8s3h"]).asm["ptx"]
    assert _float_ops(early) == _float_ops(base)
    two = _sm90(D._gemm_rotate_kernel, D.TILES["128x128x64w8s3p2"]).asm["ptx"]
    assert _float_ops(two) != _float_ops(base)  # the check sees a change of the arithmetic (one part fewer)


# ---------------------------------------------------------------------------------------------------------------
# GPU: every launch shape's bits and row invariance at the chunk's row counts; the group launches' bits
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("T", [2048, 8192])
def test_gpu_every_dense_tile_shape_is_row_invariant(T):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the dense GEMM compiled for it)")
    from dsv41.kernels.cuda_module import shared_memory_limit
    from dsv41.kernels.exl3 import prefill_dense as D
    from dsv41.kernels.exl3.prefill import _rotate

    gen = torch.Generator().manual_seed(T)
    limit = shared_memory_limit(torch.cuda.current_device())
    report = []
    for k, n, K in ((5120, 1152, 5), (1280, 16384, 5)):  # a short and a long k; 9 column blocks: BN 256 masks one
        w = _gpu_matrix(gen, k, n, K)
        x = torch.randn(T, k, generator=gen).bfloat16().cuda()
        xh, _ = _rotate(x, w.suh, k)
        wq = D.decode_into(w)
        perm = torch.randperm(T, generator=gen).cuda()
        ref = D.gemm_rotated(xh, wq, w, torch.empty(T, n, device="cuda"), D.GEMM)
        for name, cfg in D.TILES.items():
            if cfg.shared_kb * 1024 > limit:
                report.append(f"{name}: does not fit ({limit} B a block)")
                continue

            def gemm(rows):
                a = xh[rows].contiguous()
                return D.gemm_rotated(a, wq, w, torch.empty(a.shape[0], n, device="cuda"), cfg)

            y = gemm(slice(None))
            for rows in (slice(0, 1), slice(0, 64), slice(T - 1, T), perm):
                assert _same(gemm(rows), y[rows]), (name, k, n, rows if isinstance(rows, slice) else "perm")
            assert _rel(y, ref) <= 1e-5, (name, _rel(y, ref))
            report.append(f"{name} [{k} x {n}]: max |y - default| {float((y - ref).abs().max()):.1e}, same bits "
                          f"{_same(y, ref)}")
    print("\n" + "\n".join(report))


def _gpu_matrix(gen, k, n, K):
    from dsv41.kernels.exl3.layout import Exl3Tensor

    return Exl3Tensor.from_group(*_random_group(gen, k, n, K, "cuda"), "mul1")


@pytest.mark.gpu
def test_gpu_group_launches_are_the_members_bits():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the dense GEMM compiled for it)")
    from dsv41.kernels.exl3.prefill import prefill_linear
    from dsv41.kernels.exl3.prefill_group import DenseGroup

    gen = torch.Generator().manual_seed(7)
    T = 2048
    ws = [_gpu_matrix(gen, 5120, n, 6) for n in (1280, 512, 512, 512)]  # the x point: wq_a, wkv, compressor's
    x = torch.randn(T, 5120, generator=gen).bfloat16().cuda()
    dtypes = [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    alone = [prefill_linear(x, w, out_dtype=d, dense_gemm=True) for w, d in zip(ws, dtypes)]
    group = DenseGroup(ws)
    got = group([x] * 4, dtypes)
    assert all(map(_same, got, alone))
    for rows in (slice(0, 1), slice(0, 64), slice(1000, 1033)):
        assert all(_same(a, b[rows]) for a, b in zip(group([x[rows]] * 4, dtypes), got)), rows
    wo = [_gpu_matrix(gen, 4096, 1024, 5) for _ in range(4)]  # wo_a's slices: inputs side by side, u concatenated
    o = torch.randn(T, 4 * 4096, generator=gen).bfloat16().cuda()
    xs = [o[:, i * 4096:(i + 1) * 4096] for i in range(4)]
    u = DenseGroup(wo)(xs, [torch.bfloat16] * 4, concat=True)
    assert _same(u, torch.cat([prefill_linear(xi, w, dense_gemm=True) for xi, w in zip(xs, wo)], dim=1))


@pytest.mark.gpu
def test_gpu_tiny_model_prefill_is_the_same_bits_with_the_group_launches(tiny_model_dir, monkeypatch):
    """The whole model's prefill logits (every row, three prompts in one chunk) with DSV41_PREFILL_DENSE_GROUP=1 ==
    without, bitwise: the wiring (x / q_a points, wo_a into u, the shared expert's gate / up) changes no bit. (The
    same A/B interpreted on the slimmed tiny model, test_runtime_fast.LITE: equal, but ~2 x 110 s on a CPU core.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from dsv41.runtime.build import build_fast_model

    model = build_fast_model(tiny_model_dir, "cuda", torch.bfloat16)
    prompts = [[0] + [(i * (31 + 2 * s)) % 500 + 5 for i in range(40 + 7 * s)] for s in range(3)]
    logits = {}
    for value in ("0", "1"):
        monkeypatch.setenv("DSV41_PREFILL_DENSE_GROUP", value)
        states = [model.new_state() for _ in prompts]
        logits[value] = model.forward(list(zip(states, prompts)), "prefill", logits="all")
    assert _same(logits["0"], logits["1"])
    runs = [run for block in model.blocks for g in (block.attn.x_group, block.attn.qr_group, block.attn.wo_a_group)
            for run, _ in g.dense_batches()]
    print(f"\n{len(runs)} group launches a forward over {len(model.blocks)} layers")
    assert runs, "no linear group of the tiny model took the group launch: the A/B compared nothing"


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    _interp_worker(sys.argv[2])
