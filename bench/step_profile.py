"""Profiling helpers of bench/decode_step.py: where a step's device time goes by section and kernel (`classify`,
from a torch profile), the host's share without a profiler (`step_split`), and the host's Python by function
(`host_profile`, cProfile); the overlapped loop's A/B (`overlap_ab`: a chain of steps serial against overlapped,
and both again with the Engram gate, `time_chain`)."""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from dsv41.runtime import sections


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def classify(prof) -> dict:
    """Device µs and launches per runtime section. Each kernel goes to the innermost `dsv41::` range whose GPU-side
    span (the profiler's GPU user annotation) contains its start: this also places the EXL3 kernels, which are
    launched through the driver API and so have no CPU op linked to them. Busy = the union of kernel intervals
    (PDL lets EXL3 kernels overlap). `linked_us`: the same per section through the CPU ops' own kernel links."""
    events = prof.events()
    device = [e for e in events if str(e.device_type).endswith("CUDA")]
    spans = sorted(((e.time_range.start, e.time_range.end, e.name[len(sections.PREFIX):]) for e in device
                    if e.name.startswith(sections.PREFIX)), key=lambda t: (t[0], -t[1]))
    kernels = sorted((e.time_range.start, e.time_range.end) for e in device
                     if not e.name.startswith(sections.PREFIX))
    by_name, name_count = defaultdict(float), Counter()  # inside a graph the sections are one span: the kernels
    for e in device:
        if not e.name.startswith(sections.PREFIX):
            by_name[e.name[:90]] += e.time_range.end - e.time_range.start
            name_count[e.name[:90]] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:40]
    us, launches, stack, j = defaultdict(float), Counter(), [], 0
    busy, reach = 0.0, -math.inf
    for start, end in kernels:
        while j < len(spans) and spans[j][0] <= start:
            stack.append(spans[j])
            j += 1
        while stack and stack[-1][1] < start:
            stack.pop()
        inner = next((sp[2] for sp in reversed(stack) if sp[0] <= start <= sp[1]), "other")
        us[inner] += end - start
        launches[inner] += 1
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    # the step's timeline: host work before the first kernel, the device span (busy + the gaps between kernels,
    # which inside one graph are the launch latency of its nodes), and what follows the last kernel (the read-back)
    cpu = [e for e in events if not str(e.device_type).endswith("CUDA")]
    timeline = {}
    if kernels and cpu:
        t0, t1 = min(e.time_range.start for e in cpu), max(e.time_range.end for e in cpu)
        k0, k1 = kernels[0][0], max(end for _, end in kernels)
        timeline = {"lead_us": k0 - t0, "span_us": k1 - k0, "gaps_us": (k1 - k0) - busy, "tail_us": max(0.0, t1 - k1),
                    "kernels": len(kernels)}
    linked = defaultdict(float)
    for fe in events:
        for k in getattr(fe, "kernels", None) or []:
            p = fe
            while p is not None and not p.name.startswith(sections.PREFIX):
                p = p.cpu_parent
            linked[p.name[len(sections.PREFIX):] if p is not None else "other"] += k.duration
    return {"device_us": dict(us), "launches": dict(launches), "busy_us": busy, "linked_us": dict(linked),
            "kernels_us": {k: [round(v, 1), name_count[k]] for k, v in top}, "timeline_us": timeline}


