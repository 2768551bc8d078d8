"""mHC step kernels (dsv41.kernels.step.mhc) against the reference (dsv41.model.mhc, dsv41.model.norm.rms_norm).

CPU part: the kernels run in Triton's interpreter, in one child process (TRITON_INTERPRET must be set before the
kernels are decorated; setting it here would interpret every other Triton kernel of the session); the child
measures and reports JSON, the tests judge the numbers. GPU part (`-m gpu`): the same measurements on the full
shape (hc 4, d 5120 and 4096, bf16 streams), in-process, compiled.

Tolerances (each output checked on its own input, so that one rounding flip upstream does not count twice):
- pre / post / comb (fp32, values in (0, 2]): max |kernel - reference| <= 1e-5 (COEFF_ABS). Both are fp32 math with
  sums in other orders (the mixing product over hc*d terms, the 4-term Sinkhorn sums) and exp in fp32 where the
  reference rounds an fp64 exp: a few fp32 ulp (measured <= 6.6e-7 in the interpreter), and the 20 Sinkhorn steps
  are contractive (no growth).
- X' (stream dtype): |error| <= one ulp of the result + EXPAND_TERM_ULPS fp32 ulps of the magnitude of its terms
  (|post y| + sum_j |comb X_j|). Its fp32 value differs from the reference's by a few fp32 ulp of the terms (the
  sum order, fused multiply-add on the GPU), which is at most one ulp of the rounded result except near a
  cancellation, where the result is much smaller than its terms: on the H200 (d 5120 / 4096, bf16) the fused
  expand + site gave 4-6 bf16 ulp on ~4e-5 of the elements, all such.
- h (stream dtype): <= 3 ulp in bf16. The collapse is rounded to the stream dtype before the norm (as the
  reference does): where that rounding flips (1 ulp of u, up to 2^-7 relative) the normalised, weighted value
  moves by up to 2 ulp of h, plus its own rounding; in bf16 such flips must stay rare (FLIP_FRACTION of the
  elements). In fp32 streams <= 8 ulp: the mean square's sum order moves every element by an ulp or two.
  Measured in the interpreter: bf16 h and X' bitwise equal to the reference; fp32 h within 3 ulp, X' equal.
- Row invariance: a row's outputs are bitwise the same alone (B = 1) and among other rows (B = 16, shuffled). The
  interpreter runs one program at a time over numpy arrays whose shapes do not depend on B, and the kernels use no
  BLAS, so this is asserted on the CPU too.

The interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest even), so the kernels round bf16 by
its bits (`_cast`): the same result on both.
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
COEFF_ABS = 1e-5
EXPAND_TERM_ULPS = 8  # X': fp32 ulps of its terms' magnitude allowed on top of one ulp of the result
ULPS = {"bfloat16": dict(h=3), "float32": dict(h=8)}  # h, h2, final
FLIP_FRACTION = 0.02  # bf16: elements of h / X' not bitwise the reference's
EPS = dict(norm_eps=1e-20, hc_eps=1e-6, rms_eps=1e-20)  # the release's (MODEL.md §15 item 6)
CPU_CASES = [  # (hc, d, B, iters, dtype, splits: None = default_splits(d), 1 here); hc 2 is the tiny models', 3
    # exercises the padding of hc; splits > 1 the last-arriver finish (3 of 64 columns over d = 160: a short split)
    (4, 128, 1, 20, "bfloat16", None), (4, 128, 16, 20, "bfloat16", 4), (4, 256, 5, 20, "bfloat16", 5),
    (4, 256, 16, 20, "float32", None), (4, 128, 3, 1, "float32", 2), (3, 160, 4, 20, "bfloat16", 3),
    (2, 128, 16, 3, "float32", None),
]
# the release's d = 5120 (MODEL.md §3), and 4096; default splits (16)
GPU_CASES = [(4, 5120, B, 20, "bfloat16", None) for B in (1, 5, 16)] + [(4, 4096, 16, 20, "bfloat16", None)]
CASE_ID = "hc{}-d{}-B{}-it{}-{}-s{}".format
# `rows=` (live rows first, the rest zero): a small case for the interpreter (splits 2: the last-arriver finish with
# fewer programs than rows), the release's shape and bucket (16) on the GPU
CPU_ROWS_CASE = (4, 128, 4, 20, "bfloat16", 2)
GPU_ROWS_CASE = (4, 5120, 16, 20, "bfloat16", None)


# ---------------------------------------------------------------------------------------------------------------
# measurements (the interpreted child and the GPU tests share them)
# ---------------------------------------------------------------------------------------------------------------


def _ulps(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|a - ref| in units of the dtype's spacing at max(|a|, |ref|) (fp64)."""
    bits = {torch.bfloat16: 7, torch.float32: 23, torch.float16: 10}[ref.dtype]
    big = torch.maximum(a.double().abs(), ref.double().abs())
    spacing = torch.exp2(torch.floor(torch.log2(big.clamp_min(torch.finfo(ref.dtype).tiny))) - bits)
    return (a.double() - ref.double()).abs() / spacing


