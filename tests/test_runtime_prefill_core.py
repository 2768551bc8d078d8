"""The attention core of prefill rows on the step kernel (`FastAttention._core_blocked`): chunked == one-shot bitwise.

Prefill rows where the step kernels run take the indexed core (`kernels.step.prefill_slots.attention_indexed`: the key
slots read in place through an int32 slot index, PREFILL_INDEXED_ROWS rows per launch) or, with
DSV41_PREFILL_CORE_INDEXED=0, the gathered one (`attention_core`, PREFILL_CORE_ROWS rows per launch, each block's
key slots gathered right before it): the same bits. The kernel is one program per row, so a row's bits do not
depend on the block nor on the chunk: one call over T rows, the same rows in blocks of 5 and of 1, the gathered
path, and the same sequence prefilled in two chunks (the second one's window = the kept ring + its rows) give equal
bits; all of them are within fp32 rounding of the reference's `_core`. Layers with compressed slots and window-only
layers, and a source with no entry yet.

CPU: the kernel runs in Triton's interpreter, set before Triton decorates it, so in a child process (this file as a
script, reporting JSON). GPU (`-m gpu`): the same checks in-process at the full shape (64 heads, hd 512, S 640; and
a TP=2 rank's 2,048-row chunk, 32 heads, over 8,192 entries, bf16 and the pool's FP8 / FP4 values).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from types import SimpleNamespace

import pytest
import torch


def _layer(heads: int, hd: int, window: int, topk: int, device):
    from dsv41.model.attention import Attention
    from dsv41.runtime.layers.attention import FastAttention

    gen = torch.Generator().manual_seed(heads + hd)
    sink = torch.randn(heads, generator=gen).to(device)
    layer = object.__new__(FastAttention)
    layer.cfg = SimpleNamespace(sliding_window=window, index_topk=topk, head_dim=hd)
    layer.sink = sink
    ref = SimpleNamespace(cfg=layer.cfg, p=SimpleNamespace(sink=sink))
    layer.ref = SimpleNamespace(_core=partial(Attention._core, ref))
    return layer


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _values(x: torch.Tensor, kind: str, block: int) -> torch.Tensor:
    """bf16 keys: random bf16 values ("bf16") or the fast path's fake-quantised ones ("pool": the window's FP8 and
    the entries' FP4 values, held in bf16)."""
    from dsv41.model.quant import fp4_block_e4m3, fp8_block_ue8m0

    if kind == "bf16":
        return x.to(torch.bfloat16)
    return (fp8_block_ue8m0 if block == 32 else fp4_block_e4m3)(x.to(torch.bfloat16), block, True)


def _gathered(fn):
    """fn() with prefill rows on the gathered core (`INDEXED_ENV` off), the environment restored after."""
    from dsv41.runtime.layers.attention import INDEXED_ENV

    return _with_env(INDEXED_ENV, "0", fn)


def _onepass(fn):
    """(fn(), launches of the one-pass core it made) with prefill rows on the one-pass core (`ONEPASS_ENV` on),
    the environment and the module restored after (at small S its bits can be the split core's: the count says
    which core ran)."""
    from dsv41.kernels.step import prefill_core
    from dsv41.runtime.layers.attention import ONEPASS_ENV

    calls, real = [0], prefill_core.attention_onepass

    def counted(*args, **kw):
        calls[0] += 1
        return real(*args, **kw)

    prefill_core.attention_onepass = counted
    try:
        return _with_env(ONEPASS_ENV, "1", fn), calls[0]
    finally:
        prefill_core.attention_onepass = real


def _with_env(name: str, value: str, fn):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop(name)
        else:
            os.environ[name] = old


def _check(*args, **kwargs) -> dict:
    """`_check_cores` with the split core as the default path (`ONEPASS_ENV` off; `_onepass` turns it on for its
    own checks): the indexed == gathered and chunked claims are the split core's."""
    from dsv41.runtime.layers.attention import ONEPASS_ENV

    return _with_env(ONEPASS_ENV, "0", lambda: _check_cores(*args, **kwargs))


