"""Prefill of one full-shape synthetic rank (rank 0 of TP=2) at several prompt lengths, with its floors (issue 31).

One call measures, in this order (results saved after each stage, so a run cut short keeps what it measured):
- the ceilings: the bf16 GEMM rate on random data;
- the prefill kernels alone on layer 0's matrices (`kernels/exl3/prefill.py`): the routed experts at one chunk
  (grouped tiles: EXL3 weights decoded per second, the GEMM's TFLOP/s) and every dense shape of the layer both ways
  (`ms`: the tiles; `gemm_ms`: decoded once into the workspace + one GEMM, `kernels/exl3/prefill_dense.py`, with
  `decode_ms` its decode alone and `gemm_rel_to_tile`; summed in `dense_ms` / `dense_gemm_ms`; `dense_sweep`: every
  launch shape of the dense GEMM (`DSV41_PREFILL_DENSE_TILE`) and the group launches (`DSV41_PREFILL_DENSE_GROUP`)
  at the chunk and 8,192 rows, their bits and row invariance, `prefill_dense_sweep.py`); the prefill row
  kernels, old work distribution vs new (`row_kernels`: rotations, SwiGLU + rotation, the queries' RoPE); the
  attention core of one layer's chunk, gathered, indexed and one-pass (`attention_core_alone`; the one-pass
  launch alone at 1x and 4x the chunk over a few tilings: `onepass_tilings`); the indexer's top-k
  over a 128K prompt's chunk of ratio-2 rows, radix select against the bisection (`topk_alone`); layer 0's two mHC
  sites at the chunk and at 8,192 rows, row kernels against the prefill tiles, the row blocks and the split
  launches (`split_ms`, `split_coeff_max_abs_diff`, `split_x_bitwise`), and the blocks' tilings (`mhc_sites_alone`);
  the routed
  experts' CUDA tiles at `--tile-ab` rows (2,048, 8,192, 32,768), 64- vs 128-row tiles in both launch orders, evenly
  loaded and skewed routing, the bits compared (`expert_tiles_ab`, `kernels.expert_tiles`; exit status 1 if
  they differ);
- per prompt length (`--lengths`), the prompt prefilled in `--chunk`-row chunks into one sequence: seconds and
  tokens/s, the first and the last chunk's time apart (attention and the indexer grow with the position); then
  the same prompt under CED bounded replay (`--prefill replay`: the decoder layers over the last window only;
  `--no-replay` skips it), reported beside it (`replay`: seconds, tokens/s, speed-up over exact);
- the per-section table of one profiled chunk at position 0 and one at the longest prompt's last chunk;
- A/B in the same process: the 2K chunk on the reconstruct + cuBLAS path (`DSV41_PREFILL_TILES=0`);
- the floors per chunk: the weight-decode floor (the rank's EXL3 weights that the chunk touches, once, at the
  decode rate measured above) and the GEMM floor (the chunk's FLOPs at the measured bf16 rate).

On an H100 (80 GB) the full rank (~98 GiB) does not fit: `--layers N` builds the first N layers; every figure is
reported as measured and scaled to 40 layers (`scaled_40`: time x 40 / N for the per-layer work).

    python bench/prefill.py --layers 26 --lengths 2048,8192,32768 --out bench/results/prefill.json
    python bench/prefill.py --layers 1 --kernels-only --out bench/results/prefill_tiles128.json   # kernels alone
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from decode_step import StubComm, bf16_tflops, log, prefill_flops  # noqa: E402
from prefill_kernels import expert_tiles_ab, kernels_alone  # noqa: E402
from step_profile import classify, sync  # noqa: E402

from dsv41.runtime import sections  # noqa: E402
from dsv41.runtime.synthetic import synthetic_rank  # noqa: E402


def prefill_prompt(model, length: int, chunk: int, seed: int = 0, replay: bool = False) -> dict:
    """One prompt of `length` tokens prefilled in `chunk`-row chunks into a new sequence; `replay`: under CED
    bounded replay (the decoder layers run the last `sliding_window` rows only, MODEL.md §11)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.cfg.vocab_size, (length,), generator=g)
    st = model.new_state()
    chunk_s = []
    replay_from = [max(0, length - model.cfg.sliding_window)] if replay else None
    sync(torch.device("cuda"))
    t0 = time.perf_counter()
    for start in range(0, length, chunk):
        c0 = time.perf_counter()
        model.forward([(st, ids[start:start + chunk])], "prefill", replay_from=replay_from)
        sync(torch.device("cuda"))
        chunk_s.append(time.perf_counter() - c0)
    seconds = time.perf_counter() - t0
    return {"length": length, "chunk": chunk, "seconds": seconds, "tokens_per_s": length / seconds,
            "first_chunk_s": chunk_s[0], "last_chunk_s": chunk_s[-1], "chunks": len(chunk_s)}, st, ids


