"""The grouped routed-expert path of prefill rows (`FusedMoE._grouped`) is bitwise the per-expert loop it replaced.

The loop (kept here as `_loop_partial`, the code as it was): for each expert in `torch.unique(ids)` its rows by
`(ids == e).nonzero()`, the expert's swiglu on x[rows] with weights[rows, slot], `index_add_` into y. The grouped
path sorts the routing once on the device and reads the counts once; the math per expert and the order of
accumulation are the loop's, so `torch.equal` must hold: on rows that repeat experts, with an expert no row picked,
with padding rows past n, at T = 1 and T = 37.

In-process (plain CPU): experts as a list of torch linears, and `StackedExperts` over random EXL3 stacks with a
workspace whose product is the pure-torch `reference_matmul`. Child process (TRITON_INTERPRET=1, which must be set
before Triton decorates its kernels): `StackedExperts` with the real `PrefillWorkspace` (reconstruct in the
interpreter, the CPU GEMM).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial

import pytest
import torch

HIDDEN, INTER, EXPERTS, TOPK, LIMIT = 128, 128, 5, 3, 7.0


def _loop_partial(moe, x: torch.Tensor, n: int, phase: str = "prefill") -> torch.Tensor:
    """`FusedMoE.partial` on prefill rows with the per-expert loop as it was before the grouped path."""
    from dsv41.model.moe import Expert, swiglu_clamped

    ids, weights, _, _ = moe.route(x)
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for w1, w3, w2 in moe.shared:
        y += swiglu_clamped(x, Expert(w1=partial(w1, n=n, phase=phase), w2=partial(w2, n=n, phase=phase),
                                      w3=partial(w3, n=n, phase=phase)), moe.limit, None)
    ids, weights = ids[:n], weights[:n]
    for e in torch.unique(ids).tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        y.index_add_(0, rows, swiglu_clamped(x[rows], moe._expert(e), moe.limit, weights[rows, slot]))
    return y


class _TorchLinear:
    """A fast linear's call signature over a dense fp32 matrix [in, out]."""

    def __init__(self, w: torch.Tensor):
        self.w = w

    def __call__(self, x, n=None, phase="decode", out_dtype=None):
        return (x.float() @ self.w).to(out_dtype or x.dtype)


class _ReferenceWorkspace:
    """Stands in for `PrefillWorkspace` on plain CPU: `x @ W_eff` by the pure-torch reference (no Triton)."""

    def reserve(self, k, n):
        pass

    def matmul(self, x, one):
        from dsv41.weights.exl3 import reference_matmul

        return reference_matmul(x, one.words.view(torch.int16), one.suh, one.svh, one.codebook)


