"""The prefill rows' mHC sites as three launches (dsv41.kernels.step.mhc_split) against the reference (runtime/
mhc_sites.py `hc_coefficients`, dsv41.model.mhc, dsv41.model.norm.rms_norm) and the row kernels (kernels/step/
mhc.py), and their row invariance.

The bounds and the row-invariance checks are the prefill tiles' (tests/test_kernels_step_mhc_prefill.py's
docstring argues them: fp32 sums of the same products in other fixed orders), run on these launchers: rows alone,
slices cutting the mixing launch's row blocks anywhere, all rows permuted (another block, another position in it)
and in a bigger batch, bitwise the full launch's; live rows (`rows=k`) bitwise the full launch's and the rest +0.0.
Against the row kernels: X' bitwise (the same code on the same tiles: mhc.py `_expanded`), and h bitwise where the
row kernels run `splits = NB` (u the same code, `_collapsed`, and Σu² summed in the same order); the coefficients
within 2 COEFF_ABS (another sum order of the mixing product). An fp32 y gives the bits of its bf16 rounding.
Interpreted, the mixing product is numpy's sum over k of the part products (kernels/step/mhc_split.py
`_part_dot`); compiled, bf16 tensor-core dots, checked on the GPU (`-m gpu`: hc 4, d 5120, bf16, 2,048 and 8,192
rows). Small build constants (column steps, splits of K, rows a mixing block) get several of each at small shapes.
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
from test_kernels_step_mhc_prefill import GPU_ALONE, GPU_SLICES, check, measure, measure_live_rows  # noqa: E402

COEFFS = ("pre", "post", "comb", "pre2", "post2", "comb2")
# (hc, d, B, iters, dtype, (steps, mix_splits, mix_rows, plain site too)): small for the interpreter (its cost is
# per op and per program: a row costs NB programs of A and one of C, whose Sinkhorn is iters steps). d 40 with one
# 32-column step a block: 2 blocks, the second a partial step; K = 160 in splits of 64 (a short last split); 8 rows a
# mixing block (>= 16 on the GPU, the dot's M; any power of two interpreted): B 9-10 is 2 blocks, the last partial
# (the bigger batch: MORE rows appended); hc 3 padded to 4 with
# fp32 streams (x as three bf16 parts on the GPU); hc 2 the tiny models'; those two the expand site only (the plain
# site is its EXPAND-off subset, run in the first case, CPU_VS_ROWS_CASE and the runtime's check). The 20 Sinkhorn
# steps, d 72 (3 blocks, 5 splits) and the row kernels run in CPU_VS_ROWS_CASE; the release's d and rows on the GPU.
CPU_CASES = [(4, 40, 10, 3, "bfloat16", (1, 3, 8, True)), (3, 24, 9, 3, "float32", (1, 2, 8, False)),
             (2, 32, 9, 3, "bfloat16", (1, 2, 8, False))]
MORE = 5
CPU_ROWS_CASE = (2, 16, 12, 1, "bfloat16", (1, 2, 8, True))  # rows=k at k 0, 5, 12
CPU_VS_ROWS_CASE = (4, 72, 4, 20, "bfloat16", (1, 5, 16, True))  # the row kernels interpreted: a program per row
GPU_CASES = [(4, 5120, 2048, 20, "bfloat16", None), (4, 5120, 8192, 20, "bfloat16", None)]


def run_split(t: dict, iters: int, consts=None, rows: int | None = None, site: bool = True) -> dict:
    """The split launchers (the plain site unless `site` is False, and the expand site) on one input set, outputs
    named as the row kernels' test names them. consts: (steps, mix_splits, mix_rows, plain site too), None = the
    build's (both sites)."""
    from dsv41.kernels.step import mhc_split as k

    steps, splits, mrows, plain = consts or (k.STEPS, k.MIX_SPLITS, k.MIX_ROWS, True)
    site = site and plain
    args = (t["fn"].t(), t["base"], t["scale"])
    kw = dict(iters=iters, rows=rows, steps=steps, mix_splits=splits, mix_rows=mrows, **EPS)
    out = {}
    if site:
        out.update(zip(("h", "pre", "post", "comb"), k.hc_site_split(t["x"], *args, t["pre_in"], t["w"], **kw)))
    out.update(zip(("xo", "h2", "pre2", "post2", "comb2"),
                   k.hc_expand_site_split(t["y"], t["x"], t["post"], t["comb"], *args, t["pre_in"], t["w"], **kw)))
    return out


