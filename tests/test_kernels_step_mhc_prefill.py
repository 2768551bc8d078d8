"""The prefill rows' mHC site tiles (dsv41.kernels.step.mhc_prefill) against the reference (runtime/mhc_sites.py
`hc_coefficients`, dsv41.model.mhc, dsv41.model.norm.rms_norm), and their row invariance.

Tolerances, from the arithmetic (each output judged on its own input: h2 and the second coefficients against the
reference on the kernel's own X'):
- pre / post / comb: max |tile - reference| <= COEFF_ABS (1e-5), the row kernels' bound: both are fp32 sums of the
  same products in other orders (here 128-term dot chains, summed over a split's steps, then the splits in order),
  a few fp32 ulp of values in (0, 2], and the 20 Sinkhorn steps are contractive.
- X': the row kernels' bound (`_expand_error`): one ulp of the result plus EXPAND_TERM_ULPS fp32 ulp of its terms'
  magnitude (the hc + 1 terms summed in another order, or fused on the GPU).
- h = rms_norm(u) * w with u = collapse(X, pre_in) rounded to the stream dtype: |h - h_ref| <= 2 ulp(h) (the two
  results' own roundings) + r |w| (1 ulp(u) + COLLAPSE_ULPS fp32 ulp of Σ_c |pre_c X_c|) (u's hc-term sum in another
  order or fused moves the fp32 value by a few ulp of its terms; where that crosses a rounding boundary of u, the
  rounded u moves by one of its ulp) + RMS_ULPS fp32 ulp of |h| (r from Σu² in another blocked order over d: a
  relative error of a few tens of fp32 ulp at most, through the mean and the fp64 rsqrt). Near a cancellation of the
  collapse (|u| << Σ|pre_c X_c|) this is many ulp of a small h: a fixed ulp bound would fail at 10M elements for any
  sum order other than the reference's (the reverted tiles' "25 ulp" on the GPU), and is no argument. bf16 flips
  (h not bitwise the reference's) must stay rare (FLIP_FRACTION).
- Row invariance: a row's outputs bitwise the same alone, in slices of the rows that cut tiles anywhere (a partial
  last tile), with the rows permuted (another tile, another position in it) and in a bigger batch (other rows
  appended). Interpreted, the mixing product is numpy's sum over k (kernels/step/mhc_prefill.py `_mix_dot`: a BLAS
  matmul's order depends on a row's position in the tile); compiled, the bf16 tensor-core parts, checked on the GPU.

CPU: under TRITON_INTERPRET=1 in a child process (tests/step_harness.py), small shapes with small splits of d (the
last arriver over several splits, a partial split and a partial step), hc 3 (padded to 4) and 2 (the tiny models').
GPU (`-m gpu`): the release's shape (hc 4, d 5120, bf16) at 2,048 and 8,192 rows, compiled; also against the row
kernels.
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
from test_kernels_step_mhc import (COEFF_ABS, EPS, FLIP_FRACTION, _expand_error, _inputs, _is_zero,  # noqa: E402
                                   _spacing, _ulps)

COLLAPSE_ULPS = 8  # fp32 ulp of Σ_c |pre_c X_c| the collapse may move (hc - 1 = 3 roundings, fused or reordered)
RMS_ULPS = 64  # fp32 ulp of |h| from r (Σu² over d in another blocked order: ~33 roundings deep, halved by the rsqrt)
NOT_ROWS = ("fn", "base", "scale", "w")  # the inputs that are not per row
# (hc, d, B, iters, dtype, split_columns): B 33 to 45, a full tile and a partial one; d 160 with 64-column splits: 3
# splits, the last one short; d 144: a partial column step; hc 3 padded to 4; hc 2 the tiny models'
CPU_CASES = [(4, 160, 45, 20, "bfloat16", 64), (3, 144, 40, 20, "float32", 96), (2, 128, 33, 3, "float32", 32)]
CPU_ROWS_CASE = (4, 128, 40, 20, "bfloat16", 64)
CPU_FULL_D_CASE = (4, 5120, 3, 20, "bfloat16", None)  # the release's d and default splits (20): errors only
GPU_CASES = [(4, 5120, 2048, 20, "bfloat16", None), (4, 5120, 8192, 20, "bfloat16", None)]
GPU_ALONE = (0, 1, 31, 32, 33, 1000, -1)
GPU_SLICES = ((0, 1), (0, 100), (100, 2048), (7, 39), (1009, 1025), (2040, 2048))


def _rows_of(t: dict, pick) -> dict:
    return {k: (v if k in NOT_ROWS else v[pick]) for k, v in t.items()}


def run_tiles(t: dict, iters: int, split_columns=None, rows: int | None = None, site: bool = True) -> dict:
    """The tile launchers (the plain site unless `site` is False, and the expand site) on one input set, outputs
    named as the row kernels' test names them."""
    from dsv41.kernels.step import mhc_prefill as k

    args = (t["fn"].t(), t["base"], t["scale"])
    kw = dict(iters=iters, rows=rows, split_columns=split_columns or k.SPLIT_COLUMNS, **EPS)
    out = {}
    if site:
        out.update(zip(("h", "pre", "post", "comb"), k.hc_site_tiles(t["x"], *args, t["pre_in"], t["w"], **kw)))
    out.update(zip(("xo", "h2", "pre2", "post2", "comb2"),
                   k.hc_expand_site_tiles(t["y"], t["x"], t["post"], t["comb"], *args, t["pre_in"], t["w"], **kw)))
    return out


