"""The prefill tiles on Hopper's warpgroup MMA (`exl3_prefill_wg128`, kernels/exl3/prefill_wgmma.py).

CPU part (CI, where a CUDA toolkit is present): the kernel compiles for sm_90a at the pack's K and at the largest K
without spilling and without a warning (ptxas warns where it must serialise the asynchronous products); the switch
never takes the kernel off Hopper. GPU part (`-m gpu`, an H100 / H200): the routed experts of a full-shape layer
against the portable 128-row tiles (within fp32 rounding; whether the bits are the same is printed), and the wgmma
tiles' own row invariance: rows alone, in slices that cut tiles anywhere (so other N of the wgmma), reordered.
"""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from test_exl3_cuda import SM90A_KS, _codebooks_of, _nvcc_or_skip
from test_exl3_prefill import _bits, _mismatch, expert_case


@pytest.mark.parametrize("K", SM90A_KS)  # the pack's K (mul1) and the largest (3inst): _codebooks_of
def test_wgmma_kernel_compiles_for_hopper_without_spills_or_warnings(tmp_path, monkeypatch, K):
    """The builder's sm_90a image of K (the Nix closure's Hopper image: every kernel of the sm_90 one plus the wgmma
    tiles; test_exl3_cuda's K tests leave SM90A_KS to this compile), ptxas' report of the same nvcc run read."""
    from dsv41.kernels import cuda_build

    _nvcc_or_skip()
    runs, run = [], subprocess.run

    def verbose_run(cmd, **kw):  # the builder's own command with ptxas' per-kernel report (-v changes no code)
        runs.append(run([cmd[0], "-Xptxas", "-v", *cmd[1:]], **kw))
        return runs[-1]

    monkeypatch.setattr(cuda_build.subprocess, "run", verbose_run)
    variants = cuda_build.exl3_variants(Ks=[K], codebooks=tuple(_codebooks_of(K)))
    (built,) = cuda_build.build_all(["sm_90a"], tmp_path, jobs=1, variants=variants)
    (proc,) = runs
    assert "-DEXL3_WGMMA=1" in proc.args and built.stat().st_size > 0, proc.args
    assert proc.returncode == 0 and "warning" not in proc.stderr.lower(), proc.stderr[-3000:]
    found = re.search(r"Function properties for exl3_prefill_wg128\n.*?(\d+) bytes spill stores", proc.stderr)
    assert found is not None and found.group(1) == "0", proc.stderr[-3000:]


def test_the_switch_takes_the_wgmma_tiles_only_on_hopper(monkeypatch):
    from dsv41.kernels.exl3 import prefill_wgmma

    monkeypatch.setenv(prefill_wgmma.ENV, "1")
    assert prefill_wgmma.enabled()
    assert not prefill_wgmma.use_wgmma(torch.device("cpu"))
    monkeypatch.setenv(prefill_wgmma.ENV, "0")
    assert not prefill_wgmma.enabled()
    monkeypatch.delenv(prefill_wgmma.ENV)
    assert prefill_wgmma.enabled(), "on by default: the same bits as the mma tiles (its GPU test), faster"
    # shared memory: the B ring and the weight rings fit an H100's 227 KiB a block at every K
    assert all(prefill_wgmma.shared_bytes(K) <= 227 * 1024 for K in range(1, 9))


@pytest.mark.gpu
@pytest.mark.parametrize("E,inter,K,T", [(384, 1152, 3, 8192), (64, 512, 8, 3000)])
def test_gpu_wgmma_tiles_match_the_mma_tiles_and_are_row_invariant(E, inter, K, T, monkeypatch):
    """Experts from a few rows to several 128-row tiles (skewed routing): the wgmma tiles == the portable 128-row
    tiles within fp32 rounding (bits equal or not: printed); their rows alone / sliced / reordered == the batch's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("DSV41_EXL3_BACKEND", "cuda")
    from dsv41.kernels.exl3 import prefill_wgmma
    from dsv41.kernels.exl3.prefill import prefill_moe

    if not prefill_wgmma.available(torch.device("cuda")):
        pytest.skip(f"wgmma needs a Hopper GPU (sm_90), this is {torch.cuda.get_device_name()}")
    (w1, w3, w2), ids, x, wts, add, g = expert_case(E, 5120, inter, K, 6, T, seed=E + K)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
    # experts of several tiles and partial tiles (other N of the wgmma than 128)
    assert int(counts.max()) > 128 and int((counts % 128 != 0).sum()) > 0, sorted(counts.tolist())

    def run(rows=slice(None), **kw):
        return prefill_moe(x[rows], ids[rows], wts[rows], w1, w3, w2, addend=add[rows], **kw)

    mma = run(tile_rows=128, wgmma=False)
    wg = run(wgmma=True)
    assert torch.isfinite(wg).all()
    diff = float((wg.double() - mma.double()).abs().max()) / float(mma.double().abs().max())
    print(f"wgmma vs mma tiles (E {E}, K {K}, {T} rows): same bits {torch.equal(_bits(wg), _bits(mma))}, "
          f"max |diff| / max |y| {diff:.2e}")
    assert diff <= 1e-5, _mismatch(wg, mma)
    for rows in (slice(0, 1), slice(100, 117), slice(1000, 2900)):
        got = run(rows, wgmma=True)
        assert torch.equal(_bits(got), _bits(wg[rows])), f"rows {rows} alone: {_mismatch(got, wg[rows])}"
    perm = torch.randperm(T, generator=g, device=x.device)[:2000]
    got = run(perm, wgmma=True)
    assert torch.equal(_bits(got), _bits(wg[perm])), f"2,000 rows reordered: {_mismatch(got, wg[perm])}"
    got = run(wgmma=True, columns_first=False)
    assert torch.equal(_bits(got), _bits(wg)), f"tiles first vs columns first: {_mismatch(got, wg)}"


@pytest.mark.gpu
@pytest.mark.parametrize("wgmma", [False, True])
def test_gpu_prefill_moe_reads_nothing_back_to_the_host(wgmma, monkeypatch):
    """The experts' prefill (the tile table, the rotations, the tiles, the slot sums) runs without a host sync: a
    read-back each layer (torch.bincount on CUDA sizes its output from the largest id) leaves the GPU idle while the
    host launches the rest of the layer."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("DSV41_EXL3_BACKEND", "cuda")
    from dsv41.kernels.exl3 import prefill_wgmma
    from dsv41.kernels.exl3.prefill import prefill_moe

    if wgmma and not prefill_wgmma.available(torch.device("cuda")):
        pytest.skip(f"wgmma needs a Hopper GPU (sm_90), this is {torch.cuda.get_device_name()}")
    (w1, w3, w2), ids, x, wts, add, _ = expert_case(16, 512, 256, 3, 6, 300, seed=5)
    prefill_moe(x, ids, wts, w1, w3, w2, addend=add, wgmma=wgmma)  # compiled and loaded first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        prefill_moe(x, ids, wts, w1, w3, w2, addend=add, wgmma=wgmma)
    finally:
        torch.cuda.set_sync_debug_mode("default")