def run_row_kernels(t: dict, iters: int, splits=None) -> dict:
    from dsv41.kernels.step import mhc as k

    args = (t["fn"].t(), t["base"], t["scale"])
    kw = dict(iters=iters, splits=splits, **EPS)
    out = dict(zip(("h", "pre", "post", "comb"), k.hc_site(t["x"], *args, t["pre_in"], t["w"], **kw)))
    out.update(zip(("xo", "h2", "pre2", "post2", "comb2"),
                   k.hc_expand_site(t["y"], t["x"], t["post"], t["comb"], *args, t["pre_in"], t["w"], **kw)))
    return out


def vs_row_kernels(case, device: str, seed: int) -> dict:
    """Against the row kernels on the same inputs, theirs at `splits = NB` (the split's blocks): X' and h bitwise
    (both sites), the largest coefficient difference; and the split with an fp32 y bitwise its bf16 y's."""
    from dsv41.kernels.step import mhc_split as k

    hc, d, B, iters, dtype, consts = case
    t = _inputs(hc, d, B, getattr(torch, dtype), device, seed)
    split = run_split(t, iters, consts)
    nb = k.blocks_of(d, consts[0] if consts else k.STEPS)[2]
    rowk = run_row_kernels(t, iters, splits=nb)
    fp32_y = run_split(dict(t, y=t["y"].float()), iters, consts, site=False)
    return dict(xo=torch.equal(split["xo"], rowk["xo"]), h=torch.equal(split["h"], rowk["h"]),
                h2=torch.equal(split["h2"], rowk["h2"]),
                h_same=float((split["h"] == rowk["h"]).double().mean()),
                h2_same=float((split["h2"] == rowk["h2"]).double().mean()),
                diff={n: float((split[n] - rowk[n]).abs().max()) for n in COEFFS},
                fp32_y=all(torch.equal(fp32_y[n], split[n]) for n in fp32_y))


def parts_facts(seed: int = 4) -> dict:
    """`split_parts` sums back to fn exactly (lanes past (2 + hc) hc zero); `mix_parts` keeps one per fn tensor,
    remade after an in-place change."""
    from dsv41.kernels.step import mhc_split as k

    fn_t = _inputs(4, 64, 1, torch.float32, "cpu", seed)["fn"].t()
    fn_t[0, 0], fn_t[1, 1] = 1e-30, -1.5e38  # tiny and huge values split exactly too
    parts = k.split_parts(fn_t, 32)
    again = k.mix_parts(fn_t, 4)
    same = k.mix_parts(fn_t, 4) is again
    fn_t.mul_(2)
    remade = k.mix_parts(fn_t, 4)
    return dict(exact=bool(torch.equal(parts.double().sum(0)[:, :24], fn_t.double() / 2)),
                pad_zero=bool((parts[:, :, 24:] == 0).all()), shape=tuple(parts.shape), dtype=str(parts.dtype),
                cached=same, remade=remade is not again and torch.equal(remade.double().sum(0)[:, :24],
                                                                       fn_t.double()))


def sites_both_ways(seed: int = 7) -> dict:
    """MhcSites with the split launches (what prefill rows run with the knob on) and with the reference math, on the
    same fp32 inputs: the largest difference in units of the reference output's rms; and what `MhcSites.of` picks."""
    from dsv41.runtime.mhc_sites import HC, MhcSites

    t = _inputs(4, 40, 7, torch.float32, "cpu", seed)
    p = HC(t["fn"].t(), t["base"], t["scale"])
    outs = {}
    for kernels in (True, False):
        s = MhcSites(4, EPS["rms_eps"], EPS["hc_eps"], 20, kernels, split=kernels)
        outs[kernels] = [*s.site(t["x"], p, t["pre_in"], t["w"]),
                         *s.expand_site(t["y"], t["x"], t["post"], t["comb"], p, t["pre_in"], t["w"])]
    cfg = SimpleNamespace(hc_mult=4, rms_norm_eps=EPS["rms_eps"], hc_eps=EPS["hc_eps"], hc_sinkhorn_iters=20)
    picks = {}
    for phase in ("prefill", "decode", "verify"):
        for knob in ("1", "0", ""):
            with mock.patch.dict(os.environ, DSV41_PREFILL_MHC_SPLIT=knob):
                picks[f"{phase}/{knob}"] = MhcSites.of(cfg, torch.device("cpu"), phase=phase).split
    return dict(max_rel=max(float((a - b).abs().max() / b.pow(2).mean().sqrt()) for a, b in zip(outs[True],
                                                                                                outs[False])),
                count=len(outs[True]), picks=picks)