def run_row_kernels(t: dict, iters: int) -> dict:
    from dsv41.kernels.step import mhc as k

    args = (t["fn"].t(), t["base"], t["scale"])
    h, pre, post, comb = k.hc_site(t["x"], *args, t["pre_in"], t["w"], iters=iters, **EPS)
    xo, h2, pre2, post2, comb2 = k.hc_expand_site(t["y"], t["x"], t["post"], t["comb"], *args, t["pre_in"], t["w"],
                                                  iters=iters, **EPS)
    return dict(h=h, pre=pre, post=post, comb=comb, xo=xo, h2=h2, pre2=pre2, post2=post2, comb2=comb2)


def _h_error(h: torch.Tensor, x: torch.Tensor, pre_in: torch.Tensor, w: torch.Tensor) -> dict:
    """h against rms_norm(collapse(x, pre_in), w) within the module docstring's bound (fp64 arithmetic)."""
    from dsv41.model import mhc as ref
    from dsv41.model.norm import rms_norm

    u_ref = ref.collapse(x, pre_in)
    h_ref = rms_norm(u_ref, w, EPS["rms_eps"])
    u64 = u_ref.double()
    r = torch.rsqrt(u64.pow(2).mean(dim=-1, keepdim=True) + EPS["rms_eps"])
    terms = (pre_in.double()[:, :, None] * x.double()).abs().sum(1)
    big = torch.maximum(h.double().abs(), h_ref.double().abs())
    allowed = (2 * _spacing(big.to(h.dtype)) + r * w.double().abs() * (_spacing(u_ref) + COLLAPSE_ULPS * 2.0 ** -24
                                                                       * terms) + RMS_ULPS * 2.0 ** -24 * big)
    err = (h.double() - h_ref.double()).abs() / allowed
    return dict(finite=bool(torch.isfinite(h).all()), max_bound_fraction=float(err.max()),
                max_ulps=float(_ulps(h, h_ref).max()), flips=float((h != h_ref).double().mean()))


