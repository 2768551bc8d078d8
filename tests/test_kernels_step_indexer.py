"""The step indexer kernels (dsv41.kernels.step.indexer) and the fast path's batched indexer against the reference.

References: the index scores of `Attention._index_scores` (the same math as `FastAttention._scores`), the top-k of
`Attention._select` (`model.topk.topk_lowest_index_ties`, -inf picks -> -1, ascending), the candidate blocks of
`Attention._candidate_mask`, and per sequence the fast path's own reference loop `FastAttention._topk`.

Tolerance of the scores (fp32 against the reference's fp32 and against fp64): the kernel sums q.k over hd in a dot
and the heads in a tree, the reference in torch's orders, so they differ by fp32 reduction rounding; bound per row
1e-5 x the row's largest sum_h |w_h| sum_d |q_hd k_d| (the magnitude every rounding is relative to): the classical
worst case of two nested fp32 sums, (hd + Hi) x 2^-24 ~ 1e-5 at the release's 128 + 32; measured 2.8e-8 here
(rel. L2 from fp64 5.4e-8, the reference's own 5.6e-8). On integer-valued q, k and dyadic w every sum is exact in fp32, so there the
scores, the candidate pools and the ids are bitwise the reference's, ties included.

CPU part: the kernels run in Triton's interpreter in one child process (this file as a script; TRITON_INTERPRET
must be set before the kernels are decorated, see tests/test_kernels_step_router.py), which saves its outputs; the
tests rebuild the inputs and judge. GPU part (`-m gpu`): the full shape (32 index heads x 128, index top-k 512,
C up to 4,096, T 1..16 over several sequences and a 300-row prefill), compiled, in-process.

Scores from the pool (`index_scores_pool`): tests/test_kernels_step_indexer_pool.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from step_harness import interpreted, need_compiled_cuda  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NINF = float("-inf")


def _rows(name: str):
    """One launch's inputs: q [B, H, hd], w [B, H], keys [N, hd] and per row (q row, key offset, visible, own C)."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    exact = name.startswith("exact")
    H, hd = (4, 16) if exact else (5, 48)  # heads and hd not powers of two off the exact case
    Cs = (37, 52, 5, 300) if not exact else (37, 52, 5, 20)
    B = 14
    if exact:
        q = torch.randint(-2, 3, (B, H, hd), generator=gen).float()
        w = torch.randint(-4, 5, (B, H), generator=gen).float() / 4
        keys = torch.randint(-2, 3, (sum(Cs), hd), generator=gen).float()
    else:
        q = torch.randn(B, H, hd, generator=gen).bfloat16()
        w = torch.randn(B, H, generator=gen)
        keys = torch.randn(sum(Cs), hd, generator=gen).bfloat16()
    meta, off, r = [], 0, 0
    for C, vis in zip(Cs, ((37, 0, 36), (52, 51, 1, 40), (5, 2), (300, 299, 250, 17, 64))):
        for v in vis:
            meta.append((r, off, min(v, C), C))
            r += 1
        off += C
    meta = torch.tensor(meta).t().contiguous()
    return q, w, keys, meta


def _ref_scores(q, w, keys, meta, ncols):
    from dsv41.runtime.layers.attention import FastAttention

    out = torch.full((meta.shape[1], ncols), NINF)
    for i, (qr, off, vis, C) in enumerate(meta.t().tolist()):
        src = SimpleNamespace(index_k=keys[off:off + C])
        out[i, :C] = FastAttention._scores(q[qr:qr + 1], w[qr:qr + 1], src, torch.arange(C)[None] < vis)[0]
    return out


def _magnitude(q, w, keys, meta, ncols):
    """Per row: sum_h |w_h| sum_d |q_hd k_d| over its visible entries (what each score's rounding scales with)."""
    out = torch.zeros(meta.shape[1], ncols, dtype=torch.float64)
    for i, (qr, off, vis, C) in enumerate(meta.t().tolist()):
        per = (q[qr].double().abs()[:, None, :] * keys[off:off + vis].double().abs()[None]).sum(-1)
        out[i, :vis] = (w[qr].double().abs()[:, None] * per).sum(0)
    return out