def _expand_error(v: torch.Tensor, r: torch.Tensor, t: dict) -> dict:
    """X' = post y + sum_j comb[j, k] X[j] against the reference: |error| in units of one ulp of the result plus
    what fp32 rounding of its hc + 1 terms can move it (FMA contraction or another sum order: a few fp32 ulp of the
    terms, which near a cancellation are several ulp of a small result)."""
    post, y, comb, x = (t[k].double() for k in ("post", "y", "comb", "x"))
    terms = (post[:, :, None] * y[:, None, :]).abs() + (comb.abs()[:, :, :, None] * x.abs()[:, :, None, :]).sum(1)
    allowed = _spacing(r) + EXPAND_TERM_ULPS * 2.0 ** -24 * terms
    err = (v.double() - r.double()).abs() / allowed
    return dict(max_bound_fraction=float(err.max()), max_ulps=float(_ulps(v, r).max()),
                flips=float((v != r).double().mean()))


def _spacing(ref: torch.Tensor) -> torch.Tensor:
    bits = {torch.bfloat16: 7, torch.float32: 23, torch.float16: 10}[ref.dtype]
    big = ref.double().abs().clamp_min(torch.finfo(ref.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(big)) - bits)


def _inputs(hc, d, B, dtype, device, seed):
    """Random valid site inputs, scaled as the model's (synthetic.py): mixing values O(1), comb doubly stochastic."""
    from dsv41.model import mhc as ref

    g = torch.Generator().manual_seed(seed)
    nmix = (2 + hc) * hc
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    fn = r(nmix, hc * d) * (hc * d) ** -0.5
    base, scale = r(nmix) * 0.5, torch.rand(3, generator=g) + 0.5
    x = r(B, hc, d) * (1 + 3 * torch.rand(B, hc, 1, generator=g))
    y = r(B, d) * 2
    pre_in = torch.rand(B, hc, generator=g) + 1e-6
    post = 2 * torch.rand(B, hc, generator=g)
    comb = ref.sinkhorn(r(B, hc, hc), 20, 1e-6)
    w = 1 + 0.1 * r(d)
    t = dict(x=x.to(dtype), y=y.to(dtype), fn=fn, base=base, scale=scale, pre_in=pre_in, post=post, comb=comb,
             w=w.to(dtype))
    return {k: v.to(device) for k, v in t.items()}


def _run(t, iters, splits):
    """Every kernel on one input set: a dict of named outputs."""
    from dsv41.kernels.step import mhc as k

    args = (t["fn"].t(), t["base"], t["scale"])
    h, pre, post, comb = k.hc_site(t["x"], *args, t["pre_in"], t["w"], iters=iters, splits=splits, **EPS)
    xo, h2, pre2, post2, comb2 = k.hc_expand_site(t["y"], t["x"], t["post"], t["comb"], *args, t["pre_in"], t["w"],
                                                  iters=iters, splits=splits, **EPS)
    return dict(h=h, pre=pre, post=post, comb=comb, xo=xo, h2=h2, pre2=pre2, post2=post2, comb2=comb2,
                expand=k.hc_expand(t["y"], t["x"], t["post"], t["comb"]),
                final=k.collapse_norm(t["x"], t["pre_in"], t["w"], rms_eps=EPS["rms_eps"]))