def errors(t: dict, out: dict, hc: int, iters: int) -> dict:
    """Every output against the reference, each on its own input (h2 and the second coefficients on out's X')."""
    from dsv41.model import mhc as ref
    from dsv41.runtime.mhc_sites import HC, hc_coefficients

    p = HC(t["fn"].t().contiguous(), t["base"], t["scale"])
    res = {}
    for x, names in ((t["x"], ("h", "pre", "post", "comb")), (out["xo"], ("h2", "pre2", "post2", "comb2"))):
        if names[0] not in out:
            continue
        coeffs = hc_coefficients(x, p, hc, EPS["norm_eps"], EPS["hc_eps"], iters)
        res[names[0]] = _h_error(out[names[0]], x, t["pre_in"], t["w"])
        for name, r in zip(names[1:], coeffs):
            res[name] = dict(finite=bool(torch.isfinite(out[name]).all()), max_abs=float((out[name] - r).abs().max()))
    res["xo"] = dict(finite=bool(torch.isfinite(out["xo"]).all()),
                     **_expand_error(out["xo"], ref.expand(t["y"], t["x"], t["post"], t["comb"]), t))
    return res


def check(case, res: dict) -> None:
    dtype = case[4]
    for name, r in res.items():
        if name == "rows":
            assert all(r.values()), f"{case}: a row's bits depend on the other rows: {r}"
            continue
        assert r["finite"], f"{case} {name}: non-finite output"
        if "max_abs" in r:
            assert r["max_abs"] <= COEFF_ABS, f"{case} {name}: {r}"
        else:
            assert r["max_bound_fraction"] <= 1.0, f"{case} {name}: {r}"
            if dtype == "bfloat16":
                assert r["flips"] <= FLIP_FRACTION, f"{case} {name}: {r}"


def _same(a: dict, b: dict, at) -> bool:
    """Every output of a bitwise b's rows `at`."""
    return all(torch.equal(a[n].view(torch.uint8), b[n][at].view(torch.uint8)) for n in a)