def _tie_scores():
    """Scores built for the tie rule: integer values (many equal), -inf runs, +/-0.0, rows of fewer finite than k."""
    gen = torch.Generator().manual_seed(3)
    s = torch.randint(-3, 3, (8, 500), generator=gen).float()
    s[0] = NINF
    s[1, :10] = NINF
    s[2] = 0.0
    s[2, ::2] = -0.0
    s[3, 5:] = NINF  # 5 finite
    s[4] = 1.0
    s[5, ::3] = NINF
    s[6] = torch.randn(500, generator=gen)
    s[6, 100:110] = s[6, 3]  # a tie group that straddles any cut at its value
    s[7, :] = NINF
    s[7, 499] = 2.0
    return s


TOPK_KS = (1, 5, 7, 100, 499, 500)
LAYER_CASES = ("exact", "random")


def _layer_case(name: str):
    """A fast attention layer pair (candidate source 3, re-indexing layer 4, both reading source 3) and segments of
    four sequences (C 37, 52, 5 and 0 entries; decode rows, a multi-row chunk, a sequence with fewer than k)."""
    from dsv41.model.attention import Attention
    from dsv41.model.state import SequenceState
    from dsv41.runtime.layers.attention import FastAttention, Segment

    gen = torch.Generator().manual_seed(sum(map(ord, name)) + 1)
    H, hd = 4, 16
    cfg = SimpleNamespace(index_topk=8, candidate_block_size=4, candidate_topk_blocks=3, index_n_heads=H,
                          index_head_dim=hd)
    layers = []
    for index, cand in ((3, True), (4, False)):
        role = SimpleNamespace(index=index, kv_source=3, index_source=index, scores=True, swa_only=False,
                               compress_ratio=1, is_candidate_source=cand, uses_candidates=not cand)
        lay = object.__new__(FastAttention)
        lay.cfg, lay.role = cfg, role
        lay.ref = object.__new__(Attention)
        lay.ref.cfg = cfg
        layers.append(lay)
    segs, start = [], 0
    for C, T in ((37, 1), (52, 6), (5, 2), (0, 1)):
        st = SequenceState(pos=max(C - T, 0))  # the last row sees every entry
        src = st.source(3)
        if C:
            src.kv = torch.zeros(C, 1)
            src.index_k = (torch.randint(-2, 3, (C, hd), generator=gen).float() if name == "exact"
                           else torch.randn(C, hd, generator=gen).bfloat16())
        segs.append(Segment(st, start, T, st.pos))
        start += T
    B = start + 1  # one padding row
    if name == "exact":
        iq = [torch.randint(-2, 3, (B, H, hd), generator=gen).float() for _ in layers]
        iw = [torch.randint(-4, 5, (B, H), generator=gen).float() / 4 for _ in layers]
    else:
        iq = [torch.randn(B, H, hd, generator=gen).bfloat16() for _ in layers]
        iw = [torch.randn(B, H, generator=gen) for _ in layers]
    return layers, segs, iq, iw


def _run_layers(layers, segs, iq, iw, kernels: bool, rows_per_launch=None, tiles: bool = False):
    """Both layers over the segments (fresh per-forward `Shared`s). Returns per layer the traces and the pools.
    `tiles`: the prefill rows' scores on the tensor-core tiles (`kernels.step.index_tiles`)."""
    from dsv41.model.attention import Shared

    for s in segs:
        s.shared = Shared()
    out = []
    for lay, q, w in zip(layers, iq, iw):
        tr = {}
        if kernels:
            lay._index_kernels(segs, q, w, tr, rows_per_launch, tiles=tiles)
        else:
            for s in segs:
                src = s.state.source(3)
                lay._topk(s, torch.arange(s.pos, s.pos + s.T), q, w, src, tr)
        out.append({"ids": tr["index_ids"], "scores": tr["index_scores"],
                    "cand": [s.shared.candidates for s in segs]})
    return out


