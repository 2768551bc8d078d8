"""The compressor's pooling + RMSNorm kernel (dsv41.kernels.step.compress) against the reference composition of
`dsv41.model.attention.Attention._compress`: pooled = (softmax(gs.float(), dim=1) * gv.float()).sum(1), latent =
`dsv41.model.norm.rms_norm(pooled.to(out_dtype), weight, eps)`.

Tolerances (why):
- Pooling (`norm_weight=None`): the kernel's exp (Triton's; numpy's in the interpreter), its softmax division
  (`div_rn`; torch may multiply by the reciprocal) and its member-order sums each round within an ulp of torch's,
  so an fp32 pooled value is within POOL_ULPS fp32 ulps of sum_j |p_j v_j| (the scale of the sum: where the
  members cancel, the error is relative to the terms, not the result). A bf16 pooled value moves only when its fp32
  value lies that close to a rounding boundary: by one ulp, on at most FLIP_FRACTION of the elements.
- The norm: for an even width, the latent is `rowops.rms_norm_rows` of the kernel's own pooled values bit for bit
  (the same tile layout, reduction tree and warps); rowops' norm is within an ulp or two of torch's fp32 factor
  (tests/test_kernels_step_rowops.py).
- End to end, bf16: at most one ulp where the pooled bf16 value equals the reference's (only the norm's fp32 factor
  differs, by an ulp or two); where the pooled value itself moved by its one ulp, at most two (an ulp of the
  input is up to two of the output when the weight carries it across a binade); nonzero on at most FLIP_FRACTION
  of the elements. fp32: within NORM_ULPS ulps of (scale * rsqrt factor * |w| + |latent|).
- Bitwise: rows=k gives the full launch's rows [0, k) and +0.0 below; a row's bits are the same alone and among
  others in any order; `close_norm_rows` (members gathered in the load through back_row / back_open tables, the
  in-place path) equals `pool_norm_rows` on the same members gathered by torch (the load-and-store path).
CPU: the interpreter in a child process (tests/step_harness.py); GPU: the release's shape (head_dim 512, r = 2).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from step_harness import interpreted, need_compiled_cuda  # noqa: E402

EPS = 1e-6
POOL_ULPS = 8
NORM_ULPS = 8
FLIP_FRACTION = 0.02
FP32 = torch.finfo(torch.float32).eps
# (name, r, C, input dtype, output dtype, weight dtype): the tiny model's width (head_dim 128) and an odd one
CASES = (("r2_tiny", 2, 128, torch.float32, torch.bfloat16, torch.float32),
         ("r4_odd", 4, 75, torch.float32, torch.bfloat16, torch.bfloat16),
         ("r2_fp32_out", 2, 128, torch.float32, torch.float32, torch.float32),
         ("r4_bf16_in", 4, 96, torch.bfloat16, torch.bfloat16, torch.float32))
ROWS = 6


def _inputs(R: int, r: int, C: int, dtype, wdtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 97 * r + C)
    vscale = torch.tensor([0.05, 1.0, 8.0])[torch.randint(0, 3, (R, 1, 1), generator=g)]
    sscale = torch.tensor([0.1, 2.0, 30.0])[torch.randint(0, 3, (R, 1, 1), generator=g)]  # up to saturated softmax
    gv = (torch.randn(R, r, C, generator=g) * vscale).to(dtype)
    gs = (torch.randn(R, r, C, generator=g) * sscale).to(dtype)
    w = (1.0 + 0.1 * torch.randn(C, generator=g)).to(wdtype)
    return gv, gs, w


def _reference(gv, gs, w, out_dtype):
    from dsv41.model.norm import rms_norm

    p = torch.softmax(gs.float(), dim=1)
    pooled = (p * gv.float()).sum(1)
    scale = (p * gv.float()).abs().sum(1)
    latent = rms_norm(pooled.to(out_dtype), w, EPS)
    q = pooled.to(out_dtype).float()
    factor = torch.rsqrt(q.pow(2).mean(-1, keepdim=True).double() + EPS).float()
    return pooled, scale, latent, factor


def _gather_case(n: int, r: int, C: int, seed: int = 5):
    """Step rows v, s [n, C], an open store [slots, r - 1, 2, C] and tables as runtime/step_tables.py builds them
    for one sequence at position `start` (slot 1): member d back is the step's row i - d when i >= d, else the open
    store's row for position pos - d."""
    g = torch.Generator().manual_seed(seed)
    v, s = torch.randn(n, C, generator=g) * 3, torch.randn(n, C, generator=g) * 5
    store = torch.randn(3, r - 1, 2, C, generator=g)
    start, slot = 5, 1
    i = torch.arange(n)
    back_row = torch.stack([torch.where(i >= d, i - d, -1) for d in range(1, r)])
    back_open = torch.stack([slot * (r - 1) + ((start + i - d) % r).clamp(max=r - 2) for d in range(1, r)])
    return v, s, store, back_row, back_open


