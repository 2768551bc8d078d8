"""The prefill kernels alone on layer 0's shapes, for `bench/prefill.py --kernels-only` (and the first stage of every
prefill bench run): the routed experts' tiles, the dense shapes both ways (and the dense GEMM's launch shapes and
group launches: `prefill_dense_sweep.py`, at the chunk and 8,192 rows), the prefill row kernels old vs new, the
attention core (gathered, indexed, one-pass), the index top-k, the mHC sites (row kernels vs prefill tiles vs row
blocks vs the three split launches) and the experts' 64- vs 128-row tiles. Each function returns a JSON-ready dict;
`bench/prefill.py`'s docstring says what each field means."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from decode_step import log  # noqa: E402

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
        from prefill_dense_sweep import dense_sweep

        out["dense_sweep"] = dense_sweep(model, sorted({chunk, 8192}))
    except Exception as exc:  # noqa: BLE001
        out["dense_sweep"] = {"error": repr(exc)}
        log(f"dense sweep failed: {exc!r}")
    try:
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
        out["onepass_tilings"] = onepass_tilings(block.attn, (chunk, 4 * chunk))
    except Exception as exc:  # noqa: BLE001
        out["onepass_tilings"] = [{"error": repr(exc)}]
        log(f"one-pass core tilings failed: {exc!r}")
    try:
        out["mhc"] = [mhc_sites_alone(model, rows) for rows in sorted({chunk, 8192})]
    except Exception as exc:  # noqa: BLE001
        out["mhc"] = {"error": repr(exc)}
        log(f"mhc sites alone failed: {exc!r}")
    try:
        out["index_topk"] = topk_alone(k=block.attn.cfg.index_topk)
    except Exception as exc:  # noqa: BLE001
        out["index_topk"] = {"error": repr(exc)}
        log(f"index top-k alone failed: {exc!r}")
    return out


def mhc_sites_alone(model, rows: int) -> dict:
    """Layer 0's two mHC sites (each with the expand before it, as a layer runs them) at `rows` prefill rows: the
    row kernels (kernels/step/mhc.py) against the prefill tiles (kernels/step/mhc_prefill.py,
    DSV41_PREFILL_MHC_TILES), the row blocks (kernels/step/mhc_blocks.py, DSV41_PREFILL_MHC_BLOCKS) and the three
    split launches (kernels/step/mhc_split.py, DSV41_PREFILL_MHC_SPLIT; fn's bf16 parts made in the warm-up, once per
    weight as the runtime does), ms a layer, the largest coefficient difference of each to the row kernels (another
    sum order: a few fp32 ulp), and whether each one's X' is the row kernels' bitwise (the split's should be); then
    the blocks' tilings (rows a block, columns a step, warps: `BLOCK_TILINGS`, the first the default)."""
    from dsv41.kernels.step import mhc as row_k, mhc_blocks as block_k, mhc_prefill as tile_k, mhc_split as split_k

    block, cfg, dev = model.blocks[0], model.cfg, torch.device("cuda")
    hc, d = cfg.hc_mult, block.attn_norm.numel()
    g = torch.Generator(device=dev).manual_seed(2)
    x = torch.randn(rows, hc, d, generator=g, device=dev).bfloat16()
    y = torch.randn(rows, d, generator=g, device=dev)  # the reduced partial: fp32, as the runtime passes it
    pre, post = torch.rand(rows, hc, generator=g, device=dev) + 1e-6, 2 * torch.rand(rows, hc, generator=g, device=dev)
    comb = torch.softmax(torch.randn(rows, hc, hc, generator=g, device=dev), dim=-1)
    k = dict(norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, iters=cfg.hc_sinkhorn_iters, rms_eps=cfg.rms_norm_eps)
    sites = ((block.hc_attn, block.attn_norm), (block.hc_ffn, block.ffn_norm))
    layer = {name: (lambda f=f: [f(y, x, post, comb, p.fn_t, p.base, p.scale, pre, w, **k) for p, w in sites])
             for name, f in (("row_kernels", row_k.hc_expand_site), ("tiles", tile_k.hc_expand_site_tiles),
                             ("blocks", block_k.hc_expand_site_blocks), ("split", split_k.hc_expand_site_split))}
    res = {"rows": rows, **{f"{n}_ms": cuda_ms(f, reps=5) for n, f in layer.items()}}
    # the row kernels without the prefetch and the whole-row norm load (DSV41_MHC_PIPELINE=0: the same bits, 162
    # registers on sm_90 against 255, so 3 programs an SM, not 2)
    before = os.environ.get("DSV41_MHC_PIPELINE")
    os.environ["DSV41_MHC_PIPELINE"] = "0"
    try:
        res["row_kernels_unpipelined_ms"] = cuda_ms(layer["row_kernels"], reps=5)
    finally:
        if before is None:
            del os.environ["DSV41_MHC_PIPELINE"]
        else:
            os.environ["DSV41_MHC_PIPELINE"] = before
    a = layer["row_kernels"]()
    for name in ("tiles", "blocks", "split"):
        b = layer[name]()
        res[f"{name}_x_bitwise"] = all(torch.equal(sa[0], sb[0]) for sa, sb in zip(a, b))
        res[f"{name}_coeff_max_abs_diff"] = max(float((u - v).abs().max()) for sa, sb in zip(a, b)
                                                for u, v in zip(sa[2:], sb[2:]))
        res[f"{name}_speedup"] = res["row_kernels_ms"] / res[f"{name}_ms"]
    log(f"mhc sites of one layer at {rows} rows: row kernels {res['row_kernels_ms']:.3f} ms (unpipelined "
        f"{res['row_kernels_unpipelined_ms']:.3f}), tiles "
        f"{res['tiles_ms']:.3f} ms ({res['tiles_speedup']:.1f}x), blocks {res['blocks_ms']:.3f} ms "
        f"({res['blocks_speedup']:.1f}x; coefficients within {res['blocks_coeff_max_abs_diff']:.1e}), split "
        f"{res['split_ms']:.3f} ms ({res['split_speedup']:.1f}x; coefficients within "
        f"{res['split_coeff_max_abs_diff']:.1e}, X' bitwise the row kernels': {res['split_x_bitwise']})")
    res["block_tilings"] = {}
    names = ("BLOCK_ROWS", "BLOCK_COLS", "MIX_WARPS", "MIX_MAXNREG")
    default = tuple(getattr(block_k, n) for n in names)
    try:
        for tiling in BLOCK_TILINGS:
            for n, v in zip(names, tiling):
                setattr(block_k, n, v)
            res["block_tilings"]["x".join(map(str, tiling))] = cuda_ms(layer["blocks"], reps=5)
    finally:
        for n, v in zip(names, default):
            setattr(block_k, n, v)
    log(f"  blocks' tilings (rows x columns x warps x register cap: ms a layer): {res['block_tilings']}")
    return res


