"""The prefill rows' mHC site tiles (dsv41.kernels.step.mhc_tiles) against the reference (dsv41.model.mhc,
dsv41.model.norm.rms_norm), and their row invariance.

The same measurements and tolerances as the row kernels' (tests/test_kernels_step_mhc.py: `errors`, `check`). Row
invariance: a row's outputs bitwise the same as the full launch's when it runs alone, in slices of the rows that
cut tiles anywhere, and with the rows permuted (another position in another tile). On the CPU under
TRITON_INTERPRET=1 (a child process) at small shapes: partial tiles, padded hc, a partial column step; the
interpreter's `tl.dot` is numpy's matmul over the fixed tile shape. On the GPU (`-m gpu`) at the release's shape and
a prefill chunk (hc 4, d 5120, 2,048 rows, bf16 streams), compiled: the bits there are the GPU's dot.
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
from step_harness import interpreted, need_compiled_cuda  # noqa: E402
from test_kernels_step_mhc import EPS, _inputs, _is_zero, check, errors  # noqa: E402

NOT_ROWS = ("fn", "base", "scale", "w")  # the inputs that are not per row
# (hc, d, B, iters, dtype): B 5 one partial tile, 21 a full and a partial one, 33 three; hc 3 padded to 4; d 144 a
# partial column step (4.5 of 32); hc 2 the tiny models'
CPU_CASES = [(4, 128, 5, 20, "bfloat16"), (4, 144, 21, 20, "float32"), (3, 160, 33, 20, "bfloat16"),
             (2, 128, 16, 3, "float32")]
CPU_ROWS_CASE = (4, 128, 21, 20, "bfloat16")
CPU_FULL_D_CASE = (4, 5120, 16, 20, "bfloat16")  # one tile at the release's d: the sum over 20,480 terms (errors only)
GPU_CASE = (4, 5120, 2048, 20, "bfloat16")
GPU_ALONE = (0, 1, 15, 16, 17, 1000, 2047)
GPU_SLICES = ((0, 1), (0, 100), (100, 2048), (7, 39), (1009, 1025), (2040, 2048))


def _rows_of(t: dict, pick) -> dict:
    return {k: (v if k in NOT_ROWS else v[pick]) for k, v in t.items()}


def run_tiles(t: dict, iters: int, rows: int | None = None) -> dict:
    """Both tile launchers on one input set, outputs named as the row kernels' test names them."""
    from dsv41.kernels.step import mhc_tiles as k

    args = (t["fn"].t(), t["base"], t["scale"])
    h, pre, post, comb = k.hc_site_tiles(t["x"], *args, t["pre_in"], t["w"], iters=iters, rows=rows, **EPS)
    xo, h2, pre2, post2, comb2 = k.hc_expand_site_tiles(t["y"], t["x"], t["post"], t["comb"], *args, t["pre_in"],
                                                        t["w"], iters=iters, rows=rows, **EPS)
    return dict(h=h, pre=pre, post=post, comb=comb, xo=xo, h2=h2, pre2=pre2, post2=post2, comb2=comb2)


def _same(a: dict, b: dict, at) -> bool:
    """Every output of a bitwise b's rows `at`."""
    return all(torch.equal(a[n].view(torch.uint8), b[n][at].view(torch.uint8)) for n in a)


