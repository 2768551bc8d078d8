"""The row ops storing what they make (`rowops.norm_rope_rows` / `rope_rows` with `store=`): the same output as
without, and the store's bytes those `cache.store_rows` writes from that output (itself `Codec.encode`'s bytes,
tests/test_kernels_step_cache.py), for the window KV (norm -> RoPE -> FP8 / ue8m0 per 32), the index keys (RoPE,
FP4 / ue8m0 per 32) and the compressed entries (RoPE, FP4 / e4m3 per 16: the tile follows the codec), with dests
out of order, -1 dests and a bucket's padding rows (`rows=`) writing nothing. CPU: Triton's interpreter in one child
process; GPU: compiled, in-process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from step_harness import interpreted, need_compiled_cuda  # noqa: E402

B, ROWS = 7, 5  # the bucket and its real rows


def _codec(name: str):
    from dsv41.runtime.kv_pool import Fp4E4m3, Fp4Ue8m0, Fp8Ue8m0

    return {"fp8": Fp8Ue8m0(96), "fp4-ue8m0": Fp4Ue8m0(96), "fp4-e4m3": Fp4E4m3(80)}[name]


# name: (codec, norm, quant, dtype)
CASES = {"window-kv": ("fp8", True, "fp8_ue8m0", torch.bfloat16), "index-keys": ("fp4-ue8m0", False, None,
         torch.bfloat16), "entries": ("fp4-e4m3", False, None, torch.bfloat16),
         "window-kv-fp32": ("fp8", True, "fp8_ue8m0", torch.float32)}


def _inputs(name: str, device):
    codec = _codec(CASES[name][0])
    g = torch.Generator().manual_seed(len(name))
    D = codec.dim
    x = (torch.randn(B, D, generator=g) * torch.logspace(-3, 2, B)[:, None]).to(CASES[name][3])
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(CASES[name][3])
    pos = torch.tensor([5, 0, 1023, 77, 3, 9, 11])
    freq = 1.0 / (10000 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    dest = torch.tensor([4, -1, 8, 6, 2, 1, 3])  # out of order; a -1; rows 5, 6 are padding (rows=5)
    store = torch.randint(0, 256, (9, codec.row_bytes), generator=g, dtype=torch.uint8)
    return [t.to(device) for t in (x, w, pos, freq, dest, store)], codec


def _call(name: str, device, fused: bool):
    from dsv41.kernels.step.cache import store_rows
    from dsv41.kernels.step.rowops import norm_rope_rows, rope_rows

    (x, w, pos, freq, dest, store), codec = _inputs(name, device)
    _, norm, quant, _ = CASES[name]
    kw = dict(quant=quant, block=32 if quant else None, rows=ROWS)
    if fused:
        kw["store"] = (store, dest, codec)
    out = norm_rope_rows(x, w, 1e-6, pos, freq, 32, **kw) if norm else rope_rows(x, pos, freq, 32, **kw)
    if not fused:
        store_rows(store, out[:ROWS], dest[:ROWS], codec)
    return out.cpu(), store.cpu()


def run_all(device) -> dict:
    return {(name, fused): _call(name, device, fused) for name in CASES for fused in (False, True)}


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "rowops_store")


def _check(got: dict, name: str) -> None:
    (out0, store0), (out1, store1) = got[(name, False)], got[(name, True)]
    assert torch.equal(out0.view(torch.uint8), out1.view(torch.uint8))
    assert torch.equal(store0, store1)
    before = _inputs(name, "cpu")[0][5]
    assert not torch.equal(store1[[2, 4, 6, 8]], before[[2, 4, 6, 8]])  # the real rows' dests were written
    # rows only a padding row (1, 3) or none (0: where a -1 would land if clamped, 5, 7) addresses keep their bytes
    assert torch.equal(store1[[0, 1, 3, 5, 7]], before[[0, 1, 3, 5, 7]])


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_row_ops_store_the_bytes_of_store_rows(interp, name):
    _check(interp, name)


def test_bad_stores_are_refused_by_name():
    from dsv41.kernels.step.rowops import encodes, norm_rope_rows, rope_rows
    from dsv41.runtime.kv_pool import Fp8Ue8m0, Raw

    (x, w, pos, freq, dest, store), codec = _inputs("window-kv", "cpu")
    assert encodes(codec) and not encodes(Raw(96, torch.bfloat16))
    args = (x, w, 1e-6, pos, freq, 32)
    for kw, match in ((dict(store=(store, dest, Raw(96, torch.bfloat16))), "quantised codecs"),
                      (dict(store=(store, dest, Fp8Ue8m0(64))), "holds 64 values"),
                      (dict(quant="fp8_ue8m0", block=16, store=(store, dest, codec)), "blocks of 32"),
                      (dict(store=(store[:, :50], dest, codec)), "contiguous"),
                      (dict(store=(store, dest[:3], codec)), "dest must be"),
                      (dict(store=(store, dest.float(), codec)), "dest must be")):
        with pytest.raises(ValueError, match=match):
            norm_rope_rows(*args, **kw)
    with pytest.raises(ValueError, match="one vector a row"):
        rope_rows(x.view(B, 2, 48), pos, freq, 32, store=(store, dest, codec))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_row_ops_store_the_bytes_of_store_rows(name):
    need_compiled_cuda()
    _check({(name, f): _call(name, "cuda", f) for f in (False, True)}, name)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    torch.save(run_all("cpu"), sys.argv[2])