def _stacks(gen):
    from dsv41.kernels.exl3.layout import Exl3ExpertStack

    out = []
    for k, n in ((HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)):
        trellis = torch.randint(-32768, 32768, (EXPERTS, k // 16, n // 16, 16 * 2), generator=gen, dtype=torch.int32)
        suh = (torch.randn(EXPERTS, k, generator=gen) * 0.05).half()
        svh = (torch.randn(EXPERTS, n, generator=gen) * 0.05).half()
        out.append(Exl3ExpertStack.from_stacked(trellis.to(torch.int16), suh, svh, "mul1"))
    return out


def _moe(kind: str, seed: int = 0):
    from dsv41.runtime.layers.linear import PrefillWorkspace
    from dsv41.runtime.layers.moe import FusedMoE, StackedExperts

    gen = torch.Generator().manual_seed(seed)

    def lin(k, n):
        return _TorchLinear(torch.randn(k, n, generator=gen) * k ** -0.5)

    shared = [(lin(HIDDEN, INTER), lin(HIDDEN, INTER), lin(INTER, HIDDEN))]
    if kind == "list":
        experts = [(lin(HIDDEN, INTER), lin(HIDDEN, INTER), lin(INTER, HIDDEN)) for _ in range(EXPERTS)]
    else:
        w1, w3, w2 = _stacks(gen)
        ws = _ReferenceWorkspace() if kind == "stacked-ref" else PrefillWorkspace(torch.device("cpu"))
        experts = StackedExperts(w1, w3, w2, ws)
    gate = torch.randn(EXPERTS, HIDDEN, generator=gen).to(torch.bfloat16)
    bias = torch.randn(EXPERTS, generator=gen) * 0.1
    return FusedMoE(gate, bias, experts, shared, topk=TOPK, route_scale=1.5, renorm=True, swiglu_limit=LIMIT)


def _forced_route(moe, ids: torch.Tensor, seed: int):
    """Replace the router by fixed ids (and random weights) for the bucket's rows."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(ids.shape, generator=gen) + 0.1
    E = moe.gate_t.shape[1]

    def route(x):
        z = torch.zeros(x.shape[0], E)
        return ids[: x.shape[0]], weights[: x.shape[0]], z, z

    moe.route = route


def _cases():
    """(name, T rows in the bucket, n real rows, forced ids or None)."""
    gen = torch.Generator().manual_seed(3)
    # expert 4 never picked; expert 0 in every row; the other slots from 1..3 in shuffled slot order
    skewed = torch.stack([torch.cat((torch.tensor([0]), torch.randperm(3, generator=gen)[:2] + 1))[
        torch.randperm(3, generator=gen)] for _ in range(37)])
    return [("routed T=1", 1, 1, None), ("routed T=37", 37, 37, None), ("routed T=37 n=30", 37, 30, None),
            ("forced T=1", 1, 1, skewed[:1]), ("forced T=37", 37, 37, skewed), ("forced T=37 n=21", 37, 21, skewed)]


def _check(kind: str) -> dict:
    results = {}
    for name, T, n, ids in _cases():
        moe = _moe(kind)
        if ids is not None:
            _forced_route(moe, ids, seed=T + n)
        x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(T * 100 + n)).to(torch.bfloat16)
        new = moe.partial(x, n, "prefill")
        old = _loop_partial(moe, x, n)
        used = sorted(set(moe.route(x)[0][:n].flatten().tolist()))
        results[name] = {"equal": bool(torch.equal(new, old)), "nonzero": bool(new[:n].abs().sum() > 0),
                         "experts": used, "finite": bool(torch.isfinite(new).all())}
    return results


def _assert_all(results: dict) -> None:
    for name, r in results.items():
        assert r["equal"], f"{name}: grouped path differs from the per-expert loop"
        assert r["nonzero"] and r["finite"], name
    assert 4 not in results["forced T=37"]["experts"]  # an expert with no rows
    assert len(results["forced T=37"]["experts"]) == 4


@pytest.mark.parametrize("kind", ["list", "stacked-ref"])
def test_grouped_experts_equal_the_loop(kind):
    _assert_all(_check(kind))


def test_grouped_experts_sync_once(monkeypatch):
    """One host read per layer: the counts' `tolist`; no `unique`, no `nonzero` on the path."""
    moe = _moe("list")
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    calls = []
    for name in ("unique", "nonzero"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    real_nz = torch.Tensor.nonzero
    monkeypatch.setattr(torch.Tensor, "nonzero", lambda *a, **k: calls.append("nonzero") or real_nz(*a, **k))
    moe.partial(x, 37, "prefill")
    assert calls == []


def _check_tiles() -> dict:
    """The tile kernels' prefill (`kernels.exl3.prefill.prefill_moe`, the router on its row kernels) against the
    reconstruct loop on the routed part: the same function within the loop's roundings (it rounds W_eff to fp16
    and each expert's gate, up, h and output to bf16, ~4e-3 here; the tiles keep fp32 to h's one fp16 rounding
    and are within 6e-4 of fp64: tests/test_exl3_prefill.py)."""
    from dsv41.kernels.step.router_tiles import route_rows_tiles

    results = {}
    for name, T, n, ids in _cases():
        if ids is not None:  # forced routes replace `moe.route`, which the tile path does not call
            continue
        moe = _moe("stacked")
        x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(T * 100 + n)).to(torch.bfloat16)
        new = moe.partial(x, n, "prefill")
        old = _loop_partial(moe, x, n)  # the experts through the workspace (StackedExperts.expert), not the tiles
        ref_ids = moe.route(x)[0][:n]
        got_ids = route_rows_tiles(x[:n], moe.gate_t, moe.gate_bias, moe.topk, scale=moe.route_scale,
                                   renorm=moe.renorm)[0]
        shared = moe._shared(x, n, "prefill").double()[:n]  # the same on both paths: judge the routed part
        routed_new, routed_old = new[:n].double() - shared, old[:n].double() - shared
        rel = float((routed_new - routed_old).norm() / routed_old.norm())
        results[name] = {"rel": rel, "same_experts": bool(torch.equal(got_ids.long(), ref_ids.long())),
                         "finite": bool(torch.isfinite(new[:n]).all())}
    return results


def test_interpreted_stacked_experts_equal_the_loop():
    """StackedExperts with the real workspace: reconstruct in Triton's interpreter (child process), the tile
    kernels switched off (DSV41_PREFILL_TILES=0: the path this loop stands for)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "DSV41_PREFILL_TILES": "0"}
    out = subprocess.run([sys.executable, __file__, "stacked"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    _assert_all(json.loads(out.stdout.strip().splitlines()[-1]))


def test_interpreted_tile_kernels_match_the_loop():
    """Prefill rows of stacked experts take the tile kernels by default: the loop's function within fp16 rounding,
    the same experts picked by the router's row kernels, padding rows past n left out."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    env.pop("DSV41_PREFILL_TILES", None)
    out = subprocess.run([sys.executable, __file__, "tiles"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(results) == {"routed T=1", "routed T=37", "routed T=37 n=30"}
    for name, r in results.items():
        assert r["same_experts"] and r["finite"], (name, r)
        assert r["rel"] <= 1e-2, (name, r)


if __name__ == "__main__":
    print(json.dumps(_check_tiles() if sys.argv[1] == "tiles" else _check(sys.argv[1])))