def _torch_gather(v, s, store, back_row, back_open, r):
    """The in-place path's members gathered by torch (what `_close_groups` ran before the gather kernel)."""
    flat = store.view(-1, 2, store.shape[-1])
    mv, ms = [], []
    for d in range(r - 1, 0, -1):
        here = back_row[d - 1]
        inside = (here >= 0)[:, None]
        mv.append(torch.where(inside, v[here.clamp(min=0)], flat[back_open[d - 1], 0]))
        ms.append(torch.where(inside, s[here.clamp(min=0)], flat[back_open[d - 1], 1]))
    return torch.stack(mv + [v], dim=1), torch.stack(ms + [s], dim=1)


def _run(device: str) -> dict:
    from dsv41.kernels.step.compress import close_norm_rows, pool_norm_rows
    from dsv41.kernels.step.rowops import rms_norm_rows

    out = {}
    for name, r, C, dt, odt, wdt in CASES:
        gv, gs, w = (t.to(device) for t in _inputs(ROWS, r, C, dt, wdt))
        full = pool_norm_rows(gv, gs, w, EPS, odt)
        pooled = pool_norm_rows(gv, gs, None, EPS, odt)
        perm = torch.randperm(ROWS, generator=torch.Generator().manual_seed(1)).to(device)
        res = dict(full=full, pooled=pooled, perm=perm, shuffled=pool_norm_rows(gv[perm], gs[perm], w, EPS, odt),
                   alone=torch.cat([pool_norm_rows(gv[i:i + 1], gs[i:i + 1], w, EPS, odt) for i in range(ROWS)]),
                   live={k: pool_norm_rows(gv, gs, w, EPS, odt, rows=k) for k in (0, 1, ROWS - 1)})
        if C % 2 == 0:
            res["rowops"] = rms_norm_rows(pooled, w, EPS, odt)
        out[name] = {k: ({a: b.cpu() for a, b in v.items()} if isinstance(v, dict) else v.cpu())
                     for k, v in res.items()}
    for r in (2, 4):
        v, s, store, br, bo = (t.to(device) for t in _gather_case(7, r, 128))
        w = _inputs(1, r, 128, torch.float32, torch.float32)[2].to(device)
        gv, gs = _torch_gather(v, s, store, br, bo, r)
        out[f"gather{r}"] = dict(pool=pool_norm_rows(gv, gs, w, EPS, torch.bfloat16).cpu(),
                                 close=close_norm_rows(v, s, store, br, bo, w, EPS, torch.bfloat16).cpu(),
                                 live=close_norm_rows(v, s, store, br, bo, w, EPS, torch.bfloat16, rows=3).cpu())
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16).int() if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _check_case(res: dict, r: int, C: int, dt, odt, wdt, R: int = ROWS, seed: int = 0) -> None:
    gv, gs, w = _inputs(R, r, C, dt, wdt, seed)
    pooled_ref, scale, ref, factor = _reference(gv, gs, w, odt)
    full, pooled = res["full"], res["pooled"]
    assert full.dtype == odt and full.shape == (R, C) and pooled.shape == (R, C)
    if odt == torch.float32:
        assert ((pooled - pooled_ref).abs() <= POOL_ULPS * FP32 * scale).all(), (pooled - pooled_ref).abs().max()
        bound = NORM_ULPS * FP32 * (scale * factor * w.float().abs() + ref.abs())
        assert ((full - ref).abs() <= bound).all(), (full - ref).abs().max()
    else:
        dp = (_bits(pooled) - _bits(pooled_ref.to(odt))).abs()
        assert dp.max() <= 1 and (dp != 0).float().mean() <= FLIP_FRACTION, (dp.max(), (dp != 0).float().mean())
        d = (_bits(full) - _bits(ref)).abs()
        assert (d[dp == 0] <= 1).all() and (d <= 2).all(), d.max()
        assert (d != 0).float().mean() <= FLIP_FRACTION, (d != 0).float().mean()
    if "rowops" in res:
        assert torch.equal(_bits(full), _bits(res["rowops"]))
    assert torch.equal(_bits(res["alone"]), _bits(full))
    assert torch.equal(_bits(res["shuffled"]), _bits(full[res["perm"]]))
    for k, v in res["live"].items():
        assert torch.equal(_bits(v[:k]), _bits(full[:k])), k
        assert (_bits(v[k:]) == 0).all(), k  # +0.0: every bit zero


