"""The pool rows read in-kernel (dsv41.kernels.step.codecs) against the pool's own decode (runtime/kv_pool.py).

Every code and every scale byte the encoders can write, for every codec the pool uses: `decode_rows` (the device
function the attention and indexer kernels load through) gives `Codec.decode(raw, float32)` bit for bit, signs of
zero included. CPU: Triton's interpreter in one child process (tests/step_harness.py); GPU: compiled, in-process.
"""

from __future__ import annotations

import sys

import pytest
import torch

from step_harness import interpreted, need_compiled_cuda  # noqa: E402


def _cases():
    """(name, codec, raw rows) per codec: random rows encoded by the codec, plus rows made to hold every code."""
    from dsv41.runtime.kv_pool import Fp4E4m3, Fp4Ue8m0, Fp8Ue8m0, Raw

    gen = torch.Generator().manual_seed(7)
    out = []
    for codec in (Fp8Ue8m0(64), Fp4E4m3(64), Fp4Ue8m0(64), Raw(48, torch.bfloat16), Raw(40, torch.float16),
                  Raw(24, torch.float32)):
        x = torch.randn(12, codec.dim, generator=gen) * torch.logspace(-6, 4, 12)[:, None]
        x[0] = 0.0
        x[1, ::2] = -0.0
        raw = codec.encode(x)
        if codec.name.startswith("fp"):  # every code byte, every sane scale byte, directly in the stored layout
            codes = torch.arange(256, dtype=torch.uint8)
            if codec.name.startswith("fp8"):
                codes = codes[(codes & 0x7F) != 0x7F]  # e4m3fn's NaN codes are never written (clamped)
            n_code = codec.code_bytes
            extra = torch.zeros(8, codec.row_bytes, dtype=torch.uint8)
            extra[:, :n_code] = codes.repeat(-(-8 * n_code // codes.numel()))[:8 * n_code].view(8, n_code)
            scale_bytes = torch.arange(1, 255, dtype=torch.uint8) if "ue8m0" in codec.name else codes
            n_scale = codec.row_bytes - n_code
            extra[:, n_code:] = scale_bytes.repeat(-(-8 * n_scale // scale_bytes.numel()))[:8 * n_scale].view(8, -1)
            raw = torch.cat((raw, extra))
        out.append((codec.name, codec, raw))
    return out


def _interp_worker(out_path: str) -> None:
    from dsv41.kernels.step.codecs import decode_rows

    torch.save({name: decode_rows(raw, codec) for name, codec, raw in _cases()}, out_path)


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "codecs")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("name", [c[0] for c in _cases()])
def test_interpreted_load_values_is_the_pool_decode(interp, name):
    codec, raw = next((c, r) for n, c, r in _cases() if n == name)
    want = codec.decode(raw, torch.float32)
    got = interp[name]
    assert got.shape == want.shape
    assert _same_bits(got, want), (got - want).abs().max()


def test_an_unknown_codec_is_refused_by_name():
    from dsv41.kernels.step.codecs import codec_id
    from dsv41.runtime.kv_pool import Raw

    with pytest.raises(ValueError, match="raw-int32"):
        codec_id(Raw(8, torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("name", [c[0] for c in _cases()])
def test_gpu_load_values_is_the_pool_decode(name):
    need_compiled_cuda()
    from dsv41.kernels.step.codecs import decode_rows

    codec, raw = next((c, r) for n, c, r in _cases() if n == name)
    got = decode_rows(raw.cuda(), codec).cpu()
    assert _same_bits(got, codec.decode(raw, torch.float32))


if __name__ == "__main__" and sys.argv[1:2] == ["--interp-worker"]:
    _interp_worker(sys.argv[2])
