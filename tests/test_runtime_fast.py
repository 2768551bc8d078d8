"""FastModel (runtime/) against the reference model (model/) on the same checkpoint, and the fast path's bitwise
guarantees.

Parity (ENGINE.md §4): logits within the kernels' input rounding, discrete choices (router top-k, indexer top-k)
identical wherever the reference's margin at the cut exceeds the perturbation that reached it; every flip is
counted and must sit at such a near-tie. The EXL3 kernels round activations to fp16 (2^-11 relative), which
moves the tiny model's logits by ~2e-3 relative with the QAT fake quantisers off (measured ~1.5-2.8e-3 here);
with them on the forward is a step function (an FP4 code flips on a 1-ulp change, test_parallel_model.py), so
there only the argmax agreement and the choice analysis are asserted.

CPU: the kernels run in Triton's interpreter, which must be set before Triton decorates them, so the CPU runs
happen in child processes (this file as a script) and report JSON. The interpreter pays ~0.05-0.15 s per 128x128
weight block, so the CPU runs use `lite_dir`, the tiny model slimmed by config overrides (6 layers with every
attention role, hidden 128, 3 experts, one Engram layer of 2 heads); the GPU runs use the built-in tiny model.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

LITE = {"hidden_size": 128, "num_attention_heads": 2, "o_groups": 2, "q_lora_rank": 128, "o_lora_rank": 128,
        "moe_intermediate_size": 256, "n_routed_experts": 3, "num_experts_per_tok": 2, "num_hidden_layers": 6,
        "compress_ratios": [0, 2, 2, 1, 1, 1, 0, 0, 0], "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 3, 4], "candidate_source_layer_id": 3, "engram_layer_ids": [1],
        "engram_n_heads": 2, "index_n_heads": 2, "dspark_target_layer_ids": [3, 4, 5], "dspark_n_routed_experts": 3,
        "hc_sinkhorn_iters": 4}
# 4 Sinkhorn rounds, not the tiny model's 20: the loop still runs (3 row / column passes), and in Triton's interpreter
# the mHC sites are ~a third of these tests' time, the loop a quarter of that (the kernels' own tests run 20)
# two sequences long enough for every choice to be a real one: ratio-2 entries (10) and ratio-1 entries (20) above
# the index top-k (8), more candidate blocks (5) than kept (3), a window (16) that has rolled
PROMPTS = ([0] + [(i * 37) % 500 + 5 for i in range(19)], [0] + [(i * 91) % 500 + 7 for i in range(14)])
DECODE_STEPS = 2
LOGITS_TOL = 1e-2  # fake quantisers off; measured ~2e-3 (CPU lite and GPU tiny)
# near-tie bounds on the reference's margin at the cut, relative to the row's score scale (rms of the router's
# select scores; largest index score): a-priori, 3-4x the drift measured with the fake quantisers off (router 2.7e-3;
# index 1.3e-2: an index score is a product of two projections, q and k, each rounded by the kernels)
CHOICE_TOL = {"router": 1e-2, "index": 4e-2}
ARGMAX_MIN = 0.9  # fake quantisers on, rows no counted flip reached: the step functions amplify the fp16 rounding


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def lite_dir(tmp_path_factory) -> Path:
    from dsv41.tiny.model import make_tiny

    return make_tiny(tmp_path_factory.mktemp("lite") / "model", "exl3", seed=0, overrides=LITE)


# ---------------------------------------------------------------------------------------------------------------
# one parity run: the reference and the fast path on the same schedule, with the choice analysis
# ---------------------------------------------------------------------------------------------------------------


class _CaptureSelect:
    """Records the scores the reference's indexer picks from (Attention._select), in call order."""

    def __init__(self):
        from dsv41.model.attention import Attention

        self.cls, self.orig, self.scores = Attention, Attention.__dict__["_select"], []

    def __enter__(self):
        orig = self.orig.__func__

        def select(scores, k):
            self.scores.append(scores)
            return orig(scores, k)

        self.cls._select = staticmethod(select)
        return self

    def __exit__(self, *exc):
        self.cls._select = self.orig