def _reference(t, out, hc, iters):
    """The reference's outputs, each from the input the kernel's output was computed from."""
    from dsv41.model import mhc as ref
    from dsv41.model.norm import rms_norm

    p = ref.HCParams(t["fn"], t["base"], t["scale"])
    ne, he, re = EPS["norm_eps"], EPS["hc_eps"], EPS["rms_eps"]
    pre, post, comb = ref.coefficients(t["x"], p, hc, ne, he, iters)
    pre2, post2, comb2 = ref.coefficients(out["xo"], p, hc, ne, he, iters)  # on the kernel's own X'
    return dict(h=rms_norm(ref.collapse(t["x"], t["pre_in"]), t["w"], re), pre=pre, post=post, comb=comb,
                xo=ref.expand(t["y"], t["x"], t["post"], t["comb"]),
                h2=rms_norm(ref.collapse(out["xo"], t["pre_in"]), t["w"], re), pre2=pre2, post2=post2, comb2=comb2,
                expand=ref.expand(t["y"], t["x"], t["post"], t["comb"]),
                final=rms_norm(ref.collapse(t["x"], t["pre_in"]), t["w"], re))


def measure(case, device: str, seed: int = 0) -> dict:
    """Errors of every output against the reference, and whether each row's bits are the same alone and among the
    other rows (shuffled)."""
    hc, d, B, iters, dtype, splits = case
    t = _inputs(hc, d, B, getattr(torch, dtype), device, seed)
    out = _run(t, iters, splits)
    ref = _reference(t, out, hc, iters)
    res = {}
    for name, v in out.items():
        r = ref[name]
        finite = bool(torch.isfinite(v).all())
        if v.dtype == torch.float32 and name[:3] in ("pre", "pos", "com"):
            res[name] = dict(finite=finite, max_abs=float((v - r).abs().max()))
        elif name in ("xo", "expand"):
            res[name] = dict(finite=finite, **_expand_error(v, r, t))
        else:
            u = _ulps(v, r)
            res[name] = dict(finite=finite, max_ulps=float(u.max()), flips=float((u > 0).double().mean()))
    order = torch.randperm(B, generator=torch.Generator().manual_seed(seed + 1)).tolist()
    shuffled = _run({k: (v[order] if v.dim() and v.shape[0] == B and k not in ("fn", "base", "scale", "w") else v)
                     for k, v in t.items()}, iters, splits)
    alone_ok, among_ok = True, True
    for i in range(B):
        one = _run({k: (v[i:i + 1] if k not in ("fn", "base", "scale", "w") else v) for k, v in t.items()}, iters,
                   splits)
        alone_ok &= all(torch.equal(one[n][0], out[n][i]) for n in out)
        among_ok &= all(torch.equal(shuffled[n][order.index(i)], out[n][i]) for n in out)
    res["rows"] = dict(alone=alone_ok, among=among_ok)
    return res


def _run_rows(t, iters, splits, rows):
    """Every launcher with `rows=` (None: the full launch), outputs named as `_run`'s."""
    from dsv41.kernels.step import mhc as k

    args = (t["fn"].t(), t["base"], t["scale"])
    h, pre, post, comb = k.hc_site(t["x"], *args, t["pre_in"], t["w"], iters=iters, splits=splits, rows=rows, **EPS)
    xo, h2, pre2, post2, comb2 = k.hc_expand_site(t["y"], t["x"], t["post"], t["comb"], *args, t["pre_in"], t["w"],
                                                  iters=iters, splits=splits, rows=rows, **EPS)
    return dict(h=h, pre=pre, post=post, comb=comb, xo=xo, h2=h2, pre2=pre2, post2=post2, comb2=comb2,
                expand=k.hc_expand(t["y"], t["x"], t["post"], t["comb"], rows=rows),
                final=k.collapse_norm(t["x"], t["pre_in"], t["w"], rms_eps=EPS["rms_eps"], rows=rows))


