"""Projection of the 1-row decode step onto one GB10 rank (DGX Spark) from the H200's per-op numbers.

Input: bench/results/step_ops.json (per op class: calls, measured H200 ms, bytes), or, when that file does not
exist yet (or with --from-decode-step), the 1-row step in bench/results/decode_step.json: its profiled kernels by
class where the profile has them (`kernels_us`: the whole step is one CUDA graph), else its profiled sections
(launches as calls, the step's weight bytes on the "graph" section).
Per op (docs/perf/gb10-projection.md gives the reasoning):
  achieved = bytes / (t_h200 * BW_h200)            per_call = t_h200 / calls
  latency-bound      per_call < --latency-us        t = calls * max(--launch-us, per_call)
  bytes-bound        achieved >= --bytes-frac       t = t_h200 * BW_h200 / BW_gb10  (the H200's efficiency kept)
  instruction-bound  otherwise                      t = t_h200 / --compute-ratio
  and never under the op's own floor:              t = max(t, bytes / BW_gb10)
The comm stubs' classes are replaced by --comm-ms (the recipe's measured exchanges on GB10); the host gaps of
today's step (decode_step.json: graph-on 1-row step - device busy) are carried as they are (--host-ms).
  step = sum(t) + comm + host;   round = step * verify_ratio + draft;   tokens/s = tokens_per_round / round
verify_ratio: decode_step.json's 6-row verify step / its 1-row decode step.
Prints, writes --out (JSON); --markdown prints the doc's table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

DEFAULTS = {
    "gb10_gbps": 220.0,  # RECIPE.md §4.8: the recipe's roofline rate on GB10 (LPDDR5x peak ~273 GB/s)
    "gb10_peak_gbps": 273.0,
    "h200_gbps": None,  # step_ops.json's ceiling_gbps (decode_step.json's measured read ceiling)
    "compute_ratio": 0.4,  # GB10 / H200 SM throughput: 48 SMs vs 132 at similar clocks (assumption)
    "launch_us": 3.0,  # a kernel's slot in a replayed graph on GB10 (assumption)
    "latency_us": 20.0,  # per-call time under which an op is latency-bound
    "bytes_frac": 0.4,  # achieved fraction of the H200 read ceiling from which an op is bytes-bound
    "comm_ms": 1.7,  # RECIPE.md §4.8: exchanges 1.7 ms a 1-row step (0.6 transfer + 1.1 waiting), RoCE TP=2
    "draft_ms": 3.5,  # RECIPE.md §4.8: the DSpark pass a round (this engine has no drafter on the fast path yet)
    "tokens_per_round": {"code": 3.7, "prose": 1.6},  # RECIPE.md §2.6 (G19: ~3.7 code, ~1.6-1.7 prose)
}


def project_op(op: dict, p: dict) -> dict:
    """One op class on GB10: {bound, gb10_ms, floor_gb10_ms, achieved}."""
    ms, calls, nbytes = float(op["ms"]), max(1, int(op.get("calls", 1))), float(op.get("bytes", 0))
    per_call_us = ms * 1e3 / calls
    achieved = nbytes / (ms * 1e-3) / (p["h200_gbps"] * 1e9) if ms > 0 else 0.0
    floor = nbytes / p["gb10_gbps"] / 1e6
    if per_call_us < p["latency_us"]:
        bound, t = "latency", calls * max(p["launch_us"], per_call_us) / 1e3
    elif achieved >= p["bytes_frac"]:
        bound, t = "bytes", ms * p["h200_gbps"] / p["gb10_gbps"]
    else:
        bound, t = "instruction", ms / p["compute_ratio"]
    return {"class": op["class"], "group": op.get("group", ""), "calls": calls, "h200_ms": ms, "bytes": nbytes,
            "achieved_h200": achieved, "bound": bound, "floor_gb10_ms": floor, "gb10_ms": max(t, floor)}


def project(ops: list[dict], p: dict, host_ms: float, verify_ratio: float) -> dict:
    rows = [project_op(op, p) for op in ops if op.get("group") != "comm"]
    device = sum(r["gb10_ms"] for r in rows)
    step = device + p["comm_ms"] + host_ms
    floor = sum(r["floor_gb10_ms"] for r in rows)
    rnd = step * verify_ratio + p["draft_ms"]
    return {"ops": rows, "device_ms": device, "comm_ms": p["comm_ms"], "host_ms": host_ms, "step_ms": step,
            "bandwidth_floor_ms": floor, "bandwidth_floor_peak_ms": floor * p["gb10_gbps"] / p["gb10_peak_gbps"],
            "verify_ratio": verify_ratio, "round_ms": rnd,
            "tokens_per_s": {k: v / rnd * 1e3 for k, v in p["tokens_per_round"].items()},
            "h200_ms": sum(r["h200_ms"] for r in rows)}


def ops_from_step_ops(so: dict, rows: int = 1) -> list[dict]:
    row = next(s for s in so["steps"] if s["rows"] == rows)
    return [{k: c[k] for k in ("class", "group", "calls", "ms", "bytes")} for c in row["classes"]]


def ops_from_decode_step(d: dict) -> list[dict]:
    """The 1-row step's profiled sections: all weight bytes on "graph" (every static piece runs in it)."""
    one = next(s for s in d["steps"] if s["mode"] == "decode" and s["rows"] == 1)
    out = []
    for name, us in one["ops"].items():
        nbytes = one["exl3_bytes"] + one["dense_bytes"] if name == "graph" else 0
        out.append({"class": f"section {name}", "group": "comm" if name == "comm" else name,
                    "calls": one["launches"].get(name, 1), "ms": us / 1e3, "bytes": nbytes})
    return sorted(out, key=lambda o: -o["ms"])


