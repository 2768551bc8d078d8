"""CUDA path of the EXL3 kernels (dsv41.kernels.exl3.cuda) against the pure-torch reference and the golden layers.

CPU part (CI): the CUDA source compiles for Hopper and GB10 with every K and codebook, when a CUDA toolkit is
present (the kernels themselves need a GPU to run; on CPU the same math is checked through the Triton kernels in
the interpreter, tests/test_exl3_kernels.py). GPU part (`-m gpu`, run on the H200): decode bit-exact, matmul
against fp64 on the pack's shapes, rows bitwise independent of the batch and of m, MoE against fp64 and row by row.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from test_exl3_kernels import (
    CODEBOOKS,
    FIXTURE_NAMES,
    FIXTURES,
    PACK_SHAPES,
    _max_elem,
    _moe_case,
    _moe_reference,
    _random_group,
    _rel,
)

SOURCE = Path(__file__).resolve().parents[1] / "src" / "dsv41" / "kernels" / "cuda" / "exl3_fused.cu"
CACHE_K = 2  # the K whose Hopper variant the cubin cache's test compiles (not the K tests: the same nvcc command)
SM90A_KS = (3, 8)  # built by the builder as sm_90a images (sm_90's kernels + the wgmma tiles): test_exl3_prefill_wgmma
PREBUILT_K = 1  # the K tests' variant the prebuilt-cubin test finds (the host's kernel names: the same at every K)


def _nvcc_or_skip():
    from dsv41.kernels import cuda_build

    nvcc = cuda_build.find_nvcc()
    if nvcc is None:
        pytest.skip("no CUDA toolkit (nvcc) on this machine: the source is compiled on the GPU machine instead")
    return nvcc


# One test per K (a variant: ~30 s of a core on a 2-core machine), one codebook each: ptxas sees every K and codebook
# (CACHE_K and SM90A_KS: above); the pack's K = 3 meets every codebook in the GB10 test below (warning-free), its mul1
# on Hopper with the wgmma tiles. All 24 variants are built by `cuda_build` on every GPU machine and the Nix closure.
def _codebooks_of(K: int) -> list[str]:
    from dsv41.kernels import cuda_build

    names = list(cuda_build.CODEBOOK_IDS)
    return [names[(2 * K + 2) % len(names)]]  # K = 3: mul1 (the pack's), K = 8: 3inst; every codebook over the Ks


@pytest.mark.parametrize("K", [K for K in range(1, 9) if K != CACHE_K and K not in SM90A_KS])
def test_cuda_source_compiles_for_hopper_every_codebook(tmp_path_factory, K):
    """This K's variants (`_codebooks_of`) for sm_90 through the ahead-of-time builder the Nix closure uses, into one
    folder for the K tests (test_prebuilt_cubin_... finds PREBUILT_K's variant there: a compile fewer)."""
    from dsv41.kernels import cuda_build

    _nvcc_or_skip()
    variants = cuda_build.exl3_variants(Ks=[K], codebooks=tuple(_codebooks_of(K)))
    built = cuda_build.build_all(["sm_90"], tmp_path_factory.getbasetemp() / "sm90", jobs=1, variants=variants)
    assert len(built) == len(variants) == len(_codebooks_of(K)) and all(p.stat().st_size > 0 for p in built)
    assert len({p.name for p in built}) == len(built)


def test_the_compiled_variants_cover_every_k_and_codebook():
    from dsv41.kernels import cuda_build

    pairs = {(K, cb) for K in range(1, 9) for cb in _codebooks_of(K)}
    assert {K for K, _ in pairs} == set(range(1, 9)) and {cb for _, cb in pairs} == set(cuda_build.CODEBOOK_IDS)


def test_builder_variants_are_every_k_and_codebook_under_distinct_names():
    from dsv41.kernels import cuda_build

    variants = cuda_build.exl3_variants()
    assert sorted((v["EXL3_K"], v["EXL3_CB"]) for v in variants) == [(k, c) for k in range(1, 9) for c in range(3)]
    names = {cuda_build.image_name(cuda_build.EXL3_SOURCE, v, "sm_90", "cubin") for v in variants}
    assert len(names) == len(variants)


def test_cuda_source_compiles_for_gb10_without_warnings(tmp_path):
    """The pack's K=3 for GB10 (sm_121), every codebook, without a single warning; the prefill tile kernels (64 and
    128 rows, the latter at a one-block register budget) without spilling registers."""
    import re

    from dsv41.kernels import cuda_build

    nvcc = _nvcc_or_skip()
    for cb in range(3):
        proc = subprocess.run(
            [nvcc, "-cubin", "-arch=sm_121", "-O3", "-std=c++17", "-DEXL3_K=3", f"-DEXL3_CB={cb}", "-Xptxas", "-v",
             *cuda_build.flags_of(cuda_build.DEFAULT_TUNING), "-o", str(tmp_path / f"gb10-{cb}.cubin"), str(SOURCE)],
            capture_output=True, text=True,
        )
        assert proc.returncode == 0 and "warning" not in proc.stderr.lower(), proc.stderr[-3000:]
        for rows in (64, 128):
            found = re.search(rf"Function properties for exl3_prefill_r{rows}\n.*?(\d+) bytes spill stores",
                              proc.stderr)
            assert found is not None and found.group(1) == "0", (rows, proc.stderr[-3000:])


def test_prebuilt_cubin_is_used_without_compiling(tmp_path_factory, tmp_path, monkeypatch):
    """The runtime finds a prebuilt cubin without compiling anything, and every kernel the host launches is an entry
    point of the image."""
    from dsv41.kernels import cuda_build, cuda_module

    _nvcc_or_skip()
    defines = cuda_build.exl3_defines(PREBUILT_K, _codebooks_of(PREBUILT_K)[0], cuda_build.DEFAULT_TUNING)
    cubins = tmp_path_factory.getbasetemp() / "sm90"  # the K tests' folder (run alone: built here first)
    prebuilt = cubins / cuda_build.image_name(cuda_build.EXL3_SOURCE, defines, "sm_90", "cubin")
    if not prebuilt.exists():
        cuda_build.build_all(["sm_90"], cubins, jobs=1, variants=[defines])
    monkeypatch.setenv("DSV41_CUBIN_DIR", str(cubins))
    monkeypatch.setenv("DSV41_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(cuda_module, "find_nvcc", lambda: pytest.fail("compiled although a prebuilt cubin exists"))
    image = cuda_module.compile_image(cuda_build.EXL3_SOURCE, defines, "sm_90")
    assert image == prebuilt.read_bytes()
    # every kernel the host launches is an entry point of the image (a symbol of the cubin's string table)
    from dsv41.kernels.exl3.cuda import KERNELS

    missing = [name for name in KERNELS if b"\0" + name.encode() + b"\0" not in image]
    assert not missing, missing


def test_default_splits_depend_on_the_shape_only_and_fit_shared_memory():
    from dsv41.kernels.exl3.cuda import MAX_SLICE_BLOCKS, default_splits

    for k, n, _ in PACK_SHAPES + [(5120, 129280, 6), (256, 256, 3)]:
        s = default_splits(k, n, 132)
        assert 0 < s <= k // 128
        assert -(-(k // 128) // s) <= MAX_SLICE_BLOCKS


def test_linear_kernel_choice_moves_only_multi_row_launches_whose_units_fit():
    """One-row launches keep their kernels; 2..8 rows go to the by-warp kernels only where the units fit (the
    4-blocks one: the longest k slice's units <= 4 per warp); 9..16 rows keep the 16-row kernels."""
    from dsv41.kernels.exl3.cuda import _linear_kind, default_splits

    head_splits = default_splits(5120, 129280, 132)  # 3 slices of at most 14 blocks
    assert [_linear_kind(False, 8, m, 5120, head_splits, {}) for m in (1, 2, 3, 8)] == ["", "rows_", "", ""]
    assert _linear_kind(False, 16, 9, 5120, head_splits, {}) == ""
    assert _linear_kind(False, 8, 3, 5120, head_splits, {"EXL3_ROWS_WARP_UNITS": 6}) == "rows_"
    assert [_linear_kind(True, 8, m, 1280, 1, {}) for m in (1, 2, 8)] == ["few_", "few_rows_", "few_rows_"]
    assert _linear_kind(True, 16, 12, 1280, 1, {}) == "few_"


def test_default_moe_splits_fit_the_moe_slice_bound():
    from dsv41.kernels.exl3.cuda import MOE_MAX_SLICE_BLOCKS, default_moe_config

    for hidden, inter in ((5120, 2304), (7168, 2048), (2048, 1408), (256, 128)):
        cfg = default_moe_config(hidden, inter)
        assert -(-(hidden // 128) // cfg.splits_gate_up) <= MOE_MAX_SLICE_BLOCKS
        assert -(-(inter // 128) // cfg.splits_down) <= MOE_MAX_SLICE_BLOCKS
        assert cfg.splits_gate_up in range(1, hidden // 128 + 1), (hidden, cfg)
        assert cfg.splits_down in range(1, inter // 128 + 1), (inter, cfg)


GB10_SHARED_LIMIT = 101376  # 99 KB per block (sm_121), against 227 KB on the H200


def test_default_launches_fit_gb10_shared_memory_for_every_K():
    from dsv41.kernels.exl3.cuda import (MAX_ROWS, MAX_SLICE_BLOCKS, MOE_MAX_SLICE_BLOCKS, _shared_bytes, _xs_stride,
                                         default_moe_config, default_splits, slice_limit)

    for K in range(1, 9):
        limit = slice_limit(K, GB10_SHARED_LIMIT, MAX_SLICE_BLOCKS)
        for k, n, _ in PACK_SHAPES + [(5120, 129280, 6), (8192, 5120, 5)]:
            s = default_splits(k, n, 48, max_slice=limit)
            assert _shared_bytes(K, MAX_ROWS, MAX_ROWS, _xs_stride(k, s)) <= GB10_SHARED_LIMIT, (K, k, n, s)
        cfg = default_moe_config(5120, 2304, slice_limit(K, GB10_SHARED_LIMIT, MOE_MAX_SLICE_BLOCKS),
                                 slice_limit(K, GB10_SHARED_LIMIT, MOE_MAX_SLICE_BLOCKS))
        for k, s in ((5120, cfg.splits_gate_up), (2304, cfg.splits_down)):
            assert _shared_bytes(K, MAX_ROWS, MAX_ROWS, _xs_stride(k, s)) <= GB10_SHARED_LIMIT, (K, k, s)
    # the H200's 227 KB leaves the measured defaults alone
    assert slice_limit(8, 232448, MAX_SLICE_BLOCKS) == MAX_SLICE_BLOCKS
    assert default_moe_config(5120, 2304, slice_limit(3, 232448, MOE_MAX_SLICE_BLOCKS),
                              slice_limit(3, 232448, MOE_MAX_SLICE_BLOCKS)) == default_moe_config(5120, 2304)


def test_column_grid_loops_only_for_very_wide_launches_of_three_rows_or_more(monkeypatch):
    from dsv41.kernels.exl3.cuda import PERSIST_MIN_ROWS, _column_grid

    class FakeKernel:  # 4 resident blocks per SM, as the H200 measured for the 8-row variant
        def resident_blocks_per_sm(self, block, shared):
            return 4

    head = dict(col_blocks=1010, splits=4, sm_count=132)
    monkeypatch.delenv("DSV41_EXL3_PERSIST", raising=False)
    assert _column_grid(FakeKernel(), 0, rows=8, **head) == 132  # 4 x 132 resident blocks over 4 splits
    assert _column_grid(FakeKernel(), 0, rows=PERSIST_MIN_ROWS - 1, **head) == 1010
    # at most twice what fits at once: plain launch
    assert _column_grid(FakeKernel(), 0, 1010 // 8, 8, 132, 8) == 1010 // 8
    monkeypatch.setenv("DSV41_EXL3_PERSIST", "0")
    assert _column_grid(FakeKernel(), 0, rows=8, **head) == 1010


def test_slice_limit_names_a_pipeline_that_cannot_fit():
    from dsv41.kernels.exl3.cuda import slice_limit

    with pytest.raises(ValueError, match="K=8: the kernel's pipeline needs"):
        slice_limit(8, 48 * 1024, 10)


def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: GPU kernel tests run on the H200 (pytest -m gpu)")


@pytest.mark.gpu
@pytest.mark.parametrize("cb", CODEBOOKS)
def test_gpu_cuda_decode_bit_exact(cb):
    _need_cuda()
    from dsv41.kernels.exl3.cuda import decode_cuda
    from dsv41.kernels.exl3.layout import Exl3Tensor
    from dsv41.weights import exl3

    gen = torch.Generator().manual_seed(21)
    for K in range(1, 9):
        trellis, suh, svh = _random_group(gen, 512, 384, K, "cuda")
        wq = decode_cuda(Exl3Tensor.from_group(trellis, suh, svh, cb))
        assert torch.equal(wq.view(torch.int16), exl3.decode_rotated(trellis, cb).view(torch.int16)), (cb, K)


@pytest.mark.gpu
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_gpu_cuda_golden_layers(name):
    _need_cuda()
    from safetensors.torch import load_file

    from dsv41.kernels.exl3.cuda import decode_cuda, fused_matmul_cuda
    from dsv41.kernels.exl3.layout import Exl3Tensor

    t = {k: v.cuda() for k, v in load_file(str(FIXTURES / f"{name}.safetensors")).items()}
    w = Exl3Tensor.from_group(t["layer.trellis"], t["layer.suh"], t["layer.svh"], name.split("_")[0])
    assert torch.equal(decode_cuda(w).view(torch.int16), t["ref.w_q"].view(torch.int16))
    x = t["ref.x"][:16]
    y64 = x.double() @ t["ref.w_eff"].double()
    for splits in range(1, w.k // 128 + 1):
        y = fused_matmul_cuda(x, w, splits=splits)
        assert _rel(y, y64) <= 1e-3, (splits, _rel(y, y64))


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,K", PACK_SHAPES)
@pytest.mark.parametrize("cb", ["mul1", "3inst"])
def test_gpu_cuda_pack_shapes_and_row_invariance(k, n, K, cb):
    _need_cuda()
    from dsv41.kernels.exl3.cuda import fused_matmul_cuda
    from dsv41.kernels.exl3.layout import Exl3Tensor
    from dsv41.weights import exl3

    gen = torch.Generator().manual_seed(k + n + K)
    trellis, suh, svh = _random_group(gen, k, n, K, "cuda")
    w = Exl3Tensor.from_group(trellis, suh, svh, cb)
    w64 = exl3.effective_weight(trellis, suh, svh, cb, torch.float64)
    x = torch.randn(16, k, generator=gen).half().cuda()
    y = fused_matmul_cuda(x, w)
    y64 = x.double() @ w64
    assert _rel(y, y64) <= 1e-3 and _max_elem(y, y64) <= 6e-3, (_rel(y, y64), _max_elem(y, y64))
    assert torch.equal(fused_matmul_cuda(x, w).view(torch.int32), y.view(torch.int32)), "repeat differs: race?"
    perm = torch.randperm(16, generator=gen)
    for m in range(1, 17):
        rows = perm[:m].cuda()
        assert torch.equal(fused_matmul_cuda(x[rows], w).view(torch.int32), y[rows].view(torch.int32)), f"m={m}"
    # 40 rows run as 16 + 16 + 8: each row keeps its bits
    x40 = torch.cat([x, x, x[:8]])
    assert torch.equal(fused_matmul_cuda(x40, w)[16:32].view(torch.int32), y.view(torch.int32))
    # bf16 / fp32 inputs are rounded to fp16 first; fp16 / bf16 outputs are the fp32 result rounded once
    assert torch.equal(fused_matmul_cuda(x.float(), w).view(torch.int32), y.view(torch.int32))
    # few rows rotate their input by warp (fp32 rows with their own load width): the bits of the 16-row launch
    xb = x.bfloat16()
    yb = fused_matmul_cuda(xb, w)
    for m in (1, 2, 3, 8):
        assert torch.equal(fused_matmul_cuda(x[:m].float(), w).view(torch.int32), y[:m].view(torch.int32)), m
        assert torch.equal(fused_matmul_cuda(xb[:m], w).view(torch.int32), yb[:m].view(torch.int32)), m
    assert torch.equal(fused_matmul_cuda(x, w, out_dtype=torch.bfloat16), y.bfloat16())
    assert torch.equal(fused_matmul_cuda(x, w, out_dtype=torch.float16), y.half())
    # a preallocated output decides the dtype (the bench writes fp16 into its own buffers)
    o = torch.full((16, n), float("nan"), dtype=torch.float16, device="cuda")
    assert fused_matmul_cuda(x, w, out=o) is o and torch.equal(o, y.half())
    with pytest.raises(ValueError, match="out must be"):
        fused_matmul_cuda(x, w, out=torch.empty(15, n, device="cuda"))


@pytest.mark.gpu
def test_gpu_cuda_chained_launches_in_a_graph_equal_eager():
    """Each launch reads the previous one's output: with programmatic dependent launch the weights are prefetched
    early but the input must still be waited for. A captured chain must give the eager bits."""
    _need_cuda()
    from dsv41.kernels.exl3.cuda import fused_matmul_cuda, moe_forward_cuda
    from dsv41.kernels.exl3.layout import Exl3Tensor

    gen = torch.Generator().manual_seed(77)
    layers = [Exl3Tensor.from_group(*_random_group(gen, 2304, 2304, K, "cuda"), "mul1") for K in (2, 3, 4, 5)]
    _, (w1, w3, w2) = _moe_case(gen, 16, 2304, 1024, 3, "mul1", "cuda")
    x = torch.randn(4, 2304, generator=gen).half().cuda()
    ids = torch.stack([torch.randperm(16, generator=gen)[:6] for _ in range(4)]).cuda()
    wts = torch.rand(4, 6, generator=gen).cuda()
    bufs = [torch.empty(4, 2304, dtype=torch.float16, device="cuda") for _ in range(9)]

    def chain():
        h = x
        for i in range(8):
            h = fused_matmul_cuda(h, layers[i % 4], out=bufs[i])
            if i == 3:
                h = moe_forward_cuda(h, ids, wts, w1, w3, w2, out_dtype=torch.float16)
        return h

    eager = chain().clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(3):
        bufs[0].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.gpu
def test_gpu_cuda_is_the_default_path_and_triton_stays_selectable(monkeypatch):
    _need_cuda()
    from dsv41.kernels.exl3.cuda import fused_matmul_cuda
    from dsv41.kernels.exl3.linear import exl3_linear
    from dsv41.kernels.exl3.layout import Exl3Tensor

    gen = torch.Generator().manual_seed(5)
    trellis, suh, svh = _random_group(gen, 1024, 512, 3, "cuda")
    w = Exl3Tensor.from_group(trellis, suh, svh, "mul1")
    x = torch.randn(3, 1024, generator=gen).half().cuda()
    assert torch.equal(exl3_linear(x, w), fused_matmul_cuda(x, w))
    # up to 32 rows stay on the fused CUDA path (crossover), with each row's bits as alone
    x24 = torch.randn(24, 1024, generator=gen).half().cuda()
    y24 = exl3_linear(x24, w)
    assert torch.equal(y24[20:21], fused_matmul_cuda(x24[20:21], w))
    x40 = torch.randn(40, 1024, generator=gen).half().cuda()
    assert _rel(exl3_linear(x40, w), fused_matmul_cuda(x40, w)) <= 1e-3  # reconstruct + GEMM above 32
    monkeypatch.setenv("DSV41_EXL3_BACKEND", "triton")
    yt = exl3_linear(x, w)
    assert _rel(yt, fused_matmul_cuda(x, w)) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("T,hidden,inter", [(1, 5120, 2304), (4, 5120, 2304), (9, 5120, 2304), (16, 5120, 2304),
                                            (9, 2304, 1024)])
@pytest.mark.parametrize("cb", ["mul1", "mcg"])
def test_gpu_cuda_moe(T, hidden, inter, cb):
    """(2304, 1024): short k slices, so blocks of several rows rotate their input by warp too."""
    _need_cuda()
    from dsv41.kernels.exl3.cuda import moe_forward_cuda

    gen = torch.Generator().manual_seed(31 + T)
    experts, topk = 24, 6
    groups, (w1, w3, w2) = _moe_case(gen, experts, hidden, inter, 3, cb, "cuda")
    x = torch.randn(T, hidden, generator=gen).bfloat16().cuda()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(T)]).cuda()
    weights = torch.rand(T, topk, generator=gen).cuda()
    y = moe_forward_cuda(x, ids, weights, w1, w3, w2)
    ref = _moe_reference(x.half(), ids, weights, groups, cb, 10.0)
    assert _rel(y, ref) <= 2e-3 and _max_elem(y, ref) <= 1e-2, (_rel(y, ref), _max_elem(y, ref))
    assert torch.equal(moe_forward_cuda(x, ids, weights, w1, w3, w2).view(torch.int32), y.view(torch.int32))
    for t in range(T):
        alone = moe_forward_cuda(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], w1, w3, w2)
        assert torch.equal(alone[0].view(torch.int32), y[t].view(torch.int32)), f"row {t}"
    # an addend (the shared experts' output) added in the down launch's epilogue: the bits of adding it after
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(T, 2 * hidden, generator=gen).to(dtype).cuda()[:, hidden:]  # a strided view
        got = moe_forward_cuda(x, ids, weights, w1, w3, w2, addend=a)
        assert torch.equal(got.view(torch.int32), (y + a.float()).view(torch.int32)), dtype


def test_warmup_builds_nothing_without_a_gpu_and_says_so(caplog, monkeypatch):
    from dsv41.kernels.exl3 import warmup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level("INFO"):
        assert warmup.warm(None) == 0
    assert "skipped" in caplog.text


@pytest.mark.gpu
def test_gpu_warmup_fills_the_cubin_cache(tmp_path, monkeypatch):
    _need_cuda()
    from dsv41.kernels import cuda_module
    from dsv41.kernels.exl3 import warmup

    monkeypatch.setenv("DSV41_HOME", str(tmp_path))
    monkeypatch.delenv("DSV41_CUBIN_DIR", raising=False)
    monkeypatch.setattr(cuda_module, "_MODULES", {})
    images = 3 * (2 if warmup.prefill_wgmma.use_wgmma(torch.device("cuda")) else 1)  # Hopper: its wgmma image too
    assert warmup.warm(None, ks=(3,)) == images and len(list((tmp_path / "cuda").iterdir())) == images


@pytest.mark.gpu
def test_gpu_cuda_column_loop_of_very_wide_matrices_keeps_every_bit(monkeypatch):
    """A matrix with far more column blocks than fit on the GPU (like the head) runs as resident blocks that loop
    over column blocks: the same bits as one block per column block, rows still independent of m."""
    _need_cuda()
    from dsv41.kernels.exl3.cuda import (_column_grid, _shared_bytes, _sm_count, _xs_stride,
                                         default_splits, fused_matmul_cuda, kernels_for)
    from dsv41.kernels.exl3.layout import Exl3Tensor
    from dsv41.weights import exl3

    k, n, K = 1280, 1100 * 128, 2
    gen = torch.Generator().manual_seed(7)
    trellis, suh, svh = _random_group(gen, k, n, K, "cuda")
    w = Exl3Tensor.from_group(trellis, suh, svh, "mul1")
    dev = torch.device("cuda")
    splits = default_splits(k, n, _sm_count(dev))
    for variant in (8, 16):
        kernel = kernels_for(dev, K, "mul1")[f"exl3_linear_r{variant}"]
        shared = _shared_bytes(K, variant, variant, _xs_stride(k, splits))
        assert _column_grid(kernel, shared, n // 128, splits, _sm_count(dev), variant) < n // 128, "loop not used"
        assert _column_grid(kernel, shared, n // 128, splits, _sm_count(dev), 1) == n // 128
    x = torch.randn(16, k, generator=gen).half().cuda()
    monkeypatch.setenv("DSV41_EXL3_PERSIST", "0")
    y_flat = fused_matmul_cuda(x, w)
    monkeypatch.setenv("DSV41_EXL3_PERSIST", "1")
    y = fused_matmul_cuda(x, w)
    assert torch.equal(y.view(torch.int32), y_flat.view(torch.int32))
    for m in (1, 2, 3, 5, 8, 9):  # m < 3 runs one block per column block: same bits
        assert torch.equal(fused_matmul_cuda(x[:m], w).view(torch.int32), y[:m].view(torch.int32)), f"m={m}"
    cols = slice(n - 4096, n)  # the last column blocks: taken by the blocks' last loop turns
    y64 = x.double() @ exl3.effective_weight(trellis, suh, svh, "mul1", torch.float64)[:, cols]
    assert _rel(y[:, cols], y64) <= 1e-3 and _max_elem(y[:, cols], y64) <= 6e-3


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,K", [(5120, 2304, 3), (2304, 5120, 3), (8192, 5120, 5), (5120, 16896, 6)])
def test_gpu_cuda_warp_epilogue_keeps_every_bit(k, n, K, monkeypatch):
    """One-row launches finish split-K per warp (no block barrier); the block-wide epilogue gives the same bits, on
    the pack's split counts and the wide shape's few splits (like the head); other m take the block epilogue."""
    _need_cuda()
    from dsv41.kernels.exl3.cuda import fused_matmul_cuda
    from dsv41.kernels.exl3.layout import Exl3Tensor

    gen = torch.Generator().manual_seed(k + n + K)
    w = Exl3Tensor.from_group(*_random_group(gen, k, n, K, "cuda"), "mul1")
    x = torch.randn(8, k, generator=gen).half().cuda()
    for m in (1, 2, 3, 5, 8):
        monkeypatch.setenv("DSV41_EXL3_WARP_EPILOGUE", "1")
        y = fused_matmul_cuda(x[:m], w)
        again = fused_matmul_cuda(x[:m], w)  # the arrival counters reset themselves
        monkeypatch.setenv("DSV41_EXL3_WARP_EPILOGUE", "0")
        y_block = fused_matmul_cuda(x[:m], w)
        assert torch.equal(y.view(torch.int32), y_block.view(torch.int32)), f"m={m}"
        assert torch.equal(again.view(torch.int32), y.view(torch.int32)), f"m={m}"


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,K", [(5120, 2304, 3), (8192, 5120, 5)])
def test_gpu_cuda_cluster_reduction(k, n, K, monkeypatch):
    """DSV41_EXL3_CLUSTER=1: split-K partials summed through a thread block cluster's shared memory."""
    _need_cuda()
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("thread block clusters need sm_90+")
    from dsv41.kernels.exl3.cuda import fused_matmul_cuda
    from dsv41.kernels.exl3.layout import Exl3Tensor
    from dsv41.weights import exl3

    monkeypatch.setenv("DSV41_EXL3_CLUSTER", "1")
    gen = torch.Generator().manual_seed(k + K)
    trellis, suh, svh = _random_group(gen, k, n, K, "cuda")
    w = Exl3Tensor.from_group(trellis, suh, svh, "mul1")
    x = torch.randn(16, k, generator=gen).half().cuda()
    y = fused_matmul_cuda(x, w)
    y64 = x.double() @ exl3.effective_weight(trellis, suh, svh, "mul1", torch.float64)
    assert _rel(y, y64) <= 1e-3 and _max_elem(y, y64) <= 6e-3
    assert torch.equal(fused_matmul_cuda(x, w), y)
    for m in (1, 3, 8, 9, 16):
        assert torch.equal(fused_matmul_cuda(x[:m], w), y[:m]), f"m={m}"


def test_cubin_cache_builds_once_then_reuses(tmp_path, monkeypatch):
    from dsv41.kernels import cuda_build, cuda_module

    _nvcc_or_skip()  # the runtime build path needs nvcc (or NVRTC, on a GPU)
    monkeypatch.delenv("DSV41_CUBIN_DIR", raising=False)
    monkeypatch.setenv("DSV41_HOME", str(tmp_path))
    defines = cuda_build.exl3_defines(CACHE_K, _codebooks_of(CACHE_K)[0], cuda_build.DEFAULT_TUNING)
    first = cuda_module.compile_image(cuda_build.EXL3_SOURCE, defines, "sm_90")
    cached = tmp_path / "cuda" / cuda_build.image_name(cuda_build.EXL3_SOURCE, defines, "sm_90", "cubin")
    assert cached.read_bytes() == first and len(first) > 0
    assert [p.name for p in (tmp_path / "cuda").iterdir()] == [cached.name]  # no temporary file left behind
    monkeypatch.setattr(cuda_module, "find_nvcc", lambda: pytest.fail("rebuilt although the cache holds it"))
    assert cuda_module.compile_image(cuda_build.EXL3_SOURCE, defines, "sm_90") == first


def test_gpu_only_kernel_code_has_no_undefined_names():
    """The CUDA launchers only run on a GPU machine; a misspelt name there must still fail CI."""
    from pyflakes import api, messages, reporter

    class Collect(reporter.Reporter):
        def __init__(self):
            super().__init__(None, None)
            self.found = []

        def flake(self, message):
            if isinstance(message, (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)):
                self.found.append(str(message))

        def syntaxError(self, filename, msg, lineno, offset, text):
            self.found.append(f"{filename}:{lineno}: {msg}")

        def unexpectedError(self, filename, msg):
            self.found.append(f"{filename}: {msg}")

    collect = Collect()
    kernels = Path(__file__).resolve().parents[1] / "src" / "dsv41" / "kernels"
    for path in sorted(kernels.rglob("*.py")):  # kernels/exl3/ included
        api.checkPath(str(path), collect)
    assert collect.found == []
