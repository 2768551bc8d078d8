"""The prefill rows' mHC sites as row blocks (dsv41.kernels.step.mhc_blocks) against the reference (runtime/
mhc_sites.py `hc_coefficients`, dsv41.model.mhc, dsv41.model.norm.rms_norm) and the row kernels (kernels/step/
mhc.py), and their row invariance.

The bounds and the row-invariance checks are the prefill tiles' (tests/test_kernels_step_mhc_prefill.py's
docstring argues them: the same class of arithmetic, fp32 sums of the same products in other fixed orders), run on
these launchers: rows alone (at block edges), slices cutting blocks anywhere (a partial last block), all rows
permuted (another block, another position in it) and in a bigger batch, bitwise the full launch's; live rows
(`rows=k`) bitwise the full launch's and the rest +0.0. Against the row kernels: the coefficients within
2 COEFF_ABS (both within COEFF_ABS of the reference); not bitwise (other sum orders, module docstring).
Interpreted, the mixing product is numpy's sum over k (kernels/step/mhc_blocks.py `_mix`); compiled, the IEEE FMA
dot, checked on the GPU (`-m gpu`: the release's shape, hc 4, d 5120, bf16, at 2,048 and 8,192 rows).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from step_harness import cuda_median_ms, interpreted, need_compiled_cuda  # noqa: E402
from test_kernels_step_mhc import COEFF_ABS, EPS, _inputs  # noqa: E402
from test_kernels_step_mhc_prefill import (GPU_ALONE, GPU_CASES, GPU_SLICES, check, measure,  # noqa: E402
                                           measure_live_rows, run_row_kernels)

COEFFS = ("pre", "post", "comb", "pre2", "post2", "comb2")
# (hc, d, B, iters, dtype, split_columns), small for the interpreter (its cost is per op: per column step and per
# Sinkhorn step): B 33 to 45, a full block of 32 rows and a partial one; d 72 with 32-column splits: 3 splits of 32,
# 32 and 8 columns (a short split, a partial step of 16); hc 3 padded to 4; hc 2 the tiny models'. The release's
# d and rows run on the GPU.
CPU_CASES = [(4, 72, 45, 20, "bfloat16", 32), (3, 48, 40, 3, "float32", 16), (2, 32, 33, 3, "float32", 16)]
CPU_ROWS_CASE = (2, 32, 40, 3, "bfloat16", 16)
CPU_VS_ROWS_CASE = (4, 48, 9, 20, "bfloat16", 16)  # the row kernels interpreted cost a program per row and split


def run_blocks(t: dict, iters: int, split_columns=None, rows: int | None = None, site: bool = True) -> dict:
    """The row-block launchers (the plain site unless `site` is False, and the expand site) on one input set, outputs
    named as the row kernels' test names them."""
    from dsv41.kernels.step import mhc_blocks as k

    args = (t["fn"].t(), t["base"], t["scale"])
    kw = dict(iters=iters, rows=rows, split_columns=split_columns or k.SPLIT_COLUMNS, **EPS)
    out = {}
    if site:
        out.update(zip(("h", "pre", "post", "comb"), k.hc_site_blocks(t["x"], *args, t["pre_in"], t["w"], **kw)))
    out.update(zip(("xo", "h2", "pre2", "post2", "comb2"),
                   k.hc_expand_site_blocks(t["y"], t["x"], t["post"], t["comb"], *args, t["pre_in"], t["w"], **kw)))
    return out


def vs_row_kernels(case, device: str, seed: int) -> dict:
    """The largest coefficient difference to the row kernels on the same inputs (the expand site's on each
    launcher's own X', which are bf16 roundings of the same expand: compared where they agree)."""
    hc, d, B, iters, dtype, cols = case
    t = _inputs(hc, d, B, getattr(torch, dtype), device, seed)
    blk, rowk = run_blocks(t, iters, cols), run_row_kernels(t, iters)
    same_x = (blk["xo"] == rowk["xo"]).flatten(1).all(1)
    diff = {n: float((blk[n] - rowk[n]).abs().max()) for n in COEFFS[:3]}
    diff.update({n: float((blk[n][same_x] - rowk[n][same_x]).abs().max()) if same_x.any() else 0.0
                 for n in COEFFS[3:]})
    return dict(diff=diff, same_x=float(same_x.double().mean()))


