"""The step attention-core kernel (dsv41.kernels.step.attention) against the reference's `Attention._core`.

CPU part: the kernels run in Triton's interpreter, in one child process (this file run as a script; see
tests/test_kernels_step_router.py for why), which saves the kernel's outputs on the cases below; the tests rebuild
the inputs and judge. GPU part: tests/test_kernels_step_attention_gpu.py (the real shapes, compiled).
`attention_pool` (keys read from a real KVPool in place) is judged bit for bit against `attention_core` over the
same slots gathered and decoded in torch, in both parts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from step_harness import interpreted  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _case(name: str, device="cpu"):
    """(q [T, H, hd], keys [T, S, hd], ok [T, S], sink [H]): window slots first, then compressed ones."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    if name == "tiny":  # the tiny model's layout: window 16 + top-k 8 = 24 slots (not a multiple of the block)
        T, H, hd, win, comp, dtype = 5, 5, 64, 16, 8, torch.float32
    elif name == "splits":  # three key splits, the last one partial; 20 heads = two head blocks, one partial
        T, H, hd, win, comp, dtype = 4, 20, 128, 128, 172, torch.bfloat16
    elif name == "sinks":  # sinks far above the scores: the denominator is mostly the sink
        T, H, hd, win, comp, dtype = 3, 16, 64, 32, 40, torch.float32
    else:
        raise KeyError(name)
    S = win + comp
    q = (torch.randn(T, H, hd, generator=gen) * 2).to(dtype)
    keys = torch.randn(T, S, hd, generator=gen).to(dtype)
    ok = torch.rand(T, S, generator=gen) > 0.3
    ok[0] = True  # every slot live
    ok[1, win:] = False  # all-masked compressed part
    ok[2] = False  # nothing live: zeros
    if T > 3:
        ok[3, :win] = False  # only compressed slots live
    sink = torch.randn(H, generator=gen) + (12.0 if name == "sinks" else 0.0)
    return q.to(device), keys.to(device), ok.to(device), sink.to(device)


CASES = ("tiny", "splits", "sinks")


def _reference(q, keys, ok, sink):
    from dsv41.model.attention import Attention

    layer = SimpleNamespace(cfg=SimpleNamespace(head_dim=q.shape[2]), p=SimpleNamespace(sink=sink))
    return Attention._core(layer, q, keys, ok)


def _exact(q, keys, ok, sink):
    """MODEL.md §7.6 in fp64: one softmax over the live slots and the sink (denominator only)."""
    q, k, sink = q.double(), keys.double(), sink.double()
    s = torch.einsum("thd,tsd->ths", q, k) * q.shape[2] ** -0.5
    s = s.masked_fill(~ok[:, None, :], float("-inf"))
    m = torch.maximum(s.amax(dim=-1), sink[None, :])
    e = torch.exp(s - m[..., None])
    return torch.einsum("ths,tsd->thd", e, k) / (e.sum(dim=-1) + torch.exp(sink[None, :] - m))[..., None]


