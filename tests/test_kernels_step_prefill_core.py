"""The one-pass prefill attention core (dsv41.kernels.step.prefill_core.attention_onepass) against the reference's
`Attention._core` on the same slots gathered, and its row invariance bit for bit.

CPU part: the kernel runs in Triton's interpreter in one child process (this file with `--interp-worker`, as
tests/test_kernels_step_attention.py), which saves the outputs; the tests rebuild the inputs and judge. GPU part
(`-m gpu`): the full shape (32 and 64 heads, hd 512, window 128 + top-k 512 slots, 2,048 rows over 8,192 entries)
against the split + combine core it replaces (`attention_indexed`), and the same row-invariance checks compiled.
The interpreter has no bf16 dot, so there the products are fp32 dots of the same values (`attention.MMA`) and the
raw-key loads (`_raw_keys`, compiled only) are the GPU part's to check.

Tolerance: the kernel and the reference compute the same sum in fp32 in another order (blocks of slots, online
rescaling; the reference's softmax rounds exp and the log-sum-exp through fp64), so each output is the exact value
within a few fp32 roundings per term: relative error ~ sqrt(S) x 2^-24 ~ 1e-6 at S <= 100. 1e-5 (rel L2 and the
largest element difference over the rms) leaves a margin and still fails on any wrong term (a dead slot read, a
missed rescale, the sink left out: errors of 1e-2 and more).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from step_harness import interpreted, need_compiled_cuda  # noqa: E402

# name: (rows, heads, head_dim, window rows, entries, slots, keys dtype, head_block, key_block, sink offset)
CASES = {
    # fp32 keys (three bf16 parts), 5 heads in one partial head block, hd 64, S 40 (not a whole key block)
    "fp32": (6, 5, 64, 20, 30, 40, torch.float32, 16, 16, 0.0),
    # bf16 keys (one part), 20 heads = two head blocks (one partial), hd 96 (masked columns), S 72, 32-slot blocks
    "bf16": (5, 20, 96, 24, 40, 72, torch.bfloat16, 16, 32, 0.0),
    # sinks far above the scores: the denominator is mostly the sink
    "sinks": (5, 16, 64, 16, 8, 24, torch.bfloat16, 16, 16, 12.0),
}
PAD = 45  # dead slots appended: more blocks, and a block partly past the row's own slots


def _case(name: str, device="cpu") -> dict:
    """q, the window rows, the entries, an int32 slot index and the sink; rows with every slot live, none live,
    only window slots, only entry slots, and random dead slots (-1)."""
    T, H, hd, W, C, S, dtype, _, _, off = CASES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    q = (torch.randn(T, H, hd, generator=gen) * 2).to(torch.bfloat16)
    win = torch.randn(W, hd, generator=gen).to(dtype)
    ents = torch.randn(C, hd, generator=gen).to(dtype)
    slots = torch.randint(0, W + C, (T, S), generator=gen, dtype=torch.int32)
    slots[torch.rand(T, S, generator=gen) < 0.3] = -1
    slots[0] = torch.randint(0, W + C, (S,), generator=gen, dtype=torch.int32)  # every slot live
    slots[1] = -1  # nothing live: zeros
    slots[2, S // 2:] = -1
    slots[2, : S // 2] = slots[2, : S // 2] % W  # window rows only
    slots[3] = torch.where(slots[3] >= 0, W + slots[3] % C, slots[3])  # entries only
    sink = torch.randn(H, generator=gen) + off
    return {k: v.to(device) for k, v in dict(q=q, win=win, ents=ents, slots=slots, sink=sink).items()}


def _gathered(c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [T, S, hd] and ok [T, S] of the slots as the reference lays them out (a dead slot: row 0, not live)."""
    rows = torch.cat((c["win"], c["ents"]))
    return rows[c["slots"].clamp(min=0).long()], c["slots"] >= 0


def _reference(c: dict) -> torch.Tensor:
    from types import SimpleNamespace

    from dsv41.model.attention import Attention

    keys, ok = _gathered(c)
    layer = SimpleNamespace(cfg=SimpleNamespace(head_dim=c["q"].shape[2]), p=SimpleNamespace(sink=c["sink"]))
    return Attention._core(layer, c["q"], keys, ok)


def _padded(slots: torch.Tensor, extra: int) -> torch.Tensor:
    return torch.cat((slots, torch.full((slots.shape[0], extra), -1, dtype=slots.dtype, device=slots.device)), 1)


