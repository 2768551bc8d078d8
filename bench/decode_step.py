"""The decode step of one full-shape rank on the fast path (issue 14), measured on the H200.

Rank 0 of TP=2 at DeepSeek-V4.1-Flash's real shapes (runtime/synthetic.py: the pack's K map, random valid EXL3
codes made on the device, what a real rank holds in memory). Only one GPU is lent, so the two reductions per block
and the head's gather go through `StubComm`, a local stand-in of the same shapes (the peer's partial is this
rank's own: one add, one concatenation); its cost is the "comm" row of the per-op table, reported apart.

In one run:
- ceilings: streaming read (bench/exl3_kernels.py's read kernel) and a large bf16 GEMM;
- the prefill GEMM's row-count dependence: for each prefill shape of the rank, which chunk row counts M give a row
  other bits than M = 2048 (the prefill path's GEMM, fp16 operands, fp32 accumulation);
- the kernels' own best decode rate (the head at m=1, the routed experts at m=1, CUDA-graph replays);
- decode steps of 1, 2, 4, 6, 8, 16 rows (that many sequences at `--context` positions) and verify windows of that
  many rows of one sequence: wall-clock step (forward + greedy sampling + the token read back), median of
  `--steps`; one profiled step each: device time per op class (the runtime's sections), launches, host = step -
  device busy; weight bytes and EXL3 weights read (distinct experts from the step's routing) and the two floors:
  bytes / read ceiling (bandwidth), EXL3 weights / best decode rate (instruction);
- the overlapped loop (`--overlap`, default on; `--no-overlap` skips it): per decode row count, a chain of steps whose
  ids are the step before's greedy picks, serial against overlapped (step k + 1 planned and enqueued before the
  host reads step k's ids), ms a step and the host's share against the graph replayed alone, and both again with
  the Engram gate (`--engram-gate`, default on: `serial_gated_ms`, `gated_ms`; `overlap` in the JSON);
- prefill: one `--prefill`-row chunk (tokens/s, GEMM FLOPs as % of the measured bf16 rate).
Decode and verify steps run their static pieces as CUDA graphs (runtime/graphs.py; captured in the two untimed
warm-up steps of each row count) unless `--no-graphs`; the JSON says which (`graphs`: on/off) and the pieces'
captures / replays / eager calls (`graph_stats`, cumulative, per step row and for the run).
Writes `--out` (JSON) and a plot beside it. `--config DIR --device cpu` runs a smoke version on a small config.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from dsv41.parallel.comm import Comm  # noqa: E402
from dsv41.runtime import sections  # noqa: E402
from dsv41.runtime.graphs import PieceGraphs  # noqa: E402
from dsv41.runtime.layers.linear import DequantLinear, Exl3Linear  # noqa: E402
from dsv41.runtime.synthetic import synthetic_pool_sequence, synthetic_rank, synthetic_state  # noqa: E402
from step_profile import classify, host_profile, overlap_ab, step_split, sync  # noqa: E402

PREFILL_SHAPES = [(5120, 1152), (1152, 5120), (5120, 1280), (5120, 512), (1280, 16384), (4096, 1024),
                  (4096, 5120), (1280, 4096), (3072, 25600)]
ROW_COUNTS_M = [1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 127, 128, 129, 255, 256, 512, 1000, 1024, 2047]


class StubComm(Comm):
    """Rank 0 of TP=2 without the peer: partials summed with themselves, shards concatenated with themselves."""

    rank, world = 0, 2
    graph_safe = True  # device work on the current stream only

    def sum_partials(self, x):
        return x + x

    def gather_cat(self, x, dim):
        return torch.cat((x, x), dim=dim)


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------------ ceilings
def bf16_tflops(n: int = 8192, reps: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n ** 3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def gemm_row_bits(gemm, device) -> dict:
    """Per prefill shape: the chunk row counts M whose rows differ in any bit from the same rows at M = 2048."""
    out = {}
    g = torch.Generator(device=device).manual_seed(1)
    for k, n in PREFILL_SHAPES:
        w = (torch.randn(k, n, generator=g, device=device) * k ** -0.5).half()
        x = torch.randn(2048, k, generator=g, device=device).half()
        ref = gemm(x, w)
        out[f"{k}x{n}"] = [M for M in ROW_COUNTS_M if not torch.equal(gemm(x[:M], w), ref[:M])]
        perm = torch.randperm(2048, generator=g, device=device)
        out[f"{k}x{n}_position_dependent"] = not torch.equal(gemm(x[perm], w), ref[perm])
    return out


def best_decode_rates(model) -> dict:
    """EXL3 weights per second of the kernels at m=1: the head, and 64 different routed experts (weights from HBM)."""
    from exl3_kernels import graph_time_us
    from dsv41.kernels.exl3.layout import Exl3Tensor

    head = model.head
    x = torch.randn(1, head.in_features, device="cuda")
    t_head = graph_time_us([lambda: head(x, 1, "decode")] * 4)
    s = model.blocks[0].moe.experts
    views = [Exl3Tensor(s.w1.words[e], s.w1.suh[e], s.w1.svh[e], s.w1.codebook, s.w1.K, s.w1.k, s.w1.n)
             for e in range(64)]
    xe = torch.randn(1, s.w1.k, device="cuda")
    lin = Exl3Linear(views[0], model.workspace, "expert")
    launches = [(lambda v=v: lin.launch.run(xe, v, torch.empty(1, v.n, device="cuda"))) for v in views]
    t_exp = graph_time_us(launches)
    return {"head_us": t_head, "head_wps": head.in_features * head.out_features / t_head * 1e6,
            "expert_us": t_exp, "expert_wps": s.w1.k * s.w1.n / t_exp * 1e6}


# ------------------------------------------------------------------------------------------------ accounting
def step_reads(model, trace) -> dict:
    """Weight bytes and EXL3 weights one forward reads: every matrix once, routed experts as routed."""
    bytes_exl3 = weights = bytes_dense = distinct_total = 0

    def add(lin):
        nonlocal bytes_exl3, weights, bytes_dense
        if isinstance(lin, Exl3Linear):
            bytes_exl3 += lin.nbytes
            weights += lin.in_features * lin.out_features
        elif isinstance(lin, DequantLinear):
            bytes_dense += lin.nbytes

    for block in model.blocks:
        for lin in block.attn.linears():
            add(lin)
        for trio in block.moe.shared:
            for lin in trio:
                add(lin)
        bytes_dense += block.moe.gate_t.numel() * block.moe.gate_t.element_size() + 4 * (
            block.hc_attn.fn_t.numel() + block.hc_ffn.fn_t.numel())
        ids = torch.cat([t["router_ids"].reshape(-1) for t in trace.get(block.index, [])])
        distinct = int(ids.unique().numel())
        distinct_total += distinct
        s = block.moe.experts
        bytes_exl3 += distinct * (s.w1.expert_nbytes + s.w3.expert_nbytes + s.w2.expert_nbytes)
        weights += distinct * (2 * s.w1.k * s.w1.n + s.w2.k * s.w2.n)
    for e in model.engram.values():
        add(e.wkv)
    add(model.head)
    return {"exl3_bytes": bytes_exl3, "dense_bytes": bytes_dense, "exl3_weights": weights,
            "distinct_experts_per_layer": distinct_total / max(1, len(model.blocks))}


def prefill_flops(model, trace, T: int) -> float:
    flops = 0.0
    for block in model.blocks:
        lins = block.attn.linears() + [lin for trio in block.moe.shared for lin in trio]
        flops += sum(2.0 * T * lin.in_features * lin.out_features for lin in lins)
        s = block.moe.experts
        slots = sum(t["router_ids"].numel() for t in trace[block.index])
        flops += 2.0 * slots * (2 * s.w1.k * s.w1.n + s.w2.k * s.w2.n)
    for e in model.engram.values():
        flops += 2.0 * T * e.wkv.in_features * e.wkv.out_features
    return flops


# ------------------------------------------------------------------------------------------------ steps
POOL = None  # the KV pool the decode and verify rows run over in place (`--attention pool`), set by main


def run_step(model, rows, mode, trace=None):
    logits = model.forward(rows, mode, trace=trace, pool=POOL)
    from dsv41.kernels.step.argmax import greedy_ids

    with sections.section("sampling"):  # the runner's greedy pick (model_runner._greedy_tokens)
        tokens = greedy_ids(logits)
    return tokens.tolist()


def time_steps(model, rows_fn, mode, steps, device, profiled: bool, n: int):
    rows = rows_fn()
    for _ in range(2):
        run_step(model, rows(), mode)
    times, trace = [], {}
    for i in range(steps):
        batch = rows()
        sync(device)
        t0 = time.perf_counter()
        run_step(model, batch, mode)
        times.append((time.perf_counter() - t0) * 1e3)
    split = step_split(model, rows, mode, device, n, POOL)
    run_step(model, rows(), mode, trace)  # untimed: a traced forward takes the eager load-and-store path
    host = host_profile(lambda batch: run_step(model, batch, mode), rows, device) if profiled else None
    prof = None
    if device.type == "cuda" and profiled:
        from torch.profiler import ProfilerActivity, profile

        sections.enable(True)
        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run_step(model, rows(), mode)
                sync(device)
        finally:
            sections.enable(False)
    return statistics.median(times), times, trace, prof, host, split


def _sequence(model, i, context, seed):
    """Sequence i at `context`: a plain state, or (`--attention pool`) slot i of the pool and its own pages."""
    if POOL is None:
        return synthetic_state(model, context, seed=seed)
    per = POOL.num_pages // POOL.num_slots
    return synthetic_pool_sequence(model, POOL, i, list(range(i * per, (i + 1) * per)), context, seed=seed)


def decode_rows(model, n, context, seed):
    states = [_sequence(model, i, context, seed + i) for i in range(n)]
    g = torch.Generator().manual_seed(seed)
    return lambda: lambda: [(s, torch.randint(0, model.cfg.vocab_size, (1,), generator=g)) for s in states]


def verify_rows(model, n, context, seed):
    state = _sequence(model, 0, context, seed)
    g = torch.Generator().manual_seed(seed)
    return lambda: lambda: [(state, torch.randint(0, model.cfg.vocab_size, (n,), generator=g))]


def measure(model, args, device, floors_rates, ceiling_gbps):
    out = []
    for mode, maker, counts in (("decode", decode_rows, args.rows), ("verify", verify_rows, args.verify_rows)):
        for n in counts:
            step_ms, times, trace, prof, host, split = time_steps(model, lambda: maker(model, n, args.context, 100 + n)(),
                                                           mode, args.steps, device, n in args.profile_rows, n)
            reads = step_reads(model, trace)
            row = {"rows": n, "mode": mode, "step_ms": step_ms, "times_ms": times, **reads,
                   "graphs": "on" if model.graphs.active else "off", "graph_stats": model.graphs.stats.as_dict(),
                   **split}
            if prof is not None:
                cls = classify(prof)
                dev_ms = cls["busy_us"] / 1e3
                row.update(ops=cls["device_us"], launches=cls["launches"], device_ms=dev_ms, host_ms=step_ms - dev_ms,
                           ops_linked_us=cls["linked_us"], kernels_us=cls["kernels_us"], timeline_us=cls["timeline_us"],
                           ops_per_layer_us={k: v / len(model.blocks) for k, v in cls["device_us"].items()})
            if floors_rates:
                row["floors"] = {"bandwidth_ms": (reads["exl3_bytes"] + reads["dense_bytes"]) / ceiling_gbps / 1e6,
                                 "instruction_ms": reads["exl3_weights"] / floors_rates["best_wps"] * 1e3}
            log(f"{mode} rows={n} graphs {row['graphs']}: {step_ms:.1f} ms "
                f"(device {row.get('device_ms', float('nan')):.1f} ms), "
                f"{reads['exl3_bytes'] / 1e9:.2f} GB EXL3, {reads['distinct_experts_per_layer']:.1f} experts/layer")
            if split.get("graph_ms") is not None:
                log(f"  graph replayed alone {split['graph_ms']:.2f} ms (its launch call "
                    f"{split['launch_ms']:.2f} ms of host), the host's enqueue {split['enqueue_ms']:.2f} ms: "
                    f"the host adds {step_ms - split['graph_ms']:.2f} ms; start to logits "
                    f"{split['start_to_logits_ms']:.2f} ms on the device's clock, {split['after_forward_ms']:.2f} "
                    f"ms after the forward returns")
            if host is not None:
                row["host_profile"] = host
                log(f"  host (cProfile, {host['total_ms']:.1f} ms): " + ", ".join(
                    f"{e['fn']} {e['own_ms']:.2f}" for e in host["by_own"][:8]))
            tl_us = row.get("timeline_us") or {}
            if tl_us:
                log(f"  profiled step: host lead {tl_us['lead_us'] / 1e3:.2f} ms, device span {tl_us['span_us'] / 1e3:.2f} "
                    f"ms of which gaps {tl_us['gaps_us'] / 1e3:.2f} ms over {tl_us['kernels']} kernels, tail "
                    f"{tl_us['tail_us'] / 1e3:.2f} ms")
            out.append(row)
    return out


def prefill(model, args, device, tflops):
    st = model.new_state()
    model.forward([(st, torch.randint(0, model.cfg.vocab_size, (64,)))], "prefill")  # compiles the reconstructs
    ids = torch.randint(0, model.cfg.vocab_size, (args.prefill,))
    st, trace = model.new_state(), {}
    sync(device)
    t0 = time.perf_counter()
    model.forward([(st, ids)], "prefill", trace=trace)
    sync(device)
    seconds = time.perf_counter() - t0
    flops = prefill_flops(model, trace, args.prefill)
    res = {"rows": args.prefill, "seconds": seconds, "tokens_per_s": args.prefill / seconds, "gemm_tflop": flops / 1e12}
    if tflops:
        res["gemm_pct_of_bf16_rate"] = 100 * flops / seconds / (tflops * 1e12)
    log(f"prefill {args.prefill} rows: {seconds:.2f} s, {res['tokens_per_s']:.0f} tok/s")
    if args.profile_prefill and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        sections.enable(True)
        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                model.forward([(model.new_state(), ids)], "prefill")
                sync(device)
        finally:
            sections.enable(False)
        cls = classify(prof)
        res.update(ops_us=cls["device_us"], launches=cls["launches"], device_ms=cls["busy_us"] / 1e3,
                   host_ms=seconds * 1e3 - cls["busy_us"] / 1e3)
        log(f"prefill profile: device busy {res['device_ms']:.0f} ms; per section (ms, launches): "
            + ", ".join(f"{k} {v / 1e3:.0f}/{cls['launches'].get(k, 0)}"
                        for k, v in sorted(cls["device_us"].items(), key=lambda t: -t[1])))
    return res


# ------------------------------------------------------------------------------------------------ output
def plot(results, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    for mode, mark in (("decode", "o-"), ("verify", "s--")):
        rows = [s for s in results["steps"] if s["mode"] == mode]
        a.plot([s["rows"] for s in rows], [s["step_ms"] for s in rows], mark, label=f"{mode} step (wall)")
        prof = [s for s in rows if "device_ms" in s]
        if prof:
            a.plot([s["rows"] for s in prof], [s["device_ms"] for s in prof], mark, alpha=0.5,
                   label=f"{mode} device busy")
    dec = [s for s in results["steps"] if s["mode"] == "decode" and "floors" in s]
    for key, style in (("bandwidth_ms", ":"), ("instruction_ms", "-.")):
        a.plot([s["rows"] for s in dec], [s["floors"][key] for s in dec], "k" + style,
               label=key.replace("_ms", " floor"))
    a.set_xlabel("rows")
    a.set_ylabel("ms")
    a.set_yscale("log")
    a.legend(fontsize=8)
    a.set_title(f"rank 0 of TP=2, {results['gpu']}")
    dec = [s for s in dec if "ops" in s]
    if dec:
        names = sorted({k for s in dec for k in s["ops"]})
        bottom = [0.0] * len(dec)
        for name in names:
            vals = [s["ops"].get(name, 0) / 1e3 for s in dec]
            b.bar([str(s["rows"]) for s in dec], vals, bottom=bottom, label=name)
            bottom = [x + y for x, y in zip(bottom, vals)]
        b.set_xlabel("decode rows")
        b.set_ylabel("device ms per step")
        b.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE / "results" / "decode_step.json")
    p.add_argument("--rows", default="1,2,4,6,8,16")
    p.add_argument("--verify-rows", default="6", help="verify windows (rows of one sequence) to time")
    p.add_argument("--profile-rows", default="1,2,4,6,8,16", help="row counts with a profiled step")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--profile-prefill", action="store_true", help="profile one more prefill chunk, per section")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--config", default=None, help="a model folder whose config.json replaces the real shapes (smoke)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-graphs", action="store_true", help="run the decode/verify pieces eagerly (A/B)")
    p.add_argument("--attention", choices=("pool", "gather"), default="pool",
                   help="decode/verify attention over a KV pool in place (one graph a step), or over states "
                        "loaded per sequence (the pieces' graphs, eager attention between them)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="A/B of the engine's overlapped loop: each decode row count's chained step serial and "
                        "overlapped, and the host's share of each (--no-overlap: skip)")
    p.add_argument("--engram-gate", action=argparse.BooleanOptionalAction, default=True,
                   help="the overlap A/B also with the Engram gate (runtime/engram_gate.py: the step's graph "
                        "launched before its Engram rows, which the host publishes while it runs), serial and "
                        "overlapped (--no-engram-gate: skip)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall seconds this run may take: the prefill is skipped when less than 40 s are left")
    args = p.parse_args(argv)
    started = time.perf_counter()
    args.rows, args.verify_rows, args.profile_rows = ([int(r) for r in v.split(",") if r]
                                                      for v in (args.rows, args.verify_rows, args.profile_rows))
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    commit = os.environ.get("BENCH_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                              capture_output=True, text=True).stdout.strip()
    results = {"commit": commit or "unknown", "gpu": torch.cuda.get_device_name() if cuda else "cpu",
               "context": args.context}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():  # after every stage, so a run cut short still leaves what it measured
        args.out.write_text(json.dumps(results, indent=1) + "\n")

    ceiling = tflops = None
    if cuda:
        from exl3_kernels import read_ceiling_gbps
        from dsv41.runtime.layers.linear import PrefillWorkspace

        c = read_ceiling_gbps()
        ceiling, tflops = c["read_gbps"], bf16_tflops()
        results["ceilings"] = {**c, "bf16_tflops": tflops}
        ws = PrefillWorkspace(device)
        results["prefill_gemm"] = ws.gemm_mode
        results["prefill_gemm_row_count_bits"] = gemm_row_bits(ws.gemm, device)
        log(f"read ceiling {ceiling:.0f} GB/s, bf16 {tflops:.0f} TFLOP/s; GEMM bits by M: "
            f"{results['prefill_gemm_row_count_bits']}")
        save()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    from dsv41.config import ModelConfig

    cfg = ModelConfig.from_file(args.config) if args.config else None
    t0 = time.perf_counter()
    model = synthetic_rank(cfg, rank=0, world=2, device=device, dtype=torch.bfloat16 if cuda else torch.float32,
                           comm=StubComm(), layers=args.layers)
    sync(device)
    results["build_s"] = time.perf_counter() - t0
    results["rank_bytes"] = model.stored_bytes() + model.workspace.nbytes
    results["memory"] = {"held_bytes": model.stored_bytes(), "workspace_bytes": model.workspace.nbytes}
    if cuda:
        results["memory"].update(allocated_bytes=torch.cuda.memory_allocated() - base,
                                 peak_bytes=torch.cuda.max_memory_allocated() - base)
    model.graphs = PieceGraphs(device, model.comm, enabled=not args.no_graphs)
    global POOL
    if args.attention == "pool":
        from dsv41.runtime.fast_forward import pool_layout
        from dsv41.runtime.kv_pool import pool_for_model

        slots, longest = max(args.rows + [1]), max(args.verify_rows + [1])
        tokens = args.context + (args.steps + 4) * longest + 64  # the measured steps grow every sequence
        per = -(-tokens // 256)
        POOL = pool_for_model(pool_layout(model), num_slots=slots, num_pages=slots * per, page_tokens=256,
                              verify_rows=longest, device=device)
        results["pool"] = POOL.describe()
    results["attention"] = args.attention
    results["graphs"] = "on" if model.graphs.active else "off"
    log(f"built in {results['build_s']:.1f} s: {results['memory']}; graphs: {results['graphs']}")
    save()
    rates = None
    if cuda:
        rates = best_decode_rates(model)
        rates["best_wps"] = max(rates["head_wps"], rates["expert_wps"])
        results["kernel_rates"] = rates
        log(f"kernel rates {rates}")
    save()
    results["steps"] = measure(model, args, device, rates, ceiling)
    save()
    if args.overlap and args.attention == "pool" and model.pool_runs("decode"):
        batches = lambda n: decode_rows(model, n, args.context, 300 + n)()  # noqa: E731
        gate = None
        if args.engram_gate and cuda and model.engram_hasher is not None:
            from dsv41.runtime.engram_gate import EngramGate
            from dsv41.runtime.model import STEP_ROWS

            gate = EngramGate(device, max_rows=STEP_ROWS)
        results["overlap"] = overlap_ab(model, args, device, POOL, batches, log, gate=gate)
    one = next(s for s in results["steps"] if s["rows"] == args.rows[0] and s["mode"] == "decode")
    results["floors"] = one.get("floors", {})
    results["graph_stats"] = model.graphs.stats.as_dict()
    save()
    left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - started)
    if args.prefill and (left is None or left >= 40):
        results["prefill"] = prefill(model, args, device, tflops)
    elif args.prefill:
        results["prefill"] = {"skipped": f"device budget: {left:.0f} s left of --budget-s {args.budget_s:.0f}"}
        log(results["prefill"]["skipped"])
    save()
    try:
        plot(results, args.out.with_suffix(".png"))
    except Exception as e:  # noqa: BLE001 - the numbers matter more than the picture
        log(f"plot failed: {e}")
    log(f"\ngraphs: {results['graphs']} {results['graph_stats']}")
    log("mode    rows  step_ms  device_ms  host_ms  GB(exl3)  bw_floor  instr_floor")
    for s in results["steps"]:
        f = s.get("floors", {})
        log(f"{s['mode']:7} {s['rows']:4} {s['step_ms']:8.1f} {s.get('device_ms', math.nan):10.1f} "
            f"{s.get('host_ms', math.nan):8.1f} {s['exl3_bytes'] / 1e9:9.2f} {f.get('bandwidth_ms', math.nan):9.2f} "
            f"{f.get('instruction_ms', math.nan):12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