# the row blocks' (rows a block, columns a step, warps, register cap or 0) for the A/B, the default first. sm_90,
# ptxas -v: 32 x 16 x 8 180 registers uncapped (one block an SM); 16 x 16 x 4 128 capped / 168; 32 x 32 x 8 254;
# 64 x 16 x 8 255; none spills (32 x 16 x 4 does: 255 and spill stores)
BLOCK_TILINGS = ((32, 16, 8, 128), (32, 16, 8, 0), (16, 16, 4, 128), (32, 32, 8, 0), (64, 16, 8, 0))


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


def _tile_variants(dev) -> list[tuple[str, dict]]:
    """The experts' tile launches compared: 64-row tiles first (the reference bits), the 128-row tiles in both
    orders, and on Hopper the wgmma tiles (`DSV41_PREFILL_WGMMA`'s kernel, other bits allowed)."""
    from dsv41.kernels.exl3 import prefill_wgmma

    out = [("r64_tiles", {"tile_rows": 64, "columns_first": False, "wgmma": False})]
    out += [(f"r128_{'columns' if c else 'tiles'}", {"tile_rows": 128, "columns_first": c, "wgmma": False})
            for c in (True, False)]
    if prefill_wgmma.available(dev):
        out.append(("wg128_columns", {"columns_first": True, "wgmma": True}))
    return out


