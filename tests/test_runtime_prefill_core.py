"""The attention core of prefill rows on the step kernel (`FastAttention._core_blocked`): chunked == one-shot bitwise.

Prefill rows where the step kernels run take `kernels.step.attention.attention_core`, PREFILL_CORE_ROWS rows per
launch, each block's key slots gathered right before it. The kernel is one program per row, so a row's bits do not
depend on the block nor on the chunk: one call over T rows, the same rows in blocks of 5 and of 1, and the same
sequence prefilled in two chunks (the second one's window = the kept ring + its rows) give equal bits; all of them
are within fp32 rounding of the reference's `_core`. Layers with compressed slots and window-only layers, and a
source with no entry yet.

CPU: the kernel runs in Triton's interpreter, set before Triton decorates it, so in a child process (this file as a
script, reporting JSON). GPU (`-m gpu`): the same checks in-process at the full shape (64 heads, hd 512, S 640).
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


def _check(device: str, heads: int, hd: int, window: int, topk: int, T: int, split: int) -> dict:
    from dsv41.runtime.layers.attention import Segment

    dev = torch.device(device)
    gen = torch.Generator().manual_seed(T)
    layer = _layer(heads, hd, window, topk, dev)
    pos, start, C = 20, 3, 3 * topk
    B = start + T + 2
    full = torch.randn(pos + T, hd, generator=gen).to(torch.bfloat16).to(dev)  # window keys from position 0
    q = torch.randn(B, heads, hd, generator=gen).to(torch.bfloat16).to(dev)
    kv = torch.randn(C, hd, generator=gen).to(torch.bfloat16).to(dev)
    ids = torch.randint(0, C, (T, topk - 2), generator=gen)
    ids[: T // 3, : topk // 3] = -1  # early rows see fewer entries (-1 first, as `_select` lays them out)
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
        # the same sequence in two chunks: rows [0, split) then [split, T); the second chunk's window is the ring
        # the first one kept (its last `window` rows) followed by its own rows
        first = Segment(state=None, start=start, T=split, pos=pos)
        second = Segment(state=None, start=start + split, T=T - split, pos=pos + split)
        chunked = torch.zeros(B, heads, hd, dtype=torch.float32, device=dev)
        layer._core_blocked(q, chunked, first, full[: pos + split], None if sel is None else sel[:split], src, 7)
        layer._core_blocked(q, chunked, second, full[pos + split - window:], None if sel is None else sel[split:],
                            src, None)
        keys, ok = layer._slots(seg, full, sel, src, slice(0, T))
        ref = layer.ref._core(q[start:start + T], keys, ok)
        rows = slice(start, start + T)
        out[name] = {"blocks": bool(torch.equal(one, blocks5) and torch.equal(one, rows1)
                                    and torch.equal(one, default)),
                     "chunked": bool(torch.equal(one, chunked)),
                     "others zero": bool(one[:start].eq(0).all() and one[start + T:].eq(0).all()),
                     "rel": _rel(one[rows], ref), "finite": bool(torch.isfinite(one).all())}
    return out


def _assert(results: dict, tol: float = 1e-5) -> None:
    for name, r in results.items():
        assert r["blocks"], f"{name}: a row's bits depend on the block"
        assert r["chunked"], f"{name}: chunked != one-shot"
        assert r["others zero"] and r["finite"], name
        assert r["rel"] < tol, f"{name}: rel {r['rel']:.2e} from the reference core"


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


if __name__ == "__main__":
    print(json.dumps(_check(**json.loads(sys.argv[1]))))
