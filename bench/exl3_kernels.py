"""Benchmark of dsv41's EXL3 kernels on the pack's shapes (one run on the H200).

`ours` is the CUDA path (what the engine runs on NVIDIA GPUs, library defaults); `triton` the portable Triton
kernel; `dense` a bf16 cuBLAS matmul on a dense matrix of the same shape.

Writes bench/results/exl3_kernels.json (or --out) and a PNG plot beside it. Method (METHOD.md): every number is
the median over graph replays; each replay launches the kernel on several copies of the weights in turn so that
they are read from HBM, not L2; the read ceiling is measured in the same run by a plain streaming-read kernel.

`exllamav3` is ExLlamaV3 1.6.5's own kernels on the same tensors, through its own layer classes
(`bench/exllamav3_ref.py` builds the part of its extension they need from the wheel given with --exllamav3; its
whole JIT build of ~177 sources does not fit a device session). Without --exllamav3, or if that build fails,
`exllamav3_us` is null and only the issue's quoted H200 numbers (`exllamav3_quoted_us`) are shown.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dsv41.kernels.exl3.cuda import (  # noqa: E402
    TUNING,
    MoeCudaConfig,
    default_moe_config,
    default_splits,
    fused_matmul_cuda,
    moe_forward_cuda,
)
from dsv41.kernels.exl3.matmul import MatmulConfig, default_config, fused_matmul  # noqa: E402
from dsv41.kernels.exl3.moe import MoeConfig, moe_forward  # noqa: E402
from dsv41.kernels.exl3.reconstruct import prefill_matmul  # noqa: E402
from dsv41.kernels.exl3.layout import Exl3ExpertStack, Exl3Tensor  # noqa: E402

L2_BYTES = 60 * 2**20
SHAPES = [
    # name, k, n, K
    ("expert gate/up", 5120, 2304, 3),
    ("expert gate/up L18-22", 5120, 2304, 2),
    ("expert down", 2304, 5120, 3),
    ("shared expert gate/up", 5120, 2304, 5),
    ("wq_b", 1280, 32768, 5),
    ("wo_b", 8192, 5120, 5),
    ("head", 5120, 129280, 6),
]
ROWS = [1, 2, 4, 8, 16]
# ExLlamaV3 1.6.5 on this H200 as quoted in issue 6 (median of graph replays, weights out of L2): (m=1, m=8).
EXL3_QUOTED = {
    ("5120x2304", 3): {1: 14.1, 8: 17.2},
    ("2304x5120", 3): {1: 11.7, 8: 18.5},
    ("1280x32768", 5): {1: 22.0, 8: 29.2},
    ("8192x5120", 5): {1: 25.9, 8: 40.4},
    ("5120x129280", 6): {1: 239.0, 8: 383.0},
}
EXL3_MOE_QUOTED = {1: 118.0, 4: 392.0}


# ---------------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------------


def graph_time_us(launches: list, replays: int = 15) -> float:
    """Median time of one launch: a CUDA graph runs all `launches` in order; median over replays / len."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in launches[:3]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in launches:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / len(launches))
    del graph
    return statistics.median(times)


@triton.jit
def _read_kernel(x_ptr, out_ptr, per_program, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * per_program
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in range(0, per_program, BLOCK):
        acc += tl.load(x_ptr + base + i + tl.arange(0, BLOCK))
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def read_ceiling_gbps() -> dict:
    n = 2**29  # 2 GiB of int32
    x = torch.randint(-1000, 1000, (n,), dtype=torch.int32, device="cuda")
    programs = 132 * 16
    per_program = n // programs // 4096 * 4096
    out = torch.empty(programs, dtype=torch.int32, device="cuda")
    read_bytes = programs * per_program * 4
    t_read = graph_time_us([lambda: _read_kernel[(programs,)](x, out, per_program, BLOCK=4096, num_warps=8)] * 4)
    y = torch.empty_like(x)
    t_copy = graph_time_us([lambda: y.copy_(x)] * 4)
    del x, y
    torch.cuda.empty_cache()
    return {"read_gbps": read_bytes / t_read / 1e3, "copy_rw_gbps": 2 * n * 4 / t_copy / 1e3}


# ---------------------------------------------------------------------------------------------------------------
# matrices
# ---------------------------------------------------------------------------------------------------------------


def make_copies(k: int, n: int, K: int, min_bytes: int) -> list[Exl3Tensor]:
    one = k * n * K // 8
    copies = max(1, math.ceil(min_bytes / one))
    out = []
    for _ in range(copies):
        trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int32, device="cuda")
        suh = (torch.randn(k, device="cuda") * 0.02).half()
        svh = torch.randn(n, device="cuda").half()
        out.append(Exl3Tensor.from_group(trellis.to(torch.int16), suh, svh, "mul1"))
    return out


