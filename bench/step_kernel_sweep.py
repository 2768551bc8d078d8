"""Time two decode-step kernels over a sweep of launch configurations at the release's shapes, to pick defaults:
the mHC sites (kernels/step/mhc.py `hc_expand_site` / `hc_site`, their `splits=`) and the MoE router
(kernels/step/router.py `route_rows`, its block_e / block_d / d_splits / num_warps).

Shapes (runtime/synthetic.py `real_config`, the full-shape rank of bench/decode_step.py): mHC hc = 4 streams of
d = hidden_size in bf16, fn_t fp32 [hc d, (2 + hc) hc] as the loader holds it (a transposed view), Sinkhorn
iters = hc_sinkhorn_iters, a 16-row bucket with 1 or 16 live rows (`rows=`); the router d = hidden_size,
E = n_routed_experts, k = num_experts_per_tok, the gate as FusedMoE hands it over (the stored [E, d] bf16 matrix,
transposed view), on the first 1 or 16 rows of the bucket (FusedMoE routes x[:n]).

Timing (CUDA): device µs per call, `attention_sweep.timed` (calls captured in one CUDA graph, the replay timed
with events, median of 5 replays): the launcher's host Python stays out, as in the decode step's graphs. The weights
are cold, as in a step that streams gigabytes between two calls of a kernel: the captured calls cycle through
copies of the mixing matrix / gate adding up to COLD_BYTES, past the L2 (a hot-L2 time flatters the kernels that
stream a matrix: fn_t is 2 MB, the gate 3.9 MB). CPU
(`--tiny`): tiny shapes in Triton's interpreter, wall clock, a few configurations: a smoke run of the script.

Every configuration's outputs are checked against the default configuration's (another split / tile only changes
the fp32 reduction order): mHC x' bit-equal, h within one bf16 ulp, pre / post / comb within 1e-4 relative; router
logits within 1e-5 relative, ids equal except on rows where the default's top-k margin is a near-tie (recorded, not
failed), weights within fp32 rounding on the rows whose ids agree. Also recorded: whether the first row's bits are
the same with 1 and with 16 rows (the row-invariance the kernels promise).

    H200: PYTHONPATH=$PWD/src:$PWD/bench python bench/step_kernel_sweep.py [--out bench/results/step_kernel_sweep.json]
    CPU:  python bench/step_kernel_sweep.py --tiny --out /tmp/sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if "--tiny" in sys.argv:  # the kernels on the CPU run in Triton's interpreter: set before Triton decorates them
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from dsv41.kernels.step import mhc as step_mhc  # noqa: E402
from dsv41.kernels.step import router as step_router  # noqa: E402
from dsv41.runtime.synthetic import real_config  # noqa: E402

MHC_BLOCK = step_mhc.BLOCK_D  # a split needs at least one column block of the mixing loop
MHC_SPLITS = (4, 8, 16, 32, 64, 128)
MHC_WARPS = (1, 2, 4)
COLD_BYTES = 160 << 20  # weights a timed graph cycles through: over the H200's 50 MB L2, as in a real step
ROUTER_SWEEP = dict(block_e=(8, 16, 32, 64), d_splits=(4, 8, 16, 32), block_d=(64, 128), num_warps=(2, 4))
ROUTER_DEFAULT = dict(block_e=step_router.BLOCK_E, block_d=step_router.BLOCK_D, d_splits=step_router.D_SPLITS,
                      num_warps=4)
TINY = dict(d=256, E=16, k=2, B=4, mhc_splits=(4, 8),
            router=[dict(block_e=8, block_d=64, d_splits=4, num_warps=2),
                    dict(block_e=32, block_d=64, d_splits=2, num_warps=4)])


def wall_timed(fn, iters: int = 1, reps: int = 2) -> float:
    """Wall-clock µs per call (the interpreter: synchronous), median of `reps` after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are zero)."""
    scale = float(b.double().abs().max()) if b.numel() else 0.0
    diff = float((a.double() - b.double()).abs().max()) if b.numel() else 0.0
    return diff / scale if scale else diff


# ---------------------------------------------------------------------------------------------------------------
# mHC sites
# ---------------------------------------------------------------------------------------------------------------


def mhc_inputs(cfg, d: int, B: int, device):
    g = torch.Generator(device=device).manual_seed(0)
    hc = cfg.hc_mult
    mix = (2 + hc) * hc

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device)

    comb = torch.rand(B, hc, hc, generator=g, device=device) + 0.1
    comb = comb / comb.sum(dim=1, keepdim=True)  # columns sum to one, as Sinkhorn leaves them
    return dict(y=rnd(B, d).bfloat16(), x=rnd(B, hc, d).bfloat16(), post=2 * torch.sigmoid(rnd(B, hc)), comb=comb,
                fn_t=(rnd(mix, hc * d) * (hc * d) ** -0.5).t(), base=rnd(mix) * 0.5,
                scale=torch.rand(3, generator=g, device=device) + 0.5, pre_in=torch.sigmoid(rnd(B, hc)) + cfg.hc_eps,
                norm_weight=rnd(d) * 0.1 + 1.0)


def cold_copies(t: torch.Tensor, cold: bool) -> list:
    """`t` and enough copies of it (same strides) to add up to COLD_BYTES: what a timed graph cycles through."""
    if not cold:
        return [t]
    n = max(1, _cdiv(COLD_BYTES, t.untyped_storage().nbytes()))
    return [t] + [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
                  for _ in range(n - 1)]


def cycling(fn, copies: list):
    """`(call, iters)`: call() runs fn on the next copy; iters, one capture's calls, covers every copy once."""
    at = [0]

    def call():
        at[0] = (at[0] + 1) % len(copies)
        return fn(copies[at[0]])
    return call, max(20, len(copies))