def _garbage(keys: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """The keys with NaN in every dead slot: a dead slot must never be read."""
    return keys.masked_fill(~ok[..., None], float("nan"))


def _padded(keys, ok, extra: int):
    """The same rows at a longer S: `extra` dead slots (NaN keys) after each row's own."""
    T, S, hd = keys.shape
    pk = torch.full((T, S + extra, hd), float("nan"), dtype=keys.dtype, device=keys.device)
    pk[:, :S] = keys
    po = torch.zeros(T, S + extra, dtype=torch.bool, device=ok.device)
    po[:, :S] = ok
    return pk, po


def _switched(name: str, on: bool, results) -> dict:
    """`results()` with the launch switch `name` (an environment variable read at each launch) on or off."""
    before = os.environ.get(name)
    os.environ[name] = "1" if on else "0"
    try:
        return results()
    finally:
        if before is None:
            os.environ.pop(name)
        else:
            os.environ[name] = before


def _folds(results, fold: bool) -> dict:
    """`results()` with the combine folded into the split launch or as its own launch (the default)."""
    from dsv41.kernels.step.attention import FOLD_ENV

    return _switched(FOLD_ENV, fold, results)


def _aligned(results) -> dict:
    """`results()` with the one-store pool blocks (DSV41_ATTN_ALIGNED=1; on by default since b4c0e7f)."""
    from dsv41.kernels.step.attention import ALIGN_ENV

    return _switched(ALIGN_ENV, True, results)


def _counters_clean() -> bool:
    """The attention core's arrival counters exist (the fold ran) and are all zero (a next launch can use them)."""
    from dsv41.kernels.step.mhc import _COUNTERS

    have = [v for k, v in _COUNTERS._by_device.items() if k.startswith("attention@")]
    return bool(have) and all(int(v.count_nonzero()) == 0 for v in have)


def _fold_results(results) -> dict:
    """The fold's checks of a case: the folded results, a second folded launch, the two-launch path's results,
    and whether the counters were left zero."""
    folded = _folds(results, True)
    clean = _counters_clean()
    return {"folded": folded, "again": _folds(results, True), "unfolded": _folds(results, False), "clean": clean}


def _interp_worker(out_path: str) -> None:
    from dsv41.kernels.step.attention import ALIGN_ENV, FOLD_ENV, attention_core

    for name in (FOLD_ENV, ALIGN_ENV):  # the default path, whatever the caller's environment holds
        os.environ.pop(name, None)
    out = {}
    for name in CASES:
        q, keys, ok, sink = _case(name)
        hd = q.shape[2]
        core = lambda q_, k_, o_: attention_core(q_, k_, o_, sink, hd ** -0.5)  # noqa: E731
        res = {"out": core(q, keys, ok), "garbage": core(q, _garbage(keys, ok), ok)}
        res["fold"] = _fold_results(lambda: {"out": core(q, keys, ok)})
        res["padded"] = core(q, *_padded(keys, ok, 150))  # one more split, and more blocks in the last one
        res["alone"] = torch.cat([core(q[r:r + 1], keys[r:r + 1], ok[r:r + 1]) for r in range(q.shape[0])])
        rev = torch.arange(q.shape[0] - 1, -1, -1)
        res["reversed"] = core(q[rev], keys[rev], ok[rev]).flip(0)
        out[name] = res
    for name in POOL_CASES:
        case = _pool_case(name)
        out[name] = _pool_results(case)
        out[name]["fold"] = _fold_results(lambda: _pool_results(case, alone=False))
        out[name]["aligned"] = _aligned(lambda: _pool_results(case, alone=False))
    torch.save(out, out_path)


# ---------------------------------------------------------------------------------------------------------------
# attention_pool: the keys read from a real KVPool in place, against attention_core on the torch-gathered slots
# ---------------------------------------------------------------------------------------------------------------

# name: (heads, head_dim, window, width (0: swa-only), K, per_page, fake_quant, rows); a row is
# (sequence, position, selected ids), a sequence (ring slot, last position written, page ids, entries)
_SEQS = {
    "pool-fp8": {"A": (2, 5, [7], 1), "B": (0, 30, [9, 3], 7), "C": (3, 42, [5, 1, 10], 10), "D": (1, 12, [], 0)},
    "pool-raw": {"A": (1, 3, [], 0), "B": (0, 51, [4, 8, 2], 12), "C": (2, 20, [11, 6], 5)},
    "swa-fp8": {"A": (0, 2, [], 0), "B": (3, 62, [], 0), "C": (1, 17, [], 0)},
    "pool-fp8-w16": {"A": (1, 9, [2], 2), "B": (0, 47, [0, 4, 3], 11), "C": (2, 70, [1, 5, 6, 7], 16)},
}
POOL_SPECS = {
    # window 8 (not a key block), ring 11 rows; K = 6 < width 12; verify rows C at 40..42 (the ring holds up to 42);
    # A at position 5 (early window slots dead, one entry), B wrapped, D without entries (all -1)
    "pool-fp8": (3, 64, 8, 12, 6, 4, True,
                 [("C", 40, 6), ("A", 5, 1), ("C", 41, 4), ("D", 12, 0), ("B", 30, 6), ("C", 42, 6)]),
    # raw bf16 rows (no fake quantiser), K = width = 16 with at most 12 entries (leading -1), two blocks
    "pool-raw": (2, 128, 16, 16, 16, 4, False, [("B", 50, 12), ("A", 3, 0), ("C", 20, 5), ("B", 51, 9)]),
    # no entry store: window slots only (positions 2 < window, wrapped rings, a verify run 60..62)
    "swa-fp8": (3, 64, 16, 0, 0, 4, True, [("B", 60, 0), ("A", 2, 0), ("B", 61, 0), ("C", 17, 0), ("B", 62, 0)]),
    # FP8 / FP4 with the window a whole key block (16, the one-store blocks' case), K = 10 < width 20 (a block
    # that is partly past the compressed slots), verify rows B at 45..47, A early (window slots dead)
    "pool-fp8-w16": (2, 64, 16, 20, 10, 4, True,
                     [("B", 45, 9), ("A", 9, 2), ("C", 70, 10), ("B", 46, 10), ("C", 69, 3), ("B", 47, 0)]),
}
POOL_CASES = tuple(POOL_SPECS)


def _fill_pool(pool, seqs: dict, gen: torch.Generator, hd: int) -> None:
    """Every sequence's window rows (positions 0..last, the ring overwritten as it wraps, ring_rows at a time)
    and compressed entries, random; the rest of the pool stays 0xFF bytes (NaN / huge if a dead slot were read)."""
    pool.buffer.fill_(255)
    dev = pool.device
    for slot, last, page_ids, n in seqs.values():
        for first in range(0, last + 1, pool.ring_rows):
            rows = torch.randn(min(pool.ring_rows, last + 1 - first), hd, generator=gen).to(pool.dtype)
            pool.write_ring("window", 0, slot, first, rows.to(dev))
        if n:
            pool.write_entries(0, page_ids, 0, torch.randn(n, hd, generator=gen).to(pool.dtype).to(dev), None)


def _pool_case(name: str, device="cpu", spec=None, seqs=None) -> dict:
    """A filled KVPool and a launch over it: attention_pool's arguments (`args`), q and sink, and the same slots
    gathered and decoded in torch (`keys`, `ok`: the window's, then `compressed_slots` of the selected ids)."""
    from dsv41.model.attention import compressed_slots
    from dsv41.runtime.kv_pool import KVPool, SourceLayout

    H, hd, window, width, K, per_page, fq, rows = spec or POOL_SPECS[name]
    seqs = seqs or _SEQS[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    dev = torch.device(device)
    num_pages = 1 + max([p for s in seqs.values() for p in s[2]] + [0])
    pool = KVPool(num_slots=1 + max(s[0] for s in seqs.values()), num_pages=num_pages, page_tokens=4 * per_page,
                  ring_rows=window + 3, window_layers=[0], sources=[SourceLayout(0, 4, per_page, False)],
                  head_dim=hd, index_head_dim=64, dtype=torch.bfloat16, fake_quant=fq, device=dev)
    assert (pool.window_codec.name, pool.kv_codec.name) == (
        ("fp8-e4m3/ue8m0-32", "fp4-e2m1/e4m3-16") if fq else ("raw-bfloat16", "raw-bfloat16"))
    _fill_pool(pool, seqs, gen, hd)
    B = len(rows)
    P = max(1, max(len(s[2]) for s in seqs.values()))
    slot = torch.tensor([seqs[r][0] for r, _, _ in rows], dtype=torch.int32)
    pos = torch.tensor([p for _, p, _ in rows], dtype=torch.int64)
    pages = torch.zeros(B, P, dtype=torch.int32 if fq else torch.int64)
    ids = torch.full((B, K), -1, dtype=torch.int64)
    keys, ok = [], []
    for b, (r, p, k) in enumerate(rows):
        s_slot, _, page_ids, n = seqs[r]
        pages[b, :len(page_ids)] = torch.tensor(page_ids, dtype=pages.dtype)
        if k:
            ids[b, K - k:] = torch.randperm(n, generator=gen)[:k].sort().values
        first = max(0, p - window + 1)
        kw = torch.zeros(window, hd, dtype=pool.dtype, device=dev)
        kw[window - (p + 1 - first):] = pool.read_ring("window", 0, s_slot, first, p + 1)
        okw = torch.arange(window, device=dev) >= window - (p + 1 - first)
        if width:
            kv, _ = pool.read_entries(0, page_ids, n)
            comp, comp_ok = compressed_slots(SimpleNamespace(kv=kv), ids[b:b + 1].to(dev) if K else None, width, 1,
                                             hd, dev)
            kw, okw = torch.cat((kw, comp[0].to(pool.dtype))), torch.cat((okw, comp_ok[0]))
        keys.append(kw)
        ok.append(okw)
    q = (torch.randn(B, H, hd, generator=gen) * 2).bfloat16().to(dev)
    sink = torch.randn(H, generator=gen).to(dev)
    args = {"window_store": pool.stores[("window", 0)], "window_codec": pool.window_codec, "slot": slot.to(dev),
            "pos": pos.to(dev), "window": window}
    if width:
        args.update(entry_store=pool.stores[("kv", 0)], entry_codec=pool.kv_codec, pages=pages.to(dev),
                    per_page=per_page, ids=ids.to(dev), width=width)
    return {"q": q, "sink": sink, "scale": hd ** -0.5, "args": args, "keys": torch.stack(keys), "ok": torch.stack(ok)}


def _rows_of(args: dict, idx) -> dict:
    """attention_pool's per-row arguments restricted to rows `idx` (a slice or an index tensor)."""
    return {k: (v[idx] if k in ("slot", "pos", "pages", "ids") else v) for k, v in args.items()}


def _pool_results(case: dict, alone: bool = True) -> dict:
    """attention_pool together / each row alone / rows reversed, and attention_core on the gathered slots
    (`alone` False: the first two only)."""
    from dsv41.kernels.step.attention import attention_core, attention_pool, codecs_hold_bf16, decode_tiling

    q, sink, scale, args = case["q"], case["sink"], case["scale"], case["args"]
    B = q.shape[0]
    rev = torch.arange(B - 1, -1, -1, device=q.device)
    exact = codecs_hold_bf16(args["window_codec"], args.get("entry_codec"))  # the gathered keys' values
    res = {
        "core": attention_core(q, case["keys"], case["ok"], sink, scale, keys_bf16=exact,
                               **decode_tiling()),  # attention_pool's tiling
        "pool": attention_pool(q, sink, scale, **args),
    }
    if not alone:
        return res
    return {
        **res,
        **_roped(case, res["pool"]),
        "alone": torch.cat([attention_pool(q[b:b + 1], sink, scale, **_rows_of(args, slice(b, b + 1)))
                            for b in range(B)]),
        "reversed": attention_pool(q[rev], sink, scale, **_rows_of(args, rev)).flip(0),
    }


def _roped(case: dict, pool: torch.Tensor) -> dict:
    """attention_pool with its inverse RoPE in the combine (bf16 o into a bucket of 2 more rows) and the same rows
    through rowops.rope_rows after the plain launch (`pool`): "roped" / "roped_ref"."""
    from dsv41.kernels.step.attention import attention_pool
    from dsv41.kernels.step.rowops import rope_rows

    q, sink, scale, args = case["q"], case["sink"], case["scale"], case["args"]
    B, H, hd = q.shape
    R = hd // 4
    inv_freq = (10000.0 ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)).float().to(q.device)
    P = torch.cat((args["pos"], args["pos"][:2] + 7))  # the bucket's positions: the padding rows' never read
    out = torch.full((B + 2, H, hd), float("nan"), dtype=torch.bfloat16, device=q.device)
    fused = attention_pool(q, sink, scale, **args, out=out, rope=(P, inv_freq, R, torch.bfloat16))
    ref = rope_rows(torch.cat((pool, torch.full_like(pool[:2], float("nan")))), P, inv_freq, R, inverse=True,
                    out_dtype=torch.bfloat16, rows=B)
    return {"roped": fused, "roped_ref": ref}


def _bits(x: torch.Tensor) -> torch.Tensor:
    if x.dtype in (torch.bfloat16, torch.float16):
        return x.contiguous().view(torch.int16)
    return x.contiguous().view(torch.int32)


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "attention")