def measure_tiles(case, device: str, seed: int, alone=None, slices=None) -> dict:
    """Errors against the reference (`errors`), and the row invariance: rows `alone` (default all) each alone, the
    `slices` (default: cuts at every third row) and the permuted rows, each bitwise the full launch's rows."""
    hc, d, B, iters, dtype = case
    t = _inputs(hc, d, B, getattr(torch, dtype), device, seed)
    out = run_tiles(t, iters)
    res = errors(t, out, hc, iters)
    alone = range(B) if alone is None else alone
    slices = [(a, min(a + 3 + a % 5, B)) for a in range(0, B, 3)] if slices is None else slices
    order = torch.randperm(B, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    shuffled = run_tiles(_rows_of(t, order), iters)
    res["rows"] = dict(alone=all(_same(run_tiles(_rows_of(t, slice(i, i + 1)), iters), out, slice(i, i + 1))
                                 for i in alone),
                       slices=all(_same(run_tiles(_rows_of(t, slice(a, b)), iters), out, slice(a, b))
                                  for a, b in slices),
                       among=_same(shuffled, out, order))
    return res


def measure_live_rows(case, device: str, seed: int) -> dict:
    """`rows=k`: rows [0, k) bitwise the full launch's, rows [k, B) +0.0, for k = 0, 1, a tile's edge, B - 1, B."""
    hc, d, B, iters, dtype = case
    t = _inputs(hc, d, B, getattr(torch, dtype), device, seed)
    full = run_tiles(t, iters)
    res = {}
    for k in sorted({0, 1, 16, B - 1, B}):
        out = run_tiles(t, iters, rows=k)
        res[k] = all(out[n].shape == full[n].shape and torch.equal(out[n][:k], full[n][:k]) and _is_zero(out[n][k:])
                     for n in full)
    return res


def sites_both_ways(seed: int = 7) -> dict:
    """runtime/model.py's MhcSites on prefill rows (the tiles) and with the reference math, on the same fp32 inputs:
    the largest difference in units of the reference output's rms; and which launches `MhcSites.of` picks."""
    from dsv41.runtime.model import HC, MhcSites

    t = _inputs(4, 128, 19, torch.float32, "cpu", seed)
    p = HC(t["fn"].t(), t["base"], t["scale"])
    outs = {}
    for kernels in (True, False):
        s = MhcSites(4, EPS["rms_eps"], EPS["hc_eps"], 20, kernels, tiles=kernels)
        outs[kernels] = [*s.site(t["x"], p, t["pre_in"], t["w"]),
                         *s.expand_site(t["y"], t["x"], t["post"], t["comb"], p, t["pre_in"], t["w"])]
    cfg = SimpleNamespace(hc_mult=4, rms_norm_eps=EPS["rms_eps"], hc_eps=EPS["hc_eps"], hc_sinkhorn_iters=20)
    picks = {}  # the fields of the config that `MhcSites.of` reads
    for phase in ("prefill", "decode", "verify"):
        for knob in ("1", "0"):
            with mock.patch.dict(os.environ, DSV41_MHC_TILES=knob):
                picks[f"{phase}/{knob}"] = MhcSites.of(cfg, torch.device("cpu"), phase=phase).tiles
    return dict(max_rel=max(float((a - b).abs().max() / b.pow(2).mean().sqrt()) for a, b in zip(outs[True],
                                                                                                outs[False])),
                count=len(outs[True]), picks=picks)


def full_d_errors(seed: int = 3) -> dict:
    hc, d, B, iters, dtype = CPU_FULL_D_CASE
    t = _inputs(hc, d, B, getattr(torch, dtype), "cpu", seed)
    return errors(t, run_tiles(t, iters), hc, iters)


# ---------------------------------------------------------------------------------------------------------------
# CPU: the interpreted child
# ---------------------------------------------------------------------------------------------------------------


def _interp_worker(out_path: str) -> None:
    def caught(fn, *args, **kw):  # report errors, so the tests show the worker's
        try:
            return fn(*args, **kw)
        except Exception as exc:  # noqa: BLE001
            return {"error": f"{type(exc).__name__}: {exc}"}

    res = {str(case): caught(measure_tiles, case, "cpu", seed=i) for i, case in enumerate(CPU_CASES)}
    res.update(live=caught(measure_live_rows, CPU_ROWS_CASE, "cpu", seed=11), sites=caught(sites_both_ways),
               full_d=caught(full_d_errors))
    torch.save(res, out_path)


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "mhc_tiles", timeout=600)


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_interpreted_tiles_match_the_reference_and_are_row_invariant(interp, case):
    res = interp[str(case)]
    assert "error" not in res, res.get("error")
    assert res["rows"]["slices"], f"{case}: a slice of the rows gives other bits than the full launch: {res['rows']}"
    check(case, res)


def test_interpreted_tile_at_the_release_d_matches_the_reference(interp):
    """d 5120: the mixing product's sum over hc * d = 20,480 terms (128-term dots, summed over 160 steps) within the
    row kernels' tolerances (measured: coefficients within 1.9e-6 of the reference, h and X' within an ulp)."""
    res = interp["full_d"]
    assert "error" not in res, res.get("error")
    check(CPU_FULL_D_CASE, res)


def test_interpreted_tiles_live_rows_are_the_full_launch_and_the_rest_zero(interp):
    res = interp["live"]
    assert "error" not in res, res.get("error")
    assert res and all(res.values()), res


def test_runtime_sites_take_the_tiles_on_prefill_rows(interp):
    """MhcSites with the tiles (what prefill rows run on CUDA and in the interpreter) and the reference math give one
    function; `MhcSites.of` picks the tiles for prefill only, and not with DSV41_MHC_TILES=0."""
    res = interp["sites"]
    assert "error" not in res, res.get("error")
    assert res["count"] == 9 and res["max_rel"] <= 1e-5, res
    assert res["picks"] == {"prefill/1": True, "prefill/0": False, "decode/1": False, "decode/0": False,
                            "verify/1": False, "verify/0": False}, res["picks"]


