"""The decode core's tiling switch (DSV41_DECODE_CORE_TILING, `attention.decode_tiling`): other split / key-block /
warp / head-block settings for decode and verify rows keep the engine's rules at each setting.

Split and block boundaries and the head block fix the bits, so another setting gives other bits; what must hold is
that every launch of decode and verify rows takes the same setting (the in-place pool and the gathered core alike:
drafted == serial, in-place step == load-and-store step), that each row's bits depend on that row only (alone ==
batched, any order), that dead slots past a row's own change nothing, and that the values stay within fp32
rounding of the reference. CPU: Triton's interpreter on the pool cases of tests/test_kernels_step_attention.py
(release quantisers FP8 / FP4, verify rows, wrapped rings, early positions, left-padded ids), with and without the
one-store blocks (DSV41_ATTN_ALIGNED). GPU: tests/test_kernels_step_attention_gpu.py's real shapes, here."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from step_harness import interpreted, need_compiled_cuda  # noqa: E402
from test_kernels_step_attention import _bits, _errors, _padded, _pool_case, _pool_results, _reference, _rows_of
from test_kernels_step_attention_gpu import _gpu_pool_case

# (tiling, one-store blocks) -> pool cases: 16-slot splits (twice the programs of the default at one row, one key
# block each; the one-store blocks where the window is a key block), and 64-slot splits of 32-key blocks over
# 32-head programs at 8 warps (a key block loaded once for twice the heads)
TILINGS = {("16,16,4", True): ("pool-fp8-w16", "pool-fp8"), ("64,32,8,32", False): ("pool-fp8-w16",)}
NAMES = ("pool-fp8-w16", "pool-fp8")


def _tiled(tiling: str | None, aligned: bool, results):
    """`results()` under DSV41_DECODE_CORE_TILING=`tiling` (None: unset) and DSV41_ATTN_ALIGNED=`aligned`."""
    from dsv41.kernels.step.attention import ALIGN_ENV, TILING_ENV

    before = {k: os.environ.get(k) for k in (TILING_ENV, ALIGN_ENV)}
    os.environ[ALIGN_ENV] = "1" if aligned else "0"
    if tiling is None:
        os.environ.pop(TILING_ENV, None)
    else:
        os.environ[TILING_ENV] = tiling
    try:
        return results()
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _tiling_results(case: dict, tiling: str | None, aligned: bool) -> dict:
    """`_pool_results` (pool, the gathered core at the same tiling, roped, alone, reversed) and the gathered core
    over 40 more dead slots per row (NaN keys), at one setting."""
    from dsv41.kernels.step.attention import attention_core, decode_tiling

    def run():
        res = _pool_results(case)
        res["padded"] = attention_core(case["q"], *_padded(case["keys"], case["ok"], 40), case["sink"],
                                       case["scale"], keys_bf16=True, **decode_tiling())
        return res

    return _tiled(tiling, aligned, run)


def _interp_worker(out_path: str) -> None:
    out = {}
    for name in NAMES:
        case = _pool_case(name)
        out[name] = {"default": _tiled(None, False, lambda: _pool_results(case, alone=False))["pool"]}
        for (tiling, aligned), names in TILINGS.items():
            if name in names:
                out[name][tiling] = _tiling_results(case, tiling, aligned)
    torch.save(out, out_path)


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "attention_tiling")


def _check(res: dict, case: dict, default: torch.Tensor, worst_ok: float) -> None:
    assert torch.isfinite(res["pool"]).all()
    assert torch.equal(_bits(res["pool"]), _bits(res["core"]))  # in place == gathered at the same tiling
    for key in ("alone", "reversed", "padded"):
        assert torch.equal(_bits(res[key]), _bits(res["pool"])), key
    assert torch.equal(_bits(res["roped"]), _bits(res["roped_ref"]))
    assert not res["roped"][-2:].any()
    for want in (_reference(case["q"], case["keys"], case["ok"], case["sink"]), default):
        rel, worst = _errors(res["pool"], want)
        assert rel < 1e-5 and worst < worst_ok, (rel, worst)


@pytest.mark.parametrize("tiling,name", [(t, n) for (t, _), names in TILINGS.items() for n in names])
def test_interpreted_decode_tiling_keeps_pool_gathered_rows_and_padding(interp, name, tiling):
    """At another decode tiling: the pool == the gathered core bit for bit (so decode and verify rows, in place
    or gathered, share the bits), each row alone / reversed == batched, 40 more dead slots change nothing, the
    combine's inverse RoPE == the row ops', and within fp32 rounding of the reference and of the default tiling."""
    _check(interp[name][tiling], _pool_case(name), interp[name]["default"], 1e-5)


def test_decode_tiling_switch_reads_and_checks_its_value(monkeypatch):
    """Unset: the module's defaults; three or four integers: those; anything else: a ValueError naming it."""
    from dsv41.kernels.step.attention import (DECODE_SPLIT_KEYS, DECODE_WARPS, HEAD_BLOCK, KEY_BLOCK, TILING_ENV,
                                              decode_tiling)

    monkeypatch.delenv(TILING_ENV, raising=False)
    assert decode_tiling() == dict(split_keys=DECODE_SPLIT_KEYS, key_block=KEY_BLOCK, num_warps=DECODE_WARPS,
                                   head_block=HEAD_BLOCK)
    monkeypatch.setenv(TILING_ENV, "16,16,8")
    assert decode_tiling() == dict(split_keys=16, key_block=16, num_warps=8, head_block=HEAD_BLOCK)
    monkeypatch.setenv(TILING_ENV, " 64,32,8,32 ")
    assert decode_tiling() == dict(split_keys=64, key_block=32, num_warps=8, head_block=32)
    for bad in ("16,16", "a,16,4", "24,16,4", "32,8,4", "32,16,3", "32,16,4,24", "1,2,3,4,5"):
        monkeypatch.setenv(TILING_ENV, bad)
        with pytest.raises(ValueError, match="(?i)tiling"):
            decode_tiling()