def _interp_worker(out_path: str) -> None:
    from dsv41.kernels.step.indexer import candidate_mask, index_scores, topk_select

    out = {}
    for name in ("random", "exact"):
        q, w, keys, meta = _rows(name)
        ncols = int(meta[3].max())
        full = index_scores(q, w, keys, meta[0], meta[1], meta[2], ncols)
        # the raw head weights (weights_proj's bf16 output) with the two scales applied in the load
        raw = w.bfloat16()
        scaled = index_scores(q, raw.float() * 0.125 * 0.0883883, keys, meta[0], meta[1], meta[2], ncols)
        in_load = index_scores(q, raw, keys, meta[0], meta[1], meta[2], ncols, w_scales=(0.125, 0.0883883))
        alone = [index_scores(q, w, keys, meta[0, i:i + 1], meta[1, i:i + 1], meta[2, i:i + 1], int(meta[3, i]))
                 for i in range(meta.shape[1])]
        k = min(8, ncols)
        out[name] = {"scores": full, "alone": alone, "scaled_outside": scaled, "scaled_in_load": in_load, "ids": topk_select(full, k),
                     "ids_alone": [topk_select(a, min(8, a.shape[1])) for a in alone],
                     "cand": candidate_mask(full, meta[2], 4, 3),
                     "cand_alone": [candidate_mask(a, meta[2, i:i + 1], 4, 3) for i, a in enumerate(alone)]}
    s = _tie_scores()
    out["ties"] = {k: topk_select(s, k) for k in TOPK_KS}
    out["ties_mask"] = {k: topk_select(s, k, mask=True) for k in TOPK_KS}
    for name in LAYER_CASES:
        layers, segs, iq, iw = _layer_case(name)
        out["layer_" + name] = {"all": _run_layers(layers, segs, iq, iw, True),
                                "one_row": _run_layers(layers, segs, iq, iw, True, rows_per_launch=1),
                                "alone": [_run_layers(layers, [s], iq, iw, True) for s in segs],
                                "tiles": _run_layers(layers, segs, iq, iw, True, tiles=True),
                                "tiles_one_row": _run_layers(layers, segs, iq, iw, True, rows_per_launch=1,
                                                             tiles=True)}
    torch.save(out, out_path)


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "indexer")


@pytest.mark.parametrize("name", ["random", "exact"])
def test_interpreted_scores_match_the_reference(interp, name):
    q, w, keys, meta = _rows(name)
    ncols = int(meta[3].max())
    got, ref = interp[name]["scores"], _ref_scores(q, w, keys, meta, ncols)
    assert torch.equal(torch.isinf(got), torch.isinf(ref)) and not torch.isnan(got).any()
    fin = torch.isfinite(ref)
    err = (got.double() - ref.double()).abs()[fin]
    bound = 1e-5 * _magnitude(q, w, keys, meta, ncols).amax(dim=1, keepdim=True).expand_as(ref)[fin]
    assert bool((err <= bound).all()), float((err / bound).max())
    if name == "exact":  # every sum exact in fp32: the reference's bits
        assert torch.equal(got, ref)


@pytest.mark.parametrize("name", ["random", "exact"])
def test_interpreted_topk_and_candidates_follow_the_reference(interp, name):
    """On the kernel's own scores the ids and the candidate pool are exactly the reference's `_select` /
    `_candidate_mask`; against the reference's scores, ids agree on every row whose margin at the cut is clear."""
    from dsv41.model.attention import Attention

    got = interp[name]
    q, w, keys, meta = _rows(name)
    ref_layer = object.__new__(Attention)
    ref_layer.cfg = SimpleNamespace(candidate_block_size=4, candidate_topk_blocks=3)
    assert torch.equal(got["ids"], Attention._select(got["scores"], 8))
    assert torch.equal(got["cand"], Attention._candidate_mask(ref_layer, got["scores"], meta[2]))
    ref = _ref_scores(q, w, keys, meta, int(meta[3].max()))
    ref_ids = Attention._select(ref, 8)
    drift = float((got["scores"] - ref)[torch.isfinite(ref)].abs().max())
    if drift == 0:  # exact sums: the same scores, the same ids whatever the ties
        assert name == "exact" and torch.equal(got["ids"], ref_ids)
        return
    top = ref.sort(dim=1, descending=True).values
    clear = (top[:, 7] - top[:, 8] > 10 * drift) | torch.isinf(top[:, 8])
    assert clear.float().mean() >= 0.7
    assert torch.equal(got["ids"][clear], ref_ids[clear])


