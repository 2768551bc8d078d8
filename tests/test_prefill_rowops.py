"""The prefill row kernels' work distribution (issue 31): more rows a program for the EXL3 rotations
(`kernels.exl3.prefill._rotate_kernel`, `_swiglu_rotate_kernel`: ROW_BLOCKS) and the queries' RoPE in place on
their rotated tail (`kernels.step.rowops.rope_rows(inplace=True)`). Only the distribution changes, so the bits
must be the old launch's: checked bitwise new == old in Triton's interpreter on small shapes (a child process:
TRITON_INTERPRET must be set before the kernels are decorated) and, with `-m gpu`, compiled at the prefill shapes
(2,048 and 8,192 rows), with the timings printed (old vs new).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from step_harness import cuda_median_ms, interpreted, need_compiled_cuda  # noqa: E402


def _rotate_inputs(gen, rows, k, experts, pairs, device):
    x = torch.randn(rows, k, generator=gen).mul(3.0).bfloat16().to(device)
    suh = (torch.randint(0, 2, (experts, k), generator=gen) * 2 - 1).half().to(device)
    suh_b = (torch.randint(0, 2, (experts, k), generator=gen) * 2 - 1).half().to(device)
    src = torch.randint(0, rows, (pairs,), generator=gen).int().to(device)
    pair_e = torch.randint(0, experts, (pairs,), generator=gen).int().to(device)
    return x, suh, suh_b, src, pair_e


def _rotations(x, suh, suh_b, src, pair_e, row_blocks):
    """The dense rotation (one matrix, natural order) and the experts' (gathered, per expert, two, permuted)."""
    from dsv41.kernels.exl3.prefill import _rotate

    k = x.shape[1]
    dense, _ = _rotate(x, suh[0], k, row_blocks=row_blocks)
    xa, xb = _rotate(x, suh, k, src=src, pair_e=pair_e, suh_b=suh_b, rows=src.shape[0], permute=True,
                     row_blocks=row_blocks)
    pairs = src.shape[0]
    return dense, xa[:pairs], xb[:pairs]  # the CUDA tiles' padding rows past `pairs` are never written


def _swiglu_inputs(gen, pairs, inter, experts, device):
    gate = torch.randn(pairs, inter, generator=gen).mul(4.0).to(device)
    up = torch.randn(pairs, inter, generator=gen).mul(4.0).to(device)
    route = torch.rand(pairs, generator=gen).to(device)
    pair_e = torch.randint(0, experts, (pairs,), generator=gen).int().to(device)
    suh2 = (torch.randint(0, 2, (experts, inter), generator=gen) * 2 - 1).half().to(device)
    return gate, up, route, pair_e, suh2


def _swiglu(gate, up, route, pair_e, suh2, row_blocks):
    from dsv41.kernels.exl3.prefill import swiglu_rotate

    pairs, inter = gate.shape
    hh = torch.zeros(pairs, inter, dtype=torch.float16, device=gate.device)
    return swiglu_rotate(gate, up, route, pair_e, suh2, hh, pairs, inter, 10.0, row_blocks=row_blocks)


def _rope_inputs(gen, rows, heads, dim, dtype, device):
    x = torch.randn(rows, heads, dim, generator=gen).mul(2.0).to(dtype).to(device)
    pos = torch.randint(0, 200000, (rows,), generator=gen).to(device)
    return x, pos


def _inv_freq(rope_dim, device):
    return (10000.0 ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)).float().to(device)


def _rope_pair(x, pos, freq, rope_dim, inverse, rows):
    """(fresh output of `_rowops_kernel`, in-place output) of the same RoPE."""
    from dsv41.kernels.step.rowops import rope_rows

    fresh = rope_rows(x, pos, freq, rope_dim, inverse=inverse, rows=rows)
    inplace = x.clone()
    got = rope_rows(inplace, pos, freq, rope_dim, inverse=inverse, rows=rows, inplace=True)
    assert got.data_ptr() == inplace.data_ptr()
    return fresh, got


def _heads_pair(x, pos, freq, rope_dim, quant, out_dtype, rows):
    """(one head a program, several) of the same RoPE (+ quantiser) launch; pos None: the quantiser alone."""
    from dsv41.kernels.step.rowops import _launch

    kw = dict(quant=quant, out_dtype=out_dtype, rows=rows)
    if pos is not None:
        kw.update(positions=pos, inv_freq=freq, rope_dim=rope_dim)
    return _launch(x, heads_per_program=1, **kw), _launch(x, **kw)


