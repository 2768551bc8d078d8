"""FP8 block / MXFP4 / native formats: hand-computed bytes, scale byte edge cases, quantise-dequantise round trips."""

from __future__ import annotations

import math

import pytest
import torch

from dsv41.weights import formats


def u8(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def test_e8m0_scale_bytes():
    got = formats.e8m0_to_float(u8([127, 128, 126, 1, 254, 0, 255, 137]))
    assert got[:4].tolist() == [1.0, 2.0, 0.5, 2.0**-126]
    assert got[4].item() == 2.0**127
    assert got[5].item() == 0.0  # byte 0 -> 0, as the release's readers do
    assert math.isnan(got[6].item())  # 255 is UE8M0's NaN
    assert got[7].item() == 1024.0


def test_e4m3_bytes():
    got = formats.e4m3_to_float(u8([0x38, 0x40, 0x7E, 0xB8, 0x01, 0x00, 0x80, 0x3C, 0x7F]))
    assert got[:8].tolist() == [1.0, 2.0, 448.0, -1.0, 2.0**-9, 0.0, -0.0, 1.5]
    assert math.isnan(got[8].item())


def test_fp8_block_dequant_hand_case_with_ragged_edges():
    q = torch.full((33, 40), 0x38, dtype=torch.uint8)  # every element e4m3 1.0
    q[32, 39] = 0xC0  # -2.0 in the bottom-right partial block
    q[0, 0] = 0x3C  # 1.5
    scale = u8([[127, 128], [126, 130]])
    w = formats.dequant_fp8_block(q.view(torch.float8_e4m3fn), scale)
    assert w.shape == (33, 40) and w.dtype == torch.float32
    assert w[0, 0].item() == 1.5
    assert w[31, 31].item() == 1.0
    assert w[31, 32].item() == 2.0
    assert w[32, 0].item() == 0.5
    assert w[32, 33].item() == 8.0
    assert w[32, 39].item() == -16.0
    with pytest.raises(ValueError, match="FP8 scale shape"):
        formats.dequant_fp8_block(q, u8([[127, 127]]))


def test_mxfp4_nibble_order_and_codes():
    packed = u8([[0x21, 0xF7, 0x98, 0x00] + [0x00] * 12]).view(torch.int8)  # one row, 32 inputs
    w = formats.dequant_mxfp4(packed, u8([[128]]))
    # low nibble = even column: 0x21 -> col0 code 1 (0.5), col1 code 2 (1.0); scale 2
    assert w[0, :8].tolist() == [1.0, 2.0, 12.0, -12.0, -0.0, -1.0, 0.0, 0.0]
    assert math.copysign(1, w[0, 4].item()) == -1
    w = formats.dequant_mxfp4(packed, u8([[0]]))
    assert w.abs().sum().item() == 0.0
    with pytest.raises(ValueError, match="MXFP4 scale shape"):
        formats.dequant_mxfp4(packed, u8([[127, 127]]))


def test_e2m1_table_is_the_spec_table():
    assert formats.e2m1_to_float(torch.arange(16)).tolist() == [
        0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6,
    ]


@pytest.mark.parametrize(
    "amax,qmax,byte",
    [(448.0, 448.0, 127), (448.01, 448.0, 128), (224.0, 448.0, 126), (0.0, 448.0, 127),
     (6.0, 6.0, 127), (6.5, 6.0, 128), (1e-45, 448.0, 1), (1e38, 6.0, 251), (3e38, 1e-3, 254), (1.0, 6.0, 125)],
)
def test_power_of_two_scale_byte(amax, qmax, byte):
    assert formats.power_of_two_scale_byte(torch.tensor([amax]), qmax).item() == byte


def test_fp8_round_trip_of_representable_weights_is_exact():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 0x7F, (96, 70), generator=gen, dtype=torch.int64)  # finite positive codes
    sign = torch.randint(0, 2, codes.shape, generator=gen) * 0x80
    q = (codes | sign).to(torch.uint8)
    for br in range(3):
        for bc in range(3):
            q[32 * br, 32 * bc] = 0x7E  # a 448 in every block pins its scale
    scale = torch.randint(110, 140, (3, 3), generator=gen, dtype=torch.int64).to(torch.uint8)
    w = formats.dequant_fp8_block(q, scale)
    q2, scale2 = formats.quantize_fp8_block(w)
    assert q2.dtype == torch.float8_e4m3fn and scale2.dtype == torch.uint8
    assert torch.equal(scale2, scale)
    assert torch.equal(formats.dequant_fp8_block(q2, scale2), w)


def test_fp8_quantise_error_bound_on_random_weights():
    w = torch.randn(100, 130, generator=torch.Generator().manual_seed(1)) * 0.02
    q, scale = formats.quantize_fp8_block(w)
    assert scale.shape == (4, 5)
    back = formats.dequant_fp8_block(q, scale)
    blockmax = formats.expand_block_scale(formats._block_amax(w, 32), 100, 130)
    # 3 mantissa bits: half an ulp is 2^-4 relative; below the normal range the step is absolute.
    err = (back - w).abs()
    assert (err <= torch.maximum(w.abs() * 2.0**-4, blockmax * 2.0**-9 / 448 * 2)).all()


def test_mxfp4_rounding_hand_cases():
    row = torch.zeros(1, 32)
    row[0, :10] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 2.9, -0.6])
    packed, scale = formats.quantize_mxfp4(row)
    assert scale.tolist() == [[127]]
    codes = formats.unpack_e2m1(packed)[0, :10].tolist()
    assert codes == [7, 0, 2, 2, 4, 4, 6, 6, 5, 9]  # ties go to the even code
    assert packed.view(torch.uint8)[0, 0].item() == 0x07  # col0 code 7 low, col1 code 0 high


def test_mxfp4_round_trip_of_representable_weights_is_exact():
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (8, 64), generator=gen)
    codes[:, 0::32] = 7  # every 32-block holds a 6.0 so the scale is pinned
    codes[codes == 8] = 0  # -0 re-quantises to +0; keep the byte comparison meaningful
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    scale = torch.randint(100, 150, (8, 2), generator=gen).to(torch.uint8)
    w = formats.dequant_mxfp4(packed, scale)
    packed2, scale2 = formats.quantize_mxfp4(w)
    assert torch.equal(scale2, scale)
    assert torch.equal(packed2, packed)


def test_mxfp4_quantise_error_bound_and_shape_check():
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(3))
    packed, scale = formats.quantize_mxfp4(w)
    assert packed.shape == (16, 48) and packed.dtype == torch.int8 and scale.shape == (16, 3)
    back = formats.dequant_mxfp4(packed, scale)
    step = formats.e8m0_to_float(scale).repeat_interleave(32, dim=1)  # largest gap is 2 (between 4 and 6)
    assert ((back - w).abs() <= step).all()
    with pytest.raises(ValueError, match="divisible by 32"):
        formats.quantize_mxfp4(torch.zeros(2, 40))


def test_native_dequant():
    w = torch.randn(3, 4).to(torch.bfloat16)
    assert torch.equal(formats.dequant_native(w), w.float())
    with pytest.raises(TypeError, match="native weights"):
        formats.dequant_native(torch.zeros(2, dtype=torch.int8))