def test_interpreted_topk_tie_rule_infinities_and_short_rows(interp):
    """Exact ties go to the lower id, -0.0 ties +0.0, picks of -inf are -1 and come first, rows with fewer finite
    scores than k keep all of them: bitwise `Attention._select`; the mask mode marks the same set."""
    from dsv41.model.attention import Attention

    s = _tie_scores()
    for k in TOPK_KS:
        ids = interp["ties"][k]
        assert ids.dtype == torch.int64 and ids.shape == (8, k)
        assert torch.equal(ids, Attention._select(s, k)), k
        mask = torch.zeros(8, 500, dtype=torch.bool)
        for r in range(8):
            mask[r, ids[r][ids[r] >= 0]] = True
        assert torch.equal(interp["ties_mask"][k], mask), k
    assert torch.equal(interp["ties"][5][0], torch.full((5,), -1))
    assert torch.equal(interp["ties"][7][3], torch.tensor([-1, -1, 0, 1, 2, 3, 4]))
    assert torch.equal(interp["ties"][7][4], torch.arange(7))  # all equal: the lowest ids
    assert torch.equal(interp["ties"][7][7], torch.tensor([-1] * 6 + [499]))


@pytest.mark.parametrize("name", ["random", "exact"])
def test_interpreted_head_weights_scaled_in_the_load_are_the_scaled_weights(interp, name):
    """`w_scales` (the decode step hands weights_proj's raw output to the kernel): the bits of the weights scaled
    by `w.float() * a * b` first."""
    got = interp[name]
    assert torch.equal(got["scaled_in_load"], got["scaled_outside"])
    assert not torch.equal(got["scaled_in_load"], got["scores"])  # the scales took effect