# kernel name prefix -> op class (the 1-row step's profiled kernels, decode_step.json `kernels_us`: inside the step's
# CUDA graph the sections are one span, the kernels keep their names)
KERNEL_CLASSES = (("exl3_", "EXL3 linears + MoE"), ("_core_", "attention core"), ("_store_rows", "cache writes"),
                  ("_scores", "indexer"), ("_topk", "indexer"), ("_site", "mHC"), ("_expand", "mHC"),
                  ("_collapse", "mHC"), ("_router", "router"), ("_rowops", "norms / RoPE / quantisers"))


def ops_from_kernels(d: dict) -> list[dict]:
    """The 1-row step's kernels by class: the EXL3 bytes on the EXL3 class, the dense bytes (router gate, mHC
    matrices, norms) on the router and mHC classes by their time; kernels outside the profile's top list and
    torch's own (copies, fills, elementwise) as 'torch ops + rest' (device busy minus the named classes)."""
    one = next(s for s in d["steps"] if s["mode"] == "decode" and s["rows"] == 1)
    acc: dict = {}
    for name, (us, calls) in one["kernels_us"].items():
        cls = next((c for prefix, c in KERNEL_CLASSES if name.startswith(prefix)), None)
        if cls is None:
            continue
        a = acc.setdefault(cls, {"class": cls, "group": cls, "calls": 0, "ms": 0.0, "bytes": 0.0})
        a["calls"] += calls
        a["ms"] += us / 1e3
    named = sum(a["ms"] for a in acc.values())
    rest_calls = sum(c for n, (_, c) in one["kernels_us"].items()
                     if not any(n.startswith(p) for p, _ in KERNEL_CLASSES))
    acc["torch"] = {"class": "torch ops + rest", "group": "torch", "calls": max(1, rest_calls),
                    "ms": max(0.0, one["device_ms"] - named), "bytes": 0.0}
    acc["EXL3 linears + MoE"]["bytes"] = float(one["exl3_bytes"])
    dense = [acc[c] for c in ("router", "mHC") if c in acc]
    for a in dense:
        a["bytes"] = float(one["dense_bytes"]) * a["ms"] / sum(x["ms"] for x in dense)
    return sorted(acc.values(), key=lambda o: -o["ms"])


def decode_step_terms(d: dict) -> tuple[float, float]:
    """(host_ms of the graph-on 1-row step, verify ratio 6-row verify / 1-row decode)."""
    one = next(s for s in d["steps"] if s["mode"] == "decode" and s["rows"] == 1)
    ver = next((s for s in d["steps"] if s["mode"] == "verify"), None)
    host = one.get("host_ms", one["step_ms"] - one.get("device_ms", one["step_ms"]))
    return host, (ver["step_ms"] / one["step_ms"]) if ver else 1.0