def sites_both_ways(seed: int = 7) -> dict:
    """MhcSites with the row blocks (what prefill rows run with the knob on) and with the reference math, on the same
    fp32 inputs: the largest difference in units of the reference output's rms; and what `MhcSites.of` picks."""
    from dsv41.runtime.mhc_sites import HC, MhcSites

    t = _inputs(4, 128, 19, torch.float32, "cpu", seed)
    p = HC(t["fn"].t(), t["base"], t["scale"])
    outs = {}
    for kernels in (True, False):
        s = MhcSites(4, EPS["rms_eps"], EPS["hc_eps"], 20, kernels, blocks=kernels)
        outs[kernels] = [*s.site(t["x"], p, t["pre_in"], t["w"]),
                         *s.expand_site(t["y"], t["x"], t["post"], t["comb"], p, t["pre_in"], t["w"])]
    cfg = SimpleNamespace(hc_mult=4, rms_norm_eps=EPS["rms_eps"], hc_eps=EPS["hc_eps"], hc_sinkhorn_iters=20)
    picks = {}
    for phase in ("prefill", "decode", "verify"):
        for knob in ("1", "0", ""):
            with mock.patch.dict(os.environ, DSV41_PREFILL_MHC_BLOCKS=knob, DSV41_PREFILL_MHC_TILES=knob):
                s = MhcSites.of(cfg, torch.device("cpu"), phase=phase)
                picks[f"{phase}/{knob}"] = (s.blocks, s.tiles)
    return dict(max_rel=max(float((a - b).abs().max() / b.pow(2).mean().sqrt()) for a, b in zip(outs[True],
                                                                                                outs[False])),
                count=len(outs[True]), picks=picks)


# ---------------------------------------------------------------------------------------------------------------
# CPU: the interpreted child
# ---------------------------------------------------------------------------------------------------------------


def _interp_worker(out_path: str) -> None:
    from step_harness import caught

    res = {str(case): caught(measure, case, "cpu", seed=i, run=run_blocks) for i, case in enumerate(CPU_CASES)}
    res.update(live=caught(measure_live_rows, CPU_ROWS_CASE, "cpu", seed=11, run=run_blocks),
               sites=caught(sites_both_ways),
               vs_rows=caught(vs_row_kernels, CPU_VS_ROWS_CASE, "cpu", seed=5))
    torch.save(res, out_path)


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "mhc_blocks", timeout=600)


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_interpreted_blocks_match_the_reference_and_are_row_invariant(interp, case):
    res = interp[str(case)]
    assert "error" not in res, res.get("error")
    check(case, res)


def test_interpreted_blocks_live_rows_are_the_full_launch_and_the_rest_zero(interp):
    res = interp["live"]
    assert "error" not in res, res.get("error")
    assert res and all(res.values()), res


def test_interpreted_blocks_coefficients_are_the_row_kernels_within_the_bound(interp):
    res = interp["vs_rows"]
    assert "error" not in res, res.get("error")
    assert max(res["diff"].values()) <= 2 * COEFF_ABS and res["same_x"] > 0.5, res


def test_runtime_sites_take_the_blocks_on_prefill_rows_when_asked(interp):
    """MhcSites with the row blocks and the reference math give one function; `MhcSites.of` picks the blocks for
    prefill rows with DSV41_PREFILL_MHC_BLOCKS=1 only (off by default), over the tiles where both are set."""
    res = interp["sites"]
    assert "error" not in res, res.get("error")
    assert res["count"] == 9 and res["max_rel"] <= 1e-5, res
    on = {f"{p}/{k}": p == "prefill" and k == "1" for p in ("prefill", "decode", "verify") for k in ("1", "0", "")}
    assert res["picks"] == {key: (v, v) for key, v in on.items()}, res["picks"]


def test_block_launchers_refuse_bad_arguments():
    from dsv41.kernels.step import mhc_blocks as k

    x, y, w, pre, comb = torch.zeros(2, 4, 8), torch.zeros(2, 8), torch.zeros(8), torch.zeros(2, 4), \
        torch.zeros(2, 4, 4)
    fn_t, base, scale = torch.zeros(32, 24), torch.zeros(24), torch.zeros(3)
    with pytest.raises(ValueError, match="rows"):
        k.hc_site_blocks(x, fn_t, base, scale, pre, w, iters=20, rows=3, **EPS)
    with pytest.raises(ValueError, match="fn_t"):
        k.hc_site_blocks(x, fn_t.t(), base, scale, pre, w, iters=20, **EPS)
    with pytest.raises(ValueError, match="y must be"):
        k.hc_expand_site_blocks(y[:1], x, pre, comb, fn_t, base, scale, pre, w, iters=20, **EPS)