# ---------------------------------------------------------------------------------------------------------------
# CPU: the interpreted child
# ---------------------------------------------------------------------------------------------------------------


def _interp_worker(out_path: str) -> None:
    from step_harness import caught

    res = {str(case): caught(measure, case, "cpu", seed=i, run=run_split, more=MORE) for i, case in
           enumerate(CPU_CASES)}
    res.update(live=caught(measure_live_rows, CPU_ROWS_CASE, "cpu", seed=11, run=run_split, inside=5),
               sites=caught(sites_both_ways), vs_rows=caught(vs_row_kernels, CPU_VS_ROWS_CASE, "cpu", seed=5),
               parts=caught(parts_facts))
    torch.save(res, out_path)


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "mhc_split", timeout=600)


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_interpreted_split_matches_the_reference_and_is_row_invariant(interp, case):
    res = interp[str(case)]
    assert "error" not in res, res.get("error")
    check(case, res)


def test_interpreted_split_live_rows_are_the_full_launch_and_the_rest_zero(interp):
    res = interp["live"]
    assert "error" not in res, res.get("error")
    assert res and all(res.values()), res


def test_interpreted_split_x_and_h_are_the_row_kernels_bits(interp):
    """X' bitwise the row kernels'; h too at `splits = NB`; the coefficients within 2 COEFF_ABS; an fp32 y is its
    bf16 rounding."""
    res = interp["vs_rows"]
    assert "error" not in res, res.get("error")
    assert res["xo"] and res["h"] and res["h2"] and res["fp32_y"], res
    assert max(res["diff"].values()) <= 2 * COEFF_ABS, res


def test_fn_parts_are_exact_and_made_once_per_weight(interp):
    res = interp["parts"]
    assert "error" not in res, res.get("error")
    assert res == dict(exact=True, pad_zero=True, shape=(3, 256, 32), dtype="torch.bfloat16", cached=True,
                       remade=True), res


def test_runtime_sites_take_the_split_on_prefill_rows_when_asked(interp):
    """MhcSites with the split launches and the reference math give one function; `MhcSites.of` picks them for
    prefill rows only, unless DSV41_PREFILL_MHC_SPLIT=0 (on by default)."""
    res = interp["sites"]
    assert "error" not in res, res.get("error")
    assert res["count"] == 9 and res["max_rel"] <= 1e-5, res
    assert res["picks"] == {f"{p}/{k}": p == "prefill" and k != "0" for p in ("prefill", "decode", "verify")
                            for k in ("1", "0", "")}, res["picks"]


def test_split_launchers_refuse_bad_arguments():
    from dsv41.kernels.step import mhc_split as k

    x, y, w, pre, comb = torch.zeros(2, 4, 8), torch.zeros(2, 8), torch.zeros(8), torch.zeros(2, 4), \
        torch.zeros(2, 4, 4)
    fn_t, base, scale = torch.zeros(32, 24), torch.zeros(24), torch.zeros(3)
    with pytest.raises(ValueError, match="rows"):
        k.hc_site_split(x, fn_t, base, scale, pre, w, iters=20, rows=3, **EPS)
    with pytest.raises(ValueError, match="fn_t"):
        k.hc_site_split(x, fn_t.t(), base, scale, pre, w, iters=20, **EPS)
    with pytest.raises(ValueError, match="y must be"):
        k.hc_expand_site_split(y[:1], x, pre, comb, fn_t, base, scale, pre, w, iters=20, **EPS)


def test_the_shapes_are_functions_of_hc_and_d_alone():
    from dsv41.kernels.step import mhc_split as k

    assert k.blocks_of(5120) == (32, 16, 10) and k.blocks_of(4096) == (32, 16, 8) and k.blocks_of(72, 1) == (32, 1, 3)
    assert k.blocks_of(16) == (16, 1, 1) and k.k_split(20480) == (1280, 16) and k.k_split(288, 5) == (64, 5)
    assert k.lanes(4) == 32 and k.lanes(2) == 16 and k.lanes(3) == 16