def markdown(res: dict) -> str:
    lines = ["| op class | calls | H200 ms | MB | achieved (H200) | bound | GB10 floor ms | GB10 ms |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in res["ops"]:
        lines.append(f"| {r['class']} | {r['calls']} | {r['h200_ms']:.3f} | {r['bytes'] / 1e6:.1f} | "
                     f"{r['achieved_h200']:.1%} | {r['bound']} | {r['floor_gb10_ms']:.2f} | {r['gb10_ms']:.2f} |")
    t = res["tokens_per_s"]
    lines += ["", f"| term | ms |", "| --- | ---: |",
              f"| device (sum of the ops) | {res['device_ms']:.1f} |", f"| comm (RoCE, recipe) | {res['comm_ms']:.1f} |",
              f"| host gaps (carried) | {res['host_ms']:.1f} |", f"| **1-row step** | **{res['step_ms']:.1f}** |",
              f"| bandwidth floor (at {res['params']['gb10_gbps']:.0f} / {res['params']['gb10_peak_gbps']:.0f} GB/s) | "
              f"{res['bandwidth_floor_ms']:.1f} / {res['bandwidth_floor_peak_ms']:.1f} |",
              f"| round = step x {res['verify_ratio']:.2f} + draft {res['params']['draft_ms']:.1f} | {res['round_ms']:.1f} |",
              "", " | ".join(f"{k} {v:.1f} tok/s" for k, v in t.items())]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-ops", type=Path, default=RESULTS / "step_ops.json")
    ap.add_argument("--decode-step", type=Path, default=RESULTS / "decode_step.json")
    ap.add_argument("--from-decode-step", action="store_true", help="use decode_step.json's sections, not step_ops")
    ap.add_argument("--out", type=Path, default=RESULTS / "gb10_projection.json")
    ap.add_argument("--markdown", action="store_true")
    for k, v in DEFAULTS.items():
        if k != "tokens_per_round":
            ap.add_argument("--" + k.replace("_", "-"), type=float, default=v)
    ap.add_argument("--host-ms", type=float, default=None, help="default: decode_step.json's 1-row host gaps")
    ap.add_argument("--verify-ratio", type=float, default=None, help="default: decode_step.json's verify6 / decode1")
    ap.add_argument("--tokens-per-round", default="code=3.7,prose=1.6")
    args = ap.parse_args(argv)
    p = {k: getattr(args, k) for k in DEFAULTS if k != "tokens_per_round"}
    p["tokens_per_round"] = {k: float(v) for k, v in (kv.split("=") for kv in args.tokens_per_round.split(","))}
    d = json.loads(args.decode_step.read_text()) if args.decode_step.is_file() else None
    use_so = args.step_ops.is_file() and not args.from_decode_step
    if use_so:
        so = json.loads(args.step_ops.read_text())
        ops, source = ops_from_step_ops(so), {"step_ops": str(args.step_ops), "commit": so.get("commit"),
                                               "device": so.get("device")}
        p["h200_gbps"] = p["h200_gbps"] or so.get("ceiling_gbps")
    elif any("kernels_us" in st for st in d["steps"] if st["mode"] == "decode" and st["rows"] == 1):
        ops, source = ops_from_kernels(d), {"decode_step": str(args.decode_step), "commit": d.get("commit"),
                                            "from": "profiled kernels"}
    else:
        ops, source = ops_from_decode_step(d), {"decode_step": str(args.decode_step), "commit": d.get("commit")}
    if not p["h200_gbps"]:
        p["h200_gbps"] = d["ceilings"]["read_gbps"] if d else 4532.48
    host, ratio = decode_step_terms(d) if d else (0.0, 1.0)
    host = host if args.host_ms is None else args.host_ms
    ratio = ratio if args.verify_ratio is None else args.verify_ratio
    res = project(ops, p, host, ratio)
    res.update(params=p, source=source)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    if args.markdown:
        print(markdown(res))
    else:
        for r in res["ops"]:
            print(f"{r['class'][:46]:46} {r['calls']:6d} H200 {r['h200_ms']:8.3f} ms {r['bytes'] / 1e6:9.1f} MB "
                  f"{r['achieved_h200']:6.1%} {r['bound']:11} GB10 {r['gb10_ms']:8.2f} ms (floor {r['floor_gb10_ms']:.2f})")
        print(f"GB10 1-row step {res['step_ms']:.1f} ms = device {res['device_ms']:.1f} + comm {res['comm_ms']:.1f} + "
              f"host {res['host_ms']:.1f}; floor {res['bandwidth_floor_ms']:.1f} ms; round {res['round_ms']:.1f} ms; "
              + ", ".join(f"{k} {v:.1f} tok/s" for k, v in res["tokens_per_s"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