def _check_cores(device: str, heads: int, hd: int, window: int, topk: int, T: int, split: int, C: int | None = None,
                 values: str = "bf16", pos: int = 20) -> dict:
    from dsv41.runtime.layers.attention import Segment

    dev = torch.device(device)
    gen = torch.Generator().manual_seed(T)
    layer = _layer(heads, hd, window, topk, dev)
    start, C = 3, C or 3 * topk
    B = start + T + 2
    # window keys from position 0 (FP8 blocks of 32 where they are the pool's values)
    full = _values(torch.randn(pos + T, hd, generator=gen), values, 32).to(dev)
    q = torch.randn(B, heads, hd, generator=gen).to(torch.bfloat16).to(dev)
    kv = _values(torch.randn(C, hd, generator=gen), values, 16).to(dev)
    # each row's selection ascending, as `_select` gives them; early rows see fewer entries (-1 first)
    ids = torch.rand(T, C, generator=gen).topk(topk - 2, dim=1).indices.sort(dim=1).values
    ids[: T // 3, : topk // 3] = -1
    ids = ids.to(dev)
    out = {}
    for name, src, sel in (("compressed", SimpleNamespace(kv=kv), ids), ("window-only", None, None),
                           ("no entry yet", SimpleNamespace(kv=None), None)):
        seg = Segment(state=None, start=start, T=T, pos=pos)

        def core(block, s=seg, win=full, sel_=sel):
            o = torch.zeros(B, heads, hd, dtype=torch.float32, device=dev)
            layer._core_blocked(q, o, s, win, sel_, src, block)
            return o

        one = core(max(T, 1))
        blocks5, rows1, default = core(5), core(1), core(None)
        gathered = [_gathered(lambda b=b: core(b)) for b in (None, 5)]
        # the same sequence in two chunks: rows [0, split) then [split, T); the second chunk's window is the ring
        # the first one kept (its last `window` rows) followed by its own rows
        first = Segment(state=None, start=start, T=split, pos=pos)
        second = Segment(state=None, start=start + split, T=T - split, pos=pos + split)
        chunked = torch.zeros(B, heads, hd, dtype=torch.float32, device=dev)
        layer._core_blocked(q, chunked, first, full[: pos + split], None if sel is None else sel[:split], src, 7)
        layer._core_blocked(q, chunked, second, full[pos + split - window:], None if sel is None else sel[split:],
                            src, None)

        def two_chunks(s=sel):  # the same cut on the one-pass core
            o = torch.zeros(B, heads, hd, dtype=torch.float32, device=dev)
            layer._core_blocked(q, o, first, full[: pos + split], None if s is None else s[:split], src, 7)
            layer._core_blocked(q, o, second, full[pos + split - window:], None if s is None else s[split:], src, None)
            return o

        onepass, launches = _onepass(lambda: [core(None), core(5), two_chunks()])
        keys, ok = layer._slots(seg, full, sel, src, slice(0, T))
        ref = layer.ref._core(q[start:start + T], keys, ok)
        rows = slice(start, start + T)
        out[name] = {"blocks": bool(torch.equal(one, blocks5) and torch.equal(one, rows1)
                                    and torch.equal(one, default)),
                     "indexed == gathered": all(_same_bits(one, g) for g in gathered),
                     "chunked": bool(torch.equal(one, chunked)),
                     "others zero": bool(one[:start].eq(0).all() and one[start + T:].eq(0).all()),
                     "rel": _rel(one[rows], ref), "finite": bool(torch.isfinite(one).all()),
                     # the one-pass core (its own bits): whole, in blocks (ignored: one launch) and chunked alike
                     "onepass ran": launches == 4,  # one a segment: whole, whole (blocks ignored), two chunks
                     "onepass same": all(_same_bits(onepass[0], o) for o in onepass[1:]),
                     "onepass rel": _rel(onepass[0][rows], ref),
                     "onepass others zero": bool(onepass[0][:start].eq(0).all()
                                                 and onepass[0][start + T:].eq(0).all())}
    out["direct"] = _direct(q[start:start + T], full, kv, ids, layer, pos, window, topk)
    return out


def _direct(q, win, kv, ids, layer, pos: int, window: int, topk: int) -> dict:
    """The slot index against the gathered path's (`_core_blocked`'s torch form: window rows clamped, live iff the
    key position >= 0; entry W + id, dead -1), and `attention_indexed` over it: rows no live slot names (NaN here)
    and indices past the entries (dead) change no bit."""
    from dsv41.kernels.step.prefill_slots import attention_indexed, prefill_slot_index
    from dsv41.runtime.layers.attention import PREFILL_TILING

    # one entry past those the ids can name: the NaN check always has an unnamed row (at the full shape every
    # window row and every entry is named otherwise)
    kv = torch.cat((kv, torch.zeros_like(kv[:1])))
    T, W, C, dev = q.shape[0], win.shape[0], kv.shape[0], q.device
    slots = prefill_slot_index(T, pos, W, window, width=topk, ids=ids, entries=C)
    key_pos = torch.arange(pos, pos + T, device=dev)[:, None] + torch.arange(1 - window, 1, device=dev)[None, :]
    sel = torch.cat((torch.full((T, topk - ids.shape[1]), -1, dtype=ids.dtype, device=dev), ids), dim=1)
    want = torch.cat((torch.where(key_pos >= 0, (key_pos - (pos + T - W)).clamp(min=0), -1),
                      torch.where(sel >= 0, W + sel, -1)), dim=1)
    run = partial(attention_indexed, sink=layer.sink, scale=q.shape[2] ** -0.5, **PREFILL_TILING)
    plain = run(q, win, kv, slots)
    named = torch.zeros(W + C, dtype=torch.bool, device=dev)
    named[slots[slots >= 0].long()] = True
    bad_win, bad_kv = win.clone(), kv.clone()
    bad_win[~named[:W]] = float("nan")
    bad_kv[~named[W:]] = float("nan")
    past = torch.where(slots < 0, W + C + torch.arange(slots.shape[1], device=dev, dtype=slots.dtype), slots)
    into = torch.full((T + 1,) + tuple(q.shape[1:]), float("nan"), device=dev)[1:]
    return {"slot index": bool(torch.equal(slots.long(), want)) and slots.dtype == torch.int32,
            "unnamed rows": _same_bits(run(q, bad_win, bad_kv, slots), plain),
            "past the entries": _same_bits(run(q, win, kv, past), plain),
            "out": _same_bits(run(q, win, kv, slots, out=into), plain) and _same_bits(into, plain),
            "some unnamed": bool((~named).any())}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))