def measure_config(entries: dict, config: dict, rows_list, timer, copies: list, call, check) -> None:
    """One configuration at every row count: `call(rows, copy)` run once for its outputs (judged by
    `check(rows, outputs)`) and timed over the weight `copies`; appended to `entries[rows]`, with whether the first
    row's bits are the same at the fewest and the most rows."""
    got = {}
    for r in rows_list:
        try:
            got[r] = call(r)
            timed, iters = cycling(lambda c: call(r, c), copies)
            us, verdict = timer(timed, iters), check(r, got[r])
        except Exception as e:  # noqa: BLE001 - a configuration that fails is a row of the table
            us, verdict = float("nan"), {"ok": False, "error": repr(e)[:200]}
        entries[r].append({"config": config, "us": us, "check": verdict})
    if len(got) == len(rows_list):
        lo, hi = min(rows_list), max(rows_list)
        same = all(torch.equal(a[:lo], b[:lo]) for a, b in zip(got[lo], got[hi]))
        for r in rows_list:
            entries[r][-1]["check"]["row_invariant"] = same


def mhc_call(kernel: str, inp: dict, cfg, splits, rows, num_warps=None, fn_t=None):
    kw = dict(norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, iters=cfg.hc_sinkhorn_iters, rms_eps=cfg.rms_norm_eps,
              splits=splits, rows=rows, num_warps=num_warps)
    tail = (inp["fn_t"] if fn_t is None else fn_t, inp["base"], inp["scale"], inp["pre_in"], inp["norm_weight"])
    if kernel == "hc_expand_site":
        return step_mhc.hc_expand_site(inp["y"], inp["x"], inp["post"], inp["comb"], *tail, **kw)
    return step_mhc.hc_site(inp["x"], *tail, **kw)


def mhc_check(got, ref, kernel: str) -> dict:
    if kernel == "hc_expand_site":
        xo_equal = bool(torch.equal(got[0], ref[0]))
        got, ref = got[1:], ref[1:]
    else:
        xo_equal = True
    h, h0 = got[0].float(), ref[0].float()
    ulp = torch.where(h0 == 0, torch.full_like(h0, 2.0 ** -133), h0.abs() * 2.0 ** -7)  # 1 to 2 bf16 ulps
    h_ulps = float(((h - h0).abs() / ulp).max())
    coeff = max(_rel(a, b) for a, b in zip(got[1:], ref[1:]))
    return {"x_equal": xo_equal, "h_max_bf16_ulps": h_ulps, "coeff_rel": coeff,
            "ok": xo_equal and h_ulps <= 1.0 and coeff <= 1e-4}