def step_split(model, rows, mode, device, n: int, pool, reps: int = 5) -> dict:
    """The step's wall time taken apart without a profiler: `enqueue_ms`, the host's work from the call to the
    moment the forward returns with the device idle at its start (tables, Engram rows, copies, the replay's
    launch), and `graph_ms`, the step's captured graph replayed alone (CUDA events: its kernels and the gaps
    between its nodes, no host work), and `launch_ms` the host's time in that replay's launch call alone (a 6-row
    verify graph's launch was seen taking 2 ms of host where the 1-row graph's took 0.1). The step's wall time
    minus `graph_ms` is what the host adds; where it goes: `start_to_logits_ms` (device clock, from the call's
    start to the logits being ready: the enqueue plus the graph as it runs inside a step) against `enqueue_ms` +
    `graph_ms`, and `after_forward_ms` (the host from the forward's return to the sampled ids in hand)."""
    if device.type != "cuda" or model.graphs is None:
        return {}
    enq, dev, post = [], [], []
    for _ in range(reps):
        batch = rows()
        sync(device)
        first, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        first.record()  # the device is idle: this marks the call's start on the device's clock
        t0 = time.perf_counter()
        logits = model.forward(batch, mode, pool=pool)
        t1 = time.perf_counter()
        done.record()
        logits.argmax(dim=-1).tolist()
        enq.append((t1 - t0) * 1e3)
        post.append((time.perf_counter() - t1) * 1e3)
        dev.append(first.elapsed_time(done))
    out = {"enqueue_ms": statistics.median(enq), "start_to_logits_ms": statistics.median(dev),
           "after_forward_ms": statistics.median(post)}
    pieces = [p for k, p in model.graphs._pieces.items() if k[:3] == ("step", mode, n)]
    if not pieces:
        return out
    graph = pieces[-1].graph  # the bucket just run (the pieces are kept in capture order)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, launches = [], []
    for _ in range(reps):
        sync(device)
        start.record()
        t0 = time.perf_counter()
        graph.replay()
        launches.append((time.perf_counter() - t0) * 1e3)  # the host's cudaGraphLaunch, the device idle before
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return {**out, "graph_ms": statistics.median(times), "launch_ms": statistics.median(launches)}


def host_profile(run_step, rows, device, top: int = 45) -> dict:
    """Where the host's time of one step goes: cProfile of one untimed step (device synchronised before and
    after), the functions by their own time and by their cumulative time (ms; cProfile's overhead inflates both,
    the ranking is what it is for)."""
    import cProfile
    import pstats

    batch = rows()
    sync(device)
    prof = cProfile.Profile()
    prof.runcall(lambda: (run_step(batch), sync(device)))
    st = pstats.Stats(prof)
    entries = [{"fn": f"{Path(file).name}:{line}:{name}", "calls": calls, "own_ms": own * 1e3, "cum_ms": cum * 1e3}
               for (file, line, name), (_, calls, own, cum, _) in st.stats.items()]
    return {"total_ms": st.total_tt * 1e3, "by_own": sorted(entries, key=lambda e: -e["own_ms"])[:top],
            "by_cumulative": sorted(entries, key=lambda e: -e["cum_ms"])[:top]}


def time_chain(model, rows_fn, n: int, steps: int, device, pool, overlap: bool) -> float:
    """Ms a decode step of n rows in a chain of `steps` steps, each step's ids the step before's greedy picks,
    as the engine's loop runs them (runtime/step_handoff.py): serial, the host reads step k's ids (`choices`)
    before it plans and launches step k + 1; overlapped, step k + 1's forward is planned and enqueued first, its
    ids taken from step k's sample inside the forward (gathered on the device, or read on the host just before
    the Engram hash where the model has Engram and no gate: `model.engram_gate`), and step k's ids are read
    afterwards on the side stream (its event only). Returns the chain's wall time from the first launch (the
    device idle) to the last ids in hand, over `steps` (on the CPU both orders compute the same and give the same figure)."""
    from dsv41.engine.batch import Row, RowSampling
    from dsv41.runtime.model_runner import ModelRunner
    from dsv41.runtime.step_handoff import Handoff, StepSample

    rows = rows_fn()
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    rows_obj = [Row(i, 0, [0], 0, [], sample=RowSampling(0.0, 1.0, 0, 0.0, 0, 0)) for i in range(n)]
    follow_index = list(range(n))
    batches = [rows() for _ in range(steps)]  # the sequences' states: planned before the clock starts
    prev = None
    sync(device)
    t0 = time.perf_counter()
    for batch in batches:
        follow = (Handoff(prev, dict(enumerate(follow_index))), follow_index) if overlap and prev else None
        logits = model.forward(batch, "decode", pool=pool, follow=follow)
        sample = StepSample(rows_obj, [logits[i:i + 1] for i in range(n)], device, ModelRunner._choose, side)
        if overlap and prev is not None:
            prev.choices()  # step k's ids, read while step k + 1 runs
        elif not overlap:
            sample.choices()
        prev = sample
    prev.choices()
    return (time.perf_counter() - t0) * 1e3 / steps


