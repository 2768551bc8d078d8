"""The dense prefill GEMM's launch shapes and the group launches, for `bench/prefill.py --kernels-only` (issue 31).

`dense_sweep(model, rows_list)` on the built layer with the most dense EXL3 matrices, at each row count:
- `tiles[name]` for every launch shape of `prefill_dense.TILES` (`DSV41_PREFILL_DENSE_TILE`): the GEMM alone
  (`gemm_rotated` on an input already rotated and a matrix already decoded) per matrix, ms and TFLOP/s, the layer's
  sum (`layer_gemm_ms`); its bits against the default shape (`max_abs_diff`, `same_bits`) and its row invariance
  bitwise (rows 1, 64, all, a permutation of all, each against the same rows of the whole call: `row_invariant`);
  a shape that does not compile or fit records its error;
- `parts`: per matrix the input rotation, the decode and the whole `prefill_linear` call on the default shape
  (`layer_ms`: what a layer's dense projections cost today, one by one);
- `groups`: each linear group of the layer (x's projections, q_a's, wo_a's, the shared expert's gate / up) one by
  one against one `DenseGroup` launch pair (`kernels/exl3/prefill_group.py`, `DSV41_PREFILL_DENSE_GROUP`): ms and
  whether the bits are the members' own (`same_bits`); the group's rotation launch alone with 16-row dots (the
  default's bits) and 64-row dots (`rotate64_same_bits`).
Times are CUDA-graph replays of 10 calls (`timer`: "graph"), so a 2,048-row call's ~20-40 us of Python launch
overhead is not counted; where a capture fails, back-to-back calls between two events ("events").

Alone (the full-shape synthetic rank 0 of TP=2, its first `--layers` layers: 3 holds layer 2, which has every kind of
dense matrix: the compressor's wkv / wgate, the indexer's wq_b and wk):

    python bench/prefill_dense_sweep.py --layers 3 --rows 2048,8192 --out bench/results/prefill_dense_sweep.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from decode_step import log  # noqa: E402


def timed_ms(fn, reps: int = 10) -> tuple[float, str]:
    """Median device ms of one fn() over 3 replays of a graph of `reps` calls (or `reps` calls between events)."""
    fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        run, how = graph.replay, "graph"
        run()
    except Exception:  # noqa: BLE001 - a capture that fails times the calls themselves
        torch.cuda.synchronize()

        def run():
            for _ in range(reps):
                fn()
        how = "events"
    times = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return sorted(times)[1], how


def dense_linears(block) -> list:
    from dsv41.runtime.layers.linear import Exl3Linear

    lins = [lin for lin in block.attn.linears() if isinstance(lin, Exl3Linear)]
    return lins + [lin for trio in block.moe.shared for lin in trio if isinstance(lin, Exl3Linear)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)))


def _tile_sweep(lins, xh, ws, rows: int, gen: torch.Generator, tiles=None, timer=timed_ms) -> dict:
    """Every launch shape of TILES over the matrices (the GEMM alone), against the default shape."""
    from dsv41.kernels.exl3.prefill_dense import GEMM, TILES, gemm_rotated

    dev = gen.device
    perm = torch.randperm(rows, generator=gen, device=dev)
    ref = [gemm_rotated(xh[i], ws[i], lin.weight, torch.empty(rows, lin.out_features, device=dev), GEMM)
           for i, lin in enumerate(lins)]
    out = {}
    for name, cfg in (tiles or TILES).items():
        res = {"config": cfg.__dict__, "matrices": [], "row_invariant": True, "same_bits": True, "max_abs_diff": 0.0}
        try:
            for i, lin in enumerate(lins):
                w, x = ws[i], xh[i]
                y = torch.empty(rows, lin.out_features, device=dev)
                ms, how = timer(lambda: gemm_rotated(x, w, lin.weight, y, cfg))
                flop = 2.0 * rows * lin.in_features * lin.out_features
                full = gemm_rotated(x, w, lin.weight, torch.empty_like(y), cfg)
                inv = {}
                for label, sel in (("1", slice(0, 1)), ("64", slice(0, 64)), ("all", slice(None)), ("perm", perm)):
                    part = gemm_rotated(x[sel].contiguous(), w, lin.weight,
                                        torch.empty(x[sel].shape[0], lin.out_features, device=dev), cfg)
                    inv[label] = _same(part, full[sel])
                diff = float((full - ref[i]).abs().max())
                res["matrices"].append({"name": lin.name, "ms": ms, "tflops": flop / ms / 1e9, "timer": how,
                                        "max_abs_diff": diff, "same_bits": _same(full, ref[i]),
                                        "row_invariant": inv})
                res["row_invariant"] &= all(inv.values())
                res["same_bits"] &= res["matrices"][-1]["same_bits"]
                res["max_abs_diff"] = max(res["max_abs_diff"], diff)
                del y, full
        except Exception as exc:  # noqa: BLE001 - a shape that does not compile or fit must not cost the others
            res["error"] = repr(exc)[:400]
            log(f"dense tile {name} at {rows} rows failed: {exc!r}"[:300])
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        if "error" not in res:
            res["layer_gemm_ms"] = sum(m["ms"] for m in res["matrices"])
            flops = sum(2.0 * rows * lin.in_features * lin.out_features for lin in lins)
            res["layer_tflops"] = flops / res["layer_gemm_ms"] / 1e9
            log(f"dense GEMM {name} at {rows} rows: {res['layer_gemm_ms']:.3f} ms a layer ({res['layer_tflops']:.0f} "
                f"TFLOP/s; " + ", ".join(f"{m['name'].split('.', 2)[-1]} {m['tflops']:.0f}" for m in res["matrices"])
                + f"); bits {'same' if res['same_bits'] else 'other, max %.1e' % res['max_abs_diff']}, rows "
                f"{'invariant' if res['row_invariant'] else 'NOT INVARIANT'}")
        out[name] = res
    return out


def _groups(block, rows: int, gen: torch.Generator, space, timer=timed_ms) -> list:
    """Each linear group of the layer: its members one by one (`prefill_linear`) against one group launch pair."""
    from dsv41.kernels.exl3.prefill import prefill_linear
    from dsv41.kernels.exl3.prefill_group import DenseGroup
    from dsv41.runtime.layers.linear import Exl3Linear

    dev, attn = gen.device, block.attn
    x = torch.randn(rows, attn.x_group.linears[0].in_features, generator=gen, device=dev).bfloat16()
    sets = [("x", attn.x_group.linears, None), ("q_a", attn.qr_group.linears, None)]
    sets += [(f"shared{i}", g.linears, None) for i, g in enumerate(block.moe.shared_gate_up)]
    sets += [("wo_a", attn.wo_a_group.linears, "concat")]
    out = []
    for label, lins, how in sets:
        lins = [lin for lin in lins if isinstance(lin, Exl3Linear)]
        if len(lins) < 2:
            continue
        k = lins[0].in_features
        if how == "concat":
            o = torch.randn(rows, len(lins) * k, generator=gen, device=dev).bfloat16()
            xs = [o[:, g * k:(g + 1) * k] for g in range(len(lins))]
        else:
            xs = [x if x.shape[1] == k else torch.randn(rows, k, generator=gen, device=dev).bfloat16()] * len(lins)
        group = DenseGroup([lin.weight for lin in lins])
        res = {"group": label, "members": [lin.name for lin in lins], "rows": rows, "numel": group.numel}
        if group.numel > space.numel:
            res["skipped"] = f"needs {group.numel} workspace values, the rank holds {space.numel}"
            out.append(res)
            continue
        flat = space.matrix(1, group.numel)
        dtypes = [xs[0].dtype] * len(lins)

        def alone():
            return [prefill_linear(xi, lin.weight, dense_gemm=True, workspace=space.matrix) for xi, lin in
                    zip(xs, lins)]

        def grouped():
            return group(xs, dtypes, flat, concat=how == "concat")

        res["alone_ms"], res["timer"] = timer(alone)
        res["group_ms"], _ = timer(grouped)
        for rows_a in (16, 64):  # the group's rotation launch alone: 16-row dots (the default's bits) or 64
            res[f"rotate{rows_a}_ms"], _ = timer(lambda: group.rotate(xs, rows=rows_a))
        res["rotate64_same_bits"] = _same(group.rotate(xs, rows=64), group.rotate(xs))
        a, g = alone(), grouped()
        res["same_bits"] = _same(torch.cat(a, dim=1), g) if how == "concat" else all(map(_same, a, g))
        log(f"dense group {label} ({len(lins)} matrices) at {rows} rows: one by one {res['alone_ms']:.3f} ms, one "
            f"group launch pair {res['group_ms']:.3f} ms; {'same bits' if res['same_bits'] else 'BITS DIFFER'}; its "
            f"rotation {res['rotate16_ms']:.3f} ms (64-row dots {res['rotate64_ms']:.3f}, same bits "
            f"{res['rotate64_same_bits']})")
        out.append(res)
    return out


def dense_sweep(model, rows_list=(2048, 8192), device: str = "cuda", timer=timed_ms, tiles=None) -> dict:
    """The dense stage's A/Bs (module docstring) on the built layer with the most dense EXL3 matrices. (`device`,
    `timer`, `tiles`: a CPU dry run under the interpreter, tests/test_prefill_dense_tiles.py.)"""
    from dsv41.kernels.exl3.prefill import _rotate, prefill_linear
    from dsv41.kernels.exl3.prefill_dense import decode_into

    dev = torch.device(device)
    block = max(model.blocks, key=lambda b: len(dense_linears(b)))
    lins = dense_linears(block)
    space = model.workspace
    ws = [decode_into(lin.weight).clone() for lin in lins]  # each matrix decoded once, held apart
    out = {"layer": model.blocks.index(block), "matrices": [lin.name for lin in lins], "rows": {}}
    for rows in rows_list:
        gen = torch.Generator(device=dev).manual_seed(rows)
        xs = [torch.randn(rows, lin.in_features, generator=gen, device=dev).bfloat16() for lin in lins]
        xh = [_rotate(x, lin.weight.suh, lin.in_features)[0] for x, lin in zip(xs, lins)]
        r = {}
        try:
            parts = []
            for x, lin in zip(xs, lins):
                p = {"name": lin.name, "k": lin.in_features, "n": lin.out_features}
                p["rotate_ms"], p["timer"] = timer(lambda: _rotate(x, lin.weight.suh, lin.in_features))
                p["decode_ms"], _ = timer(lambda: decode_into(lin.weight, space.matrix))
                p["call_ms"], _ = timer(lambda: prefill_linear(x, lin.weight, dense_gemm=True, workspace=space.matrix))
                parts.append(p)
            r["parts"] = parts
            r["layer_ms"] = sum(p["call_ms"] for p in parts)
            r["layer_rotate_ms"] = sum(p["rotate_ms"] for p in parts)
            r["layer_decode_ms"] = sum(p["decode_ms"] for p in parts)
            log(f"dense at {rows} rows, one by one: {r['layer_ms']:.3f} ms a layer ({len(lins)} matrices; rotations "
                f"{r['layer_rotate_ms']:.3f}, decodes {r['layer_decode_ms']:.3f})")
        except Exception as exc:  # noqa: BLE001
            r["parts_error"] = repr(exc)[:400]
        r["tiles"] = _tile_sweep(lins, xh, ws, rows, gen, tiles, timer)
        try:
            r["groups"] = _groups(block, rows, gen, space, timer)
        except Exception as exc:  # noqa: BLE001
            r["groups"] = [{"error": repr(exc)[:400]}]
            log(f"dense groups at {rows} rows failed: {exc!r}"[:300])
        ok = {n: t for n, t in r["tiles"].items() if "layer_gemm_ms" in t and t["row_invariant"]}
        if ok:
            r["best_tile"] = min(ok, key=lambda n: ok[n]["layer_gemm_ms"])
        out["rows"][str(rows)] = r
        del xs, xh
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--rows", default="2048,8192")
    ap.add_argument("--out", type=Path, default=Path("bench/results/prefill_dense_sweep.json"))
    ap.add_argument("--tiles", default="", help="comma-separated names of prefill_dense.TILES (default: all)")
    args = ap.parse_args()
    from dsv41.kernels.exl3.prefill_dense import GEMM, TILES

    names = [v for v in args.tiles.split(",") if v]
    tiles = {name: TILES[name] for name in names} if names else None
    if tiles is not None:
        tiles = {"128x128x64w8s3": GEMM, **tiles}  # the default first: the others' bits are compared with it
    from decode_step import StubComm

    from dsv41.runtime.synthetic import synthetic_rank

    model = synthetic_rank(None, rank=0, world=2, device=torch.device("cuda"), dtype=torch.bfloat16, comm=StubComm(),
                           layers=args.layers)
    res = {"gpu": torch.cuda.get_device_name(),
           "sweep": dense_sweep(model, [int(v) for v in args.rows.split(",") if v], tiles=tiles)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    bad = [(r, n) for r, v in res["sweep"]["rows"].items() for n, t in v["tiles"].items()
           if "error" not in t and not t["row_invariant"]]
    bad += [(r, g["group"]) for r, v in res["sweep"]["rows"].items() for g in v["groups"]
            if g.get("same_bits") is False]
    for rows, v in res["sweep"]["rows"].items():
        log(f"{rows} rows: best launch shape {v.get('best_tile')}")
    if bad:
        log(f"ERROR: not row invariant or not the members' bits: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