def profile_chunk(model, state, ids) -> dict:
    from torch.profiler import ProfilerActivity, profile

    sections.enable(True)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            model.forward([(state, ids)], "prefill")
            sync(torch.device("cuda"))
            wall = time.perf_counter() - t0
    finally:
        sections.enable(False)
    cls = classify(prof)
    res = {"rows": int(ids.numel()), "wall_ms_profiled": wall * 1e3, "device_ms": cls["busy_us"] / 1e3,
           "sections_ms": {k: v / 1e3 for k, v in sorted(cls["device_us"].items(), key=lambda t: -t[1])},
           "launches": dict(cls["launches"]), "top_kernels": cls["kernels_us"]}
    log(f"profiled chunk of {ids.numel()} rows: device busy {res['device_ms']:.0f} ms; per section (ms / launches): "
        + ", ".join(f"{k} {v:.1f}/{cls['launches'].get(k, 0)}" for k, v in res["sections_ms"].items()))
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE / "results" / "prefill.json")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--lengths", default="2048,8192,32768")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--ab", action="store_true", help="the 2K chunk on the reconstruct path too (DSV41_PREFILL_TILES=0)")
    p.add_argument("--budget-s", type=float, default=None, help="skip the longer prompts past this many seconds")
    p.add_argument("--kernels-only", action="store_true", help="stop after the kernels alone (A/B of kernel options)")
    p.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="time the kernels alone first (--no-kernels: prompts only; the kernels' scratch, up to 4x "
                        "the chunk, otherwise stays in the caching allocator beside the prompts)")
    p.add_argument("--tile-ab", default="2048,8192,32768",
                   help="row counts at which the experts' CUDA tiles are timed with 64 vs 128 rows and both launch "
                        "orders, the bits compared (kernels.expert_tiles; empty: none)")
    p.add_argument("--replay", action=argparse.BooleanOptionalAction, default=True,
                   help="each prompt also under CED bounded replay (--prefill replay), reported beside it (default on)")
    args = p.parse_args(argv)
    started = time.perf_counter()
    dev = torch.device("cuda")
    commit = os.environ.get("BENCH_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                              capture_output=True, text=True).stdout.strip()
    from dsv41.kernels.exl3.backend import use_cuda_backend

    res = {"commit": commit or "unknown", "gpu": torch.cuda.get_device_name(), "chunk": args.chunk,
           "backend": "cuda" if use_cuda_backend(dev) else "triton",
           "exl3_tuning": os.environ.get("DSV41_EXL3_TUNING", "default")}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        args.out.write_text(json.dumps(res, indent=1) + "\n")

    tflops = bf16_tflops()
    res["bf16_tflops"] = tflops
    t0 = time.perf_counter()
    model = synthetic_rank(None, rank=0, world=2, device=dev, dtype=torch.bfloat16, comm=StubComm(),
                           layers=args.layers)
    sync(dev)
    n_layers = len(model.blocks)
    scale = model.cfg.num_hidden_layers / n_layers
    res.update(layers=n_layers, scale_to_40=scale, build_s=time.perf_counter() - t0,
               held_gib=model.stored_bytes() / 2 ** 30)
    log(f"{res['gpu']}: {n_layers} layers built in {res['build_s']:.1f} s, {res['held_gib']:.1f} GiB; bf16 "
        f"{tflops:.0f} TFLOP/s")
    save()
    res["kernels"] = kernels_alone(model, args.chunk, tflops) if args.kernels else {"skipped": "--no-kernels"}
    save()
    tile_rows = [int(v) for v in args.tile_ab.split(",") if v] if args.kernels else []
    res["kernels"]["expert_tiles"] = expert_tiles_ab(model, tile_rows) if tile_rows else []
    save()
    torch.cuda.empty_cache()  # the kernels' scratch back to the device before the prompts
    bits_ok = all(r.get("same_bits", True) for r in res["kernels"]["expert_tiles"])
    if not bits_ok:
        log("ERROR: the 64- and 128-row prefill tiles gave different bits (kernels.expert_tiles)")
    if args.kernels_only:
        return 0 if bits_ok else 1
    # warm-up: every kernel compiled (a chunk of each kind of position), at the chunks' row counts too (some launch
    # shapes follow the rows: e.g. the rotations' row blocks a program, a constexpr of their Triton kernels)
    for rows in sorted({256, *(min(args.chunk, int(v)) for v in args.lengths.split(",") if v)}):
        model.forward([(model.new_state(), torch.randint(0, model.cfg.vocab_size, (rows,)))], "prefill")
    sync(dev)
    runs = []
    last = None
    for length in [int(v) for v in args.lengths.split(",") if v]:
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            runs.append({"length": length, "skipped": "budget"})
            continue
        r, st, ids = prefill_prompt(model, length, args.chunk)
        r["scaled_40_tokens_per_s"] = r["tokens_per_s"] / scale
        runs.append(r)
        last = (st, length)
        log(f"prompt {length}: {r['seconds']:.2f} s, {r['tokens_per_s']:.0f} tok/s ({n_layers} layers; "
            f"{r['scaled_40_tokens_per_s']:.0f} scaled to 40), chunks first {r['first_chunk_s'] * 1e3:.0f} ms "
            f"last {r['last_chunk_s'] * 1e3:.0f} ms")
        res["prompts"] = runs
        save()
        if args.replay:
            r["replay"] = replay_run(model, length, args.chunk, r)
            save()
    g = torch.Generator().manual_seed(1)
    # the traced and profiled chunk: at most 2,048 rows (a traced 8K chunk keeps every layer's tensors and did not
    # fit an H100 with 26 layers)
    prof_rows = min(args.chunk, 2048)
    res["profile_rows"] = prof_rows
    ids = torch.randint(0, model.cfg.vocab_size, (prof_rows,), generator=g)
    trace = {}
    model.forward([(model.new_state(), ids)], "prefill", trace=trace)
    flops = prefill_flops(model, trace, prof_rows)
    distinct = 0
    weights = 0
    for block in model.blocks:
        s = block.moe.experts
        touched = int(torch.cat([t["router_ids"].reshape(-1) for t in trace[block.index]]).unique().numel())
        distinct += touched
        weights += touched * (2 * s.w1.k * s.w1.n + s.w2.k * s.w2.n)
        weights += sum(lin.in_features * lin.out_features for lin in block.attn.linears())
        weights += sum(lin.in_features * lin.out_features for trio in block.moe.shared for lin in trio)
    rate = res["kernels"].get("experts", {}).get("weights_per_s")  # None under --no-kernels
    res["floors"] = {"chunk_gemm_tflop": flops / 1e12, "gemm_floor_ms": flops / (tflops * 1e12) * 1e3,
                     "chunk_weights": weights, "decode_floor_ms": weights / rate * 1e3 if rate else None,
                     "experts_touched_per_layer": distinct / n_layers,
                     "note": "decode floor at the grouped kernel's measured rate of weights decoded once"}
    save()
    res["profile_first_chunk"] = profile_chunk(model, model.new_state(), ids)
    save()
    if last is not None and last[1] > args.chunk:
        st, length = last
        res["profile_late_chunk"] = profile_chunk(model, st, torch.randint(0, model.cfg.vocab_size, (prof_rows,)))
        res["profile_late_chunk"]["position"] = length
        save()
    if args.ab:
        os.environ["DSV41_PREFILL_TILES"] = "0"
        try:
            r, _, _ = prefill_prompt(model, args.chunk, args.chunk)
        finally:
            os.environ.pop("DSV41_PREFILL_TILES")
        res["reconstruct_path"] = r
        log(f"reconstruct path, {args.chunk} rows: {r['seconds']:.2f} s, {r['tokens_per_s']:.0f} tok/s")
        save()
    log("\nlength  seconds  tok/s(N layers)  tok/s(scaled 40)  replay tok/s(N)  replay tok/s(scaled 40)")
    for r in runs:
        if "seconds" in r:
            rp = r.get("replay", {})
            tail = (f" {rp['tokens_per_s']:16.0f} {rp['scaled_40_tokens_per_s']:23.0f}" if "seconds" in rp
                    else f"  replay: {rp.get('skipped') or rp.get('error', 'not run')}")
            log(f"{r['length']:6} {r['seconds']:8.2f} {r['tokens_per_s']:15.0f} {r['scaled_40_tokens_per_s']:16.0f}"
                + tail)
    return 0 if bits_ok else 1


def replay_run(model, length: int, chunk: int, exact: dict) -> dict:
    """The prompt of `exact` again under CED bounded replay: seconds, tokens/s and the speed-up over exact. With
    N < 40 layers built, `scaled_40` adds the missing decoder layers at the cost of a `sliding_window`-row chunk's
    layer (what each of them runs under replay), measured here. A failure is reported and the run goes on."""
    from dsv41.runtime.pool_forward import decoder_start

    n_layers, W = len(model.blocks), model.cfg.sliding_window
    if decoder_start(model.cfg) not in [b.index for b in model.blocks]:
        return {"skipped": f"the first decoder layer ({decoder_start(model.cfg)}) is not among the {n_layers} built"}
    try:
        r, _, _ = prefill_prompt(model, length, chunk, replay=True)
        ids = torch.randint(0, model.cfg.vocab_size, (W,), generator=torch.Generator().manual_seed(3))
        sync(torch.device("cuda"))
        t0 = time.perf_counter()
        model.forward([(model.new_state(), ids)], "prefill")
        sync(torch.device("cuda"))
        layer_w = (time.perf_counter() - t0) / n_layers
        scaled = r["seconds"] + (model.cfg.num_hidden_layers - n_layers) * layer_w
        r.update(speedup=exact["seconds"] / r["seconds"], window_layer_s=layer_w,
                 scaled_40_tokens_per_s=length / scaled,
                 scaled_40_speedup=(length / exact["scaled_40_tokens_per_s"]) / scaled)
        log(f"prompt {length} under replay: {r['seconds']:.2f} s, {r['tokens_per_s']:.0f} tok/s "
            f"({r['speedup']:.2f}x exact; {r['scaled_40_tokens_per_s']:.0f} scaled to 40, "
            f"{r['scaled_40_speedup']:.2f}x)")
        return r
    except Exception as exc:  # noqa: BLE001 - a bench stage that fails is reported, the run goes on
        log(f"prompt {length} under replay failed: {exc!r}")
        return {"error": f"{type(exc).__name__}: {exc}"}


if __name__ == "__main__":
    sys.exit(main())
