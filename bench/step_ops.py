"""Per-op timing of one decode step, EAGER, on the full-shape synthetic rank (the same rank as bench/decode_step.py).

The decode step runs its static pieces as CUDA graphs, which the profiler sees as opaque spans. This script runs
the same step eagerly (graphs off) with timing shims around the model's callables, installed for the measurement
only (no runtime code is edited; the shims are class / module attributes put back afterwards):

- leaves (timed one call at a time): every EXL3 / dense linear (`Exl3Linear.__call__`, `DequantLinear.__call__`),
  the routed-expert kernel (`MoeLaunch.run`), the router (`route_rows` / `FusedMoE.route`), the mHC sites
  (`MhcSites.*`), the row ops (norms, RoPE, quantisers: `kernels.step.rowops` and the reference ones), the
  indexer (`FastAttention._index_kernels` / `_topk`), the Engram table gather and hash, the embedding, the comm
  stub's calls and the sampling argmax;
- containers (their own time = the whole call minus the leaves inside it): `FastAttention.attend`, the Engram
  layer (`FastEngram.__call__`) and the shared expert's SwiGLU glue (`swiglu_clamped`).
Each step is run in two passes: "inner" times every leaf (a container only tags the leaves inside it), "outer"
times only the containers (their leaves run untimed inside them). A container's own time is outer - inner leaves.

Timing (CUDA): synchronise, enqueue a spin kernel (`torch.cuda._sleep`, `--pad-us`, calibrated) so the host can
enqueue the op's kernels before the device reaches them, record an event, call, record an event, synchronise:
the events then measure the op's device time (kernels back to back), not its launch latency. An op that syncs
the host inside it, or whose launches take longer than the pad (the containers: per-sequence Python), still shows
its host gaps: that is what it costs eagerly, and with graphs on as well (attend is eager in the graph build).
The per-op synchronisation makes the shimmed step much slower than a real one; the table's times are per-op
device time; "unattributed" = the eager un-shimmed step (events around it) - the sum of the classes (elementwise
glue between the shims, and host gaps of the eager step). CPU (`--tiny`): wall clock per call (synchronous).

Bytes per call: EXL3 linears their packed tensors (`Exl3Linear.nbytes`: trellis + suh + svh), dense linears their
stored tensors, the routed experts the distinct experts of the call's routing, the router its gate (+ bias), an
mHC site its mixing matrix (+ base, scale, norm), row ops their norm vector, the embedding and the Engram table
the rows gathered; attend and the indexer the caches they read (window, selected entries; index keys), reported
apart as cache bytes. `bytes_check`: the classes' EXL3 and dense bytes against decode_step.step_reads of a traced
step (equal, up to the index-key projections of groups not closed in the step, which step_reads counts always).
Floor per class: bytes / read ceiling (measured here as decode_step.py does; CPU: `--ceiling-gbps`), and the
instruction floor of EXL3 classes: weights / the kernels' best decode rate (decode_step.best_decode_rates).

Writes `--out` (default bench/results/step_ops.json) and prints a table per row count.
  H200:  python bench/step_ops.py --rows 1,6,16
  CPU:   python bench/step_ops.py --tiny   (the built-in tiny model's config, Triton's interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

if "--tiny" in sys.argv:  # the kernels on the CPU run in Triton's interpreter: set before Triton decorates them
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import decode_step as ds  # noqa: E402

MISSING: list = []  # shims whose target is not there (see install)
DEFAULT_CEILING_GBPS = 4532.48  # the H200's streaming read measured in bench/results/decode_step.json (3f664b5)


def log(*a):
    print(*a, flush=True)


def _t(obj) -> int:
    return obj.numel() * obj.element_size() if isinstance(obj, torch.Tensor) else 0


# ------------------------------------------------------------------------------------------------ the recorder
class Recorder:
    """Times shimmed calls. mode "inner": leaves timed, containers tag; "outer": containers timed, leaves pass."""

    def __init__(self, device: torch.device, pad_cycles: int = 0):
        self.device, self.cuda = device, device.type == "cuda"
        self.pad_cycles = pad_cycles
        self.mode = "inner"
        self.active = False  # a timed call is running: nested shims call through
        self.ctx = None  # the container the current leaf runs in (inner mode)
        self.step = None  # key -> record of the running step

    def begin(self, mode: str):
        self.mode, self.step, self.ctx, self.active = mode, defaultdict(_record), None, False

    def _time(self, fn):
        if self.cuda:
            torch.cuda.synchronize()
            if self.pad_cycles:
                torch.cuda._sleep(self.pad_cycles)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = fn()
            e.record()
            e.synchronize()
            return out, s.elapsed_time(e)
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) * 1e3

    def call(self, key: str, group: str, container: bool, fn, account=None):
        """`account(out) -> dict of byte counts` runs after the timed region (it may read the device)."""
        if self.step is None or self.active:
            return fn()
        if container and self.mode == "inner":
            prev, self.ctx = self.ctx, key
            try:
                return fn()
            finally:
                self.ctx = prev
        if not container and self.mode == "outer":
            return fn()
        self.active = True
        try:
            out, ms = self._time(fn)
        finally:
            self.active = False
        r = self.step[key]
        r["group"], r["container"] = group, container
        r["calls"] += 1
        r["ms"] += ms
        if self.ctx is not None:  # the part of this leaf's time spent inside a container (inner pass)
            r["ms_in::" + self.ctx] += ms
        for k, v in (account(out) if account else {}).items():
            r[k] += v
        return out


def _record():
    return defaultdict(float, calls=0, ms=0.0)


# ------------------------------------------------------------------------------------------------ the shims
def linear_kind(name: str) -> str:
    """'layers.3.attn.wo_a.slice.2' -> 'attn.wo_a'."""
    return re.sub(r"\.slice\.\d+$", "", re.sub(r"^(layers|mtp)\.\d+\.", "", name or "?"))


def install(model, rec: Recorder):
    """Puts the shims in place; returns the function that takes them out."""
    from dsv41.kernels.step import router as step_router
    from dsv41.kernels.step import rowops
    from dsv41.model import attention as ref_attention
    from dsv41.runtime import model as rt_model
    from dsv41.runtime.layers import attention as rt_attention
    from dsv41.runtime.layers import attention_index as rt_attention_index
    from dsv41.runtime.layers import moe as rt_moe
    from dsv41.runtime.layers.linear import DequantLinear, Exl3Linear

    undo = []

    def patch(owner, attr, make):
        orig = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if orig is None:  # the runtime moved on: that class's time goes to "unattributed" (listed in the JSON)
            MISSING.append(f"{getattr(owner, '__name__', owner)}.{attr}")
            return
        setattr(owner, attr, make(orig))
        undo.append((owner, attr, orig))

    def leaf(owner, attr, key, group, account=None, container=False):
        """key / account: fixed values, or functions of the call's (args, kwargs) / (args, out)."""
        def make(orig):
            def shim(*a, **k):
                name = key(a, k) if callable(key) else key
                grp = group(a, k) if callable(group) else group
                acc = (lambda out: account(a, out)) if account else None
                return rec.call(name, grp, container, lambda: orig(*a, **k), acc)
            return shim
        patch(owner, attr, make)

    # linears
    def exl3_key(a, k):
        lin = a[0]
        w = lin.weight
        kind = "head" if lin.fused_only else linear_kind(lin.name)
        return f"{'head' if lin.fused_only else 'exl3'} {kind} {w.k}x{w.n} K{w.K}"

    leaf(Exl3Linear, "__call__", exl3_key, lambda a, k: "head" if a[0].fused_only else "exl3",
         lambda a, out: {"exl3_bytes": a[0].nbytes, "exl3_weights": a[0].in_features * a[0].out_features})
    leaf(DequantLinear, "__call__",
         lambda a, k: f"dense {linear_kind(a[0].name)} {a[0].in_features}x{a[0].out_features} {a[0].fmt}", "dense",
         lambda a, out: {"dense_bytes": a[0].nbytes})

    # routed experts: the distinct experts of the call's routing (x, ids, weights, w1, w3, w2, limit)
    def moe_bytes(a, out):
        _, x, ids, _, w1, w3, w2 = a[:7]
        d = int(ids.reshape(-1).unique().numel())
        return {"exl3_bytes": d * (w1.expert_nbytes + w3.expert_nbytes + w2.expert_nbytes),
                "exl3_weights": d * (w1.k * w1.n + w3.k * w3.n + w2.k * w2.n), "distinct_experts": d}

    leaf(rt_moe.MoeLaunch, "run", "moe routed experts (kernel)", "moe", moe_bytes)

    # router
    leaf(step_router, "route_rows", "router", "router",
         lambda a, out: {"dense_bytes": _t(a[1]), "other_bytes": _t(a[2])})
    leaf(rt_moe.FusedMoE, "route", "router", "router",
         lambda a, out: {"dense_bytes": _t(a[0].gate_t), "other_bytes": _t(a[0].gate_bias)})
    leaf(rt_moe, "swiglu_clamped", "shared expert glue (act, adds)", "moe", container=True)

    # mHC
    def hc_bytes(p_at, norm_at):
        def acc(a, out):
            p = a[p_at] if p_at is not None else None
            return {"dense_bytes": _t(p.fn_t) if p is not None else 0,
                    "other_bytes": (_t(p.base) + _t(p.scale) if p is not None else 0) + _t(a[norm_at] if norm_at else None)}
        return acc

    leaf(rt_model.MhcSites, "site", "mhc site", "mhc", hc_bytes(2, 4))
    leaf(rt_model.MhcSites, "expand_site", "mhc expand+site", "mhc", hc_bytes(5, 7))
    leaf(rt_model.MhcSites, "expanded", "mhc expand", "mhc")
    leaf(rt_model.MhcSites, "collapse_norm", "mhc collapse+norm (final)", "mhc", hc_bytes(None, 3))

    # row ops (kernels, imported at call time; and the reference's, bound in the attention module)
    leaf(rowops, "rms_norm_rows", "rowops rms_norm", "rowops", lambda a, out: {"other_bytes": _t(a[1])})
    leaf(rowops, "rope_rows", "rowops rope(+quant)", "rowops")
    leaf(rowops, "norm_rope_rows", "rowops norm+rope+quant", "rowops", lambda a, out: {"other_bytes": _t(a[1])})
    leaf(rt_attention, "rms_norm", "rowops rms_norm (ref)", "rowops", lambda a, out: {"other_bytes": _t(a[1])})
    for q in ("fp8_block_ue8m0", "fp4_block_ue8m0", "fp4_block_e4m3"):
        leaf(rt_attention, q, "rowops quant (ref)", "rowops")
    leaf(ref_attention.Attention, "_rope", "rowops rope (ref)", "rowops")

    # attention and indexer: caches read (window rows, the selected compressed entries; the index keys)
    def attend_cache(a, out):
        att, segs = a[0], a[4]
        cfg, role, total = att.cfg, att.role, 0
        for s in segs:
            total += _t(s.state.window(role.index).kv)
            if not role.swa_only:
                src = s.state.source(role.kv_source)
                if src.kv is not None and src.kv.shape[0]:
                    total += min(cfg.index_topk, src.kv.shape[0]) * _t(src.kv[0])
        return {"cache_bytes": total}

    def index_cache(a, out):
        att, segs = a[0], a[1]
        return {"cache_bytes": sum(_t(s.state.source(att.role.kv_source).index_k) for s in segs)}

    leaf(rt_attention.FastAttention, "attend", "attention (attend, own)", "attention", attend_cache, container=True)
    leaf(rt_attention_index.FastIndexer, "_index_kernels", "indexer (scores, top-k)", "indexer", index_cache)
    leaf(rt_attention_index.FastIndexer, "_topk", "indexer (scores, top-k)", "indexer")

    # Engram, embedding, comm
    leaf(rt_model.FastEngram, "__call__", "engram (project glue, mix)", "engram", container=True)
    for table_type in {type(e.table) for e in model.engram.values()}:  # FP8 values + one UE8M0 byte per 32
        leaf(table_type, "gather", "engram table gather", "engram",
             lambda a, out: {"other_bytes": out.numel() * 33 // 32})  # the bucket's rows (padding rows too)
    if model.engram_hasher is not None:
        leaf(type(model.engram_hasher), "hash", "engram hash (host)", "engram")
        leaf(type(model.engram_hasher), "live", "engram hash (host)", "engram")
    leaf(rt_model.FastModel, "_embed", "embedding", "embed",
         lambda a, out: {"other_bytes": int(a[1].unique().numel()) * _t(a[0].embed_rows[0])})
    leaf(type(model.comm), "sum_partials", "comm sum_partials (stub)", "comm",
         lambda a, out: {"other_bytes": _t(a[1])})
    leaf(type(model.comm), "gather_cat", "comm gather_cat (stub)", "comm", lambda a, out: {"other_bytes": _t(a[1])})

    def restore():
        for owner, attr, orig in reversed(undo):
            setattr(owner, attr, orig)
    return restore


# ------------------------------------------------------------------------------------------------ steps
def make_batch(model, n: int, context: int, seed: int):
    """Fresh states at `context` for every call (the same caches and tokens each step: every step does the same
    work, so per-step medians and byte counts are of one step)."""
    def batch():
        g = torch.Generator().manual_seed(seed)
        return [(ds.synthetic_state(model, context, seed=seed + i), torch.randint(0, model.cfg.vocab_size, (1,),
                                                                                   generator=g)) for i in range(n)]
    return batch


def step(model, rows, rec: Recorder | None = None, trace=None):
    logits = model.forward(rows, "decode", trace=trace)
    if rec is None:
        return logits.argmax(dim=-1).tolist()
    return rec.call("sampling (argmax, token read)", "sampling", False, lambda: logits.argmax(dim=-1).tolist())


def eager_step_ms(model, batch, device, warmup: int, iters: int) -> dict:
    for _ in range(warmup):
        step(model, batch())
    wall, dev = [], []
    for _ in range(iters):
        rows = batch()
        ds.sync(device)
        t0 = time.perf_counter()
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step(model, rows)
            e.record()
            e.synchronize()
            dev.append(s.elapsed_time(e))
        else:
            step(model, rows)
        wall.append((time.perf_counter() - t0) * 1e3)
    out = {"wall_ms": statistics.median(wall), "wall_times_ms": wall}
    if dev:
        out["events_ms"] = statistics.median(dev)
    return out


def shimmed_steps(model, batch, rec: Recorder, mode: str, warmup: int, iters: int) -> list[dict]:
    out = []
    for i in range(warmup + iters):
        rows = batch()
        rec.begin(mode)
        step(model, rows, rec)
        if i >= warmup:
            out.append({k: dict(v) for k, v in rec.step.items()})
        rec.step = None
    return out


def aggregate(inner: list[dict], outer: list[dict], ceiling_gbps: float, best_wps: float | None) -> list[dict]:
    """Per class: median over the steps of the per-step totals; containers' own time = outer - their leaves."""
    last = inner[-1]
    classes = {}
    for key, r in last.items():
        if r.get("container"):
            continue
        classes[key] = {"class": key, "group": r["group"], "calls": int(r["calls"]), "container": False,
                        "ms": statistics.median(s.get(key, {}).get("ms", 0.0) for s in inner),
                        **{b: r.get(b, 0) for b in ("exl3_bytes", "dense_bytes", "other_bytes", "cache_bytes",
                                                    "exl3_weights", "distinct_experts")}}
    cont = {k for s in outer for k in s}
    for key in sorted(cont):
        r = outer[-1][key]
        own = [o.get(key, {}).get("ms", 0.0) - sum(v.get("ms_in::" + key, 0.0) for v in i.values())
               for o, i in zip(outer, inner)]
        classes[key] = {"class": key, "group": r["group"], "calls": int(r["calls"]), "container": True,
                        "ms": statistics.median(own),
                        "ms_with_leaves": statistics.median(o.get(key, {}).get("ms", 0.0) for o in outer),
                        **{b: r.get(b, 0) for b in ("exl3_bytes", "dense_bytes", "other_bytes", "cache_bytes",
                                                    "exl3_weights", "distinct_experts")}}
    out = []
    for c in classes.values():
        for b in ("exl3_bytes", "dense_bytes", "other_bytes", "cache_bytes", "exl3_weights", "distinct_experts"):
            c[b] = int(c[b])
        c["weight_bytes"] = c["exl3_bytes"] + c["dense_bytes"] + c["other_bytes"]
        c["bytes"] = c["weight_bytes"] + c["cache_bytes"]
        c["per_call_us"] = c["ms"] * 1e3 / max(1, c["calls"])
        c["bytes_per_call"] = c["bytes"] / max(1, c["calls"])
        c["floor_ms"] = c["bytes"] / ceiling_gbps / 1e6
        c["achieved_of_floor"] = c["floor_ms"] / c["ms"] if c["ms"] > 0 else None
        if best_wps and c["exl3_weights"]:
            c["instruction_floor_ms"] = c["exl3_weights"] / best_wps * 1e3
        out.append(c)
    return sorted(out, key=lambda c: -c["ms"])


def measure_rows(model, n, args, device, rec, ceiling, best_wps) -> dict:
    batch = make_batch(model, n, args.context, 100 + n)
    trace = {}
    step(model, batch(), trace=trace)  # traced (untimed): what decode_step.step_reads counts
    reads = ds.step_reads(model, trace)
    eager = eager_step_ms(model, batch, device, args.warmup, args.iters)
    restore = install(model, rec)
    try:
        inner = shimmed_steps(model, batch, rec, "inner", args.warmup, args.iters)
        outer = shimmed_steps(model, batch, rec, "outer", 0, args.iters)
    finally:
        restore()
    classes = aggregate(inner, outer, ceiling, best_wps)
    total = sum(c["ms"] for c in classes)
    ref = eager.get("events_ms", eager["wall_ms"])
    for c in classes:
        c["share"] = c["ms"] / ref if ref else None
    called_wk = sum(c["exl3_bytes"] for c in classes if " attn.indexer.wk " in c["class"])
    all_wk = sum(b.attn.w.compressor.index_wk.nbytes for b in model.blocks
                 if b.attn.w.compressor is not None and b.attn.w.compressor.index_wk is not None)
    exl3 = sum(c["exl3_bytes"] for c in classes)
    dense = sum(c["dense_bytes"] for c in classes)
    check = {"classes_exl3_bytes": exl3, "classes_dense_bytes": dense, "step_reads_exl3_bytes": reads["exl3_bytes"],
             "step_reads_dense_bytes": reads["dense_bytes"], "index_wk_uncalled_bytes": all_wk - called_wk,
             "exl3_equal": exl3 == reads["exl3_bytes"] - (all_wk - called_wk),
             "dense_equal": dense == reads["dense_bytes"]}
    return {"rows": n, "mode": "decode", "context": args.context, "eager_step": eager, "classes": classes,
            "classes_ms": total, "unattributed_ms": ref - total, "step_reads": reads, "bytes_check": check,
            "floor_ms": sum(c["floor_ms"] for c in classes),
            "bytes": sum(c["bytes"] for c in classes)}


def pad_cycles(us: float) -> tuple[int, float | None]:
    """Cycles of `torch.cuda._sleep` for `us` microseconds (calibrated with events); (0, None) if unavailable."""
    if us <= 0 or not hasattr(torch.cuda, "_sleep"):
        return 0, None
    try:
        n = 1_000_000
        torch.cuda._sleep(n)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(n)
        e.record()
        e.synchronize()
        per_us = n / (s.elapsed_time(e) * 1e3)
        return int(us * per_us), per_us
    except Exception:  # noqa: BLE001 - a private API: without it the events include launch latency
        return 0, None


def table(row) -> str:
    lines = [f"decode rows={row['rows']} context={row['context']}: eager step {row['eager_step']['wall_ms']:.2f} ms "
             f"wall / {row['eager_step'].get('events_ms', float('nan')):.2f} ms events; classes {row['classes_ms']:.2f} "
             f"ms; unattributed {row['unattributed_ms']:.2f} ms; bytes {row['bytes'] / 1e9:.3f} GB, floor "
             f"{row['floor_ms']:.3f} ms",
             f"{'class':46} {'calls':>5} {'ms':>8} {'share':>6} {'MB':>9} {'floor_ms':>8} {'ach':>6} {'us/call':>8}"]
    for c in row["classes"]:
        ach = c["achieved_of_floor"]
        lines.append(f"{c['class'][:46]:46} {c['calls']:5d} {c['ms']:8.3f} {100 * (c['share'] or 0):5.1f}% "
                     f"{c['bytes'] / 1e6:9.2f} {c['floor_ms']:8.4f} {'' if ach is None else f'{ach:6.1%}':>6} "
                     f"{c['per_call_us']:8.1f}")
    lines.append(f"bytes_check: {row['bytes_check']}")
    return "\n".join(lines)


def build(args, device):
    from dsv41.config import ModelConfig

    cfg = None
    if args.tiny or args.config:
        if args.config:
            raw = json.loads((Path(args.config) / "config.json").read_text())
        else:
            from dsv41.tiny.model import default_model_dir
            raw = json.loads((default_model_dir() / "config.json").read_text())
        if args.overrides:
            text = raw["text_config"]
            text.update(json.loads(args.overrides))
            rows = text.get("engram_num_embeddings") or []
            if len(rows) > len(text.get("engram_layer_ids") or []):  # fewer Engram layers: their first tables
                text["engram_num_embeddings"] = rows[:len(text["engram_layer_ids"])]
        cfg = ModelConfig.from_dict(raw)
    cuda = device.type == "cuda"
    model = ds.synthetic_rank(cfg, rank=0, world=2, device=device, dtype=torch.bfloat16 if cuda else torch.float32,
                              comm=ds.StubComm(), layers=args.layers)
    model.graphs = ds.PieceGraphs(device, model.comm, enabled=False)  # eager: the shims see every call
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE / "results" / "step_ops.json")
    p.add_argument("--rows", default="1", help="decode row counts, e.g. 1,6,16")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--iters", type=int, default=5, help="measured steps per pass (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--pad-us", type=float, default=200.0, help="spin before each timed op (CUDA), 0: none")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="the built-in tiny model's config on the CPU (interpreter)")
    p.add_argument("--config", default=None, help="a model folder whose config.json replaces the real shapes")
    p.add_argument("--overrides", default=None, help="JSON merged into the config's text_config (smoke runs)")
    p.add_argument("--device", default=None, help="default: cuda, cpu with --tiny")
    p.add_argument("--ceiling-gbps", type=float, default=None,
                   help="read ceiling for the floors (default: measured on CUDA, else decode_step.json's H200 value)")
    p.add_argument("--no-rates", action="store_true", help="skip the kernels' best decode rate (instruction floor)")
    args = p.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",") if r]
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    cuda = device.type == "cuda"
    commit = os.environ.get("BENCH_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                                                              capture_output=True, text=True).stdout.strip()
    import triton

    results = {"commit": commit or "unknown", "device": torch.cuda.get_device_name() if cuda else "cpu",
               "torch": torch.__version__, "triton": triton.__version__,
               "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "timer": "cuda events around each op after a spin pad" if cuda else "wall clock per op (cpu)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        args.out.write_text(json.dumps(results, indent=1) + "\n")

    ceiling = args.ceiling_gbps
    if ceiling is None and cuda:
        from exl3_kernels import read_ceiling_gbps
        results["ceilings"] = read_ceiling_gbps()
        ceiling = results["ceilings"]["read_gbps"]
    ceiling = ceiling or DEFAULT_CEILING_GBPS
    results["ceiling_gbps"] = ceiling
    t0 = time.perf_counter()
    model = build(args, device)
    ds.sync(device)
    results["build_s"] = time.perf_counter() - t0
    results["held_bytes"] = model.stored_bytes()
    log(f"built in {results['build_s']:.1f} s, {results['held_bytes'] / 2**30:.2f} GiB held; read ceiling "
        f"{ceiling:.0f} GB/s")
    best_wps = None
    if cuda and not args.no_rates:
        try:
            rates = ds.best_decode_rates(model)
            best_wps = max(rates["head_wps"], rates["expert_wps"])
            results["kernel_rates"] = {**rates, "best_wps": best_wps}
        except Exception as e:  # noqa: BLE001 - the floor is extra; the per-op times matter more
            results["kernel_rates"] = {"error": repr(e)}
    cycles, per_us = pad_cycles(args.pad_us) if cuda else (0, None)
    results["pad"] = {"us": args.pad_us if cycles else 0, "cycles": cycles, "cycles_per_us": per_us}
    save()
    rec = Recorder(device, cycles)
    results["steps"] = []
    results["missing_shims"] = MISSING
    for n in args.rows:
        row = measure_rows(model, n, args, device, rec, ceiling, best_wps)
        results["steps"].append(row)
        save()
        log(table(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
