"""Dense prefill projections as one decode into an fp16 workspace + one tensor-core GEMM
(dsv41.kernels.exl3.prefill_dense, `prefill_linear(dense_gemm=True)`, switch DSV41_PREFILL_DENSE_GEMM).

CPU part: the kernels in Triton's interpreter (a child process: TRITON_INTERPRET must be set before the kernels are
decorated) against the fp64 reference of the EXL3 linear and against the tile path; rows bitwise the same alone,
among 1 / 7 / 33 / 130 rows and in chunks (the interpreter's tl.dot is one numpy matmul of one fixed shape per
program, whatever the rows: a row's bits follow its own row); the switch read at each launch; the runtime's
Exl3Linear with its workspace. GPU part (`-m gpu`): a dense shape at 8,192 rows, against the tile path, rows
bitwise the same in any subset, both timed.
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
from step_harness import cuda_median_ms  # noqa: E402
from test_exl3_kernels import _max_elem, _random_group, _rel  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENV = "DSV41_PREFILL_DENSE_GEMM"
CASES = (("mul1", 3), ("3inst", 5), ("mcg", 2))


# ---------------------------------------------------------------------------------------------------------------
# interpreted worker (runs in the child process)
# ---------------------------------------------------------------------------------------------------------------


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)))


def _worker(results: dict) -> None:
    from dsv41.kernels.exl3.layout import Exl3Tensor
    from dsv41.kernels.exl3.prefill import prefill_linear
    from dsv41.runtime.layers.linear import Exl3Linear, PrefillWorkspace
    from dsv41.weights import exl3

    gen = torch.Generator().manual_seed(312)
    f32 = torch.float32
    for cb, K in CASES:
        trellis, suh, svh = _random_group(gen, 256, 384, K)
        w = Exl3Tensor.from_group(trellis, suh, svh, cb)
        x = torch.randn(37, 256, generator=gen).bfloat16()
        y64 = x.double() @ exl3.effective_weight(trellis, suh, svh, cb, torch.float64)
        y = prefill_linear(x, w, out_dtype=f32, dense_gemm=True)
        tile = prefill_linear(x, w, out_dtype=f32, dense_gemm=False)
        results[f"fp64/{cb}/K{K}"] = {"rel": _rel(y, y64), "max_elem": _max_elem(y, y64),
                                      "tile_rel_fp64": _rel(tile, y64), "rel_to_tile": _rel(y, tile)}
    # row invariance, one matrix: 130 rows (9 row tiles of the interpreter's 16), prefixes, rows alone, chunks
    trellis, suh, svh = _random_group(gen, 256, 384, 3)
    w = Exl3Tensor.from_group(trellis, suh, svh, "mul1")
    x = torch.randn(130, 256, generator=gen).bfloat16()
    y = prefill_linear(x, w, out_dtype=f32, dense_gemm=True)
    inv = {f"first_{n}": _same(prefill_linear(x[:n], w, out_dtype=f32, dense_gemm=True), y[:n]) for n in (1, 7, 33)}
    for i in (0, 5, 32, 129):
        inv[f"row_{i}_alone"] = _same(prefill_linear(x[i:i + 1], w, out_dtype=f32, dense_gemm=True), y[i:i + 1])
    cuts = (0, 7, 40, 130)
    parts = [prefill_linear(x[a:b], w, out_dtype=f32, dense_gemm=True) for a, b in zip(cuts, cuts[1:])]
    inv["chunks_7_33_90"] = _same(torch.cat(parts), y)
    ws = torch.full((2 * 256 * 384,), float("nan"), dtype=torch.float16)  # a larger buffer, stale values
    inv["workspace_same_bits"] = _same(prefill_linear(x, w, out_dtype=f32, dense_gemm=True,
                                                      workspace=lambda k, n: ws[:k * n].view(k, n)), y)
    results["invariance"] = inv
    # the switch, read at each launch (flipped in this process), and the runtime's linear with its workspace
    tile = prefill_linear(x, w, out_dtype=f32, dense_gemm=False)
    switch = {}
    space = PrefillWorkspace(torch.device("cpu"))
    lin = Exl3Linear(w, space, "dense")
    for value, want in (("0", tile), ("", y), ("1", y), ("on", y)):
        os.environ[ENV] = value
        switch[f"{value or 'unset'}/kernel"] = _same(prefill_linear(x, w, out_dtype=f32), want)
        switch[f"{value or 'unset'}/linear"] = _same(lin(x, phase="prefill", out_dtype=f32), want)
        switch[f"{value or 'unset'}/workspace_held"] = space.buf is not None
    os.environ.pop(ENV)
    switch["tile_rel_to_gemm"] = _rel(tile, y)
    results["switch"] = switch


def _interp_worker(out_path: str) -> None:
    results: dict = {}
    try:
        _worker(results)
    except Exception as exc:  # reported so the tests show the worker's error
        results["error"] = f"{type(exc).__name__}: {exc}"
    Path(out_path).write_text(json.dumps(results, indent=1))


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    out = tmp_path_factory.mktemp("exl3_prefill_dense") / "results.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop(ENV, None)
    proc = subprocess.run([sys.executable, __file__, "--interp-worker", str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"interpreted worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads(out.read_text())
    assert "error" not in results, results.get("error")
    return results


@pytest.mark.parametrize("case", [f"{cb}/K{K}" for cb, K in CASES])
def test_interpreted_dense_gemm_matches_fp64_and_the_tile_path(interp, case):
    r = interp[f"fp64/{case}"]
    # the tile path's tolerance (tests/test_exl3_prefill.py): fp16 rounding of the rotated input and of bf16 x
    assert r["rel"] <= 1.5e-3 and r["max_elem"] <= 1e-2, r
    assert r["tile_rel_fp64"] <= 1.5e-3, r
    # the same function as the tile path (the same fp16 products): only the fp32 summation order differs
    assert r["rel_to_tile"] <= 1e-5, r


def test_interpreted_dense_gemm_rows_are_bitwise_alone_batched_and_chunked(interp):
    r = interp["invariance"]
    assert all(r.values()), {k: v for k, v in r.items() if not v}


def test_interpreted_switch_is_read_at_each_launch_and_on_by_default(interp):
    r = interp["switch"]
    bits = {k: v for k, v in r.items() if not k.endswith("workspace_held") and k != "tile_rel_to_gemm"}
    assert all(bits.values()), {k: v for k, v in bits.items() if not v}
    # the runtime's one workspace is allocated at the first call that decodes into it, and only then
    assert not r["0/workspace_held"], r
    assert r["unset/workspace_held"] and r["1/workspace_held"] and r["on/workspace_held"], r
    assert r["tile_rel_to_gemm"] <= 1e-5, r


def test_dense_gemm_is_on_by_default(monkeypatch):
    from dsv41.kernels.exl3.prefill_dense import dense_gemm_enabled

    monkeypatch.delenv(ENV, raising=False)
    assert dense_gemm_enabled()
    monkeypatch.setenv(ENV, "0")
    assert not dense_gemm_enabled()


# ---------------------------------------------------------------------------------------------------------------
# compiled for the GPUs without one: Triton's ahead-of-time compile
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,name", [(90, "GEMM"), (80, "GEMM"), (121, "COMPACT")])
def test_each_devices_config_fits_its_shared_memory_and_pipelines(arch, name):
    """Each config compiles for its devices within the shared memory it declares (config() picks it by that: GB10
    allows 99 KB a block), and on sm_90 the k loop is pipelined (cp.async stages) into wgmma products. The pointers
    are declared 16-byte aligned, as a launch on torch's tensors specialises them (unaligned, nothing pipelines)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsv41.kernels.exl3 import prefill_dense as D

    cfg, fn = getattr(D, name), D._gemm_rotate_kernel
    const = dict(BM=cfg.block_m, BK=cfg.block_k, GROUP_M=cfg.group_m, BN=cfg.block_n, H_EARLY=cfg.h_early,
                 PARTS=cfg.rotate_parts, TMA=cfg.tma)
    ptrs = {"xh_ptr": "*fp16", "w_ptr": "*fp16", "svh_ptr": "*fp16", "had_ptr": "*fp16", "out_ptr": "*fp32"}
    sig = {a: "constexpr" if a in const else ptrs.get(a, "i32") for a in fn.arg_names}
    # as a launch specialises them: the pointers, k, n and the output's row stride multiples of 16; n_rows not
    sixteen = {*ptrs, "k", "n", "stride_out"}
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in sixteen}
    try:
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=aligned),
                                  target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    except RuntimeError as exc:  # no ptxas for this target in this Triton
        pytest.skip(f"Triton cannot compile for sm_{arch} here: {exc}")
    assert compiled.metadata.shared <= cfg.shared_kb * 1024, (arch, name, compiled.metadata.shared)
    if arch == 90:
        ttgir = compiled.asm["ttgir"]
        assert "async_copy_global_to_local" in ttgir and "warp_group_dot" in ttgir, "not pipelined into wgmma"