def _is_zero(v: torch.Tensor) -> bool:
    """Every element +0.0 (not -0.0)."""
    return bool((v == 0).all()) and not bool(torch.signbit(v).any())


def measure_rows(case, device: str, seed: int = 0) -> dict:
    """For rows = 0, 1, B - 1, B: per output, whether rows [0, k) are bitwise the full launch's and rows [k, B)
    exactly zero; and whether a full launch after the partial ones gives the first one's bits again (the per-row
    arrival counters are left clean)."""
    hc, d, B, iters, dtype, splits = case
    t = _inputs(hc, d, B, getattr(torch, dtype), device, seed)
    full = _run_rows(t, iters, splits, None)
    res = {}
    for k in sorted({0, 1, B - 1, B}):
        out = _run_rows(t, iters, splits, k)
        res[str(k)] = {n: dict(shape=out[n].shape == full[n].shape, live=torch.equal(out[n][:k], full[n][:k]),
                               zero=_is_zero(out[n][k:])) for n in full}
    again = _run_rows(t, iters, splits, None)
    res["again"] = all(torch.equal(again[n], full[n]) for n in full)
    res["outputs"] = sorted(full)
    return res


def check_rows(case, res: dict) -> None:
    B = case[2]
    assert sorted(k for k in res if k not in ("again", "outputs")) == sorted(str(k) for k in {0, 1, B - 1, B})
    assert len(res["outputs"]) == 11, res["outputs"]  # every output of the four launchers
    for k, by_out in res.items():
        if k in ("again", "outputs"):
            continue
        bad = {n: r for n, r in by_out.items() if not all(r.values())}
        assert not bad, f"{case} rows={k}: {bad}"
    assert res["again"], f"{case}: a full launch after partial ones differs from the first"


def check(case, res: dict) -> None:
    dtype = case[4]
    for name, r in res.items():
        if name == "rows":
            assert r["alone"] and r["among"], f"{case}: a row's bits depend on the other rows: {r}"
            continue
        assert r["finite"], f"{case} {name}: non-finite output"
        if "max_abs" in r:
            assert r["max_abs"] <= COEFF_ABS, f"{case} {name}: {r}"
        elif "max_bound_fraction" in r:
            assert r["max_bound_fraction"] <= 1.0, f"{case} {name}: {r}"
            if dtype == "bfloat16":
                assert r["flips"] <= FLIP_FRACTION, f"{case} {name}: {r}"
        else:
            bound = ULPS[dtype]["h"]
            assert r["max_ulps"] <= bound, f"{case} {name}: {r} (bound {bound} ulp)"
            if dtype == "bfloat16":
                assert r["flips"] <= FLIP_FRACTION, f"{case} {name}: {r}"


# ---------------------------------------------------------------------------------------------------------------
# CPU: the interpreted child
# ---------------------------------------------------------------------------------------------------------------


def _sites_both_ways(seed: int = 7) -> dict:
    """runtime/model.py's MhcSites with the kernels and with the reference math (what plain CPU runs), each method
    on the same fp32 inputs: the largest difference in units of the reference output's rms."""
    from dsv41.runtime.mhc_sites import HC, MhcSites

    t = _inputs(4, 128, 5, torch.float32, "cpu", seed)
    p, pending = HC(t["fn"].t(), t["base"], t["scale"]), (t["y"], t["post"], t["comb"])
    outs = {}
    for kernels in (True, False):
        s = MhcSites(4, EPS["rms_eps"], EPS["hc_eps"], 20, kernels)
        outs[kernels] = [*s.site(t["x"], p, t["pre_in"], t["w"]),
                         *s.expand_site(*pending[:1], t["x"], *pending[1:], p, t["pre_in"], t["w"]),
                         s.expanded(t["x"], pending), s.expanded(t["x"], None),
                         s.collapse_norm(t["x"], t["pre_in"], t["w"])]
    diffs = [float((a - b).abs().max() / b.pow(2).mean().sqrt()) for a, b in zip(outs[True], outs[False])]
    return {"max_rel": max(diffs), "count": len(diffs)}