def _garbage(c: dict) -> dict:
    """The sources with NaN in every row no live slot names: such a row must never be read."""
    W = c["win"].shape[0]
    named = torch.zeros(W + c["ents"].shape[0], dtype=torch.bool, device=c["win"].device)
    named[c["slots"][c["slots"] >= 0].long()] = True
    win, ents = c["win"].clone(), c["ents"].clone()
    win[~named[:W]] = float("nan")
    ents[~named[W:]] = float("nan")
    return {**c, "win": win, "ents": ents}


def _results(c: dict, keys_bf16: bool, tiling: dict) -> dict:
    """The core's output and the same rows run alone, in reversed order, inside a larger batch, padded with dead
    slots, over NaN'd unnamed rows, and into `out`."""
    from dsv41.kernels.step.prefill_core import attention_onepass

    def run(c_, slots=None, rows=None, **kw):
        slots = c_["slots"] if slots is None else slots
        q = c_["q"] if rows is None else c_["q"][rows]
        slots = slots if rows is None else slots[rows]
        return attention_onepass(q, c_["win"], c_["ents"], slots, c_["sink"], c_["q"].shape[2] ** -0.5,
                                 keys_bf16=keys_bf16, **tiling, **kw)

    T = c["q"].shape[0]
    rev = torch.arange(T - 1, -1, -1, device=c["q"].device)
    bigger = torch.cat((rev, torch.arange(T, device=rev.device)))  # every row twice, in two orders
    into = torch.full((T + 1,) + tuple(c["q"].shape[1:]), float("nan"), device=c["q"].device)[1:]
    out = run(c)
    return {"out": out, "alone": torch.cat([run(c, rows=slice(r, r + 1)) for r in range(T)]),
            "reversed": run(c, rows=rev).flip(0), "bigger": run(c, rows=bigger)[T:],
            "padded": run(c, slots=_padded(c["slots"], PAD)), "garbage": run(_garbage(c)),
            "into": (run(c, out=into), into)[1]}


def _interp_worker(out_path: str) -> None:
    from dsv41.kernels.step.prefill_slots import attention_indexed

    out = {}
    for name, spec in CASES.items():
        c = _case(name)
        exact = spec[6] == torch.bfloat16
        out[name] = _results(c, exact, dict(head_block=spec[7], key_block=spec[8]))
        out[name]["split"] = attention_indexed(c["q"], c["win"], c["ents"], c["slots"], c["sink"],
                                               c["q"].shape[2] ** -0.5, keys_bf16=exact)
        out[name]["roped"] = _roped(c, exact, dict(head_block=spec[7], key_block=spec[8]))
    torch.save(out, out_path)


def _roped(c: dict, exact: bool, tiling: dict) -> dict:
    """o inverse-RoPE'd in the core's epilogue (bf16 and fp16 out, a 16-dim tail) and by the row-op launch after it
    (`rope_rows` on the fp32 o)."""
    from dsv41.kernels.step.prefill_core import attention_onepass
    from dsv41.kernels.step.rowops import rope_rows

    T, H, hd = c["q"].shape
    pos = torch.tensor([3, 700, 0, 91, 12345, 8][:T], dtype=torch.int64)
    freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    plain = attention_onepass(c["q"], c["win"], c["ents"], c["slots"], c["sink"], hd ** -0.5, keys_bf16=exact,
                              **tiling)
    res = {}
    for dt in (torch.bfloat16, torch.float16):
        res[f"fused_{dt}"] = attention_onepass(c["q"], c["win"], c["ents"], c["slots"], c["sink"], hd ** -0.5,
                                               keys_bf16=exact, rope=(pos, freq, 16, dt), **tiling)
        res[f"after_{dt}"] = rope_rows(plain, pos, freq, 16, inverse=True, out_dtype=dt)
    return res


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(rel L2, largest element difference over the reference's rms), in fp64."""
    g, r = got.double(), ref.double()
    return float((g - r).norm() / r.norm()), float((g - r).abs().max() / r.pow(2).mean().sqrt())


def _check_invariance(res: dict) -> None:
    for key in ("alone", "reversed", "bigger", "padded", "garbage", "into"):
        assert torch.equal(_bits(res[key]), _bits(res["out"])), f"a row's bits changed: {key}"


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "prefill_core")