def _router_choices(ref_layer: dict, bias, fast: dict, k: int) -> list[tuple]:
    """(reference margin at the cut, drift of the fast select scores, scale of the row's scores, flipped, row)."""
    logits = ref_layer["router_logits"].double()
    select = torch.sqrt(torch.nn.functional.softplus(logits))
    select = select + bias.double().to(select.device) if bias is not None else select
    s = select.sort(dim=-1, descending=True).values
    margin = s[:, k - 1] - s[:, k]
    drift = (fast["router_select"].double().to(select.device) - select).abs().amax(dim=-1)
    ref_ids, fast_ids = ref_layer["router_ids"].tolist(), fast["router_ids"].tolist()
    scale = select.pow(2).mean(dim=-1).sqrt()
    return [(float(margin[r]), float(drift[r]), float(scale[r]), set(ref_ids[r]) != set(fast_ids[r]), r)
            for r in range(len(ref_ids))]


def _index_choices(ref_scores: torch.Tensor, ref_ids: torch.Tensor, fast_scores: torch.Tensor, fast_ids):
    out = []
    k = ref_ids.shape[1]
    for r in range(ref_ids.shape[0]):
        s = ref_scores[r].double()
        finite = torch.isfinite(s)
        if int(finite.sum()) <= k:
            continue  # every visible entry is taken: no choice
        top = s.sort(descending=True).values
        drift = float((fast_scores[r].double().to(s.device) - s)[finite].abs().max())
        flipped = set(ref_ids[r].tolist()) - {-1} != set(fast_ids[r].tolist()) - {-1}
        out.append((float(top[k - 1] - top[k]), drift, float(s[finite].abs().max()), flipped, r))
    return out


def run_parity(model_dir, device: str, fake_quant: bool, rank: int = 0, world: int = 1, comm=None,
               decode_steps: int = DECODE_STEPS) -> dict:
    """Prefill both prompts in one fast forward (and one reference forward each), then `decode_steps` decode steps
    of both rows, greedy on the reference's logits. Returns errors, argmax agreement and the choice analysis."""
    from dsv41.model.loader import load_model
    from dsv41.runtime.build import build_fast_model

    torch.manual_seed(0)
    ref = load_model(model_dir, torch.float32, device, fake_quant=fake_quant, dspark=False)
    fast = build_fast_model(model_dir, device, torch.float32, rank=rank, world=world, comm=comm,
                            fake_quant=fake_quant)
    ref_states, fast_states = [ref.new_state() for _ in PROMPTS], [fast.new_state() for _ in PROMPTS]
    steps, ref_traces, captured, fast_traces = [], [], [], []

    def reference(ids_per_seq):
        outs = []
        for st, ids in zip(ref_states, ids_per_seq):
            tr = {}
            with _CaptureSelect() as cap:
                outs.append(ref.forward(st, torch.tensor(ids), trace=tr))
            ref_traces.append(tr)
            captured.append(cap.scores)
        return outs

    ref_out = reference(PROMPTS)
    tr = {}
    fast_out = fast.forward(list(zip(fast_states, PROMPTS)), "prefill", logits="all", trace=tr)
    fast_traces.append(tr)
    steps.append(("prefill", torch.cat(ref_out), fast_out))
    for _ in range(decode_steps):
        nxt = [[int(o[-1].argmax())] for o in ref_out]
        ref_out = reference(nxt)
        tr = {}
        fast_out = fast.forward(list(zip(fast_states, nxt)), "decode", trace=tr)
        fast_traces.append(tr)
        steps.append(("decode", torch.cat(ref_out), fast_out))

    router, index = [], []

    def at_pos(rows, i, step, stage):  # (margin, drift, scale, flipped, seq, position, stage)
        return [(*c[:4], i, c[4] if step == 0 else len(PROMPTS[i]) + step - 1, stage) for c in rows]

    for step, ftr in enumerate(fast_traces):
        seqs = [(ref_traces[2 * step + i], captured[2 * step + i]) for i in range(len(PROMPTS))]
        for L in sorted(k for k in ftr if isinstance(k, int)):
            f = ftr[L][0]
            at = 0
            for i, (rtr, _) in enumerate(seqs):
                T = rtr[L]["router_ids"].shape[0]
                part = {key: f[key][at:at + T] for key in ("router_ids", "router_select")}
                gate_bias = ref.blocks[L].moe.gate_bias
                router += at_pos(_router_choices(rtr[L], gate_bias, part, ref.blocks[L].moe.topk), i, step,
                                  2 * L + 1)
                at += T
            if "index_ids" in f:
                for i, (rtr, cap) in enumerate(seqs):
                    ids = rtr[L]["index_topk_ids"]
                    if ids.shape[1] and f["index_scores"][i] is not None:
                        layer_pos = [M for M in sorted(k for k in rtr if isinstance(k, int))
                                     if "index_topk_ids" in rtr[M] and rtr[M]["index_topk_ids"].shape[1]]
                        index += at_pos(_index_choices(cap[layer_pos.index(L)], ids, f["index_scores"][i],
                                                       f["index_ids"][i]), i, step, 2 * L)
    # a flip (at a near-tie) changes what its row computes next, and through the caches its sequence's later rows:
    # those rows are left out of the rounding bound (and counted)
    first_flip = [min([pos for *_, f, seq, pos, _ in router + index if f and seq == i], default=1 << 30)
                  for i in range(len(PROMPTS))]
    clean, total, agree_clean = [], 0, []
    for step, (phase, r, f) in enumerate(steps):
        where = ([(i, p) for i, ids in enumerate(PROMPTS) for p in range(len(ids))] if step == 0 else
                 [(i, len(ids) + step - 1) for i, ids in enumerate(PROMPTS)])
        keep = torch.tensor([p < first_flip[i] for i, p in where])
        total += len(where)
        clean.append((phase, rel_l2(f[keep.to(f.device)], r[keep.to(r.device)]) if keep.any() else 0.0,
                      int(keep.sum())))
        agree_clean += (f.argmax(-1).cpu() == r.argmax(-1).cpu())[keep].tolist()
    return {
        "errors": [(phase, rel_l2(f, r)) for phase, r, f in steps],
        "errors_clean": clean, "rows": total, "rows_after_a_flip": total - sum(c[2] for c in clean),
        "argmax": float(torch.cat([(f.argmax(-1) == r.argmax(-1)).float() for _, r, f in steps]).mean()),
        "argmax_clean": sum(agree_clean) / max(1, len(agree_clean)),
        "router": router, "index": index,
        "logits": [f.cpu() for _, _, f in steps],
    }