def _fp32_y_is_its_rounding(seed: int = 5) -> dict:
    """bf16 streams, y as fp32 (a reduced partial) and as its `.to(bf16)`: per launcher, the same bits everywhere?"""
    from dsv41.kernels.step import mhc as k

    t = _inputs(4, 160, 3, torch.bfloat16, "cpu", seed)
    y32 = t["y"].float() * (1 + 1e-3 * torch.rand(t["y"].shape, generator=torch.Generator().manual_seed(seed)))
    calls = {"expand_site": lambda y: k.hc_expand_site(y, t["x"], t["post"], t["comb"], t["fn"].t(), t["base"],
                                                         t["scale"], t["pre_in"], t["w"], iters=20, splits=2, rows=2,
                                                         **EPS),
             "expand": lambda y: (k.hc_expand(y, t["x"], t["post"], t["comb"], rows=2),)}
    return {name: all(torch.equal(u.view(torch.uint8), v.view(torch.uint8))
                      for u, v in zip(call(y32), call(y32.to(torch.bfloat16)))) for name, call in calls.items()}


def _interp_worker(out_path: str) -> None:
    from step_harness import caught

    results = {json.dumps(case): caught(measure, case, "cpu", seed=i) for i, case in enumerate(CPU_CASES)}
    results.update(rows=caught(measure_rows, CPU_ROWS_CASE, "cpu", seed=11), sites=caught(_sites_both_ways),
                   fp32_y=caught(_fp32_y_is_its_rounding))
    Path(out_path).write_text(json.dumps(results, indent=1))


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    out = tmp_path_factory.mktemp("mhc_interp") / "results.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, __file__, "--interp-worker", str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"interpreted worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


def test_interpreted_fp32_y_gives_the_bits_of_its_rounding(interp):
    """An fp32 y (the MoE's reduced sum) is the bf16 one it rounds to: every output bitwise."""
    assert interp["fp32_y"] == {"expand_site": True, "expand": True}, interp["fp32_y"]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: CASE_ID(*c))
def test_interpreted_mhc_kernels_match_the_reference_and_are_row_invariant(interp, case):
    res = interp[json.dumps(case)]
    assert "error" not in res, res.get("error")
    check(case, res)


def test_runtime_sites_agree_with_the_reference_math(interp):
    """The fast path's MhcSites: kernels (CUDA, interpreter) and reference math (plain CPU) give one function."""
    res = interp["sites"]
    assert "error" not in res, res.get("error")
    assert res["count"] == 12 and res["max_rel"] <= 1e-5, res


def test_interpreted_live_rows_are_the_full_launch_and_the_rest_zero(interp):
    """`rows=k` (k = 0, 1, B - 1, B): every output of the four launchers, rows [0, k) bitwise the `rows=None`
    launch's, rows [k, B) +0.0."""
    res = interp["rows"]
    assert "error" not in res, res.get("error")
    check_rows(CPU_ROWS_CASE, res)


@pytest.mark.parametrize("rows", [-1, 3, 1.0, 1.5, True, "1", torch.tensor(1), [1]])
def test_launchers_refuse_bad_rows(rows):
    """`rows` must be None or an int in [0, B] (B = 2 here); refused before any launch."""
    from dsv41.kernels.step import mhc as k

    x, y, w = torch.zeros(2, 4, 8), torch.zeros(2, 8), torch.zeros(8)
    pre, comb, fn_t, base, scale = torch.zeros(2, 4), torch.zeros(2, 4, 4), torch.zeros(32, 24), torch.zeros(24), \
        torch.zeros(3)
    calls = [
        lambda: k.hc_site(x, fn_t, base, scale, pre, w, iters=20, rows=rows, **EPS),
        lambda: k.hc_expand_site(y, x, pre, comb, fn_t, base, scale, pre, w, iters=20, rows=rows, **EPS),
        lambda: k.hc_expand(y, x, pre, comb, rows=rows),
        lambda: k.collapse_norm(x, pre, w, rms_eps=EPS["rms_eps"], rows=rows),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="rows"):
            call()


