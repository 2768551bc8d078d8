"""Time the attention core over the pool (kernels/step/attention.py `attention_pool`) at the release's decode shapes
for a sweep of split sizes, key blocks and warps: which tiling the decode step should use (docs/perf/decode_step.md).
One row and 16 rows, 32 local heads (TP=2) of 512, window 128, index top-k 512, FP8 window rows and FP4 entries,
context 2,048.

    python3 bench/attention_sweep.py [--out bench/results/attention_sweep.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

import torch

from dsv41.kernels.step.attention import attention_pool
from dsv41.runtime.kv_pool import KVPool, SourceLayout


def build(B: int, H: int = 32, hd: int = 512, window: int = 128, topk: int = 512, context: int = 2048):
    dev = torch.device("cuda")
    per_page = 128
    pages_per = -(-context // 2 // per_page) + 1
    pool = KVPool(num_slots=B, num_pages=B * pages_per, page_tokens=256, ring_rows=window + 6, window_layers=[0],
                  sources=[SourceLayout(2, 2, per_page, True)], head_dim=hd, index_head_dim=128,
                  dtype=torch.bfloat16, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    for s in range(B):
        pool.write_ring("window", 0, s, context - window, torch.randn(window, hd, generator=g, device=dev).bfloat16())
        pages = list(range(s * pages_per, (s + 1) * pages_per))
        pool.write_entries(2, pages, 0, torch.randn(context // 2, hd, generator=g, device=dev).bfloat16(), None)
    pages = torch.tensor([list(range(s * pages_per, (s + 1) * pages_per)) for s in range(B)], device=dev)
    ids = torch.sort(torch.stack([torch.randperm(context // 2, device=dev)[:topk] for _ in range(B)]), dim=1).values
    q = torch.randn(B, H, hd, generator=g, device=dev).bfloat16()
    kw = dict(window_store=pool.stores[("window", 0)], window_codec=pool.window_codec,
              slot=torch.arange(B, device=dev), pos=torch.full((B,), context - 1, device=dev), window=window,
              entry_store=pool.stores[("kv", 2)], entry_codec=pool.kv_codec, pages=pages, per_page=per_page, ids=ids,
              width=topk)
    return q, torch.randn(H, device=dev), kw, pool


def timed(fn, iters=20) -> float:
    """Device µs per call: `iters` calls captured in one CUDA graph, the replay timed (the launcher's Python, which
    a decode step's graph does not pay, stays out)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / iters)
    return statistics.median(times)


def write_rows(out: Path, rows: list) -> None:
    """The table as JSON with the commit (BENCH_COMMIT, else git's HEAD) and the GPU's name."""
    commit = os.environ.get("BENCH_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                              capture_output=True, text=True).stdout.strip()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"commit": commit, "gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention_sweep.json")
    args = p.parse_args()
    rows = []
    for B in (1, 16):
        q, sink, kw, _ = build(B)
        base = attention_pool(q, sink, 512 ** -0.5, **kw)
        for split, block, warps in [(128, 16, 4), (128, 16, 8), (64, 16, 4), (32, 16, 4), (32, 16, 2), (16, 16, 2),
                                    (64, 32, 4), (128, 32, 4), (32, 32, 4), (128, 64, 4), (64, 64, 4), (128, 64, 8)]:
            try:
                us = timed(lambda: attention_pool(q, sink, 512 ** -0.5, split_keys=split, key_block=block,
                                                  num_warps=warps, **kw))
                got = attention_pool(q, sink, 512 ** -0.5, split_keys=split, key_block=block, num_warps=warps, **kw)
                err = float((got - base).abs().max() / base.abs().max())
            except Exception as e:  # noqa: BLE001 - a tiling that does not compile is a row of the table
                us, err = float("nan"), repr(e)[:120]
            rows.append({"B": B, "split_keys": split, "key_block": block, "num_warps": warps, "us": us, "rel": err})
            print(f"B={B:2d} split={split:3d} block={block:2d} warps={warps}: {us:8.1f} us  rel {err}", flush=True)
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