@pytest.mark.parametrize("name", CASES)
def test_interpreted_onepass_core_matches_reference(interp, name):
    """Within fp32 rounding of the reference's `_core` on the gathered slots (and of the split + combine core),
    fp32 and bf16 keys, partial head blocks, masked columns, S not a whole key block; a row with no live slot
    gives zeros; the case exercises what it claims (window-only and entry-only rows, dead slots)."""
    c = _case(name)
    res = interp[name]
    out = res["out"]
    assert out.dtype == torch.float32 and out.shape == c["q"].shape and torch.isfinite(out).all()
    assert not out[1].any(), "a row with no live slot must give zeros"
    assert out[0].abs().sum() > 0 and out[2].abs().sum() > 0
    for want in (_reference(c), res["split"]):
        rel, worst = _errors(out, want)
        assert rel < 1e-5 and worst < 1e-5, (rel, worst)
    W = c["win"].shape[0]
    assert (c["slots"][2][c["slots"][2] >= 0] < W).all() and (c["slots"][3][c["slots"][3] >= 0] >= W).all()
    assert (c["slots"][4] < 0).any() and (c["slots"][4] >= 0).any()


@pytest.mark.parametrize("name", CASES)
def test_interpreted_onepass_rows_are_invariant_bitwise(interp, name):
    """A row's bits depend only on that row: alone, reversed, inside a larger batch, with 45 dead slots of padding
    (more blocks), with every unnamed source row NaN (never read), written into `out`."""
    _check_invariance(interp[name])


@pytest.mark.parametrize("name", CASES)
def test_interpreted_onepass_inverse_rope_in_the_epilogue_is_the_row_ops_bits(interp, name):
    """`rope=`: o inverse-RoPE'd and rounded in the core's epilogue == `rope_rows(o, inverse=True, out_dtype=)` on
    the fp32 o, bit for bit (bf16 and fp16), and the tail really rotated (the roped o is not the rounded o)."""
    res = interp[name]["roped"]
    for dt in (torch.bfloat16, torch.float16):
        fused, after = res[f"fused_{dt}"], res[f"after_{dt}"]
        assert fused.dtype == dt and torch.equal(fused.view(torch.int16), after.view(torch.int16)), dt
        rounded = interp[name]["out"].to(dt)
        hd = fused.shape[2]
        assert torch.equal(fused[..., : hd - 16].view(torch.int16), rounded[..., : hd - 16].view(torch.int16))
        assert not torch.equal(fused[0, :, hd - 16:], rounded[0, :, hd - 16:]), "the tail was not rotated"


def test_onepass_rejects_bad_arguments():
    from dsv41.kernels.step.prefill_core import attention_onepass

    c = _case("fp32")
    args = (c["q"], c["win"], c["ents"])
    with pytest.raises(ValueError, match="slots must be int32"):
        attention_onepass(*args, c["slots"].long(), c["sink"], 0.1)
    with pytest.raises(ValueError, match="sink"):
        attention_onepass(*args, c["slots"], c["sink"][:-1], 0.1)
    with pytest.raises(ValueError, match="key_block"):
        attention_onepass(*args, c["slots"], c["sink"], 0.1, key_block=24)
    with pytest.raises(ValueError, match="entries must be"):
        attention_onepass(c["q"], c["win"], c["ents"].bfloat16(), c["slots"], c["sink"], 0.1)
    with pytest.raises(ValueError, match="pv_parts must be 2 or 3"):
        attention_onepass(*args, c["slots"], c["sink"], 0.1, pv_parts=1)
    T = c["q"].shape[0]
    freq = torch.ones(8)
    with pytest.raises(ValueError, match="rope must be"):
        attention_onepass(*args, c["slots"], c["sink"], 0.1, rope=(torch.zeros(T + 1), freq, 16, torch.bfloat16))
    with pytest.raises(ValueError, match="rope must be"):
        attention_onepass(*args, c["slots"], c["sink"], 0.1, rope=(torch.zeros(T), freq, 15, torch.bfloat16))
    with pytest.raises(ValueError, match="out must be contiguous"):
        attention_onepass(*args, c["slots"], c["sink"], 0.1, rope=(torch.zeros(T), freq, 16, torch.bfloat16),
                          out=torch.empty(c["q"].shape))