def measure(case, device: str, seed: int, alone=None, slices=None, run=None, more: int = 37) -> dict:
    """Errors against the reference, and the row invariance (module docstring): rows `alone` (default: at the tile
    edges) each alone, the `slices` (default: cutting tiles), the rows permuted, and the rows in a bigger batch
    (`more` rows appended). `run`: the launchers measured (default `run_tiles`; test_kernels_step_mhc_blocks.py and
    test_kernels_step_mhc_split.py pass their own)."""
    run_tiles = run or globals()["run_tiles"]
    hc, d, B, iters, dtype, cols = case
    t = _inputs(hc, d, B, getattr(torch, dtype), device, seed)
    out = run_tiles(t, iters, cols)
    res = errors(t, out, hc, iters)
    alone = sorted({i % B for i in (alone or (0, 32, -1))})  # tile edges
    slices = slices or [(3, min(B, 40)), (max(0, B - 5), B)]  # cutting tiles, a partial last tile
    order = torch.randperm(B, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    more = _inputs(hc, d, more, getattr(torch, dtype), device, seed + 2)  # other rows (fn etc. replaced by t's)
    bigger = {k: (v if k in NOT_ROWS else torch.cat([v, more[k]])) for k, v in t.items()}
    in_bigger = {n: v[:B] for n, v in run_tiles(bigger, iters, cols).items()}
    res["rows"] = dict(alone=all(_same(run_tiles(_rows_of(t, slice(i, i + 1)), iters, cols), out, slice(i, i + 1))
                                 for i in alone),
                       slices=all(_same(run_tiles(_rows_of(t, slice(a, b)), iters, cols), out, slice(a, b))
                                  for a, b in slices),
                       permuted=_same(run_tiles(_rows_of(t, order), iters, cols), out, order),
                       bigger=_same(in_bigger, out, slice(0, B)))
    return res


def measure_live_rows(case, device: str, seed: int, run=None, inside: int = 33) -> dict:
    """`rows=k`: rows [0, k) bitwise the full launch's, rows [k, B) +0.0, for k = 0, `inside` (inside a tile), B;
    and a full launch after them gives the first one's bits (the per-tile counters left clean). `run`: as
    `measure`'s."""
    run_tiles = run or globals()["run_tiles"]
    hc, d, B, iters, dtype, cols = case
    t = _inputs(hc, d, B, getattr(torch, dtype), device, seed)
    full = run_tiles(t, iters, cols)
    res = {}
    for k in sorted({0, inside, B}):
        out = run_tiles(t, iters, cols, rows=k)
        res[k] = all(out[n].shape == full[n].shape and torch.equal(out[n][:k], full[n][:k]) and _is_zero(out[n][k:])
                     for n in full)
    res["again"] = _same(run_tiles(t, iters, cols), full, slice(None))
    return res


def sites_both_ways(seed: int = 7) -> dict:
    """MhcSites with the tiles (what prefill rows run with the knob on) and with the reference math, on the same fp32
    inputs: the largest difference in units of the reference output's rms; and which launches `MhcSites.of` picks."""
    from dsv41.runtime.mhc_sites import HC, MhcSites

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
        for knob in ("1", "0", ""):
            with mock.patch.dict(os.environ, DSV41_PREFILL_MHC_TILES=knob):
                picks[f"{phase}/{knob}"] = MhcSites.of(cfg, torch.device("cpu"), phase=phase).tiles
    return dict(max_rel=max(float((a - b).abs().max() / b.pow(2).mean().sqrt()) for a, b in zip(outs[True],
                                                                                                outs[False])),
                count=len(outs[True]), picks=picks)


def full_d_errors(seed: int = 3) -> dict:
    hc, d, B, iters, dtype, cols = CPU_FULL_D_CASE
    t = _inputs(hc, d, B, getattr(torch, dtype), "cpu", seed)
    return errors(t, run_tiles(t, iters, cols, site=False), hc, iters)  # the expand site: both kernels' paths


# ---------------------------------------------------------------------------------------------------------------
# CPU: the interpreted child
# ---------------------------------------------------------------------------------------------------------------


def _interp_worker(out_path: str) -> None:
    from step_harness import caught

    res = {str(case): caught(measure, case, "cpu", seed=i) for i, case in enumerate(CPU_CASES)}
    res.update(live=caught(measure_live_rows, CPU_ROWS_CASE, "cpu", seed=11), sites=caught(sites_both_ways),
               full_d=caught(full_d_errors))
    torch.save(res, out_path)


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "mhc_prefill", timeout=600)


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_interpreted_tiles_match_the_reference_and_are_row_invariant(interp, case):
    res = interp[str(case)]
    assert "error" not in res, res.get("error")
    check(case, res)


def test_interpreted_tiles_at_the_release_d_match_the_reference(interp):
    """d 5120, the default 20 splits: the mixing product's sum over hc d = 20,480 terms within the bounds."""
    res = interp["full_d"]
    assert "error" not in res, res.get("error")
    check(CPU_FULL_D_CASE, res)


def test_interpreted_tiles_live_rows_are_the_full_launch_and_the_rest_zero(interp):
    res = interp["live"]
    assert "error" not in res, res.get("error")
    assert res and all(res.values()), res


def test_runtime_sites_take_the_tiles_on_prefill_rows_when_asked(interp):
    """MhcSites with the tiles and the reference math give one function; `MhcSites.of` picks the tiles for prefill
    rows with DSV41_PREFILL_MHC_TILES=1 only (off by default)."""
    res = interp["sites"]
    assert "error" not in res, res.get("error")
    assert res["count"] == 9 and res["max_rel"] <= 1e-5, res
    assert res["picks"] == {f"{p}/{k}": p == "prefill" and k == "1" for p in ("prefill", "decode", "verify")
                            for k in ("1", "0", "")}, res["picks"]


def test_tile_launchers_refuse_bad_arguments():
    from dsv41.kernels.step import mhc_prefill as k

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


def test_the_split_of_d_is_a_function_of_d_alone():
    from dsv41.kernels.step import mhc_prefill as k

    assert k.splits_of(5120) == 20 and k.splits_of(4096) == 16 and k.splits_of(128) == 1