def _assert(results: dict, tol: float = 1e-5) -> None:
    direct = results.pop("direct")
    for name, ok in direct.items():
        assert ok, f"indexed core: {name}"
    for name, r in results.items():
        assert r["blocks"], f"{name}: a row's bits depend on the block"
        assert r["indexed == gathered"], f"{name}: the indexed core differs from the gathered one"
        assert r["chunked"], f"{name}: chunked != one-shot"
        assert r["others zero"] and r["finite"], name
        assert r["rel"] < tol, f"{name}: rel {r['rel']:.2e} from the reference core"
        assert r["onepass ran"], f"{name}: the one-pass knob did not route prefill rows to the one-pass core"
        assert r["onepass same"], f"{name}: the one-pass core's rows depend on the chunk"
        assert r["onepass others zero"], name
        assert r["onepass rel"] < tol, f"{name}: one-pass rel {r['onepass rel']:.2e} from the reference core"


def test_interpreted_prefill_core_chunk_invariant():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    args = {"device": "cpu", "heads": 3, "hd": 64, "window": 16, "topk": 8, "T": 37, "split": 23}
    out = subprocess.run([sys.executable, __file__, json.dumps(args)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    _assert(json.loads(out.stdout.strip().splitlines()[-1]))


def test_plain_cpu_prefill_keeps_the_reference_core():
    from dsv41.kernels.exl3.backend import interpreting
    from dsv41.runtime.layers.attention import step_kernels_run

    if interpreting():
        pytest.skip("the interpreter is on in this process")
    assert not step_kernels_run(torch.device("cpu"))


@pytest.mark.gpu
def test_gpu_prefill_core_chunk_invariant_full_shape():
    _assert(_check("cuda", heads=64, hd=512, window=128, topk=512, T=300, split=131))


@pytest.mark.gpu
@pytest.mark.parametrize("values", ["bf16", "pool"])
def test_gpu_indexed_prefill_core_is_the_gathered_core_full_shape(values):
    """A TP=2 rank's full prefill shape: 32 local heads of 512, window 128 + top-k 512, a 2,048-row chunk over
    8,192 entries at position 6,000; random bf16 keys and the pool's FP8 / FP4 values. The indexed core == the
    gathered core bitwise (all rows in one launch and in 256-row blocks), every row's bits alone (blocks of 1),
    in slices (blocks of 5) and across a chunk cut, within fp32 rounding of the reference."""
    from step_harness import need_compiled_cuda

    need_compiled_cuda()
    _assert(_check("cuda", heads=32, hd=512, window=128, topk=512, T=2048, split=1000, C=8192, values=values,
                   pos=6000))


if __name__ == "__main__":
    print(json.dumps(_check(**json.loads(sys.argv[1]))))
