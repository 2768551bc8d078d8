"""Where the CUDA EXL3 matmul spends its time, and a stress run of its launches (H200, one call).

--stress: eager launches of the pack's expert shapes for many (m, splits, dtype) combinations, each repeated and
compared bitwise with its first result, then the benchmark's own graph-timed sequence; prints the first failure.
--ablate: times compile-time variants on the same weights (median of graph replays, weights out of L2):
the full kernel, the decode arithmetic removed (EXL3_ABLATE=1), the main loop removed (2), the split-K reduction
removed (3), other pipeline depths (EXL3_STAGES) and split counts, plus an empty-launch baseline.
--headline: the shapes the issue's goals name and the MoE, for each tuning given with --tuning (A/B in one run),
plus the head's split counts and MoE split configurations.
Writes JSON to --out. Variants 1-3 compute wrong results on purpose; they only time the parts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from exl3_kernels import L2_BYTES, graph_time_us, make_copies, time_dense, time_triton  # noqa: E402

from dsv41.kernels.exl3.cuda import TUNING, decode_cuda, default_splits, fused_matmul_cuda  # noqa: E402
from dsv41.kernels.exl3.matmul import default_config  # noqa: E402


def stress(log) -> dict:
    report = {"eager": [], "sequence": []}
    for K in (2, 3):
        copies = make_copies(5120, 2304, K, 0)
        w = copies[0]
        for splits in (7, 15, 22, 40):
            for m in (1, 2, 3, 4, 5, 8, 9, 16):
                for dtype in (torch.float16, torch.float32):
                    step = f"K={K} splits={splits} m={m} out={dtype}"
                    try:
                        x = torch.randn(m, 5120, device="cuda").half()
                        out = torch.empty(m, 2304, device="cuda", dtype=dtype)
                        first = fused_matmul_cuda(x, w, out_dtype=dtype, splits=splits, out=out).clone()
                        torch.cuda.synchronize()
                        for _ in range(5):
                            again = fused_matmul_cuda(x, w, out_dtype=dtype, splits=splits, out=out)
                            torch.cuda.synchronize()
                            if not torch.equal(again, first):
                                raise AssertionError("repeat differs")
                        report["eager"].append({"step": step, "ok": True})
                    except Exception as exc:
                        log(f"FAIL {step}: {type(exc).__name__}: {exc}")
                        report["eager"].append({"step": step, "ok": False, "error": repr(exc)[:500]})
                        report["fatal"] = step
                        return report
        log(f"eager K={K}: all passed")
    # the benchmark's sequence that failed once: per m, ours (graph) then triton (graph) then dense
    for K in (3, 2):
        copies = make_copies(5120, 2304, K, 4 * L2_BYTES)
        for m in (1, 2, 4, 8, 16):
            for what in ("ours", "triton", "dense"):
                try:
                    if what == "ours":
                        x = torch.randn(m, 5120, device="cuda").half()
                        outs = [torch.empty(m, 2304, device="cuda", dtype=torch.float16) for _ in copies]
                        t = graph_time_us([lambda c=c, o=o: fused_matmul_cuda(x, c, out=o) for c, o in zip(copies, outs)])
                    elif what == "triton":
                        t = time_triton(copies, m, default_config(copies[0]))
                    else:
                        t = time_dense(5120, 2304, m)
                    torch.cuda.synchronize()
                    report["sequence"].append({"K": K, "m": m, "what": what, "us": t})
                except Exception as exc:
                    log(f"FAIL sequence K={K} m={m} {what}: {type(exc).__name__}: {exc}")
                    report["sequence"].append({"K": K, "m": m, "what": what, "error": traceback.format_exc()[-1500:]})
                    report["fatal"] = f"sequence K={K} m={m} {what}"
                    return report
        log(f"sequence K={K}: passed")
    return report


def ablate(log) -> list[dict]:
    rows = []
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    # empty-launch baseline: the smallest kernel launch of this module (one 16x16 tile decode) in a graph
    tiny = make_copies(128, 128, 3, 0)[0]
    t = graph_time_us([lambda: decode_cuda(tiny)] * 24)
    rows.append({"variant": "tiny launch (decode of one 128x128 matrix)", "us": t})
    log(f"tiny launch: {t:.2f} us")
    for k, n, K in ((5120, 2304, 3), (8192, 5120, 5), (5120, 129280, 6)):
        copies = make_copies(k, n, K, 4 * L2_BYTES)
        base_splits = default_splits(k, n, sm)
        variants = [("full", {}, base_splits)]
        variants += [(f"ablate={a}", {"EXL3_ABLATE": a}, base_splits) for a in (1, 2, 3)]
        variants += [(f"STAGES={st}", {"EXL3_STAGES": st}, base_splits) for st in (2, 4)]
        variants += [(f"splits={s}", {}, s) for s in sorted({default_splits(k, n, sm, b) for b in (1, 4, 8)})]
        for name, extra, splits in variants:
            tuning = {**TUNING, **extra}
            for m in (1, 16):
                try:
                    t = time_fused(copies, m, splits=splits, tuning=tuning)
                except Exception as exc:
                    log(f"  {k}x{n} K={K} {name} m={m}: FAILED {type(exc).__name__}: {exc}")
                    continue
                rows.append({"shape": f"{k}x{n}", "K": K, "variant": name, "splits": splits, "m": m, "us": t,
                             "tweights_per_s": k * n / t / 1e6})
                log(f"  {k}x{n} K={K} {name:<18} splits={splits:<3} m={m:<2}: {t:8.1f} us "
                    f"({k * n / t / 1e6:.2f} T weights/s)")
        del copies
        torch.cuda.empty_cache()
    return rows


def repro(log) -> None:
    """The ablation's failing step in small: one shape, graph-timed at m=1 then m=16 (run under compute-sanitizer)."""
    for k, n, K in ((8192, 5120, 5), (5120, 2304, 3)):
        copies = make_copies(k, n, K, L2_BYTES)
        for m in (1, 16, 1, 16):
            x = torch.randn(m, k, device="cuda").half()
            outs = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in copies]
            t = graph_time_us([lambda c=c, o=o: fused_matmul_cuda(x, c, out=o) for c, o in zip(copies, outs)],
                              replays=2)
            torch.cuda.synchronize()
            log(f"repro {k}x{n} K={K} m={m}: {t:.1f} us")