def downstream(choice: tuple, flips: list[tuple]) -> bool:
    """Whether an earlier flip reached this choice: one of its sequence at the same or an earlier position, at an
    earlier stage (the index choice of layer L is stage 2L, its router 2L + 1). A row's stage s reads the caches
    other rows wrote with their own inputs to that stage, so a flip reaches later rows only at later stages."""
    *_, seq, pos, stage = choice
    return any(f_seq == seq and f_pos <= pos and f_stage < stage for *_, f_seq, f_pos, f_stage in flips)


def check_choices(result: dict, what: str, bounded: bool = True) -> dict:
    """A near-tie is a reference margin at the cut within CHOICE_TOL of the row's score scale. When `bounded`,
    every flip must be a near-tie or downstream of an earlier flip (which moved its inputs by more than rounding:
    counted apart); the drift that reached the scores is reported either way, for the choices no flip reached."""
    summary = {}
    every_flip = [c for c in result["router"] + result["index"] if c[3]]
    for kind in ("router", "index"):
        rows, tol = result[kind], CHOICE_TOL[kind]
        assert rows, f"{what}: no {kind} choices were made"
        first = [c for c in rows if not downstream(c, every_flip)]
        near = [c for c in first if c[0] <= tol * c[2]]
        flips = [c for c in first if c[3]]
        summary[kind] = {"choices": len(rows), "downstream_of_a_flip": len(rows) - len(first),
                         "downstream_flips": sum(c[3] for c in rows) - len(flips), "near_ties": len(near),
                         "flips": len(flips), "flip_margins_rel": [round(c[0] / c[2], 6) for c in flips[:8]],
                         "max_drift_rel": max((c[1] / c[2] for c in first if c[2] > 0), default=0.0)}
        if bounded:
            bad = [c[:3] for c in flips if c[0] > tol * c[2]]
            assert not bad, f"{what}: {kind} flips away from a near-tie (margin, drift, scale): {bad[:5]}"
    print(f"{what}: {summary}")
    return summary


