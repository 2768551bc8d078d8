"""The row-op kernels (dsv41.kernels.step.rowops) against the reference compositions (dsv41.model.norm.rms_norm ->
dsv41.model.rope.RopeTable.apply -> dsv41.model.quant), at the fast path's call sites.

CPU part: the kernels run in Triton's interpreter, in one child process (TRITON_INTERPRET must be set before the
kernels are decorated); the child saves its outputs, the tests rebuild the inputs and judge them. Shapes: the tiny
model's (src/dsv41/tiny: head_dim 128, rope 64, q_lora_rank 128, 8 heads, index 4 heads x 128), bf16 as the fast
path runs, plus fp32 / fp16 and odd dims. GPU part (`-m gpu`): the real shapes (head_dim 512, rope 64, q_lora_rank
1280, 64 heads, index 32 x 128), rows 1..16, compiled, in-process.

Tolerances:
- RoPE and the quantisers: bitwise equal to the reference on the same input (their arithmetic is a fixed sequence
  of correctly rounded fp32 operations, cos / sin rounded once from fp64, the grids rounded by their bits).
- RMSNorm: the sum of squares runs in another order than torch's. fp32 outputs within NORM_ULPS fp32 ulps of the
  reference and rel-L2 1e-6 of fp64; bf16 / fp16 outputs within one ulp, differing on at most FLIP_FRACTION of the
  elements (a 1-2 fp32-ulp move crosses a bf16 rounding boundary with odds ~2^-15).
- norm -> RoPE -> quantiser chains: the kernel's chain equals the reference's RoPE + quantiser applied to the
  kernel's own norm (`rms_norm_rows`) bitwise; against the full reference chain, an output block may differ only
  where its normed input differs (a flipped bf16 norm value moves the block's amax or a value across a code
  boundary), and such blocks are counted and bounded by the norm's flips.
- Rows: a row's bits are the same alone and among other rows in any order.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from step_harness import interpreted, need_compiled_cuda  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EPS = 1e-20
NORM_ULPS = 4
FLIP_FRACTION = 2e-3
QUANT_FN = {"fp8_ue8m0": ("fp8_block_ue8m0", 32), "fp4_ue8m0": ("fp4_block_ue8m0", 32),
            "fp4_e4m3": ("fp4_block_e4m3", 16)}


def _tables(rope_dim=64):
    """The model's two RoPE tables (`model.rope`), with the rope fields of the tiny and the real config (the same:
    theta 10000 / 160000, YaRN factor 16 over 65536 positions, betas 32 / 1)."""
    from types import SimpleNamespace

    from dsv41.config import ModelConfig
    from dsv41.model.rope import RopeTable, inv_freq, yarn_inv_freq

    ns = SimpleNamespace(qk_rope_head_dim=rope_dim, compress_rope_theta=160000.0, yarn_factor=16.0,
                         yarn_original_max_position=65536, yarn_beta_fast=32.0, yarn_beta_slow=1.0)
    ns.yarn_range = lambda: ModelConfig.yarn_range(ns)
    return {"plain": RopeTable(inv_freq(10000.0, rope_dim)), "compress": RopeTable(yarn_inv_freq(ns))}


def _quant(x, quant, block=None):
    import dsv41.model.quant as q

    name, default = QUANT_FN[quant]
    return getattr(q, name)(x, block or default)


def _case(name: str, device="cpu", real=False):
    """(kind, inputs) of one call site: kind in norm / rope / chain / quant; inputs a dict."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)) + 1000 * real)
    B = 16 if real else 6
    hd, ql, H, IH, G = (512, 1280, 64, 32, 5) if real else (128, 128, 8, 4, 3)
    P = torch.tensor([0, 1, 7, 130, 4097, 65537, 9, 300, 2, 5, 77, 1000, 31, 64, 128, 200000][:B])
    dt = torch.bfloat16

    def rn(*shape, scale=1.0, dtype=dt):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    def wt(n):
        return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(dt).to(device)

    tab = "compress" if name != "q_rope_plain" else "plain"
    c = {"P": P.to(device), "tab": tab, "R": 64}
    if name == "q_norm":  # qr = rms_norm(qa, q_norm) over q_lora_rank
        return "norm", dict(c, x=rn(B, ql, scale=3.0), w=wt(ql))
    if name == "q_norm_fp32":
        return "norm", dict(c, x=rn(B, ql, dtype=torch.float32), w=wt(ql))
    if name == "latent_norm_fp16":  # the compressor's latent norm, an odd width (tile masking)
        return "norm", dict(c, x=rn(B, 200, scale=0.5, dtype=torch.float16), w=wt(200).half())
    if name in ("q_rope", "q_rope_plain"):  # rope(qb.view(B, heads, head_dim), P)
        return "rope", dict(c, x=rn(B, H, hd))
    if name == "q_rope_strided":  # a view with row and head strides of a wider tensor (the kernel reads strides)
        return "rope", dict(c, x=rn(B, H, 2 * hd)[:, :, hd:])
    if name == "out_inverse":  # rope(o.to(dtype), P, inverse): o fp32
        o = rn(B, H, hd, dtype=torch.float32)
        o[0, :, -8:] = torch.tensor([0.0, -0.0, -0.0, 0.0, -0.0, -0.0, 1.0, -0.0])  # signed zeros at position 0
        return "rope", dict(c, x=o, inverse=True, out=dt)
    if name == "iq":  # fp4_block_ue8m0(rope(ib.view(B, index heads, 128), P), 32)
        return "rope", dict(c, x=rn(B, IH, 128, scale=2.0), quant="fp4_ue8m0")
    if name == "entries":  # fp4_block_e4m3(rope(latent, entry_pos), 16)
        return "rope", dict(c, x=rn(G, hd), P=P[:G].to(device) * 2, quant="fp4_e4m3")
    if name == "kv":  # fp8_block_ue8m0(rope(rms_norm(kva, kv_norm), P), 32)
        return "chain", dict(c, x=rn(B, hd, scale=5.0), w=wt(hd), quant="fp8_ue8m0")
    if name == "kv_fp32":  # fp32 activations: the norm moves by ulps everywhere, some blocks' codes move with it
        return "chain", dict(c, x=rn(B, hd, scale=5.0, dtype=torch.float32), w=wt(hd).float(), quant="fp8_ue8m0")
    if name == "index_k":  # fp4_block_ue8m0(rope(rms_norm(keys, k_norm), entry_pos), 32)
        return "chain", dict(c, x=rn(G, 128), w=wt(128), P=P[:G].to(device) * 2, quant="fp4_ue8m0")
    if name == "odd_rope":  # head dim not a multiple of the tile, rope 8 dims, quantiser skipped (200 % 16)
        return "rope", dict(c, x=rn(B, 3, 200), R=8, quant="fp4_e4m3", tables=8)
    if name.startswith("crafted"):  # the quantisers alone on values at the grids' ties, floors and clamps
        x = _crafted(gen, torch.float32 if name.endswith("32") else dt).to(device)
        return "quant", dict(c, x=x, P=torch.arange(x.shape[0], device=device))
    raise KeyError(name)