def test_onepass_pv_parts_env_is_checked(monkeypatch):
    """`DSV41_PREFILL_PV_PARTS` is read at the launch: a bad value is an error naming the variable."""
    from dsv41.kernels.step.prefill_core import PV_PARTS_ENV, attention_onepass

    c = _case("fp32")
    monkeypatch.setenv(PV_PARTS_ENV, "4")
    with pytest.raises(ValueError, match=PV_PARTS_ENV):
        attention_onepass(c["q"], c["win"], c["ents"], c["slots"], c["sink"], 0.1)


def _full_case(heads: int, T: int = 2048, entries: int = 8192, pos: int = 6000) -> dict:
    """A prefill chunk at the release's shape: window 128 + top-k 512 slots through `prefill_slot_index`, the
    window's FP8 and the entries' FP4 values in bf16 (as bench/prefill.py's `attention_core_alone`)."""
    from dsv41.kernels.step.prefill_slots import prefill_slot_index
    from dsv41.model.quant import fp4_block_e4m3, fp8_block_ue8m0

    dev, hd, window, topk = torch.device("cuda"), 512, 128, 512
    g = torch.Generator(device=dev).manual_seed(heads)
    W = T + window - 1
    win = fp8_block_ue8m0(torch.randn(W, hd, generator=g, device=dev).bfloat16(), 32, True)
    ents = fp4_block_e4m3(torch.randn(entries, hd, generator=g, device=dev).bfloat16(), 16, True)
    ids = torch.rand(T, entries, generator=g, device=dev).topk(topk, dim=1).indices.sort(dim=1).values
    ids[: T // 4, : topk // 2] = -1  # early rows select fewer entries
    slots = prefill_slot_index(T, pos, W, window, width=topk, ids=ids, entries=entries)
    q = torch.randn(T, heads, hd, generator=g, device=dev).bfloat16()
    return dict(q=q, win=win, ents=ents, slots=slots, sink=torch.randn(heads, generator=g, device=dev))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [32, 64])
def test_gpu_onepass_core_full_shape(heads):
    """The one-pass core at a 2,048-row chunk, hd 512, S 640: within fp32 rounding of the split + combine core it
    replaces (all rows) and of the reference (the first 64 rows, in fp64 memory bounds), every row's bits alone
    (64 sampled rows), reversed, inside a larger batch, padded with dead slots, over NaN'd unnamed rows."""
    from dsv41.kernels.step.prefill_core import attention_onepass
    from dsv41.kernels.step.prefill_slots import attention_indexed
    from dsv41.runtime.layers.attention import PREFILL_TILING

    need_compiled_cuda()
    c = _full_case(heads)
    scale = 512 ** -0.5
    res = _results({**c, "q": c["q"][:300], "slots": c["slots"][:300]}, True, {})  # alone: 300 launches
    one = attention_onepass(c["q"], c["win"], c["ents"], c["slots"], c["sink"], scale, keys_bf16=True)
    split = attention_indexed(c["q"], c["win"], c["ents"], c["slots"], c["sink"], scale, keys_bf16=True,
                              **PREFILL_TILING)
    assert torch.equal(_bits(one[:300]), _bits(res["out"])), "a row's bits depend on the row count"
    _check_invariance(res)
    rel, worst = _errors(one, split)
    assert rel < 1e-5 and worst < 1e-4, (rel, worst)
    sub = {k: (v[:64] if k in ("q", "slots") else v) for k, v in c.items()}
    rel, worst = _errors(one[:64], _reference(sub))
    assert rel < 1e-5 and worst < 1e-4, (rel, worst)
    assert torch.isfinite(one).all() and one.abs().sum() > 0
    # o's inverse RoPE in the epilogue: the row-op launch's bits on the fp32 o (rows at positions 6000 + t)
    from dsv41.kernels.step.rowops import rope_rows

    pos = 6000 + torch.arange(c["q"].shape[0], device=one.device)
    freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32, device=one.device) / 64))
    fused = attention_onepass(c["q"], c["win"], c["ents"], c["slots"], c["sink"], scale, keys_bf16=True,
                              rope=(pos, freq, 64, torch.bfloat16))
    after = rope_rows(one, pos, freq, 64, inverse=True, out_dtype=torch.bfloat16)
    assert torch.equal(fused.view(torch.int16), after.view(torch.int16)), "the epilogue's RoPE is not rope_rows'"


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    _interp_worker(sys.argv[2])