# ---------------------------------------------------------------------------------------------------------------
# GPU: a dense shape at 8,192 rows, bits and time
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,K", [(4096, 5120, 4), (1280, 16384, 5)])
def test_gpu_dense_gemm_is_the_tile_path_and_row_invariant(k, n, K):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the prefill kernels compiled for it)")
    from dsv41.kernels.exl3.layout import Exl3Tensor
    from dsv41.kernels.exl3.prefill import prefill_linear
    from dsv41.kernels.exl3.prefill_dense import decode_into
    from dsv41.weights import exl3

    T = 8192
    gen = torch.Generator().manual_seed(k + n + K)
    trellis, suh, svh = _random_group(gen, k, n, K, "cuda")
    w = Exl3Tensor.from_group(trellis, suh, svh, "mul1")
    x = torch.randn(T, k, generator=gen).bfloat16().cuda()
    buf = torch.empty(k * n, dtype=torch.float16, device="cuda")
    space = lambda kk, nn: buf[:kk * nn].view(kk, nn)  # noqa: E731 - the runtime's workspace in small

    def gemm(rows, dtype=torch.float32):
        return prefill_linear(x[rows], w, out_dtype=dtype, dense_gemm=True, workspace=space)

    y = gemm(slice(None))
    tile = prefill_linear(x, w, out_dtype=torch.float32, dense_gemm=False)
    y64 = x[:256].double() @ exl3.effective_weight(trellis, suh, svh, "mul1", torch.float64)
    assert _rel(y[:256], y64) <= 1.5e-3
    # the tile path's function: only the fp32 summation order differs (tensor-core accumulators, k up to 4096)
    assert _rel(y, tile) <= 1e-4, _rel(y, tile)
    for rows in (slice(0, 1), slice(0, 64), slice(8191, 8192), slice(1000, 1033), slice(64, 8192)):
        assert torch.equal(gemm(rows).view(torch.int32), y[rows].contiguous().view(torch.int32)), rows
    perm = torch.randperm(T, generator=gen).cuda()
    assert torch.equal(gemm(perm).view(torch.int32), y[perm].view(torch.int32))
    assert torch.equal(gemm(slice(None), torch.bfloat16).float().view(torch.int32),
                       y.bfloat16().float().view(torch.int32)), "the bf16 output is the fp32 one rounded once"
    flop = 2.0 * T * k * n
    tile_ms = cuda_median_ms(lambda: prefill_linear(x, w, dense_gemm=False))
    gemm_ms = cuda_median_ms(lambda: prefill_linear(x, w, dense_gemm=True, workspace=space))
    decode_ms = cuda_median_ms(lambda: decode_into(w, space))
    print(f"\n[{k} x {n}, K {K}, {T} rows, {torch.cuda.get_device_name()}] tile {tile_ms:.3f} ms "
          f"({flop / tile_ms / 1e9:.0f} TFLOP/s); workspace + GEMM {gemm_ms:.3f} ms ({flop / gemm_ms / 1e9:.0f} "
          f"TFLOP/s), of which the decode {decode_ms:.3f} ms ({k * n / decode_ms / 1e9:.2f} T weights/s)")


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    _interp_worker(sys.argv[2])