# ---------------------------------------------------------------------------------------------------------------
# GPU: the real shapes, compiled
# ---------------------------------------------------------------------------------------------------------------

GPU_TILINGS = [("16,16,4", True), ("16,16,4", False), ("32,32,8", True), ("64,32,8,32", True), ("32,16,4", True)]


@pytest.mark.gpu
@pytest.mark.parametrize("tiling,aligned", GPU_TILINGS)
@pytest.mark.parametrize("H", [64, 32])
def test_gpu_decode_tiling_keeps_pool_gathered_rows_and_graphs(H, tiling, aligned):
    """Compiled, the real shapes (window 128 + top-k 512, hd 512, 16 decode and verify rows of 6 sequences), at each
    candidate tiling of bench/attention_decode_sweep.py: the pool == the gathered core bitwise, rows alone /
    reversed / in contiguous parts == batched, dead padding slots change nothing, the combine's RoPE == the row
    ops', within fp32 rounding of the reference and the default tiling; a captured graph replays the eager bits."""
    from dsv41.kernels.step.attention import attention_pool

    need_compiled_cuda()
    case = _gpu_pool_case(H, True)
    default = _tiled(None, False, lambda: _pool_results(case, alone=False))["pool"]
    res = _tiling_results(case, tiling, aligned)
    q, sink, scale, args = case["q"], case["sink"], case["scale"], case["args"]

    def pool(rows=slice(None)):
        return attention_pool(q[rows], sink, scale, **_rows_of(args, rows))

    parts = _tiled(tiling, aligned, lambda: [pool(slice(a, b)) for a, b in ((0, 1), (0, 6), (3, 16), (7, 8))])
    torch.cuda.synchronize()
    _check(res, case, default, 1e-4)
    for (a, b), got in zip(((0, 1), (0, 6), (3, 16), (7, 8)), parts):
        assert torch.equal(_bits(got), _bits(res["pool"][a:b])), (a, b)
    out = torch.empty_like(res["pool"])
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        _tiled(tiling, aligned, lambda: attention_pool(q, sink, scale, **args, out=out))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(_bits(out), _bits(res["pool"]))


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    _interp_worker(sys.argv[2])
