"""The prefill tiles on Hopper's warpgroup MMA (`exl3_prefill_wg128` / `_wg64`, kernels/exl3/prefill_wgmma.py).

CPU part (CI, where a CUDA toolkit is present): both kernels compile for sm_90a at the pack's K and at the largest K
without spilling and without a warning (ptxas warns where it must serialise the asynchronous products), the 64-row
tiles in the registers that give them more blocks an SM than the 128-row tiles; the switch never takes the kernels
off Hopper; the tile height's knob. GPU part (`-m gpu`, an H100 / H200): the routed experts of a full-shape layer
against the portable 128-row tiles (within fp32 rounding; whether the bits are the same is printed), the 64-row and
128-row wgmma tiles bitwise equal, and the wgmma tiles' own row invariance: rows alone, in slices that cut tiles
anywhere (so other N of the wgmma), reordered.
"""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from test_exl3_cuda import SOURCE, _nvcc_or_skip
from test_exl3_prefill import _bits, _mismatch, expert_case


@pytest.mark.parametrize("K,cb", [(3, 2), (8, 0)])
def test_wgmma_kernel_compiles_for_hopper_without_spills_or_warnings(tmp_path, K, cb):
    from dsv41.kernels import cuda_build

    nvcc = _nvcc_or_skip()
    proc = subprocess.run(
        [nvcc, "-cubin", "-arch=sm_90a", "-O3", "-std=c++17", f"-DEXL3_K={K}", f"-DEXL3_CB={cb}", "-DEXL3_WGMMA=1",
         "-Xptxas", "-v", *cuda_build.flags_of(cuda_build.DEFAULT_TUNING), "-o", str(tmp_path / "wg.cubin"),
         str(SOURCE)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0 and "warning" not in proc.stderr.lower(), proc.stderr[-3000:]
    for name in ("exl3_prefill_wg128", "exl3_prefill_wg64"):
        found = re.search(rf"Function properties for {name}\n.*?(\d+) bytes spill stores", proc.stderr)
        assert found is not None and found.group(1) == "0", f"{name}: {proc.stderr[-3000:]}"
    # the 64-row tiles' point: at the pack's K their registers allow four blocks (32 warps) an SM, not two
    regs = re.search(r"Compiling entry function 'exl3_prefill_wg64'.*?Used (\d+) registers", proc.stderr, re.S)
    assert regs is not None, proc.stderr[-3000:]
    assert int(regs.group(1)) <= (64 if K <= 4 else 128), f"wg64 at K = {K}: {regs.group(1)} registers"


def test_the_switch_takes_the_wgmma_tiles_only_on_hopper(monkeypatch):
    from dsv41.kernels.exl3 import prefill_wgmma

    monkeypatch.setenv(prefill_wgmma.ENV, "1")
    assert prefill_wgmma.enabled()
    assert not prefill_wgmma.use_wgmma(torch.device("cpu"))
    monkeypatch.setenv(prefill_wgmma.ENV, "0")
    assert not prefill_wgmma.enabled()
    monkeypatch.delenv(prefill_wgmma.ENV)
    assert prefill_wgmma.enabled(), "on by default: the same bits as the mma tiles (its GPU test), faster"
    # shared memory: the B ring and the weight rings fit an H100's 227 KiB a block at every K; the 64-row tiles
    # leave room for four blocks an SM (228 KiB, 1 KiB of it reserved a block) where their registers do (K <= 4)
    assert all(prefill_wgmma.shared_bytes(K, rows) <= 227 * 1024 for K in range(1, 9) for rows in (64, 128))
    assert all(4 * (prefill_wgmma.shared_bytes(K, 64) + 1024) <= 228 * 1024 for K in range(1, 5))


def test_the_tile_height_follows_its_knob_and_auto_follows_the_pairs_an_expert(monkeypatch):
    from dsv41.kernels.exl3 import prefill_wgmma

    monkeypatch.delenv(prefill_wgmma.ROWS_ENV, raising=False)
    assert prefill_wgmma.tile_rows(2048 * 6, 384) == 128, "128 until an A/B on a GPU says otherwise"
    monkeypatch.setenv(prefill_wgmma.ROWS_ENV, "64")
    assert prefill_wgmma.tile_rows(8192 * 6, 384) == 64
    monkeypatch.setenv(prefill_wgmma.ROWS_ENV, "auto")
    # a 2,048-row chunk: 32 pairs an expert -> 64; 8,192 rows: 128 an expert -> 128; the bound itself -> 64
    assert prefill_wgmma.tile_rows(2048 * 6, 384) == 64
    assert prefill_wgmma.tile_rows(8192 * 6, 384) == 128
    assert prefill_wgmma.tile_rows(prefill_wgmma.AUTO_ROWS * 384, 384) == 64
    assert prefill_wgmma.tile_rows(prefill_wgmma.AUTO_ROWS * 384 + 1, 384) == 128
    assert prefill_wgmma.tile_rows(10, 384, rows=128) == 128, "an explicit height wins over the knob"
    monkeypatch.setenv(prefill_wgmma.ROWS_ENV, "96")
    with pytest.raises(ValueError, match=prefill_wgmma.ROWS_ENV):
        prefill_wgmma.tile_rows(100, 8)


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
    wg = run(wgmma=True, wg_rows=128)
    assert torch.isfinite(wg).all()
    diff = float((wg.double() - mma.double()).abs().max()) / float(mma.double().abs().max())
    print(f"wgmma vs mma tiles (E {E}, K {K}, {T} rows): same bits {torch.equal(_bits(wg), _bits(mma))}, "
          f"max |diff| / max |y| {diff:.2e}")
    assert diff <= 1e-5, _mismatch(wg, mma)
    # the 64-row tiles: the same products a row, so the same bits (experts of several 64-row tiles here too)
    wg64 = run(wgmma=True, wg_rows=64)
    assert torch.equal(_bits(wg64), _bits(wg)), f"64-row vs 128-row wgmma tiles: {_mismatch(wg64, wg)}"
    for height in (128, 64):
        for rows in (slice(0, 1), slice(100, 117), slice(1000, 2900)):
            got = run(rows, wgmma=True, wg_rows=height)
            assert torch.equal(_bits(got), _bits(wg[rows])), f"{height}: rows {rows} alone: {_mismatch(got, wg[rows])}"
        perm = torch.randperm(T, generator=g, device=x.device)[:2000]
        got = run(perm, wgmma=True, wg_rows=height)
        assert torch.equal(_bits(got), _bits(wg[perm])), f"{height}: 2,000 rows reordered: {_mismatch(got, wg[perm])}"
        got = run(wgmma=True, columns_first=False, wg_rows=height)
        assert torch.equal(_bits(got), _bits(wg)), f"{height}: tiles first vs columns first: {_mismatch(got, wg)}"


@pytest.mark.gpu
@pytest.mark.parametrize("wgmma,wg_rows", [(False, None), (True, 128), (True, 64)])
def test_gpu_prefill_moe_reads_nothing_back_to_the_host(wgmma, wg_rows, monkeypatch):
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
    prefill_moe(x, ids, wts, w1, w3, w2, addend=add, wgmma=wgmma, wg_rows=wg_rows)  # compiled and loaded first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        prefill_moe(x, ids, wts, w1, w3, w2, addend=add, wgmma=wgmma, wg_rows=wg_rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