def _crafted(gen, dtype):
    """[rows, 64] rows of hand-made blocks (16 or 32 values): e2m1 and e4m3 ties, zero and -0 blocks, blocks under
    the amax floors, amax exactly 448 * 2^k and 6 * 2^k (a power-of-two ratio), huge values."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    ties = torch.cat([ties, -ties])
    e4 = torch.tensor([448.0, 416.0, 432.0, 1.0625, 1.1875, 2.0 ** -7, 3 * 2.0 ** -10, -2.0 ** -10, 17.0, -19.0,
                       0.0, -0.0, 0.5, 240.0, 232.0, -248.0])
    rows = [torch.cat([ties, ties * 4, e4, e4 / 448]), torch.cat([ties * 2.0 ** -30, torch.zeros(16), -torch.zeros(16),
            torch.full((16,), 1e-5)]), torch.cat([ties * 1e30, e4 * 1e-3, ties * 0.5 ** 20, -e4])]
    rows += [torch.randn(64, generator=gen) * 10.0 ** float(e) for e in (-6, -2, 0, 3)]
    return torch.stack(rows).to(dtype)


CASES = ("q_norm", "q_norm_fp32", "latent_norm_fp16", "q_rope", "q_rope_plain", "q_rope_strided", "out_inverse",
         "iq", "entries", "kv", "kv_fp32", "index_k", "odd_rope", "crafted_bf16", "crafted_fp32")


def _kernel(kind, c, rows=None, live=None):
    """The kernels of a case; `rows` picks input rows, `live` is the launchers' `rows=` (programs for the first
    `live` rows only)."""
    from dsv41.kernels.step import rowops

    tab = _tables(c.get("tables", 64))[c["tab"]]
    x, P = c["x"], c["P"]
    if rows is not None:
        x, P = x[rows], P[rows]
    kw = {} if live is None else {"rows": live}
    if kind == "norm":
        return [rowops.rms_norm_rows(x, c["w"], EPS, **kw)]
    if kind == "rope":
        return [rowops.rope_rows(x, P, tab.inv_freq, c["R"], inverse=c.get("inverse", False), quant=c.get("quant"),
                                 out_dtype=c.get("out"), **kw)]
    if kind == "chain":  # the chain, and its norm alone
        return [rowops.norm_rope_rows(x, c["w"], EPS, P, tab.inv_freq, c["R"], quant=c["quant"], **kw),
                rowops.rms_norm_rows(x, c["w"], EPS, **kw)]
    return [rowops.fake_quant_rows(x, q, block, **kw) for q in QUANT_FN for block in (16, 32)]


def _reference(kind, c, normed=None):
    from dsv41.model.norm import rms_norm

    tab = _tables(c.get("tables", 64))[c["tab"]]
    x, P = c["x"].cpu(), c["P"].cpu()
    if kind == "norm":
        return [rms_norm(x, c["w"].cpu(), EPS)]
    if kind == "rope":
        out = tab.apply(x.to(c.get("out") or x.dtype), P, c["R"], inverse=c.get("inverse", False))
        return [_quant(out, c["quant"]) if c.get("quant") else out]
    if kind == "chain":
        n = rms_norm(x, c["w"].cpu(), EPS) if normed is None else normed.cpu()
        return [_quant(tab.apply(n, P, c["R"]), c["quant"])]
    return [_quant(x, q, block) for q in QUANT_FN for block in (16, 32)]


def _interp_worker(out_path: str) -> None:
    out = {}
    for name in CASES:
        kind, c = _case(name)
        B = c["x"].shape[0]
        got = _kernel(kind, c)
        alone = [_kernel(kind, c, rows=slice(r, r + 1)) for r in range(B)]
        rev = torch.arange(B - 1, -1, -1)
        out[name] = {"got": got, "alone": [torch.cat([a[i] for a in alone]) for i in range(len(got))],
                     "reversed": [t.flip(0) for t in _kernel(kind, c, rows=rev)],
                     "live": {k: _kernel(kind, c, live=k) for k in {0, 1, B - 1}}}
    torch.save(out, out_path)


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "rowops")


@pytest.mark.parametrize("name", CASES)
def test_interpreted_live_rows_are_the_full_launch_and_the_rest_zero(interp, name):
    """`rows=k` (a bucket's real rows): rows [0, k) of every output are the full launch's bits, the rest +0.0."""
    got = interp[name]
    for k, outs in got["live"].items():
        for full, part in zip(got["got"], outs):
            assert part.shape == full.shape and part.dtype == full.dtype
            assert torch.equal(part[:k], full[:k]), (name, k)
            assert torch.equal(part[k:], torch.zeros_like(part[k:])) and not torch.signbit(part[k:].float()).any()


def test_live_rows_are_checked():
    from dsv41.kernels.step.rowops import rms_norm_rows

    x = torch.ones(2, 8)
    for bad in (-1, 3, 1.0, True, torch.tensor(1)):
        with pytest.raises(ValueError, match="rows"):
            rms_norm_rows(x, torch.ones(8), EPS, rows=bad)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in ulps of b's dtype at b's magnitude."""
    fi = torch.finfo(b.dtype)
    ulp = torch.maximum(b.float().abs(), torch.tensor(fi.tiny)) * fi.eps
    return (a.float() - b.float()).abs() / ulp


def check_norm(got, ref, x, w):
    """fp32: within NORM_ULPS ulps; 16-bit: within an ulp on at most FLIP_FRACTION of the elements; rel-L2 vs fp64."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    xd = x.double().cpu()
    exact = xd / xd.pow(2).mean(-1, keepdim=True).add(EPS).sqrt() * w.double().cpu()
    assert float((got.double() - exact).norm() / exact.norm()) < (1e-6 if got.dtype == torch.float32 else 5e-3)
    u = _ulps(got, ref)
    if got.dtype == torch.float32:
        assert float(u.max()) <= NORM_ULPS, float(u.max())
    else:
        assert float(u.max()) <= 1.0, float(u.max())
        assert float((got != ref).float().mean()) <= FLIP_FRACTION
    return int((got != ref).sum())


def check_chain(got, normed, ref_normed, ref, block):
    """Blocks of the chain's output that differ from the reference's only where the normed input differs."""
    bad = (got != ref).reshape(*got.shape[:-1], -1, block).any(-1)
    moved = (normed != ref_normed).reshape(*got.shape[:-1], -1, block).any(-1)
    assert not bool((bad & ~moved).any()), "a block differs with the same normed input"
    return int(bad.sum()), int(moved.sum())


def _judge(name, outs, device="cpu"):
    kind, c = _case(name, device, real=device != "cpu")
    if kind == "norm":
        check_norm(outs[0].cpu(), _reference(kind, c)[0], c["x"], c["w"])
        return
    if kind == "chain":
        got, normed = outs[0].cpu(), outs[1].cpu()
        ref_normed = _reference("norm", c)[0]
        check_norm(normed, ref_normed, c["x"], c["w"])
        # the chain = the reference's RoPE and quantiser on the kernel's own norm, bitwise
        assert torch.equal(got, _reference(kind, c, normed=normed)[0])
        check_chain(got, normed, ref_normed, _reference(kind, c)[0], QUANT_FN[c["quant"]][1])
        return
    for g, r in zip(outs, _reference(kind, c)):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert torch.equal(g.cpu(), r), (name, int((g.cpu() != r).sum()))
        assert torch.equal(g.cpu().view(torch.int16 if g.element_size() == 2 else torch.int32),
                           r.view(torch.int16 if r.element_size() == 2 else torch.int32))  # signs of zero too


@pytest.mark.parametrize("name", CASES)
def test_interpreted_rowops_match_the_reference(interp, name):
    _judge(name, interp[name]["got"])


@pytest.mark.parametrize("name", CASES)
def test_interpreted_rowops_rows_alone_and_reordered_keep_their_bits(interp, name):
    got = interp[name]
    for other in (got["alone"], got["reversed"]):
        for a, b in zip(got["got"], other):
            assert torch.equal(a, b), name


def test_interpreted_crafted_cases_hit_the_corners(interp):
    """The crafted rows reach the corners they are made for: fp8 keeps a negative zero block's signs, e2m1 gives it
    +0 (the reference's code table), e2m1 ties land on both neighbours, e4m3 saturates at 448 times the scale."""
    outs = interp["crafted_fp32"]["got"]  # (fp8, fp4 ue8m0, fp4 e4m3) x (block 16, 32)
    neg_zero = slice(32, 48)  # row 1's third block of 16: -0.0
    assert bool((outs[0][1, neg_zero].view(torch.int32) < 0).all())
    for fp4 in outs[2:]:
        assert bool((fp4[1, neg_zero].view(torch.int32) == 0).all())
    ties = outs[2][0, :16]  # fp4 ue8m0 / 16 on 0.25 .. 6 (amax 6: scale 1): the ties to the even code
    assert ties[:8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    assert outs[0][0, 32].item() == 448.0  # e4m3's largest value at scale 1


def test_rowops_reject_bad_arguments():
    from dsv41.kernels.step import rowops

    x = torch.zeros(2, 8, 128)
    with pytest.raises(ValueError):
        rowops.rope_rows(x, torch.zeros(2, dtype=torch.long), torch.ones(16), 64)  # table of the wrong length
    with pytest.raises(ValueError):
        rowops.fake_quant_rows(x, "nvfp4")
    with pytest.raises(ValueError):
        rowops.rms_norm_rows(x, torch.ones(64), EPS)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the real shapes, compiled
# ---------------------------------------------------------------------------------------------------------------


_need_cuda = need_compiled_cuda


@pytest.mark.gpu
@pytest.mark.parametrize("name", [c for c in CASES if c not in ("odd_rope",)])
def test_gpu_rowops_real_shapes_vs_reference_and_row_invariance(name):
    """head_dim 512, rope 64, q_lora_rank 1280, 64 heads, index 32 x 128, 16 rows (5 compressed entries): the same
    judgement as the interpreter's against the CPU reference, and each row's bits alone (B 1), in a prefix / suffix
    of B 2..15 and shuffled."""
    _need_cuda()
    kind, c = _case(name, "cuda", real=True)
    outs = _kernel(kind, c)
    torch.cuda.synchronize()
    _judge(name, outs, "cuda")
    n = c["x"].shape[0]
    for B in sorted({1, 2, 3, 5, 8, 13, n}):
        if B > n:
            continue
        for start in sorted({0, n - B}):
            part = _kernel(kind, c, rows=slice(start, start + B))
            for a, b in zip(outs, part):
                assert torch.equal(a[start:start + B], b), (name, B, start)
    perm = torch.randperm(n, device="cuda")
    for a, b in zip(outs, _kernel(kind, c, rows=perm)):
        assert torch.equal(a[perm], b)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    _interp_worker(sys.argv[2])