@pytest.mark.parametrize("arch", [90, 121])
def test_tile_kernel_compiles_for_the_targets(arch):
    """Ahead-of-time compile (Triton's own ptxas, no GPU) at the release's constants, bf16 streams, the expand site
    (the plain site is its subset): a cubin for sm_90 (H100 / H200) and GB10's sm_121, the mixing product on the
    bf16 tensor cores (the path the interpreter does not run) and no tf32. (~30 s a compile on 2 busy cores: the
    fp32 streams' and sm_80's variants are left to the GPU.)"""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from dsv41.kernels.step import mhc_prefill as k

    if not isinstance(k._tile_kernel, JITFunction) or not k.MMA:
        pytest.skip("kernels decorated for the interpreter in this process")
    names = ("x_ptr y_ptr post_in_ptr comb_in_ptr xo_ptr fn_ptr stride_fk stride_fn base_ptr scale_ptr pre_in_ptr "
             "w_ptr h_ptr pre_ptr post_ptr comb_ptr part_ptr count_ptr B d chunk norm_eps hc_eps rms_eps iters "
             "live_rows").split()
    for dt, xp in (("bf16", 1),):
        types = (f"*{dt} *{dt} *fp32 *fp32 *{dt} *fp32 i32 i32 *fp32 *fp32 *fp32 *{dt} *{dt} *fp32 *fp32 *fp32 *fp32 "
                 "*i32 i32 i32 i32 fp32 fp32 fp32 i32 i32").split()
        for expand in (True,):
            const = dict(HC=4, HCP=4, NP=32, SPLITS=k.splits_of(5120), EXPAND=expand, BM=k.TILE_ROWS,
                         BLOCK=k.TILE_BLOCK, BLOCK_N=k.TILE_NORM, XP=xp, PDL=arch >= 90)
            src = ASTSource(fn=k._tile_kernel, signature={**dict(zip(names, types)),
                                                          **{c: "constexpr" for c in const}}, constexprs=const)
            try:
                compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                          options=dict(num_warps=k.TILE_WARPS))
            except RuntimeError as exc:  # no ptxas for this target in this Triton
                pytest.skip(f"Triton cannot compile for sm_{arch} here: {exc}")
            assert compiled.asm.get("cubin"), (arch, dt, expand)
            ptx = compiled.asm["ptx"]
            assert "mma" in ptx and "bf16" in ptx and "tf32" not in ptx, (arch, dt, expand)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the release's shape, 2,048 and 8,192 rows, compiled
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"rows{c[2]}")
def test_gpu_mhc_prefill_tiles_full_shape_match_the_reference_and_are_row_invariant(case):
    """hc 4, d 5120, bf16: the bounds against the reference; rows alone (tile edges included), slices cutting tiles
    anywhere, all rows permuted and in a bigger batch, bitwise the full launch's; the coefficients within
    2 COEFF_ABS of the row kernels'."""
    need_compiled_cuda()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's fp32 products in fp32
    try:
        res = measure(case, "cuda", seed=300, alone=GPU_ALONE, slices=GPU_SLICES)
        t = _inputs(*case[:3], getattr(torch, case[4]), "cuda", 300)
        tiles, rowk = run_tiles(t, case[3]), run_row_kernels(t, case[3])
        vs_rows = {n: float((tiles[n] - rowk[n]).abs().max()) for n in ("pre", "post", "comb")}
        ref_rows = errors(t, rowk, case[0], case[3])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    print(case, res, "tiles - row kernels:", vs_rows, "row kernels vs reference:", ref_rows)
    check(case, res)
    assert max(vs_rows.values()) <= 2 * COEFF_ABS, vs_rows


@pytest.mark.gpu
def test_gpu_mhc_prefill_tiles_live_rows_are_the_full_launch_and_the_rest_zero():
    need_compiled_cuda()
    res = measure_live_rows((4, 5120, 100, 20, "bfloat16", None), "cuda", seed=301)
    assert res and all(res.values()), res


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    _interp_worker(sys.argv[2])