def overlap_ab(model, args, device, pool, decode_rows, log, gate=None) -> list[dict]:
    """bench/decode_step.py `--overlap`: per decode row count, the chained step serial and overlapped (the same
    call, the same machine), and the host's share of each against the step's graph replayed alone.
    `decode_rows(n)`: a function giving the next batch of n decode rows over `pool`. `gate` (an EngramGate,
    runtime/engram_gate.py; a model with Engram): the same chains again with the gate on, serial and overlapped
    (the step's graph launched before its Engram rows are read, the host publishing them while it runs)."""
    out = []
    for n in args.rows:
        make = lambda: decode_rows(n)  # noqa: E731
        model.engram_gate = None
        time_chain(model, make, n, 3, device, pool, overlap=True)  # warm: the graphs of this bucket exist already
        serial = time_chain(model, make, n, args.steps + 1, device, pool, overlap=False)
        overlapped = time_chain(model, make, n, args.steps + 1, device, pool, overlap=True)
        split = step_split(model, make(), "decode", device, n, pool)  # (before the gated graph is captured)
        graph = split.get("graph_ms")
        row = {"rows": n, "serial_ms": serial, "overlapped_ms": overlapped, "graph_ms": graph,
               "engram_on_host": model.engram_hasher is not None}
        if graph:
            row.update(host_share_serial=1 - graph / serial, host_share_overlapped=1 - graph / overlapped)
        if gate is not None:
            row.update(gated_chains(model, make, n, args.steps + 1, device, pool, gate))
            if graph:
                row.update(host_share_serial_gated=1 - graph / row["serial_gated_ms"],
                           host_share_gated=1 - graph / row["gated_ms"])
        log(f"overlap rows={n}: serial {serial:.2f} ms, overlapped {overlapped:.2f} ms"
            + (f", with the Engram gate: serial {row['serial_gated_ms']:.2f} ms, overlapped {row['gated_ms']:.2f} ms"
               f" (rows published after the launch in {row['gate_fed']['after']} of "
               f"{sum(row['gate_fed'].values())} steps)" if gate is not None else "")
            + (f" (graph alone {graph:.2f} ms: host share {row['host_share_serial']:.1%} -> "
               f"{row['host_share_overlapped']:.1%}"
               + (f" -> {row['host_share_gated']:.1%} gated" if gate is not None else "") + ")" if graph else "")
            + ("; the ids read on the host before the Engram hash" if row["engram_on_host"] and gate is None
               else ""))
        out.append(row)
    return out


def gated_chains(model, make, n: int, steps: int, device, pool, gate) -> dict:
    """The chained step with the Engram gate, serial and overlapped (after a warm chain that captures the gated
    graph), how many of its steps published their rows after the launch, and the gate's check of them all."""
    model.engram_gate = gate
    try:
        time_chain(model, make, n, 3, device, pool, overlap=True)
        before = dict(gate.fed)
        out = {"serial_gated_ms": time_chain(model, make, n, steps, device, pool, overlap=False),
               "gated_ms": time_chain(model, make, n, steps, device, pool, overlap=True)}
        out["gate_fed"] = {k: gate.fed[k] - before[k] for k in before}  # published before / after the launch
        gate.check(gate.take_steps())  # no step ran without its rows
        return out
    finally:
        model.engram_gate = None
