"""Which regime each kernel of the decode step is in on the H200 (issue 16 item 7): bytes, instructions or latency,
read from the hardware counters (Nsight Compute) rather than inferred from times.

Two halves. `run` is the workload ncu watches: the full-shape synthetic rank of bench/decode_step.py, its decode
step over the KV pool run eagerly (every kernel its own launch, so ncu sees each; the graph's kernels are the same
launches), a warm-up step first, then one step per row count between cudaProfilerStart / Stop. `report` reads
ncu's raw CSV and sums it per kernel name: device time, DRAM bytes, the DRAM and SM throughput against their
peaks, issue activity and achieved occupancy, and a regime:

    bytes         DRAM throughput >= 50% of peak
    instructions  SM throughput (the busiest unit) >= 50% of peak
    latency       neither: the kernel waits (dependent loads, reductions, too few warps or programs)

ncu replays each kernel with the caches flushed (`--cache-control all`, its default), so the weights are cold, as
in a step that streams gigabytes between two calls of a kernel. `--clock-control none` (METHOD.md: leave the
clocks alone). Durations under ncu are a serialized kernel's, without PDL's overlap or a graph's launch gaps.

    ncu --profile-from-start off --clock-control none --metrics $(python3 bench/kernel_regimes.py metrics) \\
        --csv --page raw --log-file OUT/ncu.csv python3 bench/kernel_regimes.py run --rows 1 --layers 3
    python3 bench/kernel_regimes.py report OUT/ncu.csv --rows 1 --out bench/results/kernel_regimes.json [--markdown]

One row count a run: the report cannot tell two steps' kernels apart. The full 43-layer step under ncu took longer
than a 420 s call; `--layers 3` (an Engram layer, a compressed-KV source with its indexer) profiles in ~45 s.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
METRICS = {
    "gpu__time_duration.sum": "ns",
    "dram__bytes_read.sum": "read",
    "dram__bytes_write.sum": "write",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "sm__inst_issued.avg.pct_of_peak_sustained_active": "issue_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_pct",
    "launch__grid_size": "grid",
    "launch__registers_per_thread": "regs",
}
BYTES_PCT = INSTR_PCT = 50.0


def regime(dram_pct: float, sm_pct: float) -> str:
    if dram_pct >= BYTES_PCT:
        return "bytes"
    if sm_pct >= INSTR_PCT:
        return "instructions"
    return "latency"


def _number(text: str) -> float:
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return float("nan")


def read_ncu_csv(path: Path) -> list[dict]:
    """ncu's `--csv --page raw` rows, one a profiled kernel: its name, the step it ran in (NVTX-free: the launch
    order and the `--rows` list give it) and the metrics of METRICS by short name. ncu writes a units row after
    the header; lines before the header (its own log) are skipped."""
    lines = path.read_text(errors="replace").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError(f"{path}: no ncu CSV header (a line starting with \"ID\")")
    rows = list(csv.DictReader(lines[start:]))
    out = []
    for r in rows:
        if not r.get("ID", "").strip().isdigit():
            continue  # the units row
        k = {"id": int(r["ID"]), "name": r.get("Kernel Name", "?")}
        for metric, short in METRICS.items():
            k[short] = _number(r.get(metric, "nan"))
        out.append(k)
    return out


def summarise(kernels: list[dict], label: str) -> dict:
    """Every profiled kernel of the run (one row count a run: ncu's raw CSV does not say which step a kernel
    belonged to), summed per kernel name, under `label`."""
    if not kernels:
        raise ValueError("no kernels in the ncu output")
    groups = {label: kernels}
    result = {}
    for key, ks in groups.items():
        by = defaultdict(lambda: defaultdict(float))
        for k in ks:
            name = k["name"].split("(")[0][:80]
            b = by[name]
            b["calls"] += 1
            b["us"] += k["ns"] / 1e3
            b["mb"] += (k["read"] + k["write"]) / 1e6
            for f in ("dram_pct", "sm_pct", "issue_pct", "occupancy_pct"):
                b[f] += k[f] * k["ns"]  # time-weighted
            b["grid"] = max(b["grid"], k["grid"])
            b["regs"] = max(b["regs"], k["regs"])
        table = []
        for name, b in by.items():
            ns = b["us"] * 1e3 or 1.0
            row = {"kernel": name, "calls": int(b["calls"]), "us": round(b["us"], 1),
                   "us_per_call": round(b["us"] / b["calls"], 2), "mb": round(b["mb"], 2),
                   **{f: round(b[f] / ns, 1) for f in ("dram_pct", "sm_pct", "issue_pct", "occupancy_pct")},
                   "grid": int(b["grid"]), "regs": int(b["regs"])}
            row["regime"] = regime(row["dram_pct"], row["sm_pct"])
            table.append(row)
        table.sort(key=lambda r: -r["us"])
        total = sum(r["us"] for r in table)
        by_regime = defaultdict(float)
        for r in table:
            by_regime[r["regime"]] += r["us"]
        result[str(key)] = {"kernels": len(ks), "total_us": round(total, 1),
                            "by_regime_us": {k: round(v, 1) for k, v in by_regime.items()}, "table": table}
    return result


def markdown(summary: dict, top: int = 14) -> str:
    out = []
    for key, s in summary.items():
        out.append(f"rows {key}: {s['kernels']} kernels, {s['total_us'] / 1e3:.2f} ms serialized; by regime "
                   + ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in sorted(s["by_regime_us"].items())))
        out.append("")
        out.append("| kernel | calls | µs | µs a call | MB | DRAM % | SM % | issue % | occupancy % | grid | regs | regime |")
        out.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for r in s["table"][:top]:
            out.append(f"| `{r['kernel'][:48]}` | {r['calls']} | {r['us']:.0f} | {r['us_per_call']:.1f} | {r['mb']:.1f} | "
                       f"{r['dram_pct']:.0f} | {r['sm_pct']:.0f} | {r['issue_pct']:.0f} | {r['occupancy_pct']:.0f} | "
                       f"{r['grid']} | {r['regs']} | {r['regime']} |")
        out.append("")
    return "\n".join(out)


def run(n: int, context: int, layers: int | None) -> None:
    import time

    import torch

    t0 = time.perf_counter()

    def note(what):
        print(f"kernel_regimes: {what} at {time.perf_counter() - t0:.1f} s", flush=True)

    sys.path.insert(0, str(HERE))
    import decode_step as ds
    from dsv41.runtime.fast_forward import pool_layout
    from dsv41.runtime.graphs import PieceGraphs
    from dsv41.runtime.kv_pool import pool_for_model
    from dsv41.runtime.synthetic import synthetic_rank

    device = torch.device("cuda")
    model = synthetic_rank(None, rank=0, world=2, device=device, dtype=torch.bfloat16, comm=ds.StubComm(),
                           layers=layers)
    model.graphs = PieceGraphs(device, model.comm, enabled=False)  # every kernel its own launch: ncu sees each
    note("built")
    per = -(-(context + 64) // 256)
    ds.POOL = pool_for_model(pool_layout(model), num_slots=n, num_pages=n * per, page_tokens=256,
                             device=device)
    rows = ds.decode_rows(model, n, context, 100 + n)()
    note("sequences written")
    ds.run_step(model, rows(), "decode")  # warm-up: Triton's compiles, the workspaces
    torch.cuda.synchronize()
    note(f"warm-up step of {n} rows")
    torch.cuda.cudart().cudaProfilerStart()
    ds.run_step(model, rows(), "decode")
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    note(f"profiled step of {n} rows")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("metrics", help="print the --metrics list for ncu")
    r = sub.add_parser("run", help="the workload (under ncu)")
    r.add_argument("--rows", type=int, default=1)
    r.add_argument("--context", type=int, default=2048)
    r.add_argument("--layers", type=int, default=None)
    rep = sub.add_parser("report", help="sum ncu's raw CSV per kernel")
    rep.add_argument("csv", type=Path)
    rep.add_argument("--rows", type=int, default=1, help="the row count the workload ran")
    rep.add_argument("--out", type=Path, default=None)
    rep.add_argument("--commit", default="unknown")
    rep.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "metrics":
        print(",".join(METRICS))
        return 0
    if args.cmd == "run":
        run(args.rows, args.context, args.layers)
        return 0
    summary = summarise(read_ncu_csv(args.csv), str(args.rows))
    if args.out:
        args.out.write_text(json.dumps({"commit": args.commit, "source": "ncu --page raw", "steps": summary},
                                       indent=1) + "\n")
    print(markdown(summary) if args.markdown else json.dumps(summary, indent=1)[:4000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