# ---------------------------------------------------------------------------------------------------------------
# CPU: the interpreted child process
# ---------------------------------------------------------------------------------------------------------------


def _child(args: dict) -> None:
    torch.set_num_threads(1)
    comm = None
    if args["world"] > 1:
        from dsv41.parallel.rendezvous import init_tp

        group = init_tp(args["rank"], args["world"], args["master"], deadline_s=120, backend="gloo")
        comm = group.comm
    device = args.get("device", "cpu")
    res = run_parity(args["model"], device, args["fake_quant"], args["rank"], args["world"], comm,
                     args.get("decode_steps", DECODE_STEPS))
    torch.save(res.pop("logits"), args["out"] + ".pt")
    Path(args["out"]).write_text(json.dumps(res))


def interpreted(model_dir: Path, fake_quant: bool, tmp_path: Path, world: int = 1, device: str = "cpu",
                decode_steps: int = DECODE_STEPS) -> list[dict]:
    """Run the parity schedule in `world` child processes (gloo ranks when world > 1), interpreted on the CPU."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master = f"127.0.0.1:{s.getsockname()[1]}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"TRITON_INTERPRET": "1"} if device == "cpu" else {})}
    outs, procs = [], []
    for rank in range(world):
        out = str(tmp_path / f"parity-{world}-{rank}.json")
        args = dict(model=str(model_dir), fake_quant=fake_quant, rank=rank, world=world, master=master, out=out,
                    device=device, decode_steps=decode_steps)
        procs.append(subprocess.Popen([sys.executable, __file__, json.dumps(args)], env=env))
        outs.append(out)
    codes = [p.wait(timeout=900) for p in procs]
    assert codes == [0] * world, f"parity children exited {codes}"
    return [{**json.loads(Path(o).read_text()), "logits": torch.load(o + ".pt")} for o in outs]


def check_logits(res: dict, what: str) -> None:
    """Rows no flip reached are within the rounding bound; flips are rare enough that most rows are checked."""
    print(f"{what}: errors {res['errors']}, rows clear of flips {res['errors_clean']}, "
          f"{res['rows_after_a_flip']} of {res['rows']} rows after a near-tie flip, argmax {res['argmax']}")
    assert all(err <= LOGITS_TOL for _, err, _ in res["errors_clean"]), res["errors_clean"]
    assert res["rows_after_a_flip"] <= res["rows"] // 2


def test_interpreted_parity_tp1(lite_dir, tmp_path):
    (res,) = interpreted(lite_dir, False, tmp_path)
    check_choices(res, "CPU TP=1 fake quant off")
    check_logits(res, "CPU TP=1 fake quant off")
    assert res["rows_after_a_flip"] == 0 and res["argmax"] == 1.0


def test_a_flip_reaches_later_stages_of_its_sequence_only():
    """The choice analysis's reach rule: (margin, drift, scale, flipped, seq, position, stage)."""
    flip = (0.0, 0.0, 1.0, True, 0, 3, 5)
    assert downstream((1, 0, 1, False, 0, 3, 6), [flip])  # same row, a later stage
    assert downstream((1, 0, 1, False, 0, 9, 6), [flip])  # a later row reads caches the flip's row wrote after it
    assert not downstream((1, 0, 1, False, 0, 9, 5), [flip])  # the same stage of a later row: caches of its input
    assert not downstream((1, 0, 1, False, 0, 2, 9), [flip])  # an earlier row
    assert not downstream((1, 0, 1, False, 1, 3, 6), [flip])  # another sequence
    assert not downstream(flip, [flip])


def test_fp8_release_layout_takes_the_dequant_path(tmp_path):
    """The release's FP8 + MXFP4 layout has no kernels: DequantLinear and the per-expert loop, the reference's
    own math, so the fast path matches it far inside the EXL3 tolerance (no interpreter needed)."""
    from dsv41.tiny.model import make_tiny

    model = make_tiny(tmp_path / "fp8", "fp8", seed=1, overrides=LITE)
    res = run_parity(model, "cpu", fake_quant=False)
    assert all(err <= 1e-4 for _, err in res["errors"]), res["errors"]
    assert not any(c[3] for c in res["router"] + res["index"])


