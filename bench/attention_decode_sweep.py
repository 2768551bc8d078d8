"""Which tiling the decode core should take (DSV41_DECODE_CORE_TILING, DSV41_ATTN_ALIGNED): `attention_pool` at the
release's decode shapes (window 128 FP8 ring rows + index top-k 512 FP4 entries, hd 512, bf16 queries), 32 (TP=2)
and 64 (TP=1) local heads, 1 row, a 6-row verify window of one sequence (positions p-5..p) and 16 rows of 16
sequences, each candidate's split + combine timed inside a CUDA graph (20 calls a replay, PDL as the step runs it)
and checked: pool == the gathered core at the same tiling bit for bit (what keeps the in-place step == the
load-and-store step and drafted == serial), every row alone == batched, and its error against the default tiling
and an fp64 reference. One tiling serves every row count (the phase picks the kernel, the row count never does),
so the pick weighs 1 row, the verify window and 16 rows together.

    python3 bench/attention_decode_sweep.py --out bench/results/attention_decode_sweep.json [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_sweep import timed, write_rows  # noqa: E402

from dsv41.kernels.step.attention import (ALIGN_ENV, TILING_ENV, attention_core, attention_pool,  # noqa: E402
                                          codecs_hold_bf16, decode_tiling)
from dsv41.model.attention import compressed_slots  # noqa: E402
from dsv41.runtime.kv_pool import KVPool, SourceLayout  # noqa: E402

# (split_keys, key_block, num_warps, head_block, one-store blocks); the first is today's default
CONFIGS = [(32, 16, 4, 16, False), (32, 16, 4, 16, True), (16, 16, 4, 16, True), (16, 16, 8, 16, True),
           (16, 16, 2, 16, True), (32, 16, 8, 16, True), (32, 32, 4, 16, True), (32, 32, 8, 16, True),
           (64, 32, 8, 16, True), (64, 64, 8, 16, True), (32, 16, 8, 32, True), (64, 32, 8, 32, True),
           (16, 16, 4, 16, False), (16, 16, 4, 32, True)]
QUICK = CONFIGS[:4] + [CONFIGS[7]]
SHAPES = [(1, False), (6, True), (16, False)]  # (rows, verify window of one sequence)
HD, WINDOW, TOPK, CONTEXT, PER_PAGE = 512, 128, 512, 2048, 128
DEVICE = "cuda"  # (a smoke run in the interpreter patches these)


def build(B: int, H: int, verify: bool) -> dict:
    """A filled pool and attention_pool's arguments: B sequences at position CONTEXT - 1, or (verify) one sequence's
    B rows at CONTEXT - B .. CONTEXT - 1; plus the same slots gathered and decoded in torch (keys, ok)."""
    dev = torch.device(DEVICE)
    n_seq = 1 if verify else B
    pages_per = -(-CONTEXT // 2 // PER_PAGE) + 1
    pool = KVPool(num_slots=n_seq, num_pages=n_seq * pages_per, page_tokens=256, ring_rows=WINDOW + 16,
                  window_layers=[0], sources=[SourceLayout(2, 2, PER_PAGE, True)], head_dim=HD, index_head_dim=128,
                  dtype=torch.bfloat16, device=dev)
    g = torch.Generator(device=dev).manual_seed(H * 100 + B)
    first = CONTEXT - WINDOW - 16
    for s in range(n_seq):
        pool.write_ring("window", 0, s, first, torch.randn(WINDOW + 16, HD, generator=g, device=dev).bfloat16())
        pool.write_entries(2, list(range(s * pages_per, (s + 1) * pages_per)), 0,
                           torch.randn(CONTEXT // 2, HD, generator=g, device=dev).bfloat16(), None)
    seq = [0] * B if verify else list(range(B))
    pos = [CONTEXT - B + b for b in range(B)] if verify else [CONTEXT - 1] * B
    pages = torch.tensor([list(range(s * pages_per, (s + 1) * pages_per)) for s in seq], device=dev)
    picks = [torch.randperm(CONTEXT // 2, device=dev, generator=g)[:TOPK] for _ in range(n_seq)]
    ids = torch.sort(torch.stack([picks[s] for s in seq]), dim=1).values
    kw = dict(window_store=pool.stores[("window", 0)], window_codec=pool.window_codec,
              slot=torch.tensor(seq, device=dev), pos=torch.tensor(pos, device=dev), window=WINDOW,
              entry_store=pool.stores[("kv", 2)], entry_codec=pool.kv_codec, pages=pages, per_page=PER_PAGE, ids=ids,
              width=TOPK)
    keys, ok = [], []
    for b, (s, p) in enumerate(zip(seq, pos)):
        win = pool.read_ring("window", 0, s, p - WINDOW + 1, p + 1)
        kv, _ = pool.read_entries(2, list(range(s * pages_per, (s + 1) * pages_per)), CONTEXT // 2)
        comp, comp_ok = compressed_slots(SimpleNamespace(kv=kv), ids[b:b + 1], TOPK, 1, HD, dev)
        keys.append(torch.cat((win, comp[0].to(win.dtype))))
        ok.append(torch.cat((torch.ones(WINDOW, dtype=torch.bool, device=dev), comp_ok[0])))
    q = (torch.randn(B, H, HD, generator=g, device=dev) * 2).bfloat16()
    return dict(q=q, sink=torch.randn(H, generator=g, device=dev), kw=kw, keys=torch.stack(keys), ok=torch.stack(ok),
                pool=pool, exact=codecs_hold_bf16(pool.window_codec, pool.kv_codec))


def reference(case: dict) -> torch.Tensor:
    """MODEL.md §7.6 in fp64 over the gathered slots."""
    q, k, sink = case["q"].double(), case["keys"].double(), case["sink"].double()
    s = torch.einsum("thd,tsd->ths", q, k) * HD ** -0.5
    s = s.masked_fill(~case["ok"][:, None, :], float("-inf"))
    m = torch.maximum(s.amax(dim=-1), sink[None, :])
    e = torch.exp(s - m[..., None])
    return torch.einsum("ths,tsd->thd", e, k) / (e.sum(dim=-1) + torch.exp(sink[None, :] - m))[..., None]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def measure(case: dict, cfg: tuple, default: torch.Tensor | None) -> dict:
    """One candidate on one shape: device µs a call in a graph, and its bit checks."""
    split, block, warps, hb, aligned = cfg
    os.environ[TILING_ENV] = f"{split},{block},{warps},{hb}"
    os.environ[ALIGN_ENV] = "1" if aligned else "0"
    q, sink, kw = case["q"], case["sink"], case["kw"]
    B = q.shape[0]
    pool = attention_pool(q, sink, HD ** -0.5, **kw)
    us = timed(lambda: attention_pool(q, sink, HD ** -0.5, **kw))
    core = attention_core(q, case["keys"], case["ok"], sink, HD ** -0.5, keys_bf16=case["exact"], **decode_tiling())
    alone = torch.cat([attention_pool(q[b:b + 1], sink, HD ** -0.5,
                                      **{k: (v[b:b + 1] if k in ("slot", "pos", "pages", "ids") else v)
                                         for k, v in kw.items()}) for b in range(B)])
    if q.is_cuda:
        torch.cuda.synchronize()
    bits = lambda x: x.contiguous().view(torch.int32)  # noqa: E731
    return {"us": us, "pool_eq_core": torch.equal(bits(pool), bits(core)), "alone_eq": torch.equal(bits(alone),
                                                                                                     bits(pool)),
            "same_bits_as_default": None if default is None else torch.equal(bits(pool), bits(default)),
            "rel_default": None if default is None else rel(pool, default), "rel_exact": rel(pool, reference(case)),
            "out": pool}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention_decode_sweep.json")
    p.add_argument("--quick", action="store_true", help="the default and four candidates only")
    p.add_argument("--heads", default="32,64")
    args = p.parse_args()
    configs = QUICK if args.quick else CONFIGS
    saved = {k: os.environ.get(k) for k in (TILING_ENV, ALIGN_ENV)}
    rows = []
    for H in (int(h) for h in args.heads.split(",")):
        for B, verify in SHAPES:
            case = build(B, H, verify)
            default = None
            for cfg in configs:
                try:
                    res = measure(case, cfg, default)
                except Exception as e:  # noqa: BLE001 - a tiling that does not compile is a row of the table
                    res = {"us": float("nan"), "error": repr(e)[:160]}
                if default is None and "out" in res:
                    default = res["out"]
                res.pop("out", None)
                split, block, warps, hb, aligned = cfg
                rows.append({"H": H, "rows": B, "verify": verify, "split_keys": split, "key_block": block,
                             "num_warps": warps, "head_block": hb, "aligned": aligned, **res})
                print(f"H={H} rows={B:2d}{'v' if verify else ' '} {split:3d}/{block:2d}/{warps}w/hb{hb:2d}"
                      f"{' aligned' if aligned else '        '}: {res['us']:7.2f} us  pool==core "
                      f"{res.get('pool_eq_core')} alone {res.get('alone_eq')} same-as-default "
                      f"{res.get('same_bits_as_default')} rel(default) {res.get('rel_default')} "
                      f"rel(fp64) {res.get('rel_exact')} {res.get('error', '')}", flush=True)
            del case
            torch.cuda.empty_cache()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    summary = rank(rows, configs)
    for line in summary:
        print(line["config"], {k: round(v, 1) for k, v in line["us"].items()}, "score", round(line["score"], 1),
              "bitwise" if line["bitwise"] else "NOT BITWISE")
    write_rows(args.out, rows)
    data = __import__("json").loads(args.out.read_text())
    data["ranking"] = summary
    args.out.write_text(__import__("json").dumps(data, indent=1))
    return 0


def rank(rows: list, configs: list) -> list:
    """Per candidate: its µs at each (H, rows) and a score, the step's weighting: 1 row + the 6-row verify + 16 rows
    / 4 (the headline is one row), summed over the head counts; `bitwise`: pool == core and alone == batched at every
    shape (a candidate that fails it cannot be the decode tiling)."""
    out = []
    for cfg in configs:
        mine = [r for r in rows if (r["split_keys"], r["key_block"], r["num_warps"], r["head_block"],
                                    r["aligned"]) == cfg]
        us = {f"H{r['H']}x{r['rows']}{'v' if r['verify'] else ''}": r["us"] for r in mine}
        score = sum(r["us"] / (4 if r["rows"] == 16 else 1) for r in mine)
        ok = all(r.get("pool_eq_core") and r.get("alone_eq") for r in mine)
        out.append({"config": "%d,%d,%d,%d%s" % (*cfg[:4], " aligned" if cfg[4] else ""), "us": us, "score": score,
                    "bitwise": ok})
    return sorted(out, key=lambda r: (not r["bitwise"], r["score"] if r["score"] == r["score"] else float("inf")))


if __name__ == "__main__":
    raise SystemExit(main())