def test_the_split_of_d_is_a_function_of_d_alone():
    from dsv41.kernels.step import mhc_blocks as k

    assert k.split_of(5120) == (256, 20) and k.split_of(4096) == (256, 16) and k.split_of(128) == (128, 1)
    assert k.split_of(144, 96) == (80, 2) and k.split_of(160, 64) == (64, 3)


def _ptxas_report(ptx: str, arch: int, tmp_path) -> str:
    """`ptxas -v` on a kernel's PTX with Triton's own ptxas: its registers and spill lines."""
    import subprocess

    from triton.backends.nvidia.compiler import get_ptxas

    src = tmp_path / f"k{arch}.ptx"
    src.write_text(ptx)
    proc = subprocess.run([get_ptxas(arch).path, "-v", f"-arch=sm_{arch}{'a' if arch == 90 else ''}", str(src), "-o",
                           str(tmp_path / f"k{arch}.cubin")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


def test_mixing_kernel_compiles_for_sm90_on_cuda_cores_without_spills(tmp_path):
    """Ahead-of-time compile (Triton's own ptxas, no GPU) of the mixing launch at the release's constants, bf16
    streams, the expand site (the plain site is its subset): a cubin for sm_90 (H100 / H200), the product as FMA
    loops (no mma, no tf32), and no register spills at MIX_MAXNREG (the design's point: the row kernels take 255
    registers, the tiles spill). ~5 s on 2 busy cores."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from dsv41.kernels.step import mhc_blocks as k

    if not isinstance(k._mix_kernel, JITFunction) or not k.COMPILED:
        pytest.skip("kernels decorated for the interpreter in this process")
    names = ("x_ptr y_ptr post_in_ptr comb_in_ptr xo_ptr fn_ptr stride_fk stride_fn pre_in_ptr h_ptr part_ptr B d "
             "chunk live_rows").split()
    types = "*bf16 *fp32 *fp32 *fp32 *bf16 *fp32 i32 i32 *fp32 *bf16 *fp32 i32 i32 i32 i32".split()
    chunk, splits = k.split_of(5120)
    const = dict(HC=4, NP=32, SPLITS=splits, EXPAND=True, BM=k.BLOCK_ROWS, BLOCK=k.BLOCK_COLS, PDL=True)
    src = ASTSource(fn=k._mix_kernel, signature={**dict(zip(names, types)), **{c: "constexpr" for c in const}},
                    constexprs=const)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=k.MIX_WARPS, maxnreg=k.MIX_MAXNREG))
    except RuntimeError as exc:  # no ptxas for this target in this Triton
        pytest.skip(f"Triton cannot compile for sm_90 here: {exc}")
    ptx = compiled.asm["ptx"]
    assert compiled.asm.get("cubin") and "fma.rn.f32" in ptx and "mma" not in ptx and "tf32" not in ptx
    report = _ptxas_report(ptx, 90, tmp_path)
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), report


# ---------------------------------------------------------------------------------------------------------------
# GPU: the release's shape, 2,048 and 8,192 rows, compiled
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"rows{c[2]}")
def test_gpu_mhc_blocks_full_shape_match_the_reference_and_are_row_invariant(case):
    """hc 4, d 5120, bf16: the bounds against the reference; rows alone (block edges included), slices cutting
    blocks anywhere, all rows permuted and in a bigger batch, bitwise the full launch's; the coefficients within
    2 COEFF_ABS of the row kernels'. Prints the expand site's time against the row kernels' (one site)."""
    need_compiled_cuda()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's fp32 products in fp32
    try:
        res = measure(case, "cuda", seed=300, alone=GPU_ALONE, slices=GPU_SLICES, run=run_blocks)
        rows = vs_row_kernels(case, "cuda", 300)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    t = _inputs(*case[:3], getattr(torch, case[4]), "cuda", 300)
    ms = dict(blocks=cuda_median_ms(lambda: run_blocks(t, case[3], site=False)),
              row_kernels=cuda_median_ms(lambda: run_row_kernels(t, case[3])) / 2)  # (both sites there)
    print(case, res, "blocks - row kernels:", rows, "ms a site:", ms)
    check(case, res)
    assert max(rows["diff"].values()) <= 2 * COEFF_ABS, rows


@pytest.mark.gpu
def test_gpu_mhc_blocks_live_rows_are_the_full_launch_and_the_rest_zero():
    need_compiled_cuda()
    res = measure_live_rows((4, 5120, 100, 20, "bfloat16", None), "cuda", seed=301, run=run_blocks)
    assert res and all(res.values()), res


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    _interp_worker(sys.argv[2])