def _errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(rel L2, largest element difference over the reference's rms), in fp64."""
    g, r = got.double(), ref.double()
    return float((g - r).norm() / r.norm()), float((g - r).abs().max() / r.pow(2).mean().sqrt())


@pytest.mark.parametrize("name", CASES)
def test_interpreted_core_matches_reference(interp, name):
    """fp32 rounding of the reference (METHOD.md: far under 1e-3); masked slots, an all-masked compressed part,
    a row with no live slot (zeros), S not a multiple of the key block, several splits, partial head blocks."""
    q, keys, ok, sink = _case(name)
    got = interp[name]["out"]
    ref = _reference(q, keys, ok, sink)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.isfinite(got).all()
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # no live slot
    # worst element < 5e-5: the interpreter's dot is numpy's BLAS, its order the CPU's (seen 1.8e-5 on one CPU)
    for want in (ref, _exact(q, keys, ok, sink)):
        rel, worst = _errors(got, want)
        assert rel < 1e-5 and worst < 5e-5, (rel, worst)


@pytest.mark.parametrize("name", CASES)
def test_interpreted_core_bits_ignore_dead_slots_padding_and_other_rows(interp, name):
    """NaN in dead slots changes nothing (they are not read); 150 more dead slots (another split) change no bit;
    every row alone, or in reversed order, has the bits it has among the others."""
    res = interp[name]
    for key in ("garbage", "padded", "alone", "reversed"):
        assert torch.equal(res[key], res["out"]), key


@pytest.mark.parametrize("name", POOL_CASES)
def test_interpreted_pool_is_the_gathered_core_bitwise(interp, name):
    """attention_pool over a real KVPool (FP8 window rows and FP4 entries, or raw bf16 rows; swa-only or with
    entries) has the bits of attention_core over the same slots gathered and decoded in torch: early dead window
    slots, wrapped rings, verify rows of one sequence, entries over non-sequential pages, leading -1 with K < width
    and K = width, a row without entries; the rest of the pool is 0xFF bytes (never read). Within fp32 rounding of
    the reference, and each row's bits are the same alone, together and in reversed order."""
    res = interp[name]
    case = _pool_case(name)
    assert res["pool"].dtype == torch.float32 and res["pool"].shape == case["q"].shape
    assert torch.isfinite(res["pool"]).all()
    assert torch.equal(_bits(res["pool"]), _bits(res["core"]))
    for key in ("alone", "reversed"):
        assert torch.equal(_bits(res[key]), _bits(res["pool"])), key
    rel, worst = _errors(res["pool"], _reference(case["q"], case["keys"], case["ok"], case["sink"]))
    assert rel < 1e-5 and worst < 1e-5, (rel, worst)
    # o's inverse RoPE in the combine == the row ops' launch after it, bit for bit; the bucket's padding rows zero
    assert res["roped"].dtype == torch.bfloat16 and res["roped"].shape[0] == case["q"].shape[0] + 2
    assert torch.equal(_bits(res["roped"]), _bits(res["roped_ref"]))
    assert not res["roped"][-2:].any() and res["roped"][:-2].any()
    if case["args"].get("width"):  # the layout exercised what it claims: dead and live entry slots
        ok = case["ok"][:, case["args"]["window"]:]
        assert ok.any() and not ok.all(dim=1).any() and not ok.any(dim=1).all()
    assert not case["ok"][:, 0].all() and case["ok"][:, -1].any()


@pytest.mark.parametrize("name", POOL_CASES)
def test_interpreted_one_store_blocks_are_the_gathered_core_bitwise(interp, name):
    """With DSV41_ATTN_ALIGNED=1 a pool block whose window is a whole number of key blocks reads one store (the
    window's ring rows or the entries, never both): the bits of the gathered core, as the default path's (cases
    whose window is not a key block, or without entries, take the same path either way)."""
    from dsv41.kernels.step.attention import KEY_BLOCK

    res = interp[name]
    assert torch.equal(_bits(res["aligned"]["pool"]), _bits(res["core"]))
    assert torch.equal(_bits(res["aligned"]["core"]), _bits(res["core"]))
    H, hd, window, width = POOL_SPECS[name][:4]
    if name == "pool-fp8-w16":  # the case that exercises the one-store path at the release's quantisers
        assert window % KEY_BLOCK == 0 and width and POOL_SPECS[name][6]


def _check_fold(fold: dict) -> None:
    assert fold["clean"], "arrival counters left non-zero"
    for key, got in fold["folded"].items():
        assert torch.equal(_bits(got), _bits(fold["unfolded"][key])), key  # the two-launch path's bits
        assert torch.equal(_bits(got), _bits(fold["again"][key])), key  # a second launch on the same counters


@pytest.mark.parametrize("name", CASES + POOL_CASES)
def test_interpreted_fold_is_the_two_launch_path_bitwise(interp, name):
    """The combine folded into the split launch's last arrivers (DSV41_ATTN_FOLD=1) has the bits of the split
    launch then the combine launch (the default): the gathered core over generic rows (one to three splits, partial head
    blocks, rows without live slots) and, at the decode tiling, the in-place pool over decode and verify rows;
    the arrival counters are zero after the launch, and a second launch gives the same bits."""
    res = interp[name]
    _check_fold(res["fold"])
    assert torch.equal(_bits(res["fold"]["folded"]["out" if name in CASES else "pool"]),
                       _bits(res["out" if name in CASES else "pool"]))


def test_pool_rejects_bad_arguments():
    """Clear ValueErrors (before any launch): shapes, dtypes, width < K, pieces missing or given without the
    entry store, a window longer than the ring, a store that does not hold the codec."""
    from dsv41.kernels.step.attention import attention_pool

    case = _pool_case("pool-fp8")
    q, sink, scale, args = case["q"], case["sink"], case["scale"], case["args"]

    def bad(match, q_=q, sink_=sink, **change):
        kw = dict(args)
        for k, v in change.items():
            if v is None:
                kw.pop(k, None)
            else:
                kw[k] = v
        with pytest.raises(ValueError, match=match):
            attention_pool(q_, sink_, scale, **kw)

    bad("q must be", q_=q[0])
    bad("sink", sink_=sink[:-1])
    bad("width 5 < K = 6", width=5)
    bad("ids must be", ids=args["ids"][:-1])
    bad("ids must be", ids=args["ids"].float())
    bad("pages must be", pages=args["pages"][:, 0])
    bad("slot must be", slot=args["slot"].float())
    bad("pos must be", pos=args["pos"][:-1])
    bad("longer than the ring", window=12)
    bad("window must be", window=0)
    bad("entry_store needs", pages=None)
    bad("entry_store needs", entry_codec=None)
    bad("without entry_store", entry_store=None)
    bad("codec", window_codec=args["entry_codec"])
    bad("per_page", per_page=8)
    bad("window_store must be uint8", window_store=args["window_store"].float())


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    _interp_worker(sys.argv[2])