def sweep_mhc(cfg, d: int, B: int, rows_list, splits_list, device, timer, warps_list=(None,)) -> list:
    inp = mhc_inputs(cfg, d, B, device)
    fns = cold_copies(inp["fn_t"], device.type == "cuda")
    default = step_mhc.default_splits(d)
    cands = [(s, w) for s in sorted({s for s in splits_list if s * MHC_BLOCK <= d} | {default}) for w in warps_list]
    if (default, step_mhc.NUM_WARPS) not in cands and None not in warps_list:
        cands.insert(0, (default, step_mhc.NUM_WARPS))
    out = []
    for kernel in ("hc_expand_site", "hc_site"):
        ref = {r: mhc_call(kernel, inp, cfg, None, r) for r in rows_list}
        entries = {r: [] for r in rows_list}
        for splits, warps in cands:
            chunk = _cdiv(_cdiv(d, splits), MHC_BLOCK) * MHC_BLOCK  # as the launcher sizes a split
            config = {"splits": splits, "num_warps": warps or step_mhc.NUM_WARPS, "used_splits": _cdiv(d, chunk),
                      "default": splits == default and (warps or step_mhc.NUM_WARPS) == step_mhc.NUM_WARPS}
            measure_config(entries, config, rows_list, timer, fns,
                           lambda r, f=None: mhc_call(kernel, inp, cfg, splits, r, warps, f),
                           lambda r, got: mhc_check(got, ref[r], kernel))
        shape = {"B": B, "hc": cfg.hc_mult, "d": d, "dtype": "bfloat16", "iters": cfg.hc_sinkhorn_iters}
        out += [{"kernel": kernel, "shape": shape, "rows": r, "configs": entries[r]} for r in rows_list]
    return out


# ---------------------------------------------------------------------------------------------------------------
# router
# ---------------------------------------------------------------------------------------------------------------


def router_configs(d: int, tiny: bool) -> list[dict]:
    """The swept knobs, without the combos that give a d split no chunk at all (more splits than chunks); the
    default first."""
    if tiny:
        cands = TINY["router"]
    else:
        cands = [dict(block_e=be, block_d=bd, d_splits=ds, num_warps=w) for be in ROUTER_SWEEP["block_e"]
                 for bd in ROUTER_SWEEP["block_d"] for ds in ROUTER_SWEEP["d_splits"]
                 for w in ROUTER_SWEEP["num_warps"]]
    keep = [c for c in cands if c["d_splits"] <= _cdiv(d, c["block_d"]) and c != ROUTER_DEFAULT]
    return [ROUTER_DEFAULT] + keep


def router_inputs(d: int, E: int, B: int, device):
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(B, d, generator=g, device=device).bfloat16()
    gate = (torch.randn(E, d, generator=g, device=device) * 2 * d ** -0.5).bfloat16()  # the stored [E, d]
    bias = torch.randn(E, generator=g, device=device) * 0.3
    return x, gate.t(), bias


def router_check(got, ref, k: int) -> dict:
    ids, w, logits, select = got
    ids0, w0, logits0, select0 = ref
    drift = float((select.double() - select0.double()).abs().max())
    top = torch.sort(select0.double(), dim=-1, descending=True).values
    margin = top[:, k - 1] - top[:, k] if top.shape[1] > k else torch.full_like(top[:, 0], float("inf"))
    near_tie = margin <= 10 * drift + 1e-6
    differ = (ids != ids0).any(dim=1)
    agree = ~differ
    w_ok = bool(torch.allclose(w[agree], w0[agree], rtol=1e-5, atol=1e-7))
    logits_rel = _rel(logits, logits0)
    return {"logits_rel": logits_rel, "weights_rel": _rel(w[agree], w0[agree]) if bool(agree.any()) else 0.0,
            "ids_mismatch_rows": int(differ.sum()), "ids_mismatch_near_tie": int((differ & near_tie).sum()),
            "ids_equal": not bool(differ.any()),
            "ok": logits_rel <= 1e-5 and w_ok and not bool((differ & ~near_tie).any())}


def sweep_router(cfg, d: int, E: int, k: int, B: int, rows_list, device, timer, tiny: bool) -> list:
    x, gate_t, bias = router_inputs(d, E, B, device)
    kw = dict(scale=cfg.routed_scaling_factor, renorm=cfg.norm_topk_prob, temp=cfg.gate_temp)

    gates = cold_copies(gate_t, device.type == "cuda")

    def call(r, knobs, gate=gate_t):
        return step_router.route_rows(x[:r], gate, bias, k, **kw, **knobs)

    ref = {r: call(r, ROUTER_DEFAULT) for r in rows_list}
    entries = {r: [] for r in rows_list}
    for knobs in router_configs(d, tiny):
        chunks = _cdiv(d, knobs["block_d"])
        config = dict(knobs, used_splits=_cdiv(chunks, _cdiv(chunks, knobs["d_splits"])),
                      default=knobs == ROUTER_DEFAULT)
        measure_config(entries, config, rows_list, timer, gates,
                       lambda r, g=gate_t: call(r, knobs, g), lambda r, got: router_check(got, ref[r], k))
    shape = {"d": d, "E": E, "k": k, "gate": f"{gate_t.dtype} [d, E] view of the stored [E, d]", "x": str(x.dtype)}
    return [{"kernel": "route_rows", "shape": shape, "rows": r, "configs": entries[r]} for r in rows_list]