def _compile(fn, names: str, types: str, const: dict, options: dict):
    """Ahead-of-time compile for sm_90 with Triton's own ptxas (no GPU), or skip with the reason."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(fn, JITFunction):
        pytest.skip("kernels decorated for the interpreter in this process")
    src = ASTSource(fn=fn, signature={**dict(zip(names.split(), types.split())), **{c: "constexpr" for c in const}},
                    constexprs=const)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except RuntimeError as exc:  # no ptxas for this target in this Triton
        pytest.skip(f"Triton cannot compile for sm_90 here: {exc}")


def _axis0_reduce_layouts(ttgir: str) -> set:
    """(shape, layout) of every fp32 reduction over axis 0 of a [4, 4, 32] or [4, 32] tile in blocked layout: the
    expand's Σ_j comb[j, k] X[j] and the collapse's Σ_c pre[c] X[c] (their order follows the layout)."""
    import re

    defs = dict(re.findall(r"^(#blocked\d*) = (#ttg\.blocked<\{[^}]*\}>)", ttgir, re.M))
    found = set()
    for chunk in ttgir.split('"tt.reduce"')[1:]:
        axis = re.search(r"axis = (\d+)", chunk).group(1)
        m = re.search(r"\}\) : \(tensor<([0-9x]+)xf32, (#blocked\d*)>\)", chunk)
        if axis == "0" and m and m.group(1) in ("4x4x32", "4x32"):
            found.add((m.group(1), defs[m.group(2)]))
    return found


def test_expand_and_collapse_compile_to_the_row_kernels_layouts_and_the_mix_to_bf16_mma():
    """sm_90, offline: A's two reductions over the streams (the expand's mix, the collapse) get the row kernel's
    layouts (the 3-D mix over the streams in-thread, the collapse across the 4 warps), so the same order and the same
    instructions: the ground of X' and u bitwise the row kernels' on the GPU (its test checks the bits). B's product
    is bf16 tensor-core MMAs (no tf32). ~15 s on 2 busy cores."""
    from dsv41.kernels.step import mhc as rk, mhc_split as k

    if not k.MMA:
        pytest.skip("kernels decorated for the interpreter in this process")
    row = _compile(rk._site_kernel, "x_ptr y_ptr post_in_ptr comb_in_ptr xo_ptr fn_ptr stride_fk stride_fn base_ptr "
                   "scale_ptr pre_in_ptr w_ptr h_ptr pre_ptr post_ptr comb_ptr part_ptr count_ptr d chunk norm_eps "
                   "hc_eps rms_eps iters live_rows", "*bf16 *fp32 *fp32 *fp32 *bf16 *fp32 i32 i32 *fp32 *fp32 *fp32 "
                   "*bf16 *bf16 *fp32 *fp32 *fp32 *fp32 *i32 i32 i32 fp32 fp32 fp32 i32 i32",
                   dict(HC=4, HCP=4, NP=32, SPLITS=32, EXPAND=True, BLOCK=rk.BLOCK_D, BLOCK_N=rk.BLOCK_H, PDL=True,
                        PIPELINE=True, NORM_ALL=8192), dict(num_warps=rk.NUM_WARPS))
    block, steps, nb = k.blocks_of(5120)
    split_a = _compile(k._expand_collapse_kernel, "x_ptr y_ptr post_in_ptr comb_in_ptr xo_ptr pre_in_ptr h_ptr "
                       "sums_ptr d live_rows", "*bf16 *fp32 *fp32 *fp32 *bf16 *fp32 *bf16 *fp32 i32 i32",
                       dict(HC=4, HCP=4, NB=nb, EXPAND=True, BLOCK=block, STEPS=steps, PDL=True),
                       dict(num_warps=rk.NUM_WARPS))
    theirs, ours = _axis0_reduce_layouts(row.asm["ttgir"]), _axis0_reduce_layouts(split_a.asm["ttgir"])
    assert len(theirs) == 2 and ours == theirs, (theirs, ours)
    chunk, splits = k.k_split(4 * 5120)
    split_b = _compile(k._mix_kernel, "xo_ptr parts_ptr mix_ptr B K chunk live_rows", "*bf16 *bf16 *fp32 i32 i32 i32 "
                       "i32", dict(NP=32, SPLITS=splits, BM=k.MIX_ROWS, BK=k.MIX_K, XP=1, PDL=True),
                       dict(num_warps=k.MIX_WARPS, num_stages=k.MIX_STAGES))
    ptx = split_b.asm["ptx"]
    assert split_b.asm.get("cubin") and "mma" in ptx and ".bf16" in ptx and "tf32" not in ptx


# ---------------------------------------------------------------------------------------------------------------
# GPU: the release's shape, 2,048 and 8,192 rows, compiled
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"rows{c[2]}")
def test_gpu_mhc_split_full_shape_matches_the_reference_and_the_row_kernels(case):
    """hc 4, d 5120, bf16: the bounds against the reference; rows alone, slices cutting the mixing blocks anywhere,
    all rows permuted and in a bigger batch, bitwise the full launch's; the first site's h bitwise the row
    kernels' at `splits = NB` and its coefficients within 2 COEFF_ABS of theirs (X' is within the reference's bound,
    `check`, and printed whether bitwise theirs: compiled, ptxas may contract the expand otherwise, so the second
    site's inputs, and with them its outputs, may differ from theirs). Prints one expand site's ms against the row
    kernels'."""
    need_compiled_cuda()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's fp32 products in fp32
    try:
        res = measure(case, "cuda", seed=300, alone=GPU_ALONE, slices=GPU_SLICES, run=run_split)
        rows = vs_row_kernels(case, "cuda", 300)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    t = _inputs(*case[:3], getattr(torch, case[4]), "cuda", 300)
    ms = dict(split=cuda_median_ms(lambda: run_split(t, case[3], site=False)),
              row_kernels=cuda_median_ms(lambda: run_row_kernels(t, case[3])) / 2)  # (both sites there)
    print(case, res, "split vs row kernels:", rows, "ms a site:", ms)
    check(case, res)
    assert rows["fp32_y"] and rows["h"], rows
    assert max(rows["diff"][k] for k in ("pre", "post", "comb")) <= 2 * COEFF_ABS, rows


