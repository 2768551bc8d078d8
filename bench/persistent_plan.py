"""What a persistent 1-row decode step could take, predicted before it is built (issue 37 item 1; no GPU needed).

One full-shape rank's layer as the persistent step would run it (kernels/step/persistent_plan.py): its ops in program
order, each split into work items, each item waiting on flags of the ops it reads. An item's time is its share of
the op's work at one SM's share of the measured rates: EXL3 weights at the step's best decode rate (`kernel_rates.
best_wps` of a bench/decode_step.py run: the head's product, all SMs busy), other bytes at the measured read
bandwidth, plus a fixed latency an item (`--item-us`: the reads' first bytes, the reduction, the release). The
layers chain (each layer's first op waits for the last of the layer before). Printed and written beside each other:

- `graph`: the measured 1-row graph step of the same run (decode_step's `graph_ms`);
- `kernel_chain`: the same items as a launch an op (`--gap-us` between launches) — calibrated: the gap that makes
  it equal the measured graph is reported (`implied_gap_us`: what a kernel boundary costs today);
- `persistent`: the simulated persistent step (dynamic queue over `--workers` SMs, `--flag-us` a flag hop), its
  critical path, and the floors of the same run (instruction / bandwidth): the issue's goal is 1 row <= 1.3x the
  instruction floor.

The op table (`layer_ops`) is this rank's matrices (MODEL.md's shapes, TP = 2, the pack's K: runtime/synthetic.py's
`pack_k`), 6 routed experts a row, the attention over a 2,048-token context; the small ops (row ops, RoPE, the
combine, the router's select, the SwiGLU) as a few items of fixed latency. Rough by design: it says which levers the
persistent step's time hangs on (levels a layer x the flag hop and item latency) before any kernel exists.

    python3 bench/persistent_plan.py --step bench/results/decode_step_aligned_b4c0e7f.json [--layers 26]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from dsv41.kernels.step.persistent_plan import Need, Op, build, critical_path, kernel_chain, simulate  # noqa: E402

D, Q_LORA, HD, HEADS, O_LORA, GROUPS, INTER, EXPERTS, TOPK = 5120, 1280, 512, 32, 1024, 4, 1152, 384, 6
WINDOW, TOPK_ENTRIES = 128, 512  # the keys a decode row attends: its window and its selected compressed entries


def layer_ops(L: int, wps_sm: float, bps_sm: float, item_us: float, workers: int) -> list[Op]:
    """One layer's ops at one row (this rank's shapes: TP = 2). wps_sm / bps_sm: one SM's EXL3 weights / bytes a
    microsecond; an op of W weights (or B bytes) over T items costs W / T / wps_sm (B / T / bps_sm) + item_us."""
    K = {"expert": 2 if 18 <= L <= 22 else 3, "shared": 4 if 11 <= L <= 29 else 5, "attn": 5}
    prev = [Need(f"L{L - 1}.down")] if L else []

    def exl3(name, weights, needs, items=workers, groups=1):
        return Op(f"L{L}.{name}", items, weights / items / wps_sm + item_us, tuple(needs), groups)

    def small(name, nbytes, needs, items=8):
        return Op(f"L{L}.{name}", items, nbytes / items / bps_sm + item_us, tuple(needs))

    n = lambda s, per_group=False: Need(f"L{L}.{s}", per_group)  # noqa: E731
    x_proj = D * Q_LORA + D * HD + 2 * D * HD  # wq_a, wkv, the compressor's wkv / wgate (one group launch)
    return [
        small("attn_site", 24 * 4 * D * 4, prev, items=16),  # the mHC site: fn [24, 4d] fp32, expand + collapse
        exl3("x_proj", x_proj, [n("attn_site")]),
        small("kv_rows", 4 * HD * 2, [n("x_proj")], items=4),  # q / kv norms, kv RoPE, the window store
        exl3("wq_b", Q_LORA * HEADS * HD, [n("kv_rows")]),
        small("q_rope", HEADS * 64 * 4, [n("wq_b")], items=4),
        small("core_split", (WINDOW + TOPK_ENTRIES) * HD, [n("q_rope")], items=32),  # 8 head blocks x 4 splits
        Op(f"L{L}.core_combine", 8, item_us, (n("core_split"),)),
        exl3("wo_a", GROUPS * 8 * HD * O_LORA, [n("core_combine")]),
        exl3("wo_b", GROUPS * O_LORA * D, [n("wo_a")]),
        small("ffn_site", 24 * 4 * D * 4, [n("wo_b")], items=16),
        small("router", EXPERTS * D * 2, [n("ffn_site")], items=24),  # the bf16 gate, then the top-6 select
        exl3("gate_up", TOPK * 2 * D * INTER * K["expert"] / 3 + 2 * D * INTER * K["shared"] / 3,
             [n("router")]),  # weights scaled by K / 3 into "3-bit decode work" (the rate's own K)
        exl3("down", TOPK * INTER * D * K["expert"] / 3 + INTER * D * K["shared"] / 3, [n("gate_up")]),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step", type=Path, default=HERE / "results" / "decode_step_aligned_b4c0e7f.json",
                   help="a bench/decode_step.py result: its rates, 1-row graph time, floors and GPU")
    p.add_argument("--layers", type=int, default=26, help="the layers that run measured (an H100 holds 26)")
    p.add_argument("--workers", type=int, default=132, help="SMs (one persistent block each)")
    p.add_argument("--flag-us", default="0.5,0.7,1.0", help="a flag hop's latency(s) to predict with")
    p.add_argument("--item-us", default="0.5,1.0,1.5", help="an item's fixed latency(s)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    step = json.loads(args.step.read_text())
    one = next(s for s in step["steps"] if s["rows"] == 1 and s.get("mode", "decode") == "decode")
    wps_sm = step["kernel_rates"]["best_wps"] / args.workers / 1e6  # weights a us on one SM
    bps_sm = step["ceilings"]["read_gbps"] * 1e3 / args.workers  # bytes a us on one SM
    graph_us = one["graph_ms"] * 1e3
    res = {"step": str(args.step), "gpu": step.get("gpu"), "commit_of_step": step.get("commit"),
           "layers": args.layers, "workers": args.workers, "graph_ms": one["graph_ms"], "floors": one["floors"],
           "runs": []}
    for item_us in [float(v) for v in args.item_us.split(",")]:
        ops = [op for L in range(args.layers) for op in layer_ops(L, wps_sm, bps_sm, item_us, args.workers)]
        plan = build(ops)
        no_gap = kernel_chain(ops, args.workers, 0.0)
        implied_gap = (graph_us - no_gap) / len(ops)
        for flag_us in [float(v) for v in args.flag_us.split(",")]:
            tl = simulate(plan, args.workers, flag_us=flag_us)
            run = {"item_us": item_us, "flag_us": flag_us, "ops_a_layer": len(ops) // args.layers,
                   "items": len(plan.items), "kernel_chain_no_gap_ms": no_gap / 1e3,
                   "implied_gap_us": implied_gap, "persistent_ms": tl.makespan_us / 1e3,
                   "critical_path_ms": critical_path(plan, flag_us) / 1e3,
                   "spin_share": tl.spin_us / (tl.makespan_us * args.workers),
                   "x_instruction_floor": tl.makespan_us / 1e3 / one["floors"]["instruction_ms"],
                   "x_graph": graph_us / tl.makespan_us}
            res["runs"].append(run)
            print(f"item {item_us:.1f} us, flag {flag_us:.1f} us: persistent {run['persistent_ms']:.2f} ms "
                  f"({run['x_instruction_floor']:.2f}x the instruction floor {one['floors']['instruction_ms']:.2f}; "
                  f"{run['x_graph']:.2f}x faster than the graph's {one['graph_ms']:.2f}); critical path "
                  f"{run['critical_path_ms']:.2f} ms; the chain without gaps {no_gap / 1e3:.2f} ms, so today's "
                  f"boundary ~{implied_gap:.1f} us an op")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0 if all(math.isfinite(r["persistent_ms"]) for r in res["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