# (rows, heads, dim, rope dim, input dtype, quantiser, out dtype, live rows, with RoPE)
HEADS_CASES = [(6, 5, 128, 64, torch.bfloat16, "fp4_ue8m0", None, 4, True),
               (5, 3, 64, 16, torch.float32, None, torch.bfloat16, 5, True),
               (4, 9, 64, 32, torch.bfloat16, "fp8_ue8m0", None, 3, True),
               (3, 6, 64, 0, torch.bfloat16, "fp4_e4m3", None, 3, False)]
ROPE_CASES = [(6, 5, 128, 64, torch.bfloat16, False, 4), (7, 3, 64, 16, torch.float16, True, 7),
              (5, 9, 32, 8, torch.float32, True, 3), (4, 2, 512, 64, torch.bfloat16, True, 4)]


def _worker(out_path: str) -> None:
    gen = torch.Generator().manual_seed(31)
    res = {}
    args = _rotate_inputs(gen, 53, 256, 4, 70, "cpu")
    res["rotate"] = {rb: _rotations(*args, row_blocks=rb) for rb in (1, 4)}
    sw = _swiglu_inputs(gen, 70, 256, 4, "cpu")
    res["swiglu"] = {rb: _swiglu(*sw, row_blocks=rb) for rb in (1, 4)}
    for i, (rows, heads, dim, rope_dim, dtype, inverse, live) in enumerate(ROPE_CASES):
        x, pos = _rope_inputs(gen, rows, heads, dim, dtype, "cpu")
        res[f"rope/{i}"] = _rope_pair(x, pos, _inv_freq(rope_dim, "cpu"), rope_dim, inverse, live)
    for i, (rows, heads, dim, rope_dim, dtype, quant, out_dtype, live, rope) in enumerate(HEADS_CASES):
        x, pos = _rope_inputs(gen, rows, heads, dim, dtype, "cpu")
        res[f"heads/{i}"] = _heads_pair(x, pos if rope else None, _inv_freq(rope_dim, "cpu") if rope else None,
                                        rope_dim, quant, out_dtype, live)
    torch.save(res, out_path)


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "prefill_rowops")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def test_interpreted_rotations_keep_their_bits_whatever_the_rows_a_program(interp):
    old = interp["rotate"][1]
    for a, b in zip(old, interp["rotate"][4]):
        assert _same_bits(a, b)
    assert old[0].abs().sum() > 0 and old[1].abs().sum() > 0  # the rows were written
    assert _same_bits(interp["swiglu"][1], interp["swiglu"][4])
    assert interp["swiglu"][1].abs().sum() > 0


@pytest.mark.parametrize("case", range(len(ROPE_CASES)))
def test_interpreted_rope_in_place_is_the_fresh_launchs_bits(interp, case):
    fresh, inplace = interp[f"rope/{case}"]
    assert _same_bits(fresh, inplace)
    live = ROPE_CASES[case][-1]
    assert (inplace[live:] == 0).all() and (inplace[:live] != 0).any()


@pytest.mark.parametrize("case", range(len(HEADS_CASES)))
def test_interpreted_heads_a_program_keep_the_one_head_launchs_bits(interp, case):
    one, several = interp[f"heads/{case}"]
    assert _same_bits(one, several)
    live = HEADS_CASES[case][-2]
    assert (several[live:] == 0).all() and (several[:live] != 0).any()


def test_row_blocks_leave_enough_programs():
    from dsv41.kernels.exl3.prefill import _row_blocks

    assert _row_blocks(16, 40) == 1 and _row_blocks(2048, 10) == 1
    assert _row_blocks(2048, 40) == 4  # 5,120 units -> 1,280 programs
    assert _row_blocks(2048 * 6, 40) == 8 and _row_blocks(8192, 40) == 8


