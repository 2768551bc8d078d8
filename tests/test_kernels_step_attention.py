"""The step attention-core kernel (dsv41.kernels.step.attention) against the reference's `Attention._core`.

CPU part: the kernels run in Triton's interpreter, in one child process (this file run as a script; see
tests/test_kernels_step_router.py for why), which saves the kernel's outputs on the cases below; the tests rebuild
the inputs and judge. GPU part (`-m gpu`): the real shapes (64 or 32 local heads of 512, S = 128 + 512), compiled.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from step_harness import interpreted, need_compiled_cuda  # noqa: E402

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


def _interp_worker(out_path: str) -> None:
    from dsv41.kernels.step.attention import attention_core

    out = {}
    for name in CASES:
        q, keys, ok, sink = _case(name)
        hd = q.shape[2]
        core = lambda q_, k_, o_: attention_core(q_, k_, o_, sink, hd ** -0.5)  # noqa: E731
        res = {"out": core(q, keys, ok), "garbage": core(q, _garbage(keys, ok), ok)}
        res["padded"] = core(q, *_padded(keys, ok, 150))  # one more split, and more blocks in the last one
        res["alone"] = torch.cat([core(q[r:r + 1], keys[r:r + 1], ok[r:r + 1]) for r in range(q.shape[0])])
        rev = torch.arange(q.shape[0] - 1, -1, -1)
        res["reversed"] = core(q[rev], keys[rev], ok[rev]).flip(0)
        out[name] = res
    torch.save(out, out_path)


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
    rel, worst = _errors(got, ref)
    assert rel < 1e-5 and worst < 1e-5, (rel, worst)
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # no live slot
    assert _errors(got, _exact(q, keys, ok, sink))[0] < 1e-5


@pytest.mark.parametrize("name", CASES)
def test_interpreted_core_bits_ignore_dead_slots_padding_and_other_rows(interp, name):
    """NaN in dead slots changes nothing (they are not read); 150 more dead slots (another split) change no bit;
    every row alone, or in reversed order, has the bits it has among the others."""
    res = interp[name]
    for key in ("garbage", "padded", "alone", "reversed"):
        assert torch.equal(res[key], res["out"]), key


# ---------------------------------------------------------------------------------------------------------------
# GPU: the real shapes, compiled
# ---------------------------------------------------------------------------------------------------------------


_need_cuda = need_compiled_cuda


@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 32])
def test_gpu_core_real_shapes_vs_reference_and_row_invariance(H):
    """64 (TP=1) or 32 (TP=2) heads of 512, S = 128 window + 512 compressed slots, bf16 queries and keys, rows
    1..16: within fp32 rounding of the reference, and each row's bits equal alone, among 15 others, at any position
    and with its keys padded by another split of dead slots."""
    from dsv41.kernels.step.attention import attention_core

    _need_cuda()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(11)
    T, hd, win, comp = 16, 512, 128, 512
    q = (torch.randn(T, H, hd, generator=gen, device=dev) * 0.5).bfloat16()
    keys = torch.randn(T, win + comp, hd, generator=gen, device=dev).bfloat16()
    ok = torch.rand(T, win + comp, generator=gen, device=dev) > 0.2
    ok[1, win:] = False
    ok[2] = False
    ok[3, : win + comp // 2] = True
    sink = torch.randn(H, generator=gen, device=dev)
    scale = hd ** -0.5
    out = attention_core(q, keys, ok, sink, scale)
    torch.cuda.synchronize()
    ref = _reference(q, keys, ok, sink)
    rel, worst = _errors(out, ref)
    assert rel < 1e-5 and worst < 1e-4, (rel, worst)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    for B in (1, 2, 3, 5, 8, 13, 16):
        for start in sorted({0, T - B}):
            part = attention_core(q[start:start + B], keys[start:start + B], ok[start:start + B], sink, scale)
            assert torch.equal(part, out[start:start + B]), (B, start)
    perm = torch.randperm(T, generator=gen, device=dev)
    assert torch.equal(attention_core(q[perm], keys[perm], ok[perm], sink, scale), out[perm])
    assert torch.equal(attention_core(q, *_padded(keys, ok, 130), sink, scale), out)
    assert torch.equal(attention_core(q, _garbage(keys, ok), ok, sink, scale), out)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    _interp_worker(sys.argv[2])
