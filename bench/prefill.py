"""Prefill of one full-shape synthetic rank (rank 0 of TP=2) at several prompt lengths, with its floors (issue 31).

One call measures, in this order (results saved after each stage, so a run cut short keeps what it measured):
- the ceilings: the bf16 GEMM rate on random data;
- the prefill kernels alone on layer 0's matrices (`kernels/exl3/prefill.py`): the routed experts at one chunk
  (grouped tiles: EXL3 weights decoded per second, the GEMM's TFLOP/s) and every dense shape of the layer both ways
  (`ms`: the tiles; `gemm_ms`: decoded once into the workspace + one GEMM, `kernels/exl3/prefill_dense.py`, with
  `decode_ms` its decode alone and `gemm_rel_to_tile`; summed in `dense_ms` / `dense_gemm_ms`); the prefill row
  kernels, old work distribution vs new (`row_kernels`: rotations, SwiGLU + rotation, the queries' RoPE); the
  attention core of one layer's chunk, gathered against indexed (`attention_core_alone`); the indexer's top-k
  over a 128K prompt's chunk of ratio-2 rows, radix select against the bisection (`topk_alone`); the routed
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
import functools
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
from step_profile import classify, sync  # noqa: E402

from dsv41.runtime import sections  # noqa: E402
from dsv41.runtime.synthetic import synthetic_rank  # noqa: E402


def cuda_ms(fn, reps: int = 3) -> float:
    """Median ms of fn() over reps runs after one warm-up (CUDA events)."""
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def kernels_alone(model, chunk: int, tflops: float) -> dict:
    """The prefill kernels on layer 0's matrices at `chunk` rows: ms, EXL3 weights decoded per second, TFLOP/s."""
    from dsv41.kernels.exl3.prefill import EXPERTS, prefill_linear, prefill_moe
    from dsv41.kernels.exl3.prefill_dense import decode_into
    from dsv41.runtime.layers.linear import Exl3Linear

    dev = torch.device("cuda")
    block = model.blocks[0]
    s = block.moe.experts
    E, topk = s.w1.experts, block.moe.topk
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(chunk, s.w1.k, generator=g, device=dev).bfloat16()
    # a router's spread: each row's top-k distinct, the experts about evenly loaded
    ids = torch.rand(chunk, E, generator=g, device=dev).topk(topk, dim=1).indices.int()
    w = torch.rand(chunk, topk, generator=g, device=dev)
    out = {}
    ms = cuda_ms(lambda: prefill_moe(x, ids, w, s.w1, s.w3, s.w2))
    touched = int(ids.unique().numel())
    weights = touched * (2 * s.w1.k * s.w1.n + s.w2.k * s.w2.n)
    flops = 2.0 * chunk * topk * (2 * s.w1.k * s.w1.n + s.w2.k * s.w2.n)
    rows_per_expert = chunk * topk / touched
    decodes = -(-rows_per_expert // EXPERTS.block_m)  # about: each expert's tiles decode its weights once
    out["experts"] = {"rows": chunk, "ms": ms, "experts_touched": touched, "weights_per_s": weights / ms * 1e3,
                      "decoded_weights_per_s": weights * decodes / ms * 1e3, "tflops": flops / ms / 1e9,
                      "pct_of_bf16": 100 * flops / ms / 1e9 / tflops, "K": s.w1.K}
    dense = []
    lins = [lin for lin in block.attn.linears() if isinstance(lin, Exl3Linear)]
    lins += [lin for trio in block.moe.shared for lin in trio if isinstance(lin, Exl3Linear)]
    space = model.workspace.matrix  # the rank's one workspace, as Exl3Linear hands it over
    for lin in lins:
        xl = torch.randn(chunk, lin.in_features, generator=g, device=dev).bfloat16()
        f = 2.0 * chunk * lin.in_features * lin.out_features
        # both ways whatever DSV41_PREFILL_DENSE_GEMM says: the tiles, and decode-once into the workspace + GEMM
        t = cuda_ms(lambda: prefill_linear(xl, lin.weight, dense_gemm=False))
        tg = cuda_ms(lambda: prefill_linear(xl, lin.weight, dense_gemm=True, workspace=space))
        td = cuda_ms(lambda: decode_into(lin.weight, space))
        tile = prefill_linear(xl, lin.weight, out_dtype=torch.float32, dense_gemm=False)
        gemm = prefill_linear(xl, lin.weight, out_dtype=torch.float32, dense_gemm=True, workspace=space)
        rel = float((gemm.double() - tile.double()).norm() / tile.double().norm())
        dense.append({"name": lin.name, "k": lin.in_features, "n": lin.out_features, "K": lin.weight.K, "ms": t,
                      "tflops": f / t / 1e9, "gemm_ms": tg, "gemm_tflops": f / tg / 1e9, "decode_ms": td,
                      "gemm_rel_to_tile": rel})
        del tile, gemm
    out["dense"] = dense
    out["dense_ms"] = sum(d["ms"] for d in dense)
    out["dense_gemm_ms"] = sum(d["gemm_ms"] for d in dense)
    out["dense_decode_ms"] = sum(d["decode_ms"] for d in dense)
    log(f"kernels at {chunk} rows: experts {ms:.2f} ms ({out['experts']['tflops']:.0f} TFLOP/s, "
        f"{out['experts']['weights_per_s'] / 1e12:.2f} T weights/s once each), dense {out['dense_ms']:.2f} ms over "
        f"{len(dense)} matrices (tiles), {out['dense_gemm_ms']:.2f} ms decoded once + GEMM (the decodes "
        f"{out['dense_decode_ms']:.2f} ms)")
    try:  # a failure here must not cost the rest of the run
        out["row_kernels"] = row_kernels_ab(block, x, ids)
    except Exception as exc:  # noqa: BLE001
        out["row_kernels"] = {"error": repr(exc)}
        log(f"row kernels A/B failed: {exc!r}")
    try:
        out["attention_core"] = attention_core_alone(block.attn, chunk)
    except Exception as exc:  # noqa: BLE001
        out["attention_core"] = {"error": repr(exc)}
        log(f"attention core alone failed: {exc!r}")
    try:
        out["index_topk"] = topk_alone(k=block.attn.cfg.index_topk)
    except Exception as exc:  # noqa: BLE001
        out["index_topk"] = {"error": repr(exc)}
        log(f"index top-k alone failed: {exc!r}")
    return out


def row_kernels_ab(block, x, ids) -> dict:
    """The prefill row kernels, old distribution vs new (the same bits: tests/test_prefill_rowops.py), in us: the
    input rotation of a dense matrix and of the experts' pairs, the experts' SwiGLU + rotation, the queries' RoPE."""
    from dsv41.kernels.exl3.prefill import _rotate, swiglu_rotate, tile_table
    from dsv41.kernels.step.rowops import _launch, rope_rows

    s, attn = block.moe.experts, block.attn
    T, k = x.shape
    order, pair_e, _ = tile_table(ids, s.w1.experts, 128)
    src, pairs = (order // ids.shape[1]).int(), order.numel()
    gate = torch.randn(pairs, s.w1.n, device=x.device)
    route, hh = torch.rand(pairs, device=x.device), torch.empty(pairs, s.w1.n, dtype=torch.float16, device=x.device)
    q = torch.randn(T, attn.heads, attn.cfg.head_dim, device=x.device).bfloat16()
    iq = torch.randn(T, attn.cfg.index_n_heads, attn.cfg.index_head_dim, device=x.device).bfloat16()
    pos, freq, R = torch.arange(T, device=x.device), attn._inv_freq(x.device), attn.cfg.qk_rope_head_dim
    rope = dict(positions=pos, inv_freq=freq, rope_dim=R)
    res = {}
    for name, new in (("old", False), ("new", True)):
        rb = None if new else 1
        res[name] = {
            "rotate_dense_us": cuda_ms(lambda: _rotate(x, s.w1.suh[0], k, row_blocks=rb), 5) * 1e3,
            "rotate_experts_us": cuda_ms(lambda: _rotate(x, s.w1.suh, k, src=src, pair_e=pair_e, suh_b=s.w3.suh,
                                                         rows=pairs, permute=True, row_blocks=rb), 5) * 1e3,
            "swiglu_rotate_us": cuda_ms(lambda: swiglu_rotate(gate, gate, route, pair_e, s.w2.suh, hh, pairs,
                                                              s.w1.n, 10.0, row_blocks=rb), 5) * 1e3,
            "q_rope_us": cuda_ms(lambda: rope_rows(q, pos, freq, R, inplace=new), 5) * 1e3,
            "index_q_rope_fp4_us": cuda_ms(lambda: _launch(iq, quant="fp4_ue8m0", heads_per_program=None if new else 1,
                                                           **rope), 5) * 1e3}
    log(f"row kernels at {T} rows (us, old -> new): " + ", ".join(
        f"{key[:-3]} {res['old'][key]:.0f} -> {res['new'][key]:.0f}" for key in res["old"]))
    return res


def _routing(rows: int, experts: int, topk: int, skew: float, gen: torch.Generator) -> torch.Tensor:
    """Each row's top-k distinct experts, drawn with log-normal expert popularity of spread `skew` (Gumbel top-k:
    without replacement, proportional to e^(skew · z_e)); 0: about evenly loaded, as `kernels_alone` routes."""
    dev = gen.device
    popularity = torch.randn(experts, generator=gen, device=dev) * skew
    u = torch.rand(rows, experts, generator=gen, device=dev).clamp_(1e-20, 1 - 1e-7)
    return (popularity[None, :] - torch.log(-torch.log(u))).topk(topk, dim=1).indices.int()


def expert_tiles_ab(model, rows_list: list[int], skews=(0.0, 0.8)) -> list[dict]:
    """The routed experts of layer 0 through the CUDA tile kernels at each row count and routing spread: 64- vs
    128-row tiles (`DSV41_PREFILL_TILE_ROWS`), each in both launch orders (`DSV41_PREFILL_TILE_ORDER`), ms and
    TFLOP/s, the tiles (= decodes of an expert's trellis) each needs; every output's bits against 64 rows, tiles
    first (`same_bits`)."""
    from dsv41.kernels.exl3 import prefill_cuda
    from dsv41.kernels.exl3.backend import use_cuda_backend
    from dsv41.kernels.exl3.prefill import prefill_moe

    dev = torch.device("cuda")
    s = model.blocks[0].moe.experts
    E, topk = s.w1.experts, model.blocks[0].moe.topk
    if not use_cuda_backend(dev):
        return [{"skipped": "the EXL3 CUDA backend is off (DSV41_EXL3_BACKEND)"}]
    if prefill_cuda.tile_rows(dev, (s.w1.K, s.w2.K), 128) != 128:
        return [{"skipped": f"128-row tiles do not fit this GPU's shared memory (K={s.w1.K}/{s.w2.K})"}]
    out = []
    for rows in rows_list:
        for skew in skews:
            g = torch.Generator(device=dev).manual_seed(rows)
            x = torch.randn(rows, s.w1.k, generator=g, device=dev).bfloat16()
            ids = _routing(rows, E, topk, skew, g)
            w = torch.rand(rows, topk, generator=g, device=dev)
            counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
            flops = 2.0 * rows * topk * (2 * s.w1.k * s.w1.n + s.w2.k * s.w2.n)
            r = {"rows": rows, "skew": skew, "experts_touched": int((counts > 0).sum()),
                 "rows_per_expert": {"min": int(counts.min()), "median": int(counts.sort().values[E // 2]),
                                     "max": int(counts.max())},
                 "tiles": {str(bm): int(((counts + bm - 1) // bm).sum()) for bm in prefill_cuda.TILE_ROWS},
                 "ms": {}, "tflops": {}, "same_bits": True}
            ref = None
            for bm in prefill_cuda.TILE_ROWS:
                for cols in (False, True):
                    name = f"r{bm}_{'columns' if cols else 'tiles'}"
                    run = functools.partial(prefill_moe, x, ids, w, s.w1, s.w3, s.w2, tile_rows=bm,
                                            columns_first=cols)
                    try:
                        ms = cuda_ms(run)
                        y = run().view(torch.int32)
                    except torch.OutOfMemoryError as exc:
                        r["ms"][name] = None
                        r.setdefault("errors", {})[name] = repr(exc)[:300]
                        torch.cuda.empty_cache()
                        continue
                    r["ms"][name], r["tflops"][name] = ms, flops / ms / 1e9
                    if ref is None:
                        ref = y
                    elif not torch.equal(y, ref):
                        r["same_bits"] = False
                        r.setdefault("differ", []).append(name)
                    del y
            del ref, run
            torch.cuda.empty_cache()
            ms = r["ms"]
            log(f"experts at {rows} rows, skew {skew}: tiles {r['tiles']}; " + ", ".join(
                f"{k} {v:.2f} ms" if v is not None else f"{k} out of memory" for k, v in ms.items())
                + ("; same bits" if r["same_bits"] else f"; BITS DIFFER: {r['differ']}"))
            out.append(r)
    return out


def topk_alone(rows: int = 2048, entries: int = 65536, k: int = 512, device: str = "cuda", timer=cuda_ms) -> dict:
    """The indexer's top-k (`topk_select`) over one 128K prompt's ratio-2 chunk: `rows` rows of `entries` fp32
    scores (row r sees entries - (rows - 1 - r) // 2 of them, -inf after: a causal chunk), k of them each; the
    k-th score by radix select (4 histogram passes) against the bisection (DSV41_TOPK_RADIX=0: 32 counting passes),
    whether the two give the same bits, and the bytes each reads (passes x the scores). The production launches
    split the rows into slabs of 1,024 (`attention_index.py`); the kernel is one program per row, so one launch of
    all rows costs what the slabs cost together. (`device` / `timer`: a CPU dry run under the interpreter.)"""
    from dsv41.kernels.step.indexer import topk_select

    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(3)
    s = torch.randn(rows, entries, generator=g, device=dev)
    vis = entries - (rows - 1 - torch.arange(rows, device=dev)) // 2
    s[torch.arange(entries, device=dev)[None, :] >= vis[:, None]] = float("-inf")
    res = {"rows": rows, "entries": entries, "k": k, "score_bytes": s.numel() * 4}
    ids = {}
    for name, radix in (("radix", True), ("bisect", False)):
        res[f"{name}_ms"] = timer(lambda: topk_select(s, k, radix=radix), reps=5)
        ids[name] = topk_select(s, k, radix=radix)
    res["same_bits"] = bool(torch.equal(ids["radix"], ids["bisect"]))
    res["passes"] = {"radix": 5, "bisect": 35}  # reads of the row: histograms + the write pass; n_fin + 32 + 2
    res["speedup"] = res["bisect_ms"] / res["radix_ms"]
    log(f"index top-k, {rows} rows x {entries} entries, k {k}: radix {res['radix_ms']:.2f} ms, bisection "
        f"{res['bisect_ms']:.2f} ms ({res['speedup']:.1f}x), same bits {res['same_bits']}")
    return res


def attention_core_alone(attn, chunk: int, entries: int = 8192, pos: int = 6000, device: str = "cuda",
                         timer=cuda_ms) -> dict:
    """One layer's prefill attention core (`FastAttention._core_blocked`) over a `chunk`-row segment at `pos`:
    window + top-k slots over `entries` compressed entries, the pool's FP8 / FP4 values in bf16; gathered
    (DSV41_PREFILL_CORE_INDEXED=0: the slots' torch index ops, cat(window, entries), one gather per 256-row block)
    against indexed (one slot-index launch, one core launch pair). Whole-call device time, index building included;
    reports whether the two give the same bits. (`device` / `timer`: a CPU dry run under the interpreter.)"""
    from types import SimpleNamespace

    from dsv41.model.quant import fp4_block_e4m3, fp8_block_ue8m0
    from dsv41.runtime.layers.attention import INDEXED_ENV, Segment

    dev = torch.device(device)
    cfg, H = attn.cfg, attn.heads
    hd, window, topk = cfg.head_dim, cfg.sliding_window, cfg.index_topk
    g = torch.Generator(device=dev).manual_seed(2)
    W = chunk + window - 1
    win = fp8_block_ue8m0(torch.randn(W, hd, generator=g, device=dev).bfloat16(), 32, True)
    kv = fp4_block_e4m3(torch.randn(entries, hd, generator=g, device=dev).bfloat16(), 16, True)
    ids = torch.rand(chunk, entries, generator=g, device=dev).topk(topk, dim=1).indices.sort(dim=1).values
    q = torch.randn(chunk, H, hd, generator=g, device=dev).bfloat16()
    seg = Segment(state=None, start=0, T=chunk, pos=pos)
    src = SimpleNamespace(kv=kv)
    o = torch.zeros(chunk, H, hd, dtype=torch.float32, device=dev)

    def run():
        attn._core_blocked(q, o, seg, win, ids, src)

    res = {"rows": chunk, "heads": H, "head_dim": hd, "slots": window + topk, "entries": entries}
    outs = {}
    before = os.environ.get(INDEXED_ENV)
    for name, flag in (("gathered", "0"), ("indexed", "1")):
        os.environ[INDEXED_ENV] = flag
        try:
            res[f"{name}_ms"] = timer(run, reps=5)
            run()
            outs[name] = o.clone()
        finally:
            os.environ.pop(INDEXED_ENV)
            if before is not None:
                os.environ[INDEXED_ENV] = before
    res["same_bits"] = bool(torch.equal(outs["gathered"].view(torch.int32), outs["indexed"].view(torch.int32)))
    res["gathered_key_bytes"] = chunk * (window + topk) * hd * 2  # written by the gathers, then read by the core
    res["cat_bytes"] = (W + entries) * hd * 2
    log(f"attention core, one layer, {chunk} rows x {H} heads x {window + topk} slots over {entries} entries: "
        f"gathered {res['gathered_ms']:.2f} ms, indexed {res['indexed_ms']:.2f} ms, same bits {res['same_bits']}")
    return res


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
    res["kernels"] = kernels_alone(model, args.chunk, tflops)
    save()
    tile_rows = [int(v) for v in args.tile_ab.split(",") if v]
    res["kernels"]["expert_tiles"] = expert_tiles_ab(model, tile_rows) if tile_rows else []
    save()
    bits_ok = all(r.get("same_bits", True) for r in res["kernels"]["expert_tiles"])
    if not bits_ok:
        log("ERROR: the 64- and 128-row prefill tiles gave different bits (kernels.expert_tiles)")
    if args.kernels_only:
        return 0 if bits_ok else 1
    # warm-up: every kernel compiled (a chunk of each kind of position)
    model.forward([(model.new_state(), torch.randint(0, model.cfg.vocab_size, (256,)))], "prefill")
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
    rate = res["kernels"]["experts"]["weights_per_s"]
    res["floors"] = {"chunk_gemm_tflop": flops / 1e12, "gemm_floor_ms": flops / (tflops * 1e12) * 1e3,
                     "chunk_weights": weights, "decode_floor_ms": weights / rate * 1e3,
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