@pytest.mark.parametrize("name", ["random", "exact"])
def test_interpreted_rows_alone_equal_rows_among_others(interp, name):
    """A row launched alone with its own column count has the bits it has among rows of other sequences padded to
    the longest: scores (its own columns; -inf past them), ids (the padded launch's last min(k, C) columns, the
    others -1) and candidate pool (whose last partial block may extend past C in the padded launch: the runtime
    cuts every row to its own C)."""
    got = interp[name]
    _, _, _, meta = _rows(name)
    for i, C in enumerate(meta[3].tolist()):
        k = min(8, C)
        assert torch.equal(got["alone"][i][0], got["scores"][i, :C])
        assert bool(torch.isneginf(got["scores"][i, C:]).all())
        assert torch.equal(got["ids_alone"][i][0], got["ids"][i, 8 - k:])
        assert bool((got["ids"][i, :8 - k] == -1).all())
        assert torch.equal(got["cand_alone"][i][0], got["cand"][i, :C])
        assert not got["cand"][i, -(-C // 4) * 4:].any()  # past the row's last (partial) block: never kept


@pytest.mark.parametrize("name", LAYER_CASES)
def test_interpreted_fast_path_indexer_equals_its_reference_loop(interp, name):
    """`FastAttention._index_kernels` (all sequences in one launch) against `_topk` per sequence (the reference
    math plain CPU runs): candidate source then a re-indexing layer inside its pool, sequences of 37 / 52 / 5 / 0
    entries. Exact inputs: bitwise everywhere. Random: scores within the tolerance and ids / pools equal on the
    kernel's own scores; and in both, every segment alone or one row per launch gives the same bits."""
    from dsv41.model.attention import Attention

    layers, segs, iq, iw = _layer_case(name)
    ref = _run_layers(layers, segs, iq, iw, False)
    got = interp["layer_" + name]
    for L, (g, r) in enumerate(zip(got["all"], ref)):
        for i, s in enumerate(segs):
            if r["scores"][i] is None:
                assert g["scores"][i] is None and g["ids"][i].shape == (s.T, 0)
                continue
            if name == "exact":
                assert torch.equal(g["scores"][i], r["scores"][i]), (L, i)
                assert torch.equal(g["ids"][i], r["ids"][i]), (L, i)
                if L == 0:
                    assert torch.equal(g["cand"][i], r["cand"][i]), i
            else:
                fin = torch.isfinite(r["scores"][i])
                assert torch.equal(torch.isfinite(g["scores"][i]), fin)
                assert float((g["scores"][i] - r["scores"][i])[fin].abs().max()) < 1e-4
                k = min(8, s.state.source(3).entries)
                assert torch.equal(g["ids"][i], Attention._select(g["scores"][i], k)), (L, i)
                if L == 0:
                    assert torch.equal(g["cand"][i], layers[0].ref._candidate_mask(
                        g["scores"][i], torch.arange(s.pos, s.pos + s.T) + 1)), i
        for i in range(len(segs)):
            for key in ("ids", "scores", "cand"):
                a, b, c = g[key][i], got["one_row"][L][key][i], got["alone"][i][L][key][0]
                assert (a is None and b is None and c is None) or (torch.equal(a, b) and torch.equal(a, c)), key


@pytest.mark.parametrize("name", LAYER_CASES)
def test_interpreted_fast_path_indexer_on_tiles_equals_the_row_kernels(interp, name):
    """`_index_kernels(tiles=True)` (the prefill rows' scores on the tensor-core tiles, per sequence) against the
    row kernels: the exact inputs bitwise (scores, ids, candidate pools; and one row per launch the same bits), the
    random ones within fp32 sum rounding with ids and pools the reference's on the tiles' own scores."""
    from dsv41.model.attention import Attention

    layers, segs, iq, iw = _layer_case(name)
    got = interp["layer_" + name]
    for L in range(len(layers)):
        for i, s in enumerate(segs):
            a, t, t1 = got["all"][L], got["tiles"][L], got["tiles_one_row"][L]
            if a["scores"][i] is None:
                assert t["scores"][i] is None and t["ids"][i].shape == (s.T, 0)
                continue
            if name == "exact":
                for key in ("scores", "ids", "cand"):
                    assert torch.equal(t[key][i], a[key][i]) and torch.equal(t1[key][i], t[key][i]), (L, i, key)
                continue
            fin = torch.isfinite(a["scores"][i])
            assert torch.equal(torch.isfinite(t["scores"][i]), fin)
            assert float((t["scores"][i] - a["scores"][i])[fin].abs().max()) < 1e-4
            k = min(8, s.state.source(3).entries)
            assert torch.equal(t["ids"][i], Attention._select(t["scores"][i], k)), (L, i)
            if L == 0:
                assert torch.equal(t["cand"][i], layers[0].ref._candidate_mask(
                    t["scores"][i], torch.arange(s.pos, s.pos + s.T) + 1)), i


def test_candidate_pool_reuses_the_padded_launch_or_pads_per_segment():
    """Re-indexing layers read the candidate source's [R, ncols] pool as it is when every segment's pool is its
    row slice in order, and otherwise pad each segment's [T, C] pool with False to the longest C."""
    from dsv41.runtime.layers.attention_index import _candidate_pool

    base = torch.rand(5, 9) > 0.5
    segs = [SimpleNamespace(T=2, shared=SimpleNamespace(candidates=base[0:2, :9])),
            SimpleNamespace(T=3, shared=SimpleNamespace(candidates=base[2:5, :4]))]
    work = [(s, None) for s in segs]
    assert _candidate_pool(work, 5, 9) is base
    segs[1].shared.candidates = base[2:5, :4].clone()
    pool = _candidate_pool(work, 5, 9)
    assert pool is not base and torch.equal(pool[:2], base[:2]) and torch.equal(pool[2:, :4], base[2:, :4])
    assert not pool[2:, 4:].any()
    segs[1].shared.candidates = base[2:5, :4]
    pool = _candidate_pool(work[::-1], 5, 9)  # rows out of the base's order: padded
    assert torch.equal(pool[:3, :4], base[2:, :4]) and torch.equal(pool[3:], base[:2])


@pytest.mark.parametrize("arch", [80, 90, 121])
def test_indexer_kernels_compile_for_every_target(arch):
    """Ahead-of-time compile (Triton's own ptxas, no GPU) at the release shape (32 heads x 128, bf16 q and keys)
    for sm_80, sm_90 and GB10's sm_121: a cubin each, no Hopper-only instruction, no local memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from dsv41.kernels.step import codecs
    from dsv41.kernels.step import indexer as k

    if not isinstance(k._scores_kernel, JITFunction):
        pytest.skip("kernels decorated for the interpreter in this process")
    sc = dict(q_ptr="*bf16", sqt="i32", sqh="i32", w_ptr="*fp32", swt="i32", k_ptr="*bf16", skc="i32",
              qrow_ptr="*i64", koff_ptr="*i64", nvis_ptr="*i64", allow_ptr="*u8", sat="i32", out_ptr="*fp32",
              sot="i32", H="i32", HD="i32", ncols="i32", pg_ptr="*i64", spg="i32", per_page="i32", skp="i32",
              wa="fp32", wb="fp32")
    tk = dict(s_ptr="*fp32", sst="i32", ids_ptr="*i64", mask_ptr="*i8", smt="i32", ncols="i32", k="i32")
    kernels = [(k._scores_kernel, sc, dict(HP=32, HDP=128, BC=k.BLOCK_C, HAS_ALLOW=a, PAGED=False, CODEC=0))
               for a in (False, True)]
    kernels += [(k._scores_kernel, {**sc, "k_ptr": "*u8"}, dict(HP=32, HDP=128, BC=k.BLOCK_C, HAS_ALLOW=a, PAGED=True,
                                                               CODEC=cid))
                for a, cid in ((False, codecs.FP4_UE8M0), (True, codecs.FP4_UE8M0), (False, codecs.RAW_BF16))]
    kernels += [(k._topk_kernel, tk, dict(NEG=k.NEG_INF_KEY, BLOCK=k.TOPK_BLOCK, WRITE_IDS=not m, WRITE_MASK=m,
                                          RADIX=radix))
                for m in (False, True) for radix in (True, False)]
    for fn, sig, const in kernels:
        const = {**const, "PDL": arch >= 90}  # dependent launch exists from sm_90 on (kernels/step/pdl.py)
        src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in const}}, constexprs=const)
        try:
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4))
        except RuntimeError as exc:  # no ptxas for this target in this Triton
            pytest.skip(f"Triton cannot compile for sm_{arch} here: {exc}")
        assert compiled.asm.get("cubin"), (fn.__name__, arch)
        ptx = compiled.asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == (arch >= 90), (fn.__name__, arch)
        for op in ("wgmma", "cp.async.bulk", "setmaxnreg", "tcgen05", ".local"):
            assert op not in ptx, (fn.__name__, arch, op)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the full shape, compiled
# ---------------------------------------------------------------------------------------------------------------


_need_cuda = need_compiled_cuda


def _gpu_rows(T_per_seq, Cs, vis_of, dev, gen, fp4: bool):
    """q [B, 32, 128] bf16, w [B, 32] fp32, keys of the sequences concatenated (bf16), meta [4, B]."""
    from dsv41.model.quant import fp4_block_ue8m0

    B = sum(T_per_seq)
    q = torch.randn(B, 32, 128, generator=gen, device=dev).bfloat16()
    keys = torch.randn(sum(Cs), 128, generator=gen, device=dev).bfloat16()
    if fp4:
        q, keys = fp4_block_ue8m0(q, 32, True), fp4_block_ue8m0(keys, 32, True)
    w = torch.randn(B, 32, generator=gen, device=dev) * (128 ** -0.5) * (32 ** -0.5)
    meta, off, r = [], 0, 0
    for T, C in zip(T_per_seq, Cs):
        for j in range(T):
            meta.append((r, off, vis_of(C, T, j), C))
            r += 1
        off += C
    return q, w, keys, torch.tensor(meta, device=dev).t().contiguous()


def _maxabs(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_gpu_indexer_full_shape_vs_reference_and_rows_alone(phase):
    """Decode: 16 rows of 16 sequences (C 1..4,096, some below top-k 512); prefill: 300 causal rows over C = 4,096
    (ratio 1, the newest entries visible row by row). Scores within the tolerance of fp64 and of the fast path's
    fp32 reference (`FastAttention._scores`), ids exactly `_select` of the kernel's scores and the reference's ids
    where the margin is clear, candidate pools exactly `_candidate_mask` (2,048 blocks of 8); each row's bits alone ==
    among others (and, in decode, in any batch order)."""
    _need_cuda()
    _full_shape_check(phase, torch.device("cuda"))


def _full_shape_check(phase: str, dev: torch.device, every: int = 1) -> None:
    """The GPU test's body (`every`: check every n-th row against the reference, to run it in the interpreter)."""
    from dsv41.kernels.step.indexer import candidate_mask, index_scores, topk_select
    from dsv41.model.attention import Attention
    from dsv41.runtime.layers.attention import FastAttention

    gen = torch.Generator(device=dev).manual_seed(11)
    if phase == "decode":
        Cs = [1, 7, 100, 511, 512, 513, 1000, 2047, 2048, 2049, 3000, 3333, 4000, 4095, 4096, 600]
        T_per_seq, vis_of = [1] * 16, (lambda C, T, j: C)
    else:
        Cs, T_per_seq, vis_of = [4096], [300], (lambda C, T, j: C - T + 1 + j)
    for fp4 in (False, True):
        q, w, keys, meta = _gpu_rows(T_per_seq, Cs, vis_of, dev, gen, fp4)
        ncols = max(Cs)
        got = index_scores(q, w, keys, meta[0], meta[1], meta[2], ncols)
        k = min(512, ncols)
        ids = topk_select(got, k)
        cand = candidate_mask(got, meta[2], 8, 2048)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        for i, (qr, off, vis, C) in enumerate(meta.t().tolist()):
            if i % every:
                continue
            sl = slice(off, off + C)
            visible = (torch.arange(C, device=dev) < vis)[None]
            ref = FastAttention._scores(q[qr:qr + 1], w[qr:qr + 1], SimpleNamespace(index_k=keys[sl]), visible)[0]
            exact = (w[qr].double()[:, None] * torch.relu(q[qr].double() @ keys[sl].double().t())).sum(0)
            mag = (w[qr].double().abs()[:, None] * (q[qr].double().abs() @ keys[sl].double().abs().t())).sum(0)
            fin = visible[0]
            bound = 1e-5 * float(mag[fin].max()) if vis else 0.0
            assert _maxabs(got[i, :C][fin].double() - exact[fin]) <= bound, (i, fp4)
            assert _maxabs(got[i, :C][fin] - ref[fin]) <= bound, (i, fp4)
            assert bool(torch.isneginf(got[i, vis:]).all())
            kc = min(512, C)
            mine = Attention._select(got[i:i + 1, :C], kc)[0]
            assert torch.equal(ids[i, k - kc:], mine) and bool((ids[i, :k - kc] == -1).all()), i
            r_ids = Attention._select(ref[None], kc)[0]
            top = ref.sort(descending=True).values
            drift = _maxabs((got[i, :C] - ref)[fin])
            if C <= kc or vis <= kc or float(top[kc - 1] - top[kc]) > 10 * drift:
                assert torch.equal(mine, r_ids), i
        layer = object.__new__(Attention)
        layer.cfg = SimpleNamespace(candidate_block_size=8, candidate_topk_blocks=2048)
        assert torch.equal(cand, Attention._candidate_mask(layer, got, meta[2]))
        # bits alone == among others
        picks = range(meta.shape[1]) if phase == "decode" else (0, 1, 150, 299)
        for i in picks:
            C = int(meta[3, i])
            a = index_scores(q, w, keys, meta[0, i:i + 1], meta[1, i:i + 1], meta[2, i:i + 1], C)
            assert torch.equal(a[0], got[i, :C]), i
            assert torch.equal(topk_select(a, min(512, C))[0], ids[i, k - min(512, C):]), i
            assert torch.equal(candidate_mask(a, meta[2, i:i + 1], 8, 2048)[0], cand[i, :C]), i
        if phase == "decode":
            perm = torch.randperm(16, generator=gen, device=dev)
            p = index_scores(q, w, keys, meta[0][perm], meta[1][perm], meta[2][perm], ncols)
            assert torch.equal(p, got[perm]) and torch.equal(topk_select(p, k), ids[perm])


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    _interp_worker(sys.argv[2])