def test_a_prefill_forward_cut_between_layers_leaves_its_states_as_they_were(tmp_path):
    """FastModel's layer loop asks its abort watch before each layer (runtime/abort.py): a prefill whose step was
    abandoned stops there with StepAborted before its states advance (the engine's states are views of the pool,
    stored back only after the last layer: it drops them), the model holds nothing of the cut forward (the next
    prefill gives the bits of one never cut), and decode rows (fused) are never cut."""
    from dsv41.engine.batch import StepAborted
    from dsv41.runtime.abort import AbortWatch
    from dsv41.runtime.build import build_fast_model
    from dsv41.tiny.model import make_tiny

    model = build_fast_model(make_tiny(tmp_path / "fp8", "fp8", seed=1, overrides=LITE), "cpu", torch.float32,
                             fake_quant=False)
    ids = [0] + [(i * 31) % 500 + 5 for i in range(20)]
    layers = len(model.blocks)
    asked = []
    watch = AbortWatch(probe=lambda: len(asked) >= 2 or bool(asked.append(1)), layers=layers)
    cut = model.new_state()
    with pytest.raises(StepAborted):
        model.forward([(cut, ids)], "prefill", watch=watch)
    assert watch.stopped_at == 3 and cut.pos == 0 and not cut.ids
    whole, again = model.new_state(), model.new_state()
    want = model.forward([(whole, ids)], "prefill")
    assert torch.equal(model.forward([(again, ids)], "prefill"), want)
    decode = model.forward([(again, [7])], "decode", watch=AbortWatch(probe=lambda: True, layers=layers))
    assert torch.equal(decode, model.forward([(whole, [7])], "decode"))


# ---------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fake_quant", [False, True])
def test_gpu_parity_tiny(tiny_model_dir, fake_quant):
    what = f"GPU tiny fake quant {'on' if fake_quant else 'off'}"
    res = run_parity(tiny_model_dir, "cuda", fake_quant)
    # with the fake quantisers on an FP4 code flip moves a score by up to a third: flips are counted, not bounded
    check_choices(res, what, bounded=not fake_quant)
    if not fake_quant:
        check_logits(res, what)
    print(f"{what}: argmax {res['argmax']}, on the {res['rows'] - res['rows_after_a_flip']} rows before their "
          f"sequence's first flip {res['argmax_clean']}")
    # fake quantisers on, flips are many (an FP4 code flip is a step): a quarter of the rows (a prefill's worth) must
    # still come before their sequence's first flip for the argmax check to mean something
    assert res["rows"] - res["rows_after_a_flip"] >= res["rows"] // 4
    assert res["argmax_clean"] >= ARGMAX_MIN


def _prefilled(model, n: int):
    states = [model.new_state() for _ in range(n)]
    prompts = [[0] + [(i * (31 + 2 * s)) % 500 + 5 for i in range(20 + s)] for s in range(n)]
    model.forward(list(zip(states, prompts)), "prefill")
    return states


@pytest.mark.gpu
def test_gpu_decode_row_bits_alone_and_among_others(tiny_model_dir):
    """A decode row's logits are the same bits alone and among 1-15 other rows; a verify window's rows too."""
    from dsv41.runtime.build import build_fast_model

    model = build_fast_model(tiny_model_dir, "cuda", torch.bfloat16)
    states = _prefilled(model, 16)
    toks = [[(37 * s) % 500 + 3] for s in range(16)]
    alone = [model.forward([(copy.deepcopy(states[s]), toks[s])], "decode") for s in range(16)]
    for n in range(2, 17):
        out = model.forward([(copy.deepcopy(states[s]), toks[s]) for s in range(n)], "decode")
        for s in range(n):
            assert torch.equal(out[s:s + 1], alone[s]), f"row {s} differs among {n} rows"
    window = [5, 6, 7, 8]
    v_alone = model.forward([(copy.deepcopy(states[0]), window)], "verify", logits="all")
    v_mixed = model.forward([(copy.deepcopy(states[0]), window)] +
                            [(copy.deepcopy(states[s]), toks[s]) for s in range(1, 13)], "verify", logits="all")
    assert torch.equal(v_mixed[:4], v_alone)


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