def test_launchers_refuse_wrong_layouts():
    from dsv41.kernels.step import mhc as k

    x = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="contiguous"):
        k.hc_expand(torch.zeros(2, 8), x.transpose(0, 1), torch.zeros(2, 4), torch.zeros(2, 4, 4))
    with pytest.raises(ValueError, match="fn_t"):
        k.hc_site(x, torch.zeros(24, 32), torch.zeros(24), torch.zeros(3), torch.zeros(2, 4), torch.zeros(8),
                  iters=20, **EPS)
    with pytest.raises(ValueError, match="pre_in"):
        k.hc_site(x, torch.zeros(32, 24), torch.zeros(24), torch.zeros(3), torch.zeros(2, 4).double(),
                  torch.zeros(8), iters=20, **EPS)


_SITE_ARGS = ("x_ptr y_ptr post_in_ptr comb_in_ptr xo_ptr fn_ptr stride_fk stride_fn base_ptr scale_ptr pre_in_ptr w_ptr "
              "h_ptr pre_ptr post_ptr comb_ptr part_ptr count_ptr d chunk norm_eps hc_eps rms_eps iters live_rows").split()
_SITE_TYPES = "*S *S *fp32 *fp32 *S *fp32 i32 i32 *fp32 *fp32 *fp32 *S *S *fp32 *fp32 *fp32 *fp32 *i32 i32 i32 fp32 fp32 " \
    "fp32 i32 i32"


@pytest.mark.parametrize("arch", [80, 90, 121])
def test_kernels_compile_for_every_target_without_hopper_only_instructions(arch):
    """Ahead-of-time compile (no GPU needed: Triton's own ptxas) for sm_80, sm_90 and GB10's sm_121, release shape
    constants, bf16 streams: a cubin for each kernel, and none of the sm_90-only instructions in the PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from dsv41.kernels.step import mhc as k

    if not isinstance(k._site_kernel, JITFunction):
        pytest.skip("kernels decorated for the interpreter in this process")

    site = dict(zip(_SITE_ARGS, (t.replace("S", "bf16") for t in _SITE_TYPES.split())))
    shape = dict(HC=4, HCP=4, NP=32, SPLITS=32, BLOCK=32, BLOCK_N=1024)  # NORM_ALL: the release d = 5120 as one block
    kernels = [(k._site_kernel, site, dict(shape, EXPAND=e, PIPELINE=p, NORM_ALL=8192 * p)) for e in (True, False)
               for p in (True, False)] + [
        (k._expand_kernel, dict(y_ptr="*bf16", x_ptr="*bf16", post_ptr="*fp32", comb_ptr="*fp32", xo_ptr="*bf16",
                                d="i32", live_rows="i32"), dict(HC=4, HCP=4, BLOCK=256)),
        (k._collapse_norm_kernel, dict(x_ptr="*bf16", pre_ptr="*fp32", w_ptr="*bf16", h_ptr="*bf16", d="i32",
                                       rms_eps="fp32", live_rows="i32"), dict(HC=4, HCP=4, BLOCK=1024, BLOCK_N=1024)),
    ]
    for fn, sig, const in kernels:
        const = {**const, "PDL": arch >= 90}  # dependent launch exists from sm_90 on (kernels/step/pdl.py)
        src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in const}}, constexprs=const)
        try:
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=k.NUM_WARPS))
        except RuntimeError as exc:  # no ptxas for this target in this Triton
            pytest.skip(f"Triton cannot compile for sm_{arch} here: {exc}")
        assert compiled.asm.get("cubin"), (fn.__name__, arch)
        ptx = compiled.asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == (arch >= 90), (fn.__name__, arch)
        for op in ("wgmma", "cp.async.bulk", "setmaxnreg", "tcgen05"):
            assert op not in ptx, (fn.__name__, arch, op)


# ---------------------------------------------------------------------------------------------------------------
# GPU: full shape, compiled
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: CASE_ID(*c))
def test_gpu_mhc_kernels_full_shape(case):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: GPU kernel tests run on the H200 (pytest -m gpu)")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: GPU tests need compiled kernels")
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's fp32 products in fp32, whatever ran before
    try:
        res = measure(case, "cuda", seed=100 + case[2])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    print(case, json.dumps(res))
    check(case, res)


@pytest.mark.gpu
def test_gpu_live_rows_are_the_full_launch_and_the_rest_zero():
    """The twin of the interpreted `rows=` test at the release's shape and bucket (B 16), compiled."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from step_harness import need_compiled_cuda

    need_compiled_cuda()
    res = measure_rows(GPU_ROWS_CASE, "cuda", seed=21)
    check_rows(GPU_ROWS_CASE, res)


