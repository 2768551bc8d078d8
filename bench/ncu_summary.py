"""Nsight Compute CSV (`--csv --page details` or `--page raw`) to one line a kernel name: launches, total and mean
duration, SM / memory / DRAM / L2 throughput in % of peak, achieved occupancy, registers, and (from a raw page with
the warp-state metrics) the three largest stall reasons in cycles per issued instruction.

    python3 bench/ncu_summary.py ncu.csv [--json out.json] [--top 40]
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

# details page: (section, metric) -> short name; raw page: metric id -> short name
DETAILS = {"Duration": "us", "Compute (SM) Throughput": "sm_pct", "Memory Throughput": "mem_pct",
           "DRAM Throughput": "dram_pct", "L2 Cache Throughput": "l2_pct", "L1/TEX Cache Throughput": "l1_pct",
           "Achieved Occupancy": "occ_pct", "Registers Per Thread": "regs",
           "Warp Cycles Per Issued Instruction": "cpi", "Issue Slots Busy": "issue_pct",
           "Dynamic Shared Memory Per Block": "dsmem", "Block Limit Registers": "blk_lim_regs"}
RAW = {"gpu__time_duration.sum": "us", "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
       "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "mem_pct",
       "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
       "lts__throughput.avg.pct_of_peak_sustained_elapsed": "l2_pct",
       "sm__warps_active.avg.pct_of_peak_sustained_active": "occ_pct", "launch__registers_per_thread": "regs",
       "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_pct",
       "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor_pct"}
_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
STALL = re.compile(r"smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio")


def _num(v: str) -> float | None:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return None


def _short(name: str) -> str:
    return re.sub(r"\(.*", "", name).strip()[:60]


def read(path: Path) -> dict:
    text = [line for line in path.read_text(errors="replace").splitlines() if not line.startswith("==")]
    start = next((i for i, line in enumerate(text) if line.startswith('"ID"')), None)
    if start is None:
        raise SystemExit(f"{path}: no ncu CSV header (\"ID\",...) found")
    rows = list(csv.reader(text[start:]))
    head = rows[0]
    kernels: dict[str, dict] = {}
    if "Metric Name" in head:  # details page: one row a metric
        col = {n: head.index(n) for n in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}
        for r in rows[1:]:
            if len(r) <= col["Metric Value"]:
                continue
            k = kernels.setdefault(r[col["ID"]], {"name": _short(r[col["Kernel Name"]])})
            short = DETAILS.get(r[col["Metric Name"]])
            val = _num(r[col["Metric Value"]])
            if short and val is not None:
                if short == "us":
                    unit = r[col["Metric Unit"]]
                    val *= _TO_US.get(unit, 1.0)
                k[short] = val
    else:  # raw page: one row a launch, one column a metric (the second row: units); a metric's column may carry
        # its section's prefix ("LTS.TriageCompute.lts__throughput...."): matched by its end
        units = rows[1]
        name_at = head.index("Kernel Name")
        short_at = {i: short for i, metric in enumerate(head) for key, short in RAW.items() if metric.endswith(key)}
        stall_at = {i: m.group(1) for i, metric in enumerate(head) if (m := STALL.search(metric))}
        for r in rows[2:]:
            if len(r) < len(head):
                continue
            k = kernels.setdefault(r[0], {"name": _short(r[name_at]), "stalls": {}})
            for i, short in short_at.items():
                val = _num(r[i])
                if val is not None:
                    k[short] = val * _TO_US.get(units[i], 1.0) if short == "us" else val
            for i, reason in stall_at.items():
                val = _num(r[i])
                if val is not None:
                    k["stalls"][reason] = val
    return kernels


def summarise(kernels: dict) -> list[dict]:
    by_name: dict[str, list[dict]] = defaultdict(list)
    for k in kernels.values():
        by_name[k["name"]].append(k)
    out = []
    for name, ks in by_name.items():
        row = {"name": name, "launches": len(ks), "total_us": sum(k.get("us", 0.0) for k in ks)}
        for key in ("sm_pct", "mem_pct", "dram_pct", "l2_pct", "l1_pct", "occ_pct", "issue_pct", "cpi", "regs",
                    "tensor_pct"):
            vals = [k[key] for k in ks if key in k]
            if vals:  # weighted by duration: the long launches say where the time goes
                w = [k.get("us", 1.0) for k in ks if key in k]
                row[key] = sum(v * x for v, x in zip(vals, w)) / max(sum(w), 1e-9)
        stalls: dict[str, float] = defaultdict(float)
        for k in ks:
            for reason, v in k.get("stalls", {}).items():
                stalls[reason] += v / len(ks)
        if stalls:
            row["stalls"] = dict(sorted(stalls.items(), key=lambda t: -t[1])[:4])
        out.append(row)
    return sorted(out, key=lambda r: -r["total_us"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args(argv)
    rows = summarise(read(args.csv))
    total = sum(r["total_us"] for r in rows) or 1.0
    print(f"{'kernel':60} {'n':>4} {'ms':>8} {'%':>5} {'sm%':>5} {'mem%':>5} {'dram%':>5} {'l2%':>5} {'occ%':>5} "
          f"{'iss%':>5} {'regs':>4}  stalls (cycles a issued instruction)")
    for r in rows[:args.top]:
        f = {k: (f"{r[k]:5.0f}" if k in r else "    -") for k in ("sm_pct", "mem_pct", "dram_pct", "l2_pct",
                                                                   "occ_pct", "issue_pct", "regs")}
        stalls = " ".join(f"{k} {v:.1f}" for k, v in r.get("stalls", {}).items())
        print(f"{r['name']:60} {r['launches']:4} {r['total_us'] / 1e3:8.3f} {100 * r['total_us'] / total:5.1f} "
              f"{f['sm_pct']} {f['mem_pct']} {f['dram_pct']} {f['l2_pct']} {f['occ_pct']} {f['issue_pct']} "
              f"{f['regs'][1:]}  {stalls}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