def _interp_worker(out_path: str) -> None:
    torch.save(_run("cpu"), out_path)


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "compress", timeout=600)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpreted_pool_norm_matches_the_reference_rows_alone_and_live(interp, case):
    name, r, C, dt, odt, wdt = case
    _check_case(interp[name], r, C, dt, odt, wdt)


@pytest.mark.parametrize("r", [2, 4])
def test_interpreted_gather_in_the_load_is_the_stacked_members_bits(interp, r):
    res = interp[f"gather{r}"]
    assert torch.equal(_bits(res["close"]), _bits(res["pool"]))
    assert torch.equal(_bits(res["live"][:3]), _bits(res["pool"][:3])) and (_bits(res["live"][3:]) == 0).all()


def test_bad_inputs_are_refused():
    from dsv41.kernels.step.compress import close_norm_rows, pool_norm_rows

    gv, w = torch.zeros(3, 2, 8), torch.ones(8)
    bad = [
        (lambda: pool_norm_rows(gv, torch.zeros(3, 2, 6), w, EPS, torch.bfloat16), "gv and gs"),
        (lambda: pool_norm_rows(gv, gv.bfloat16(), w, EPS, torch.bfloat16), "gv and gs"),
        (lambda: pool_norm_rows(gv[0], gv[0], w, EPS, torch.bfloat16), "gv and gs"),
        (lambda: pool_norm_rows(gv[:, :0], gv[:, :0], w, EPS, torch.bfloat16), "r >= 1"),
        (lambda: pool_norm_rows(gv.double(), gv.double(), w, EPS, torch.bfloat16), "gv and gs must be bf16"),
        (lambda: pool_norm_rows(gv, gv, torch.ones(4), EPS, torch.bfloat16), "norm_weight"),
        (lambda: pool_norm_rows(gv, gv, w, EPS, torch.int32), "out_dtype"),
        (lambda: pool_norm_rows(gv, gv, w, EPS, torch.bfloat16, rows=4), "rows"),
        (lambda: pool_norm_rows(gv, gv, w, EPS, torch.bfloat16, rows=-1), "rows"),
    ]
    v, s, store, br, bo = _gather_case(4, 2, 8)
    bad += [
        (lambda: close_norm_rows(v, s[:, :4], store, br, bo, w, EPS, torch.bfloat16), "v and s"),
        (lambda: close_norm_rows(v, s, store[..., :4], br, bo, w, EPS, torch.bfloat16), "open_store"),
        (lambda: close_norm_rows(v, s, store.bfloat16(), br, bo, w, EPS, torch.bfloat16), "open_store"),
        (lambda: close_norm_rows(v, s, store, br[:, :2], bo[:, :2], w, EPS, torch.bfloat16), "back_row"),
        (lambda: close_norm_rows(v, s, store, br.float(), bo, w, EPS, torch.bfloat16), "back_row"),
        (lambda: close_norm_rows(v, s, store, br, bo[:, :3], w, EPS, torch.bfloat16), "back_row and back_open"),
        (lambda: close_norm_rows(v, s, store, br, bo, w[:4], EPS, torch.bfloat16), "norm_weight"),
        (lambda: close_norm_rows(v, s, store, br, bo, w, EPS, torch.bfloat16, rows=5), "rows"),
    ]
    for call, match in bad:
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.parametrize("arch", [80, 90, 121])
def test_kernel_compiles_for_every_target(arch):
    """Ahead-of-time compile (Triton's own ptxas, no GPU) of both member modes at the release's constants (r 2,
    head_dim 512: 16 x 16 tiles, 4 warps), fp32 members, bf16 latent: a cubin each."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from dsv41.kernels.step import compress as k

    if not isinstance(k._pool_norm_kernel, JITFunction):
        pytest.skip("kernels decorated for the interpreter in this process")
    for gather in (False, True):
        tab = "*i64" if gather else "*fp32"
        sig = dict(v_ptr="*fp32", s_ptr="*fp32", sv_r="i32", sv_m="i32", ss_r="i32", ss_m="i32", o_ptr="*fp32",
                   so_r="i32", so_k="i32", br_ptr=tab, bo_ptr=tab, sb="i32", out_ptr="*bf16", w_ptr="*fp32",
                   eps="fp32", C="i32", live_rows="i32")
        const = dict(RATIO=2, GATHER=gather, NORM=True, NB=16, HB=16, OUT=tl.bfloat16, PDL=arch >= 90)
        src = ASTSource(fn=k._pool_norm_kernel, signature={**sig, **{c: "constexpr" for c in const}}, constexprs=const)
        try:
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                      options=dict(num_warps=4, enable_fp_fusion=False))
        except RuntimeError as exc:  # no ptxas for this target in this Triton
            pytest.skip(f"Triton cannot compile for sm_{arch} here: {exc}")
        assert compiled.asm.get("cubin"), (gather, arch)
        assert ("griddepcontrol.wait" in compiled.asm["ptx"]) == (arch >= 90), (gather, arch)


@pytest.mark.gpu
def test_gpu_pool_norm_release_shape():
    """The release's compressor (head_dim 512, the same on every TP rank; r = 2), fp32 members as `project` makes
    them, bf16 latent, a 16-row bucket, compiled: the reference bounds, rowops' norm bits, rows=, and the in-place
    gather's bits equal to the stacked members' (what keeps `attend_pool` == `attend` on the GPU)."""
    need_compiled_cuda()
    from dsv41.kernels.step.compress import close_norm_rows, pool_norm_rows
    from dsv41.kernels.step.rowops import rms_norm_rows

    R, r, C = 16, 2, 512
    gv, gs, w = _inputs(R, r, C, torch.float32, torch.float32, seed=3)
    cv, cs, cw = gv.cuda(), gs.cuda(), w.cuda()
    full = pool_norm_rows(cv, cs, cw, EPS, torch.bfloat16)
    pooled = pool_norm_rows(cv, cs, None, EPS, torch.bfloat16)
    perm = torch.randperm(R, generator=torch.Generator().manual_seed(1)).cuda()
    res = dict(full=full.cpu(), pooled=pooled.cpu(), rowops=rms_norm_rows(pooled, cw, EPS).cpu(), perm=perm.cpu(),
               shuffled=pool_norm_rows(cv[perm], cs[perm], cw, EPS, torch.bfloat16).cpu(),
               alone=torch.cat([pool_norm_rows(cv[i:i + 1], cs[i:i + 1], cw, EPS, torch.bfloat16)
                                for i in range(R)]).cpu(),
               live={k: pool_norm_rows(cv, cs, cw, EPS, torch.bfloat16, rows=k).cpu() for k in (0, 1, R - 1)})
    _check_case(res, r, C, torch.float32, torch.bfloat16, torch.float32, R=R, seed=3)
    v, s, store, br, bo = (t.cuda() for t in _gather_case(R, r, C))
    gv2, gs2 = _torch_gather(v, s, store, br, bo, r)
    assert torch.equal(_bits(close_norm_rows(v, s, store, br, bo, cw, EPS, torch.bfloat16).cpu()),
                       _bits(pool_norm_rows(gv2, gs2, cw, EPS, torch.bfloat16).cpu()))


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    _interp_worker(sys.argv[2])