def time_ours(copies: list[Exl3Tensor], m: int, splits: int | None = None) -> float:
    """The CUDA kernel (what the engine runs on NVIDIA GPUs); splits=None is the library default."""
    x = torch.randn(m, copies[0].k, device="cuda").half()
    outs = [torch.empty(m, c.n, device="cuda", dtype=torch.float16) for c in copies]
    launches = [lambda c=c, o=o: fused_matmul_cuda(x, c, splits=splits, out=o) for c, o in zip(copies, outs)]
    reps = max(1, 24 // len(launches))
    return graph_time_us(launches * reps)


def as_trellis(words: torch.Tensor) -> torch.Tensor:
    """The int16 trellis `[..., k/16, n/16, 16K]` ExLlamaV3 takes, as a view of our int32 words."""
    return words.view(torch.int16)


def time_exllamav3(ext, copies: list[Exl3Tensor], m: int) -> tuple[float, str]:
    """ExLlamaV3's EXL3 linear (its BC_LinearEXL3 -> exl3_gemm) on the same copies; also the kernel it picked."""
    import exllamav3_ref

    x = torch.randn(m, copies[0].k, device="cuda").half()
    layers = [exllamav3_ref.make_linear(ext, as_trellis(c.words), c.suh, c.svh, c.K, False, True) for c in copies]
    outs = [torch.empty(m, c.n, device="cuda", dtype=torch.float16) for c in copies]
    for layer, o in zip(layers, outs):  # the first call of a shape autotunes: never inside the capture
        layer(x, o)
    torch.cuda.synchronize()
    c = copies[0]
    route = exllamav3_ref.linear_route(ext, x, as_trellis(c.words), c.suh, c.svh, False, True)
    launches = [lambda f=f, o=o: f(x, o) for f, o in zip(layers, outs)]
    return graph_time_us(launches * max(1, 24 // len(launches))), route


def time_triton(copies: list[Exl3Tensor], m: int, cfg: MatmulConfig) -> float:
    x = torch.randn(m, copies[0].k, device="cuda").half()
    outs = [torch.empty(m, c.n, device="cuda", dtype=torch.float16) for c in copies]
    launches = [lambda c=c, o=o: fused_matmul(x, c, config=cfg, out=o) for c, o in zip(copies, outs)]
    reps = max(1, 24 // len(launches))
    return graph_time_us(launches * reps)


def time_dense(k: int, n: int, m: int) -> float:
    one = k * n * 2
    copies = max(1, math.ceil(4 * L2_BYTES / one))
    ws = [torch.randn(k, n, device="cuda").bfloat16() for _ in range(copies)]
    x = torch.randn(m, k, device="cuda").bfloat16()
    launches = [lambda w=w: torch.matmul(x, w) for w in ws]
    reps = max(1, 24 // len(launches))
    t = graph_time_us(launches * reps)
    del ws
    return t


def sweep_splits(copies: list[Exl3Tensor], log) -> list[dict]:
    """CUDA kernel at m=1 and m=16 for several split-K counts (the count must not depend on m: row invariance)."""
    k, n = copies[0].k, copies[0].n
    d = default_splits(k, n, 132)
    options = sorted({s for s in (d - 2, d - 1, d, d + 1, d + 2) if 1 <= s <= k // 128}
                     | {default_splits(k, n, 132, b) for b in (1, 3, 4)})
    tried = []
    for splits in options:
        t1 = time_ours(copies, 1, splits)
        t16 = time_ours(copies, 16, splits)
        tried.append({"splits": splits, "m1_us": t1, "m16_us": t16})
        log(f"    splits={splits}: m=1 {t1:.1f} us, m=16 {t16:.1f} us")
    return tried


# ---------------------------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------------------------


def moe_bench(log, experts: int = 384, K: int = 3, cfg=None, triton: bool = False, tuning=None,
              exl3_ext=None) -> list[dict]:
    def stack(k, n):
        trellis = torch.randint(-32768, 32768, (experts, k // 16, n // 16, 16 * K), dtype=torch.int32, device="cuda")
        suh = (torch.randn(experts, k, device="cuda") * 0.02).half()
        svh = torch.randn(experts, n, device="cuda").half()
        return Exl3ExpertStack.from_stacked(trellis.to(torch.int16), suh, svh, "mul1")

    w1, w3, w2 = stack(5120, 2304), stack(5120, 2304), stack(2304, 5120)
    exl3_moe = None
    if exl3_ext is not None and not triton:
        import exllamav3_ref

        exl3_moe = exllamav3_ref.make_moe(exl3_ext, *[(as_trellis(w.words), w.suh, w.svh) for w in (w1, w3, w2)],
                                          experts=experts, top_k=6, out_dtype=torch.float)
    rows_out = []
    gen = torch.Generator().manual_seed(0)
    for rows in ((1,) if triton else (1, 4, 6)):
        sets = []
        for _ in range(16):
            ids = torch.randperm(experts, generator=gen)[: rows * 6].view(rows, 6).cuda()
            sets.append((ids, torch.rand(rows, 6, generator=gen).cuda()))
        x = torch.randn(rows, 5120, device="cuda").half()
        if triton:
            launches = [lambda ids=ids, wts=wts: moe_forward(x, ids, wts, w1, w3, w2, config=cfg) for ids, wts in sets]
        else:
            launches = [lambda ids=ids, wts=wts: moe_forward_cuda(x, ids, wts, w1, w3, w2, config=cfg, tuning=tuning)
                        for ids, wts in sets]
        t = graph_time_us(launches)
        t_exl3 = None
        if exl3_moe is not None:
            # their router hands fp16 weights and int64 ids to the layer; their output stays fp32
            exl3_sets = [(ids.long(), wts.half()) for ids, wts in sets]
            for ids, wts in exl3_sets[:1]:
                exl3_moe(x, ids, wts)
            torch.cuda.synchronize()
            t_exl3 = graph_time_us([lambda ids=ids, wts=wts: exl3_moe(x, ids, wts) for ids, wts in exl3_sets])
        read_floor_bytes = rows * 6 * (w1.expert_nbytes + w3.expert_nbytes + w2.expert_nbytes)
        rows_out.append(
            {
                "rows": rows,
                "experts": rows * 6,
                "ours_us": t,
                "exllamav3_us": t_exl3,
                "exllamav3_quoted_us": EXL3_MOE_QUOTED.get(rows),
                "weight_bytes": read_floor_bytes,
            }
        )
        log(f"  MoE rows={rows} experts={rows * 6}: {t:.1f} us" + (f", ExLlamaV3 {t_exl3:.1f} us" if t_exl3 else ""))
    del w1, w3, w2
    torch.cuda.empty_cache()
    return rows_out


# ---------------------------------------------------------------------------------------------------------------


def crossover(log) -> list[dict]:
    """Fused kernel (16-row blocks) vs reconstruct + cuBLAS, growing m, on two shapes."""
    out = []
    for k, n, K in ((5120, 2304, 3), (8192, 5120, 5)):
        copies = make_copies(k, n, K, 2 * L2_BYTES)
        for m in (16, 32, 64, 128, 256, 512):
            t_fused = time_ours(copies, m)
            x = torch.randn(m, k, device="cuda").half()
            launches = [lambda c=c: prefill_matmul(x, c, out_dtype=torch.float16) for c in copies]
            t_prefill = graph_time_us(launches * max(1, 8 // len(launches)))
            out.append({"shape": f"{k}x{n}", "K": K, "m": m, "fused_us": t_fused, "prefill_us": t_prefill})
            log(f"  crossover {k}x{n} K={K} m={m}: fused {t_fused:.1f} us, prefill {t_prefill:.1f} us")
        del copies
        torch.cuda.empty_cache()
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = []
    for r in results["rows"]:
        key = (r["name"], r["shape"], r["K"])
        if key not in shapes:
            shapes.append(key)
    cols = 4
    fig, axes = plt.subplots(math.ceil(len(shapes) / cols), cols, figsize=(18, 8.5), squeeze=False)
    ceiling = results["read_ceiling_gbps"]
    for ax, (name, shape, K) in zip(axes.flat, shapes):
        rows = [r for r in results["rows"] if r["shape"] == shape and r["K"] == K]
        ms = [r["m"] for r in rows]
        ours = [(r["m"], r["ours_gbps"]) for r in rows if r["ours_us"]]
        if ours:
            ax.plot(*zip(*ours), "o-", label="dsv41 CUDA (fragment decode)")
        ax.plot(ms, [r["weight_bytes"] / r["triton_us"] / 1e3 for r in rows], "x-",
                label="dsv41 Triton (portable path)")
        ax.plot(ms, [r["weight_bytes"] / r["dense_us"] / 1e3 for r in rows], "s--",
                label="dense bf16 cuBLAS (same matrix)")
        e = [(r["m"], r["weight_bytes"] / r["exllamav3_us"] / 1e3) for r in rows if r.get("exllamav3_us")]
        if e:
            ax.plot(*zip(*e), "v-", label="ExLlamaV3 1.6.5 (measured, same tensors)")
        q = [(r["m"], r["weight_bytes"] / r["exllamav3_quoted_us"] / 1e3) for r in rows if r.get("exllamav3_quoted_us")]
        if q:
            ax.plot(*zip(*q), "^", label="ExLlamaV3 1.6.5 (quoted, issue 6)")
        ax.axhline(ceiling, color="gray", lw=0.8, ls=":", label="read ceiling")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{name} {shape} K={K}", fontsize=9)
        ax.set_xlabel("rows m")
        ax.set_ylabel("EXL3 weight bytes / time (GB/s)")
    for ax in list(axes.flat)[len(shapes):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"EXL3 kernels on {results['gpu']} (commit {results['commit'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "exl3_kernels.json"))
    parser.add_argument("--commit", default=os.environ.get("BENCH_COMMIT", "unknown"))
    parser.add_argument("--sweep", action="store_true", help="try several launch configs per shape")
    parser.add_argument("--skip-crossover", action="store_true")
    parser.add_argument("--exllamav3", type=Path, help="ExLlamaV3 1.6.5 wheel: build its kernels and time them too")
    parser.add_argument("--exllamav3-build", type=Path,
                        default=Path(__file__).resolve().parents[1] / "build" / "exllamav3_ref")
    args = parser.parse_args()
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    torch.manual_seed(0)
    ceiling = read_ceiling_gbps()
    log(f"read ceiling {ceiling['read_gbps']:.0f} GB/s, copy (r+w) {ceiling['copy_rw_gbps']:.0f} GB/s")
    results = {
        "commit": args.commit,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "read_ceiling_gbps": ceiling["read_gbps"],
        "copy_rw_gbps": ceiling["copy_rw_gbps"],
        "exllamav3_note": "exllamav3_us: ExLlamaV3 1.6.5's own kernels on the same tensors through its layer "
        "classes (bench/exllamav3_ref.py), null where not measured; exllamav3_quoted_us: the issue's own H200 "
        "measurements",
        "cuda_tuning": dict(TUNING),
        "rows": [],
        "configs": {},
        "moe": [],
    }
    exl3_ext = None
    if args.exllamav3:
        import exllamav3_ref

        t0 = time.time()
        try:
            exl3_ext = exllamav3_ref.build(args.exllamav3, args.exllamav3_build)
            results["exllamav3_build_s"] = time.time() - t0
            log(f"ExLlamaV3 1.6.5 subset built/loaded in {results['exllamav3_build_s']:.0f} s")
            results["exllamav3_check"] = exllamav3_ref.check(exl3_ext)
            log(f"ExLlamaV3 check against the fp64 reference: {json.dumps(results['exllamav3_check'])}")
        except Exception as exc:  # ours are still measured; the JSON says why theirs are not
            results["exllamav3_error"] = f"{type(exc).__name__}: {exc}"[:2000]
            log(f"ExLlamaV3 not measured: {results['exllamav3_error']}")
            exl3_ext = None
    for name, k, n, K in SHAPES:
        copies = make_copies(k, n, K, 4 * L2_BYTES)
        shape = f"{k}x{n}"
        log(f"{name} {shape} K={K}: {len(copies)} copies of {copies[0].nbytes / 1e6:.1f} MB")
        splits = default_splits(k, n, torch.cuda.get_device_properties(0).multi_processor_count)
        results["configs"][f"{shape}/K{K}"] = {"splits": splits}
        if args.sweep:
            results["configs"][f"{shape}/K{K}"]["tried"] = sweep_splits(copies, log)
        triton_cfg = default_config(copies[0])
        for m in ROWS:
            ours = time_ours(copies, m)
            tri = time_triton(copies, m, triton_cfg)
            dense = time_dense(k, n, m)
            exl3_us = exl3_route = None
            if exl3_ext is not None:
                try:
                    exl3_us, exl3_route = time_exllamav3(exl3_ext, copies, m)
                except Exception as exc:
                    log(f"  m={m}: ExLlamaV3 failed: {type(exc).__name__}: {exc}")
            nbytes = copies[0].nbytes
            row = {
                "name": name,
                "shape": shape,
                "K": K,
                "m": m,
                "ours_us": ours,
                "triton_us": tri,
                "exllamav3_us": exl3_us,
                "exllamav3_kernel": exl3_route,
                "exllamav3_quoted_us": EXL3_QUOTED.get((shape, K), {}).get(m),
                "dense_us": dense,
                "weight_bytes": nbytes,
                "ours_gbps": nbytes / ours / 1e3,
                "ours_pct_read_ceiling": 100 * nbytes / ours / 1e3 / ceiling["read_gbps"],
                "ours_tweights_per_s": k * n / ours / 1e6,
            }
            results["rows"].append(row)
            log(f"  m={m}: ours {ours:.1f} us ({row['ours_gbps']:.0f} GB/s, {row['ours_pct_read_ceiling']:.0f}%, "
                f"{row['ours_tweights_per_s']:.2f} T w/s), triton {tri:.1f} us, dense bf16 {dense:.1f} us"
                + (f", ExLlamaV3 {exl3_us:.1f} us ({exl3_route})" if exl3_us else ""))
        del copies
        torch.cuda.empty_cache()
        out_path.write_text(json.dumps(results, indent=1))
    moe_rows = []
    configs = [None] + ([MoeCudaConfig(2, 2), MoeCudaConfig(4, 2), MoeCudaConfig(3, 3)] if args.sweep else [])
    for moe_cfg in configs:
        log(f"MoE CUDA config {moe_cfg or 'default'}")
        for row in moe_bench(log, cfg=moe_cfg, exl3_ext=exl3_ext if moe_cfg is None else None):
            row["config"] = (moe_cfg or default_moe_config(5120, 2304)).__dict__
            row["default"] = moe_cfg is None
            moe_rows.append(row)
    results["moe_all_configs"] = moe_rows
    results["moe"] = [r for r in moe_rows if r["default"]]
    tri_moe = moe_bench(log, cfg=MoeConfig(), triton=True)
    results["moe_triton"] = tri_moe
    out_path.write_text(json.dumps(results, indent=1))
    if not args.skip_crossover:
        results["crossover"] = crossover(log)
        out_path.write_text(json.dumps(results, indent=1))
    plot(results, out_path.with_suffix(".png"))
    log(f"wrote {out_path} and {out_path.with_suffix('.png')}")
    print("\nshape        K  m   ours_us    triton  dense_us  exl3_us  vs_exl3  exl3(quoted)  %ceiling")
    for r in results["rows"]:
        q, e = r["exllamav3_quoted_us"], r["exllamav3_us"]
        e_txt = f"{e:.1f}" if e else "-"
        ratio = f"{e / r['ours_us']:.2f}x" if e else "-"
        print(f"{r['shape']:<12} {r['K']} {r['m']:>2} {r['ours_us']:9.1f} {r['triton_us']:9.1f} "
              f"{r['dense_us']:9.1f} {e_txt:>8} {ratio:>8} {q if q else '-':>12} {r['ours_pct_read_ceiling']:8.1f}")
    for r in results["moe"]:
        print(f"MoE rows={r['rows']} experts={r['experts']}: {r['ours_us']:.1f} us (ExLlamaV3 measured "
              f"{r['exllamav3_us']}, quoted {r['exllamav3_quoted_us']})")


if __name__ == "__main__":
    main()
