"""The shared expert's clamped SwiGLU kernel (dsv41.kernels.step.swiglu) against the reference's elementwise middle
of `dsv41.model.moe.swiglu_clamped`: h = (silu(min(g, limit)) * clamp(u, ±limit)) in fp32, rounded to the dtype.

Tolerance: the clamps, the product and the rounding are exact operations; silu's exp is the kernel's own (Triton's
exp, numpy's in the interpreter) against torch's, so an fp32 h lies within a few fp32 ulps of the reference's and a
bf16 h within one bf16 ulp, differing on a small fraction of the elements (an fp32 ulp moves a bf16 rounding only
at a boundary). Bitwise claims: rows=k gives the full launch's rows [0, k) and +0.0 below; a row's bits are the
same alone and among other rows in any order.
CPU: the interpreter in a child process (tests/step_harness.py); GPU: the release's shape (1,152 columns a rank).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from step_harness import interpreted, need_compiled_cuda  # noqa: E402

LIMIT = 10.0
FP32_ULPS = 4
FLIP_FRACTION = 0.02


def _inputs(B: int, width: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.1, 1.0, 4.0, 30.0])[torch.randint(0, 4, (B, 1), generator=g)]  # some past the limit
    gate = (torch.randn(B, width, generator=g) * scale).to(dtype)
    up = (torch.randn(B, width, generator=g) * scale).to(dtype)
    return gate, up


def _reference(gate, up, limit=LIMIT):
    import torch.nn.functional as F

    return (F.silu(gate.float().clamp(max=limit)) * up.float().clamp(-limit, limit)).to(gate.dtype)


def _run(device: str) -> dict:
    from dsv41.kernels.step.swiglu import swiglu_rows

    out = {}
    for name, dtype, B, width in (("bf16", torch.bfloat16, 5, 300), ("fp32", torch.float32, 3, 64)):
        gate, up = (t.to(device) for t in _inputs(B, width, dtype))
        full = swiglu_rows(gate, up, LIMIT)
        alone = torch.cat([swiglu_rows(gate[r:r + 1], up[r:r + 1], LIMIT) for r in range(B)])
        perm = torch.randperm(B, generator=torch.Generator().manual_seed(1)).to(device)
        shuffled = swiglu_rows(gate[perm], up[perm], LIMIT)
        live = {k: swiglu_rows(gate, up, LIMIT, rows=k) for k in (0, 1, B - 1)}
        out[name] = dict(full=full.cpu(), alone=alone.cpu(), shuffled=shuffled.cpu(), perm=perm.cpu(),
                         live={k: v.cpu() for k, v in live.items()})
    return out


def _check(res: dict, shapes=(("bf16", torch.bfloat16, 5, 300), ("fp32", torch.float32, 3, 64))) -> None:
    for name, dtype, B, width in shapes:
        r = res[name]
        gate, up = _inputs(B, width, dtype)
        ref, h = _reference(gate, up), r["full"]
        assert h.dtype == dtype and h.shape == (B, width)
        if dtype == torch.float32:
            ulp = torch.finfo(torch.float32).eps * ref.abs().clamp(min=torch.finfo(torch.float32).tiny)
            assert ((h - ref).abs() <= FP32_ULPS * ulp).all(), (h - ref).abs().max()
        else:
            diff = h.view(torch.int16).int() - ref.view(torch.int16).int()
            assert diff.abs().max() <= 1, name
            assert (diff != 0).float().mean() <= FLIP_FRACTION, (diff != 0).float().mean()
        assert torch.equal(r["alone"].view(torch.uint8), h.view(torch.uint8)), name
        assert torch.equal(r["shuffled"].view(torch.uint8), h[r["perm"]].view(torch.uint8)), name
        for k, v in r["live"].items():
            assert torch.equal(v[:k].view(torch.uint8), h[:k].view(torch.uint8)), (name, k)
            assert (v[k:].view(torch.uint8) == 0).all(), (name, k)  # +0.0: every byte zero


def _interp_worker(out_path: str) -> None:
    torch.save(_run("cpu"), out_path)


def test_interpreted_swiglu_matches_the_reference_rows_alone_and_live(tmp_path_factory):
    _check(interpreted(tmp_path_factory, __file__, "swiglu", timeout=300))


def test_bad_inputs_are_refused():
    from dsv41.kernels.step.swiglu import swiglu_rows

    g = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one dtype and shape"):
        swiglu_rows(g, torch.zeros(2, 8), LIMIT)
    with pytest.raises(ValueError, match="one dtype and shape"):
        swiglu_rows(g, torch.zeros(2, 4, dtype=torch.bfloat16), LIMIT)
    with pytest.raises(ValueError, match="bf16 / fp16 / fp32"):
        swiglu_rows(g.double(), g.double(), LIMIT)
    with pytest.raises(ValueError, match="unit column stride"):
        swiglu_rows(torch.zeros(8, 2, dtype=torch.bfloat16).t(), g, LIMIT)
    with pytest.raises(ValueError, match="rows"):
        swiglu_rows(g, g, LIMIT, rows=3)


@pytest.mark.gpu
def test_gpu_swiglu_release_shape():
    """A rank's shared expert at the release's shape (moe_intermediate_size 2,304 over TP=2), bf16, 16-row bucket."""
    need_compiled_cuda()
    from dsv41.kernels.step.swiglu import swiglu_rows

    gate, up = _inputs(16, 1152, torch.bfloat16, seed=3)
    ref = _reference(gate, up)
    h = swiglu_rows(gate.cuda(), up.cuda(), LIMIT).cpu()
    diff = h.view(torch.int16).int() - ref.view(torch.int16).int()
    assert diff.abs().max() <= 1 and (diff != 0).float().mean() <= FLIP_FRACTION
    live = swiglu_rows(gate.cuda(), up.cuda(), LIMIT, rows=1).cpu()
    assert torch.equal(live[:1].view(torch.int16), h[:1].view(torch.int16)) and (live[1:].view(torch.int16) == 0).all()


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    _interp_worker(sys.argv[2])
