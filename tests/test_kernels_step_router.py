"""The step router kernel (dsv41.kernels.step.router) against the reference router (dsv41.model.moe.route).

CPU part: the kernels run in Triton's interpreter, in one child process (this file run as a script: TRITON_INTERPRET
must be set before the kernels are decorated, and setting it here would turn every other Triton kernel of the test
session into an interpreted one). The child runs the kernel on the cases below and saves its outputs; the tests
rebuild the same inputs and judge them against the reference. GPU part (`-m gpu`): the real shapes, in-process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from step_harness import interpreted, need_compiled_cuda  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _case(name: str, device="cpu"):
    """Inputs of one case: (x, gate [E, d] fp32, bias or None, k, scale, renorm, temp)."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    if name == "tiny":  # a tiny model's router, bf16 rows, d not a multiple of the block
        B, d, E, k = 7, 200, 24, 3
        x = torch.randn(B, d, generator=gen).bfloat16()
        gate = torch.randn(E, d, generator=gen) * 0.1
        bias = torch.randn(E, generator=gen) * 0.1
        args = (k, 1.5, True, 1.0)
    elif name == "nobias":  # no bias, no renorm, a temperature, fp32 rows
        B, d, E, k = 5, 384, 40, 5
        x = torch.randn(B, d, generator=gen)
        gate = torch.randn(E, d, generator=gen) * 0.05
        bias, args = None, (k, 2.5, False, 0.7)
    elif name == "k1":  # one expert per row: no renormalisation even when asked
        B, d, E, k = 4, 128, 3, 1
        x = torch.randn(B, d, generator=gen)
        gate = torch.randn(E, d, generator=gen) * 0.1
        bias, args = torch.randn(E, generator=gen) * 0.1, (k, 1.0, True, 1.0)
    elif name == "ties":  # experts in groups of 4 with identical gate rows and biases: exact ties at the cut
        B, d, E, k = 6, 160, 32, 6
        x = torch.randn(B, d, generator=gen)
        gate = (torch.randn(E // 4, d, generator=gen) * 0.1).repeat_interleave(4, dim=0)
        bias = (torch.randn(E // 4, generator=gen) * 0.1).repeat_interleave(4)
        args = (k, 1.5, True, 1.0)
    elif name == "zeros":  # every logit 0: every select equal, the k lowest ids in order
        B, d, E, k = 2, 64, 16, 4
        x = torch.randn(B, d, generator=gen)
        gate = torch.zeros(E, d)
        bias, args = torch.zeros(E), (k, 1.5, True, 1.0)
    else:
        raise KeyError(name)
    return (x.to(device), gate.to(device), None if bias is None else bias.to(device), *args)


CASES = ("tiny", "nobias", "k1", "ties", "zeros")


def _run(name: str, device="cpu", rows=None):
    from dsv41.kernels.step.router import route_rows

    x, gate, bias, k, scale, renorm, temp = _case(name, device)
    if rows is not None:
        x = x[rows]
    return route_rows(x, gate.t(), bias, k, scale=scale, renorm=renorm, temp=temp)


KNOBS = dict(block_e=8, block_d=64, d_splits=8, num_warps=2)  # "tiny": more splits than its 4 chunks of d


def _interp_worker(out_path: str) -> None:
    from dsv41.kernels.step.router import route_rows
    from dsv41.kernels.step.router_tiles import route_rows_tiles

    out = {}
    for name in CASES:  # prefill rows: the logits as one tiled product (kernels/step/router_tiles.py)
        x, gate, bias, k, scale, renorm, temp = _case(name)
        ids, w, logits, select = route_rows_tiles(x, gate.t(), bias, k, scale=scale, renorm=renorm, temp=temp)
        out["tiles_" + name] = {"ids": ids, "weights": w, "logits": logits, "select": select}
    # a native matrix's prefill product (the indexer's weights_proj): x [B, d] @ W.T, a tile's fp32 sums
    from dsv41.kernels.step.router_tiles import rows_product_tiles

    gen = torch.Generator().manual_seed(11)
    xp, wp = torch.randn(70, 96, generator=gen).bfloat16(), torch.randn(40, 96, generator=gen).bfloat16()
    out["rows_product"] = {"x": xp, "w": wp, "full": rows_product_tiles(xp, wp.t()),
                           "slice": rows_product_tiles(xp[5:9], wp.t()),
                           "fp32": rows_product_tiles(xp.float(), wp.float().t())}
    for name in ("tiny", "nobias"):
        x, gate, bias, k, scale, renorm, temp = _case(name)
        out["knobs_" + name] = route_rows(x, gate.t(), bias, k, scale=scale, renorm=renorm, temp=temp, **KNOBS)
    for name in CASES:
        ids, w, logits, select = _run(name)
        out[name] = {"ids": ids, "weights": w, "logits": logits, "select": select}
        # every row alone, and the rows reversed: the same bits per row
        alone = [_run(name, rows=slice(r, r + 1)) for r in range(ids.shape[0])]
        out[name]["alone"] = [torch.cat([a[i] for a in alone]) for i in range(4)]
        rev = torch.arange(ids.shape[0] - 1, -1, -1)
        out[name]["reversed"] = [t.flip(0) for t in _run(name, rows=rev)]
    # the release's bf16 gate read in-kernel: the bits of its fp32 copy
    x, gate, bias, k, scale, renorm, temp = _case("tiny")
    g16 = gate.bfloat16()
    out["bf16_gate"] = [route_rows(x, g.t(), bias, k, scale=scale, renorm=renorm, temp=temp)
                        for g in (g16, g16.float())]
    out["int32_ids"] = [route_rows(x, gate.t(), bias, k, scale=scale, renorm=renorm, temp=temp, ids_dtype=dt)
                        for dt in (torch.int32, torch.int64)]
    # the select folded into the logits launch (the default) against its own launch, default and other knobs;
    # twice folded: the arrival counters are back at zero after a launch
    out["fold"] = {}
    for name in CASES:
        x, gate, bias, k, scale, renorm, temp = _case(name)
        for tag, knobs in (("", {}), ("knobs_", KNOBS)):
            out["fold"][tag + name] = [route_rows(x, gate.t(), bias, k, scale=scale, renorm=renorm, temp=temp,
                                                  fold=f, **knobs) for f in (False, True, True)]
    torch.save(out, out_path)


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "router")


def _reference(name: str, device="cpu"):
    from dsv41.model.moe import route

    x, gate, bias, k, scale, renorm, temp = _case(name, device)
    ids, w, logits = route(x, gate, bias, k, scale=scale, renorm=renorm, temp=temp)
    import torch.nn.functional as F

    scores = torch.sqrt(F.softplus(logits.double())).float()
    select = scores + bias.float() if bias is not None else scores
    return ids, w, logits, select


def _margins(select: torch.Tensor, k: int) -> torch.Tensor:
    """The reference's margin at the cut per row: k-th largest select minus the (k+1)-th."""
    top = torch.sort(select.double(), dim=-1, descending=True).values
    if top.shape[1] == k:
        return torch.full((top.shape[0],), float("inf"), dtype=torch.float64)
    return top[:, k - 1] - top[:, k]


def _logits_fp64(name: str) -> torch.Tensor:
    x, gate, _, _, _, _, temp = _case(name)
    return (x.double() @ gate.double().t()) / temp


@pytest.mark.parametrize("name", [c for c in CASES if c not in ("ties", "zeros")])
def test_interpreted_router_matches_reference(interp, name):
    """Logits within fp32 reduction rounding of fp64, ids identical where the reference's margin at the cut is
    above the fp32-vs-fp64 drift (the cases keep every margin clear), weights within fp32 rounding."""
    got = interp[name]
    ids, w, logits, select = _reference(name)
    exact = _logits_fp64(name)
    rel = float((got["logits"].double() - exact).norm() / exact.norm())
    assert rel < 1e-6, rel
    drift = float((got["select"].double() - select.double()).abs().max())
    margins = _margins(select, ids.shape[1])
    clear = margins > 10 * drift + 1e-6
    assert clear.float().mean() >= 0.8, (margins, drift)
    assert torch.equal(got["ids"][clear], ids[clear]), (got["ids"], ids)
    assert got["ids"].dtype == torch.int64 and got["weights"].dtype == torch.float32
    assert torch.allclose(got["weights"], w, rtol=1e-5, atol=1e-7), (got["weights"] - w).abs().max()


@pytest.mark.parametrize("name", CASES)
def test_interpreted_prefill_router_tiles_match_reference(interp, name):
    """The prefill router (tiled logits, the same select): logits within fp32 reduction rounding of fp64, ids the
    reference's where its margin is clear, and always the tie rule's on the kernel's own selects."""
    from dsv41.model.topk import topk_lowest_index_ties

    got = interp["tiles_" + name]
    ids, w, logits, select = _reference(name)
    exact = _logits_fp64(name)
    if float(exact.norm()):
        assert float((got["logits"].double() - exact).norm() / exact.norm()) < 1e-6
    else:
        assert not got["logits"].any()
    assert torch.equal(got["ids"], topk_lowest_index_ties(got["select"], ids.shape[1]))
    drift = float((got["select"].double() - select.double()).abs().max())
    clear = _margins(select, ids.shape[1]) > 10 * drift + 1e-6
    assert torch.equal(got["ids"][clear], ids[clear])
    if bool(clear.any()):
        assert float((got["weights"][clear] - w[clear]).abs().max()) < 1e-5


def test_interpreted_router_ties_go_to_the_lower_id(interp):
    """Experts with identical gate rows and biases tie exactly (the kernel gives them the same bits); the k picked
    are the stable descending sort's first k of the kernel's own selects: best first, lower id first among equal."""
    from dsv41.model.topk import topk_lowest_index_ties

    for name in ("ties", "zeros"):
        got = interp[name]
        sel = got["select"]
        k = got["ids"].shape[1]
        grouped = sel.view(sel.shape[0], -1, 4 if name == "ties" else sel.shape[1])
        assert torch.equal(grouped, grouped[..., :1].expand_as(grouped))  # exact ties inside every group
        assert torch.equal(got["ids"], topk_lowest_index_ties(sel, k)), (got["ids"], sel)
        ids, w, _, _ = _reference(name)
        assert torch.equal(got["ids"], ids)
        assert torch.allclose(got["weights"], w, rtol=1e-6, atol=0)
        cut = torch.sort(sel, dim=-1, descending=True).values
        if name == "ties":  # the cut goes through a tie group on some row (k = 6 of groups of 4)
            assert bool((cut[:, k - 1] == cut[:, k]).any())
    assert torch.equal(interp["zeros"]["ids"], torch.arange(4).expand(2, 4))


@pytest.mark.parametrize("name", CASES)
def test_interpreted_router_rows_alone_and_reordered_keep_their_bits(interp, name):
    got = interp[name]
    full = [got[key] for key in ("ids", "weights", "logits", "select")]
    for other in (got["alone"], got["reversed"]):
        for a, b in zip(full, other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["tiny", "nobias"])
def test_interpreted_router_launch_knobs_match_reference(interp, name):
    """Other tiles and splits (another fp32 reduction order): the reference's result as the defaults are held to,
    and the defaults' ids."""
    ids, w, logits, select = interp["knobs_" + name]
    r_ids, r_w, _, r_select = _reference(name)
    exact = _logits_fp64(name)
    assert float((logits.double() - exact).norm() / exact.norm()) < 1e-6
    assert float((logits - interp[name]["logits"]).abs().max() / interp[name]["logits"].abs().max()) < 1e-5
    clear = _margins(r_select, r_ids.shape[1]) > 10 * float((select.double() - r_select.double()).abs().max()) + 1e-6
    assert clear.float().mean() >= 0.8
    assert torch.equal(ids[clear], r_ids[clear])
    assert torch.equal(ids, interp[name]["ids"])
    assert torch.allclose(w, r_w, rtol=1e-5, atol=1e-7)


def test_interpreted_router_int32_ids_are_the_int64_ones(interp):
    """`ids_dtype=torch.int32` (the MoE kernels' table): the same ids, the other outputs the same bits."""
    (ids32, *rest32), (ids64, *rest64) = interp["int32_ids"]
    assert ids32.dtype == torch.int32 and ids64.dtype == torch.int64
    assert torch.equal(ids32.long(), ids64)
    for a, b in zip(rest32, rest64):
        assert torch.equal(a, b)


def test_interpreted_router_folded_select_is_the_two_launches_bitwise(interp):
    """The select in the logits launch's last arriver == the select launch, every output, every case, default and
    other launch knobs, launch after launch."""
    for key, (two, folded, again) in interp["fold"].items():
        for a, b, c in zip(two, folded, again):
            assert torch.equal(a, b) and torch.equal(b, c), key
    assert torch.equal(interp["fold"]["ties"][1][0], interp["ties"]["ids"])  # the default is the folded launch


def test_router_refuses_other_id_dtypes():
    from dsv41.kernels.step.router import route_rows

    with pytest.raises(ValueError, match="ids_dtype"):
        route_rows(torch.zeros(1, 8), torch.zeros(8, 4), None, 2, scale=1.0, renorm=True, ids_dtype=torch.int16)


def test_interpreted_router_reads_a_bf16_gate_as_its_fp32_copy(interp):
    for a, b in zip(*interp["bf16_gate"]):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the real shapes (d 5120, E 384, k 6; and the d 4096, E 256), compiled
# ---------------------------------------------------------------------------------------------------------------


_need_cuda = need_compiled_cuda


@pytest.mark.gpu
@pytest.mark.parametrize("d,E", [(5120, 384), (4096, 256)])
def test_gpu_router_real_shapes_vs_reference_and_row_invariance(d, E):
    """Rows 1..16 (bf16, as the fast path feeds them): ids identical to the reference's (fp32 per row on the GPU)
    where its margin is clear of the drift, weights within fp32 rounding, and each row's bits equal alone, among 15
    others and at any position of the batch."""
    from dsv41.kernels.step.router import route_rows
    from dsv41.model.moe import route

    _need_cuda()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(7)
    x = torch.randn(16, d, generator=gen, device=dev).bfloat16()
    gate = torch.randn(E, d, generator=gen, device=dev) * d ** -0.5
    bias = torch.randn(E, generator=gen, device=dev) * 0.05
    ids, w, logits, select = route_rows(x, gate.t(), bias, 6, scale=1.5, renorm=True)
    torch.cuda.synchronize()
    exact = x.double() @ gate.double().t()
    rel = float((logits.double() - exact).norm() / exact.norm())
    assert rel < 1e-6, rel
    r_ids, r_w, r_logits = route(x, gate, bias, 6, scale=1.5, renorm=True)
    import torch.nn.functional as F

    r_sel = torch.sqrt(F.softplus(r_logits.double())).float() + bias
    drift = float((select - r_sel).abs().max())
    clear = _margins(r_sel, 6) > 10 * drift + 1e-6
    assert clear.float().mean() >= 0.75, drift
    assert torch.equal(ids[clear], r_ids[clear])
    assert torch.allclose(w[clear], r_w[clear], rtol=1e-5, atol=1e-7)
    full = (ids, w, logits, select)
    for B in (1, 2, 3, 5, 8, 13, 16):
        for start in sorted({0, 16 - B}):
            part = route_rows(x[start:start + B], gate.t(), bias, 6, scale=1.5, renorm=True)
            for a, b in zip(full, part):
                assert torch.equal(a[start:start + B], b), (B, start)
    # the release's dtype, read in-kernel: compiled for bf16 loads the lanes reduce in another order than for fp32
    # ones (on the H200 the bits differ from the fp32 copy's), so it is held to the same checks on its own
    g16 = gate.bfloat16()
    ids16, w16, logits16, select16 = full16 = route_rows(x, g16.t(), bias, 6, scale=1.5, renorm=True)
    exact16 = x.double() @ g16.double().t()
    assert float((logits16.double() - exact16).norm() / exact16.norm()) < 1e-6
    r16_ids, r16_w, r16_logits = route(x, g16.float(), bias, 6, scale=1.5, renorm=True)
    r16_sel = torch.sqrt(F.softplus(r16_logits.double())).float() + bias
    clear16 = _margins(r16_sel, 6) > 10 * float((select16 - r16_sel).abs().max()) + 1e-6
    assert clear16.float().mean() >= 0.75
    assert torch.equal(ids16[clear16], r16_ids[clear16])
    assert torch.allclose(w16[clear16], r16_w[clear16], rtol=1e-5, atol=1e-7)
    for B in (1, 5, 16):
        part = route_rows(x[16 - B:], g16.t(), bias, 6, scale=1.5, renorm=True)
        for a, b in zip(full16, part):
            assert torch.equal(a[16 - B:], b), B
    perm = torch.randperm(16, generator=gen, device=dev)
    for a, b in zip(full, route_rows(x[perm], gate.t(), bias, 6, scale=1.5, renorm=True)):
        assert torch.equal(a[perm], b)
    # the select folded into the logits launch (the default) == its own launch, eager and replayed in a graph
    for a, b in zip(full, route_rows(x, gate.t(), bias, 6, scale=1.5, renorm=True, fold=False)):
        assert torch.equal(a, b)
    graph = torch.cuda.CUDAGraph()
    xs = x.clone()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = route_rows(xs, gate.t(), bias, 6, scale=1.5, renorm=True, fold=True)
    for rows in (x.flip(0), x):
        xs.copy_(rows)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(captured, route_rows(rows, gate.t(), bias, 6, scale=1.5, renorm=True, fold=False)):
            assert torch.equal(a, b)


def test_interpreted_rows_product_is_the_exact_products_summed_in_fp32(interp):
    """The prefill product of a native matrix: within fp32 rounding of the fp64 product of the same bf16 values,
    in every row slice, and the bf16 operands' tensor-core form equal to their fp32 values' IEEE dot."""
    r = interp["rows_product"]
    want = r["x"].double() @ r["w"].double().t()
    tol = 1e-5 * (r["x"].double().abs() @ r["w"].double().abs().t())
    for got in (r["full"], r["fp32"]):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert bool(((got.double() - want).abs() <= tol).all())
    assert bool(((r["slice"].double() - want[5:9]).abs() <= tol[5:9]).all())


def test_rows_product_refuses_operands_that_do_not_multiply():
    from dsv41.kernels.step.router_tiles import rows_product_tiles

    with pytest.raises(ValueError, match="do not multiply"):
        rows_product_tiles(torch.zeros(3, 8), torch.zeros(7, 2))


@pytest.mark.gpu
def test_gpu_prefill_native_linear_rows_alone():
    """The indexer's weights_proj ([32, 5120] native bf16) on prefill rows: a row's bits the same in any chunk (the
    chunking bug of issue 31: cuBLAS chose its kernel by the row count), within bf16 rounding of fp64."""
    need_compiled_cuda()
    from dsv41.runtime.layers.linear import DequantLinear

    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(4096, 5120, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(32, 5120, generator=gen, device="cuda") * 5120 ** -0.5).bfloat16()
    lin = DequantLinear("native", {"weight": w}, 5120, 32, "attn.indexer.weights_proj")
    full = lin(x, 4096, "prefill")
    assert full.dtype == torch.bfloat16
    for rows in (slice(0, 1), slice(0, 2048), slice(1348, 1414), slice(2048, 4096), torch.randperm(4096, device="cuda")):
        part = lin(x[rows], x[rows].shape[0], "prefill")
        assert torch.equal(part, full[rows]), rows
    want = x.double() @ w.double().t()
    assert float((full.double() - want).abs().max()) <= 2 ** -7 * float(want.abs().max())


@pytest.mark.gpu
def test_gpu_decode_native_linear_rows_alone_in_every_bucket():
    """weights_proj on decode / verify buckets (1-32 rows, and past 32): a row's bits the same alone and in any
    bucket (cuBLAS picks its kernel by the row count; the fused phases run fixed 32-row products)."""
    need_compiled_cuda()
    from dsv41.runtime.layers.linear import DequantLinear

    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(40, 5120, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(32, 5120, generator=gen, device="cuda") * 5120 ** -0.5).bfloat16()
    lin = DequantLinear("native", {"weight": w}, 5120, 32, "attn.indexer.weights_proj")
    alone = torch.cat([lin(x[r:r + 1], 1, "decode") for r in range(40)])
    for B in (2, 6, 8, 12, 16, 24, 32, 40):
        assert torch.equal(lin(x[:B], B, "verify"), alone[:B]), B
    want = x.double() @ w.double().t()
    assert float((alone.double() - want).abs().max()) <= 2 ** -7 * float(want.abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
def test_gpu_prefill_router_tiles_full_shape_rows_alone(gate_dtype):
    """The prefill router at the release's shape (d 5120, E 384, top-6): a row's ids, weights and logits the same
    bits in any chunk (alone, a slice, reordered), and the reference's ids where its margin is clear."""
    need_compiled_cuda()
    from dsv41.kernels.step.router_tiles import route_rows_tiles
    from dsv41.model.moe import route

    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(700, 5120, generator=gen, device="cuda").bfloat16()
    gate = (torch.randn(384, 5120, generator=gen, device="cuda") * 0.02).to(gate_dtype)
    bias = torch.randn(384, generator=gen, device="cuda") * 0.01
    full = route_rows_tiles(x, gate.t(), bias, 6, scale=1.5, renorm=True)
    for rows in (slice(0, 1), slice(5, 70), slice(300, 700), torch.randperm(700, device="cuda")):
        part = route_rows_tiles(x[rows], gate.t(), bias, 6, scale=1.5, renorm=True)
        for a, b in zip(part, full):
            assert torch.equal(a, b[rows]), rows
    ref_ids = route(x.float(), gate.float(), bias, 6, scale=1.5, renorm=True)[0]
    assert float((full[0] == ref_ids).all(dim=1).float().mean()) > 0.99


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    _interp_worker(sys.argv[2])