# ---------------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------------


def _knobs(config: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items() if k not in ("default", "used_splits"))


def best_of(results: list) -> list:
    """Per (kernel, rows): the fastest configuration whose check passed, beside the default's time. Per kernel
    (`rows`: "all"): the one fastest summed over the row counts, since a configuration may not depend on B."""
    best = []
    by_kernel: dict[str, list] = {}
    for res in results:
        by_kernel.setdefault(res["kernel"], []).append(res)
        ok = [c for c in res["configs"] if c["check"].get("ok") and c["us"] == c["us"]]
        default = next(c for c in res["configs"] if c["config"]["default"])
        if ok:
            top = min(ok, key=lambda c: c["us"])
            best.append({"kernel": res["kernel"], "rows": res["rows"], "config": top["config"], "us": top["us"],
                         "default_us": default["us"], "speedup": default["us"] / top["us"]})
    for kernel, group in by_kernel.items():
        total: dict[str, list] = {}
        for res in group:
            for c in res["configs"]:
                total.setdefault(_knobs(c["config"]), []).append(c)
        whole = {key: cs for key, cs in total.items() if len(cs) == len(group)
                 and all(c["check"].get("ok") and c["us"] == c["us"] for c in cs)}
        if whole:
            key = min(whole, key=lambda key: sum(c["us"] for c in whole[key]))
            default = next(cs for cs in total.values() if cs[0]["config"]["default"])
            us, default_us = sum(c["us"] for c in whole[key]), sum(c["us"] for c in default)
            best.append({"kernel": kernel, "rows": "all", "config": whole[key][0]["config"], "us": us,
                         "default_us": default_us, "speedup": default_us / us})
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "results" / "step_kernel_sweep.json")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, Triton's interpreter, a few configurations")
    p.add_argument("--device", default=None, help="default: cpu with --tiny, else cuda")
    p.add_argument("--only", choices=("mhc", "router"), default=None, help="one kernel's sweep only")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    cuda = device.type == "cuda"
    if cuda:
        from attention_sweep import timed as timer
    else:
        timer = wall_timed
        torch.set_num_threads(1)
    cfg = real_config()
    if args.tiny:
        d, E, k, B, splits = TINY["d"], TINY["E"], TINY["k"], TINY["B"], TINY["mhc_splits"]
    else:
        d, E, k, B, splits = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, 16, MHC_SPLITS
    rows_list = (1, B)
    commit = os.environ.get("BENCH_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                                                              capture_output=True, text=True).stdout.strip()
    import triton

    t0 = time.perf_counter()
    results = []
    if args.only in (None, "mhc"):
        results += sweep_mhc(cfg, d, B, rows_list, splits, device, timer, (None,) if args.tiny else MHC_WARPS)
    if args.only in (None, "router"):
        results += sweep_router(cfg, d, E, k, B, rows_list, device, timer, args.tiny)
    report = {"commit": commit or "unknown", "device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "torch": torch.__version__, "triton": triton.__version__,
              "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
              "timer": "cuda graph of >= 20 calls cycling through cold weight copies, replay timed by events, "
                       "median of 5" if cuda
              else "wall clock per call (interpreter), median of 2",
              "args": {key: (str(v) if isinstance(v, Path) else v) for key, v in vars(args).items()},
              "wall_s": time.perf_counter() - t0, "results": results, "best": best_of(results)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    for res in results:
        print(f"\n{res['kernel']} rows={res['rows']} {res['shape']}")
        for c in res["configs"]:
            chk = c["check"]
            flag = "ok" if chk.get("ok") else "FAIL " + str(chk.get("error", chk))
            print(f"  {_knobs(c['config']):<50s}{' *' if c['config']['default'] else '  '} {c['us']:10.1f} us  {flag}")
    print(f"\nbest (* = default; {report['wall_s']:.0f} s in all):")
    for b in report["best"]:
        print(f"  {b['kernel']:<15s} rows={str(b['rows']):<4s} {_knobs(b['config']):<50s} {b['us']:9.1f} us "
              f"(default {b['default_us']:.1f} us, x{b['speedup']:.2f})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