@pytest.mark.gpu
def test_gpu_live_rows_under_cuda_graph_capture():
    """`rows=k` captured in a CUDA graph (the padding rows' zeros included) and replayed on new inputs: the eager
    launch's bits, the tail zero."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from step_harness import need_compiled_cuda

    need_compiled_cuda()
    hc, d, B, iters, dtype, splits = GPU_ROWS_CASE
    k = 5
    t = _inputs(hc, d, B, getattr(torch, dtype), "cuda", 31)
    _run_rows(t, iters, splits, k)  # compile and allocate the counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run_rows(t, iters, splits, k)
    fresh = _inputs(hc, d, B, getattr(torch, dtype), "cuda", 32)
    for name, v in fresh.items():
        t[name].copy_(v)
    for name in out:
        out[name].fill_(1)  # the replay must zero the tail again
    graph.replay()
    torch.cuda.synchronize()
    eager = _run_rows(fresh, iters, splits, k)
    for name in out:
        assert torch.equal(out[name][:k], eager[name][:k]), name
        assert _is_zero(out[name][k:]), name


@pytest.mark.gpu
def test_gpu_mhc_kernel_times():
    """Not a bound: device time per launch (do_bench median, 4 rotated input sets) at the release's shape, B 1 and 16,
    and a splits sweep of the fused site; printed (pytest -s) for docs/perf/fast_path.md "mHC kernels"."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: GPU kernel tests run on the H200 (pytest -m gpu)")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: GPU tests need compiled kernels")
    from triton.testing import do_bench

    from dsv41.kernels.step import mhc as k

    rows = []
    for B in (1, 16):
        sets = [_inputs(4, 5120, B, torch.bfloat16, "cuda", seed) for seed in range(4)]
        at = [0]

        def nxt():
            at[0] = (at[0] + 1) % len(sets)
            return sets[at[0]]

        def site(splits=None):
            t = nxt()
            k.hc_site(t["x"], t["fn"].t(), t["base"], t["scale"], t["pre_in"], t["w"], iters=20, splits=splits, **EPS)

        def expand_site(splits=None):
            t = nxt()
            k.hc_expand_site(t["y"], t["x"], t["post"], t["comb"], t["fn"].t(), t["base"], t["scale"], t["pre_in"],
                             t["w"], iters=20, splits=splits, **EPS)

        def expand():
            t = nxt()
            k.hc_expand(t["y"], t["x"], t["post"], t["comb"])

        def final():
            t = nxt()
            k.collapse_norm(t["x"], t["pre_in"], t["w"], rms_eps=EPS["rms_eps"])

        for name, fn in (("hc_site", site), ("hc_expand_site", expand_site), ("hc_expand", expand),
                         ("collapse_norm", final)):
            rows.append((name, B, "default", do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3))
        for splits in (1, 4, 8, 16, 32):
            rows.append(("hc_expand_site", B, splits,
                         do_bench(lambda: expand_site(splits), warmup=10, rep=50, return_mode="median") * 1e3))
    print("\nkernel            B  splits   us (median)")
    for name, B, splits, us in rows:
        print(f"{name:16s} {B:3d}  {str(splits):7s} {us:8.1f}")
    assert all(us > 0 for *_, us in rows)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    _interp_worker(sys.argv[2])