@pytest.mark.gpu
def test_gpu_mhc_split_live_rows_are_the_full_launch_and_the_rest_zero():
    need_compiled_cuda()
    res = measure_live_rows((4, 5120, 100, 20, "bfloat16", None), "cuda", seed=301, run=run_split)
    assert res and all(res.values()), res


@pytest.mark.gpu
def test_gpu_prefill_through_the_split_sites_chunked_is_one_shot_bitwise(monkeypatch):
    """DSV41_PREFILL_MHC_SPLIT=1 through the forward (MhcSites.of picks the split for prefill rows): the full-shape
    synthetic rank's first 3 layers, an 8K prompt in 4K chunks and in odd cuts (tests/test_runtime_prefill_chunks.py's
    scheme): every cache byte and the logits of the rows both return are the same bits, and the split launches ran.
    Prints the logits' largest difference to the row kernels' path (other coefficient bits: not asserted)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the full-shape synthetic rank)")
    need_compiled_cuda()
    from dsv41.kernels.step import mhc_split as k
    from dsv41.runtime.synthetic import synthetic_rank
    from test_runtime_prefill_chunks import SCHEMES, _bits, _HalfOfTwo, _prefill, _tensors

    model = synthetic_rank(None, rank=0, world=2, device="cuda", dtype=torch.bfloat16, comm=_HalfOfTwo(), layers=3)
    ids = torch.randint(0, model.cfg.vocab_size, (8192,), generator=torch.Generator().manual_seed(17))
    monkeypatch.delenv(k.ENV, raising=False)
    _, rows_path = _prefill(model, ids, [4096])
    calls, real = [], k._split_site
    monkeypatch.setattr(k, "_split_site", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv(k.ENV, "1")
    st4, lg4 = _prefill(model, ids, [4096])
    assert calls, "the split launches did not run"
    st2, lg2 = _prefill(model, ids, SCHEMES["odd cuts inside ratio-2 groups"])
    a, b = dict(_tensors(st2)), dict(_tensors(st4))
    assert a.keys() == b.keys() and a
    differ = [path for path in a if not torch.equal(_bits(a[path]), _bits(b[path]))]
    assert not differ, differ
    common = sorted(lg2.keys() & lg4.keys())
    assert len(common) >= 4 and all(torch.equal(_bits(lg2[r]), _bits(lg4[r])) for r in common)
    print("split vs row kernels, logits' largest |difference|:",
          max(float((lg4[r].float() - rows_path[r].float()).abs().max()) for r in lg4))


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    _interp_worker(sys.argv[2])