def expert_tiles_ab(model, rows_list: list[int], skews=(0.0, 0.8)) -> list[dict]:
    """The routed experts of layer 0 through the CUDA tile kernels at each row count and routing spread: 64- vs
    128-row tiles (`DSV41_PREFILL_TILE_ROWS`), each in both launch orders (`DSV41_PREFILL_TILE_ORDER`), ms and
    TFLOP/s, the tiles (= decodes of an expert's trellis) each needs; every output's bits against 64 rows, tiles
    first (`same_bits`); the wgmma tiles' bits and largest relative difference apart (`wgmma_*`)."""
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
            for name, kw in _tile_variants(dev):
                run = functools.partial(prefill_moe, x, ids, w, s.w1, s.w3, s.w2, **kw)
                try:
                    ms = cuda_ms(run)
                    y = run()
                except torch.OutOfMemoryError as exc:
                    r["ms"][name] = None
                    r.setdefault("errors", {})[name] = repr(exc)[:300]
                    torch.cuda.empty_cache()
                    continue
                r["ms"][name], r["tflops"][name] = ms, flops / ms / 1e9
                if ref is None:
                    ref = y
                elif kw.get("wgmma"):  # other bits allowed: its own row invariance is its GPU test's
                    r["wgmma_same_bits"] = bool(torch.equal(y.view(torch.int32), ref.view(torch.int32)))
                    r["wgmma_max_rel"] = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                elif not torch.equal(y.view(torch.int32), ref.view(torch.int32)):
                    r["same_bits"] = False
                    r.setdefault("differ", []).append(name)
                del y
            del ref, run
            torch.cuda.empty_cache()
            ms = r["ms"]
            log(f"experts at {rows} rows, skew {skew}: tiles {r['tiles']}; " + ", ".join(
                f"{k} {v:.2f} ms" if v is not None else f"{k} out of memory" for k, v in ms.items())
                + ("; same bits" if r["same_bits"] else f"; BITS DIFFER: {r['differ']}")
                + (f"; wgmma same bits {r['wgmma_same_bits']}, max rel {r['wgmma_max_rel']:.2e}"
                   if "wgmma_same_bits" in r else ""))
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
    against indexed (one slot-index launch, one core launch pair) and the indexed one-pass core
    (DSV41_PREFILL_CORE_ONEPASS=1: one slot-index launch, one core launch, no split scratch). Whole-call device time,
    index building included; reports whether the first two give the same bits and the one-pass core's distance to
    the indexed one (its own bits). (`device` / `timer`: a CPU dry run under the interpreter.)"""
    from types import SimpleNamespace

    from dsv41.model.quant import fp4_block_e4m3, fp8_block_ue8m0
    from dsv41.runtime.layers.attention import INDEXED_ENV, ONEPASS_ENV, Segment

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
    before = {env: os.environ.get(env) for env in (INDEXED_ENV, ONEPASS_ENV)}
    for name, flag, onepass in (("gathered", "0", "0"), ("indexed", "1", "0"), ("onepass", "1", "1")):
        os.environ[INDEXED_ENV], os.environ[ONEPASS_ENV] = flag, onepass
        try:
            res[f"{name}_ms"] = timer(run, reps=5)
            run()
            outs[name] = o.clone()
        finally:
            for env, value in before.items():
                os.environ.pop(env)
                if value is not None:
                    os.environ[env] = value
    res["same_bits"] = bool(torch.equal(outs["gathered"].view(torch.int32), outs["indexed"].view(torch.int32)))
    diff = (outs["onepass"].double() - outs["indexed"].double()).norm()
    res["onepass_rel_to_indexed"] = float(diff / outs["indexed"].double().norm())
    res["gathered_key_bytes"] = chunk * (window + topk) * hd * 2  # written by the gathers, then read by the core
    res["cat_bytes"] = (W + entries) * hd * 2
    log(f"attention core, one layer, {chunk} rows x {H} heads x {window + topk} slots over {entries} entries: "
        f"gathered {res['gathered_ms']:.2f} ms, indexed {res['indexed_ms']:.2f} ms, same bits {res['same_bits']}; "
        f"one-pass {res['onepass_ms']:.2f} ms (rel {res['onepass_rel_to_indexed']:.1e} to indexed)")
    return res


# (head_block, key_block, num_warps, num_stages, raw, pv_parts); the first the exact 3-part tiling (the others' rel
# L2 is to it), the second prefill_core.ONEPASS_TILING's
ONEPASS_SWEEP = ((32, 64, 8, None, True, 3), (32, 64, 8, None, True, 2), (32, 64, 8, 2, True, 2),
                 (32, 64, 8, 3, True, 2), (32, 32, 8, None, True, 2), (32, 32, 4, None, True, 2),
                 (16, 64, 4, None, True, 2), (16, 32, 4, None, True, 2), (16, 64, 8, None, True, 2),
                 (32, 64, 8, None, False, 3))


def onepass_tilings(attn, rows_list, entries: int = 8192, pos: int = 6000, device: str = "cuda",
                    timer=cuda_ms, keep: dict | None = None) -> list:
    """The one-pass core launch alone (`attention_onepass`, slot index built once) at each row count, over a few
    tilings (`ONEPASS_SWEEP`: the 3-part tiling first; stages None: Triton's default), each against the
    first. `keep`: filled with rows -> (q, window, entries, slots, sink, scale, {tiling: o}) of the 3- and 2-part
    default tilings (bench/onepass_sweep.py's reference check)."""
    from dsv41.kernels.step.prefill_core import attention_onepass
    from dsv41.kernels.step.prefill_slots import prefill_slot_index
    from dsv41.model.quant import fp4_block_e4m3, fp8_block_ue8m0

    dev, cfg, H, g, res = torch.device(device), attn.cfg, attn.heads, torch.Generator(device=device).manual_seed(5), []
    hd, window, topk = cfg.head_dim, cfg.sliding_window, cfg.index_topk
    kv = fp4_block_e4m3(torch.randn(entries, hd, generator=g, device=dev).bfloat16(), 16, True)
    for rows in rows_list:
        W = rows + window - 1
        win = fp8_block_ue8m0(torch.randn(W, hd, generator=g, device=dev).bfloat16(), 32, True)
        ids = torch.rand(rows, entries, generator=g, device=dev).topk(topk, dim=1).indices.sort(dim=1).values
        slots = prefill_slot_index(rows, pos, W, window, width=topk, ids=ids, entries=entries, device=dev)
        q, first = torch.randn(rows, H, hd, generator=g, device=dev).bfloat16(), None
        for hb, bs, warps, stages, raw, pp in ONEPASS_SWEEP:
            run = functools.partial(attention_onepass, q, win, kv, slots, attn.sink, hd ** -0.5, keys_bf16=True,
                                    head_block=hb, key_block=bs, num_warps=warps, num_stages=stages, raw=raw,
                                    pv_parts=pp)
            res.append(dict(rows=rows, head_block=hb, key_block=bs, num_warps=warps, num_stages=stages, raw=raw,
                            pv_parts=pp))
            try:
                res[-1]["ms"], o = timer(run, reps=5), run()
            except Exception as exc:  # noqa: BLE001  (one tiling failing must not cost the others)
                res[-1]["error"] = repr(exc)
                continue
            first = o if first is None else first  # 32-slot blocks: other bits by design
            if keep is not None and (hb, bs, warps, stages, raw) == (32, 64, 8, None, True):
                keep.setdefault(rows, (q, win, kv, slots, attn.sink, hd ** -0.5, {}))[6][f"pv{pp}"] = o
            res[-1].update(same_bits=bool(torch.equal(o.view(torch.int32), first.view(torch.int32))),
                           rel_to_first=float((o.double() - first.double()).norm() / first.double().norm()))
            log(f"one-pass core, {H} heads: {res[-1]}")
    return res
