"""Engram's gate + mix kernel (dsv41.kernels.step.engram) against the reference `dsv41.model.engram.engram_mix`.

Tolerance: the three sums of a stream run in another order than torch's, so a gate lies within fp32 rounding of
the reference's (checked through X' in fp32 streams: within a few ulps of |X| + |g·v|), and a bf16 X' within one
ulp, differing on a small fraction of the elements. Exact: the live mask (a shut gate leaves X' = X), rows=k
(rows [0, k) the full launch's bits, +0.0 below), a row alone == among others in any order.
CPU: the interpreter in a child process (tests/step_harness.py); GPU: the release's shape (hc 4, d 5120).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from step_harness import interpreted, need_compiled_cuda  # noqa: E402

EPS = 1e-6
FP32_ULPS = 8
FLIP_FRACTION = 0.02


def _inputs(B: int, hc: int, d: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, hc, d, generator=g) * (1 + 3 * torch.rand(B, hc, 1, generator=g))).to(dtype)
    x[0, 1] = 0  # a zero stream: its score is exactly 0, the gate takes the floor's root
    kv = torch.randn(B, (hc + 1) * d, generator=g) * 0.5
    qw, kw = 1 + 0.2 * torch.randn(hc, d, generator=g), 1 + 0.2 * torch.randn(hc, d, generator=g)
    live = torch.ones(B, dtype=torch.bool)
    live[-1] = False
    return x, kv, qw, kw, live


CASES = (("bf16", torch.bfloat16, 5, 4, 96), ("fp32", torch.float32, 3, 4, 100))


def _run(device: str) -> dict:
    from dsv41.kernels.step.engram import engram_mix_rows, gate_weight

    out = {}
    for name, dtype, B, hc, d in CASES:
        x, kv, qw, kw, live = (t.to(device) for t in _inputs(B, hc, d, dtype))
        w = gate_weight(qw, kw)
        full = engram_mix_rows(x, kv, w, EPS, live)
        perm = torch.randperm(B, generator=torch.Generator().manual_seed(1)).to(device)
        out[name] = dict(full=full.cpu(), perm=perm.cpu(),
                         alone=torch.cat([engram_mix_rows(x[r:r + 1], kv[r:r + 1], w, EPS, live[r:r + 1])
                                          for r in range(B)]).cpu(),
                         shuffled=engram_mix_rows(x[perm], kv[perm], w, EPS, live[perm]).cpu(),
                         no_live=engram_mix_rows(x, kv, w, EPS).cpu(),
                         rows={k: engram_mix_rows(x, kv, w, EPS, live, rows=k).cpu() for k in (0, 1, B - 1)})
    return out


def _check(res: dict, shapes=CASES) -> None:
    from dsv41.model.engram import engram_mix

    for name, dtype, B, hc, d in shapes:
        r = res[name]
        x, kv, qw, kw, live = _inputs(B, hc, d, dtype)
        ref, h = engram_mix(x, kv, qw, kw, EPS, live), r["full"]
        assert h.dtype == dtype and h.shape == x.shape
        if dtype == torch.float32:
            scale = x.abs() + (ref - x).abs()
            assert ((h - ref).abs() <= FP32_ULPS * torch.finfo(torch.float32).eps * scale + 1e-30).all(), name
        else:
            diff = h.view(torch.int16).int() - ref.view(torch.int16).int()
            assert diff.abs().max() <= 1, name
            assert (diff != 0).float().mean() <= FLIP_FRACTION, name
        assert torch.equal(h[-1].view(torch.uint8), x[-1].view(torch.uint8)), name  # a shut gate: X' = X, bitwise
        bits = lambda t: t.view(torch.uint8)  # noqa: E731
        assert torch.equal(bits(r["alone"]), bits(h)) and torch.equal(bits(r["shuffled"]), bits(h[r["perm"]])), name
        assert torch.equal(bits(r["no_live"][:-1]), bits(h[:-1])), name  # live rows unchanged by the mask
        for k, v in r["rows"].items():
            assert torch.equal(bits(v[:k]), bits(h[:k])) and (bits(v[k:]) == 0).all(), (name, k)


def _interp_worker(out_path: str) -> None:
    torch.save(_run("cpu"), out_path)


def test_interpreted_engram_matches_the_reference_rows_alone_and_live(tmp_path_factory):
    _check(interpreted(tmp_path_factory, __file__, "engram", timeout=300))


def test_bad_inputs_are_refused():
    from dsv41.kernels.step.engram import engram_mix_rows

    x, w = torch.zeros(2, 4, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="kv has shape"):
        engram_mix_rows(x, torch.zeros(2, 32), w, EPS)
    with pytest.raises(ValueError, match="gate_weight"):
        engram_mix_rows(x, torch.zeros(2, 40), w.double(), EPS)
    with pytest.raises(ValueError, match="live must be bool"):
        engram_mix_rows(x, torch.zeros(2, 40), w, EPS, torch.ones(2))
    with pytest.raises(ValueError, match="contiguous"):
        engram_mix_rows(torch.zeros(2, 8, 4).transpose(1, 2), torch.zeros(2, 40), w, EPS)
    with pytest.raises(ValueError, match="rows"):
        engram_mix_rows(x, torch.zeros(2, 40), w, EPS, rows=3)


@pytest.mark.gpu
def test_gpu_engram_release_shape():
    """hc 4, d 5120, bf16 streams, a 16-row bucket, compiled: the reference bounds and the live mask."""
    need_compiled_cuda()
    case = ("bf16", torch.bfloat16, 16, 4, 5120)
    from dsv41.kernels.step.engram import engram_mix_rows, gate_weight

    x, kv, qw, kw, live = _inputs(*case[2:], case[1])
    full = engram_mix_rows(x.cuda(), kv.cuda(), gate_weight(qw, kw).cuda(), EPS, live.cuda()).cpu()
    from dsv41.model.engram import engram_mix

    diff = full.view(torch.int16).int() - engram_mix(x, kv, qw, kw, EPS, live).view(torch.int16).int()
    assert diff.abs().max() <= 1 and (diff != 0).float().mean() <= FLIP_FRACTION


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    _interp_worker(sys.argv[2])