def test_tile_launchers_refuse_what_the_row_launchers_refuse():
    """The shared argument checks (`mhc.site_args`): bad rows, layouts and dtypes refused before any launch."""
    from dsv41.kernels.step import mhc_tiles as k

    x, y, w, pre, comb = torch.zeros(2, 4, 8), torch.zeros(2, 8), torch.zeros(8), torch.zeros(2, 4), \
        torch.zeros(2, 4, 4)
    fn_t, base, scale = torch.zeros(32, 24), torch.zeros(24), torch.zeros(3)
    with pytest.raises(ValueError, match="rows"):
        k.hc_site_tiles(x, fn_t, base, scale, pre, w, iters=20, rows=3, **EPS)
    with pytest.raises(ValueError, match="contiguous"):
        k.hc_site_tiles(x.transpose(0, 1), fn_t, base, scale, pre, w, iters=20, **EPS)
    with pytest.raises(ValueError, match="fn_t"):
        k.hc_site_tiles(x, fn_t.t(), base, scale, pre, w, iters=20, **EPS)
    with pytest.raises(ValueError, match="y must be"):
        k.hc_expand_site_tiles(y[:1], x, pre, comb, fn_t, base, scale, pre, w, iters=20, **EPS)
    with pytest.raises(ValueError, match="comb"):
        k.hc_expand_site_tiles(y, x, pre, comb.double(), fn_t, base, scale, pre, w, iters=20, **EPS)


@pytest.mark.parametrize("arch", [80, 90, 121])
def test_tile_kernel_compiles_for_every_target(arch):
    """Ahead-of-time compile (Triton's own ptxas, no GPU) at the release's constants, bf16 streams, with and
    without the expand: a cubin for sm_80, sm_90 and GB10's sm_121, and the fp32 dot without tf32 MMA."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from dsv41.kernels.step import mhc_tiles as k

    if not isinstance(k._site_tile_kernel, JITFunction):
        pytest.skip("kernels decorated for the interpreter in this process")
    names = ("x_ptr y_ptr post_in_ptr comb_in_ptr xo_ptr fn_ptr stride_fk stride_fn base_ptr scale_ptr pre_in_ptr "
             "w_ptr h_ptr pre_ptr post_ptr comb_ptr B d norm_eps hc_eps rms_eps iters live_rows").split()
    types = ("*bf16 *bf16 *fp32 *fp32 *bf16 *fp32 i32 i32 *fp32 *fp32 *fp32 *bf16 *bf16 *fp32 *fp32 *fp32 i32 i32 "
             "fp32 fp32 fp32 i32 i32").split()
    for expand in (True, False):
        const = dict(HC=4, HCP=4, NP=32, EXPAND=expand, BM=k.TILE_ROWS, BLOCK=k.TILE_BLOCK, BLOCK_N=k.TILE_NORM,
                     PDL=arch >= 90)
        src = ASTSource(fn=k._site_tile_kernel, signature={**dict(zip(names, types)),
                                                           **{c: "constexpr" for c in const}}, constexprs=const)
        try:
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=k.TILE_WARPS))
        except RuntimeError as exc:  # no ptxas for this target in this Triton
            pytest.skip(f"Triton cannot compile for sm_{arch} here: {exc}")
        assert compiled.asm.get("cubin"), (arch, expand)
        ptx = compiled.asm["ptx"]
        for op in ("tf32", "wgmma"):
            assert op not in ptx, (arch, expand, op)


def test_the_knob_reads_off_and_on(monkeypatch):
    from dsv41.kernels.step.mhc_tiles import tiles_on

    for value, on in (("0", False), ("off", False), ("1", True), ("on", True)):
        monkeypatch.setenv("DSV41_MHC_TILES", value)
        assert tiles_on() is on, value
    monkeypatch.delenv("DSV41_MHC_TILES")
    assert tiles_on()  # the default


# ---------------------------------------------------------------------------------------------------------------
# GPU: the release's shape, a 2,048-row chunk, compiled
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_tiles_full_shape_match_the_reference_and_are_row_invariant():
    """hc 4, d 5120, 2,048 bf16 rows: the row kernels' tolerances against the reference; rows alone (tile edges
    included), slices cutting tiles anywhere and all rows permuted, bitwise the full launch's."""
    need_compiled_cuda()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's fp32 products in fp32
    try:
        res = measure_tiles(GPU_CASE, "cuda", seed=300, alone=GPU_ALONE, slices=GPU_SLICES)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    print(GPU_CASE, res)
    assert res["rows"]["slices"], res["rows"]
    check(GPU_CASE, res)


@pytest.mark.gpu
def test_gpu_tiles_live_rows_are_the_full_launch_and_the_rest_zero():
    need_compiled_cuda()
    res = measure_live_rows((4, 5120, 100, 20, "bfloat16"), "cuda", seed=301)
    assert res and all(res.values()), res


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    _interp_worker(sys.argv[2])