def test_rope_in_place_rejects_what_it_cannot_do():
    from dsv41.kernels.step.rowops import rope_rows

    x = torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    pos, freq = torch.zeros(2, dtype=torch.long), _inv_freq(16, "cpu")
    for kw in ({"quant": "fp8_ue8m0"}, {"out_dtype": torch.float32}):
        with pytest.raises(ValueError, match="inplace"):
            rope_rows(x, pos, freq, 16, inplace=True, **kw)
    with pytest.raises(ValueError, match="inplace"):
        rope_rows(x, pos, _inv_freq(24, "cpu"), 24, inplace=True)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the prefill shapes, bits and timings
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2048, 8192])
def test_gpu_prefill_rotations_keep_their_bits(rows):
    need_compiled_cuda()
    gen = torch.Generator().manual_seed(rows)
    args = _rotate_inputs(gen, rows, 5120, 384, rows * 6, "cuda")
    old, new = _rotations(*args, row_blocks=1), _rotations(*args, row_blocks=None)
    for a, b in zip(old, new):
        assert _same_bits(a, b)
    sw = _swiglu_inputs(gen, rows * 6, 1152, 384, "cuda")
    assert _same_bits(_swiglu(*sw, row_blocks=1), _swiglu(*sw, row_blocks=None))
    from dsv41.kernels.exl3.prefill import _rotate

    x, suh, suh_b, src, pair_e = args
    for rb in (1, None):
        t_dense = cuda_median_ms(lambda: _rotate(x, suh[0], 5120, row_blocks=rb))
        t_moe = cuda_median_ms(lambda: _rotate(x, suh, 5120, src=src, pair_e=pair_e, suh_b=suh_b, rows=src.shape[0],
                                    permute=True, row_blocks=rb))
        t_sw = cuda_median_ms(lambda: _swiglu(*sw, row_blocks=rb))
        print(f"rows {rows} row_blocks {rb or 'auto'}: rotate dense {t_dense * 1e3:.1f} us, experts (x6, two) "
              f"{t_moe * 1e3:.1f} us, swiglu_rotate {t_sw * 1e3:.1f} us")


@pytest.mark.gpu
@pytest.mark.parametrize("rows,heads", [(2048, 32), (8192, 64)])
def test_gpu_query_rope_in_place_keeps_its_bits(rows, heads):
    need_compiled_cuda()
    from dsv41.kernels.step.rowops import rope_rows

    gen = torch.Generator().manual_seed(rows + heads)
    x, pos = _rope_inputs(gen, rows, heads, 512, torch.bfloat16, "cuda")
    freq = _inv_freq(64, "cuda")
    for inverse, live in ((False, rows), (True, rows - 5)):
        fresh, inplace = _rope_pair(x, pos, freq, 64, inverse, live)
        assert _same_bits(fresh, inplace), (inverse, live)
    y = x.clone()
    t_old = cuda_median_ms(lambda: rope_rows(x, pos, freq, 64, rows=rows))
    t_new = cuda_median_ms(lambda: rope_rows(y, pos, freq, 64, rows=rows, inplace=True))
    t_heads = cuda_median_ms(lambda: rope_rows(x, pos, freq, 64, rows=rows))
    print(f"q rope {rows} x {heads} x 512: one head a program {t_old * 1e3:.1f} us, in place {t_new * 1e3:.1f} us"
          f", fresh with 8 heads a program {t_heads * 1e3:.1f} us")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2048, 8192])
def test_gpu_index_query_rope_fp4_heads_a_program_keep_their_bits(rows):
    need_compiled_cuda()
    gen = torch.Generator().manual_seed(rows + 7)
    freq = _inv_freq(64, "cuda")
    x, pos = _rope_inputs(gen, rows, 32, 128, torch.bfloat16, "cuda")
    one, several = _heads_pair(x, pos, freq, 64, "fp4_ue8m0", None, rows)
    assert _same_bits(one, several)
    o, _ = _rope_inputs(gen, rows, 32, 512, torch.float32, "cuda")  # the output's inverse RoPE, fp32 -> bf16
    one, several = _heads_pair(o, pos, freq, 64, None, torch.bfloat16, rows - 3)
    assert _same_bits(one, several)
    from dsv41.kernels.step.rowops import _launch

    kw = dict(positions=pos, inv_freq=freq, rope_dim=64, quant="fp4_ue8m0")
    t_one, t_new = (cuda_median_ms(lambda: _launch(x, heads_per_program=hp, **kw)) for hp in (1, None))
    print(f"index q rope + fp4 {rows} x 32 x 128: one head a program {t_one * 1e3:.1f} us, "
          f"8 heads {t_new * 1e3:.1f} us")


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "--interp-worker":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    _worker(sys.argv[2])
