"""The mHC site's prefetching (`kernels/step/mhc.py: pipelined()`, `DSV41_MHC_PIPELINE`) changes when loads are
issued, never the arithmetic: every output of every launcher bitwise the same with the knob on and off. On CPU under
TRITON_INTERPRET=1 (a child process: the interpreter must be chosen before the kernels are decorated) at small shapes
that cover short splits, padded hc and a one-split row; on the GPU at the release's d = 5120 and 4096."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from step_harness import interpreted, need_compiled_cuda  # noqa: E402
# (hc, d, B, iters, dtype, splits); splits None = default_splits(d)
CPU_CASES = [(4, 160, 4, 20, "bfloat16", 3), (3, 128, 2, 20, "bfloat16", 1), (4, 256, 3, 20, "float32", None)]
GPU_CASES = [(4, 5120, B, 20, "bfloat16", None) for B in (1, 16)] + [(4, 4096, 6, 20, "bfloat16", None)]


def same_bits_both_ways(case, device: str, seed: int = 0) -> dict:
    """Each output of `_run` (every launcher): bitwise equal with DSV41_MHC_PIPELINE=0 and =1?"""
    from test_kernels_step_mhc import _inputs, _run

    hc, d, B, iters, dtype, splits = case
    t = _inputs(hc, d, B, getattr(torch, dtype), device, seed)
    outs = {}
    for knob in ("0", "1"):
        with mock.patch.dict(os.environ, DSV41_MHC_PIPELINE=knob):
            outs[knob] = _run(t, iters, splits)
    return {n: torch.equal(outs["0"][n].view(torch.uint8), outs["1"][n].view(torch.uint8)) for n in outs["0"]}


def test_the_knob_reads_off_and_on(monkeypatch):
    from dsv41.kernels.step.mhc import pipelined

    for value, on in (("0", False), ("off", False), (" False ", False), ("1", True), ("on", True)):
        monkeypatch.setenv("DSV41_MHC_PIPELINE", value)
        assert pipelined() is on, value
    monkeypatch.delenv("DSV41_MHC_PIPELINE")
    assert pipelined()  # the default


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "mhc_pipeline", timeout=600)


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_interpreted_pipelined_site_gives_the_same_bits(interp, case):
    res = interp[json.dumps(case)]
    assert res and all(res.values()), res


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_pipelined_site_gives_the_same_bits(case):
    need_compiled_cuda()
    res = same_bits_both_ways(case, "cuda", seed=200 + case[2])
    assert res and all(res.values()), res


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    torch.save({json.dumps(c): same_bits_both_ways(c, "cpu", seed=i) for i, c in enumerate(CPU_CASES)}, sys.argv[2])