HEADLINE_SHAPES = (("expert gate/up", 5120, 2304, 3, (1, 2, 4, 8, 16)), ("expert down", 2304, 5120, 3, (1, 2, 8)),
                   ("wq_b", 1280, 32768, 5, (1, 2, 4, 8)), ("wo_b", 8192, 5120, 5, (1, 2, 8)),
                   ("head", 5120, 129280, 6, (1, 2, 8, 16)))


def time_fused(copies, m: int, **options) -> float:
    """Graph-timed fused matmul of m fp16 rows over the weight copies (each replay walks all of them)."""
    k, n = copies[0].k, copies[0].n
    x = torch.randn(m, k, device="cuda").half()
    outs = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in copies]
    return graph_time_us([lambda c=c, o=o: fused_matmul_cuda(x, c, out=o, **options)
                          for c, o in zip(copies, outs)] * max(1, 24 // len(copies)))


def try_time(log, label: str, copies, m: int, **options) -> float | None:
    """time_fused, or None (logged) where the launch fails: one failing variant does not end an A/B run."""
    try:
        return time_fused(copies, m, **options)
    except Exception as exc:
        log(f"{label} m={m}: FAILED {type(exc).__name__}: {exc}")
        return None


def headline(log, tunings: list[dict], repeat: int = 1, only: tuple[str, ...] = ()) -> list[dict]:
    """The numbers the issue's goals name, once per tuning (each a set of overrides of TUNING), on the same weights;
    with repeat > 1 the tunings alternate per m (A B A B ...), so that drift between runs does not pose as an effect.
    `only`: shape names to keep (all if empty)."""
    rows = []
    for name, k, n, K, ms in HEADLINE_SHAPES:
        if only and name not in only:
            continue
        copies = make_copies(k, n, K, 4 * L2_BYTES)
        for m, rep, extra in [(m, rep, extra) for m in ms for rep in range(repeat) for extra in tunings]:
            t = try_time(log, f"{name} {extra}", copies, m, tuning={**TUNING, **extra})
            if t is None:
                continue
            rows.append({"shape": f"{k}x{n}", "K": K, "m": m, "tuning": extra, "us": t, "rep": rep,
                         "tweights_per_s": k * n / t / 1e6})
            log(f"{name:<15} {k}x{n} K={K} m={m:<2} {json.dumps(extra):<28} {t:8.1f} us "
                f"({k * n / t / 1e6:.2f} T weights/s)")
        del copies
        torch.cuda.empty_cache()
    return rows


def splits_sweep(log) -> list[dict]:
    """Split counts around default_splits on the wide and the large shapes (m = 1 and 8)."""
    rows = []
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for k, n, K, options, ms in ((5120, 129280, 6, (2, 3, 4), (1, 4, 8, 16)), (1280, 32768, 5, (1, 2), (1, 8)),
                                 (8192, 5120, 5, (6, 7, 13), (1, 8, 16)), (5120, 2304, 3, (13, 14), (1, 8, 16)),
                                 (2304, 5120, 3, (5, 6), (1, 8, 16))):
        copies = make_copies(k, n, K, 4 * L2_BYTES)
        for splits in options:
            for m in ms:
                t = try_time(log, f"{k}x{n} splits={splits}", copies, m, splits=splits)
                if t is None:
                    continue
                rows.append({"shape": f"{k}x{n}", "K": K, "splits": splits, "m": m, "us": t,
                             "default": splits == default_splits(k, n, sm)})
                log(f"{k}x{n} K={K} m={m} splits={splits}: {t:.1f} us ({k * n / t / 1e6:.2f} T weights/s)")
        del copies
        torch.cuda.empty_cache()
    return rows


def moe_ab(log, tunings: list[dict], configs: list[tuple[int, ...]]) -> list[dict]:
    from exl3_kernels import moe_bench

    from dsv41.kernels.exl3.cuda import MoeCudaConfig

    rows = []
    for extra in tunings:
        for cfg in [None] + [MoeCudaConfig(*c) for c in configs]:
            for r in moe_bench(lambda msg: None, cfg=cfg, tuning={**TUNING, **extra}):
                r.update(tuning=extra, config=cfg.__dict__ if cfg else "default")
                rows.append(r)
                log(f"MoE rows={r['rows']} {json.dumps(extra):<28} config={r['config']}: {r['ours_us']:.1f} us")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stress", action="store_true")
    parser.add_argument("--ablate", action="store_true")
    parser.add_argument("--repro", action="store_true")
    parser.add_argument("--headline", action="store_true")
    parser.add_argument("--tuning", action="append", default=[], help="JSON overrides of TUNING for --headline")
    parser.add_argument("--moe-config", action="append", default=[],
                        help="gate_up,down split counts for --headline / --moe")
    parser.add_argument("--moe", action="store_true", help="only the MoE A/B of --tuning and --moe-config")
    parser.add_argument("--repeat", type=int, default=1, help="--headline: alternate the tunings this many times")
    parser.add_argument("--only", action="append", default=[], help="--headline: only these shape names")
    parser.add_argument("--no-moe", action="store_true", help="--headline: skip the MoE A/B")
    parser.add_argument("--splits", action="store_true", help="split-count sweep on four shapes")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    result = {"gpu": torch.cuda.get_device_name()}
    if args.repro:
        repro(log)
    if args.headline:
        tunings = [{}] + [json.loads(t) for t in args.tuning]
        result["tunings"] = tunings
        result["headline"] = headline(log, tunings, args.repeat, tuple(args.only))
        Path(args.out).write_text(json.dumps(result, indent=1))
        configs = [tuple(int(v) for v in c.split(",")) for c in args.moe_config]
        if not args.no_moe:
            result["moe"] = moe_ab(log, tunings, configs)
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.moe and not args.headline:
        tunings = [{}] + [json.loads(t) for t in args.tuning]
        configs = [tuple(int(v) for v in c.split(",")) for c in args.moe_config]
        result["moe"] = moe_ab(log, tunings, configs)
    if args.splits:
        result["splits"] = splits_sweep(log)
    if args.stress:
        result["stress"] = stress(log)
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.ablate:
        result["ablate"] = ablate(log)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
