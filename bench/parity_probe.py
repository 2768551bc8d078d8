"""Where the fast path's GPU parity error comes from (issue 14): one device call, printed as JSON lines.

1. every EXL3 linear of the tiny model (TP=1 and the TP=2 slices): the fused kernel (each backend) and the prefill
   path against `weights.exl3.reference_matmul` (the kernels' own order and precision, in fp64 here), m = 1 and 16;
2. the routed experts: the kernels' MoE against the reference loop over the same experts;
3. block by block: the fast path's residual streams, router logits and index scores against the reference's on the
   same prompt (fp32, fake quantisers off), per backend;
4. the reference on the device against the reference on the CPU (the oracle itself).

    python3 bench/parity_probe.py [--model DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests")]

PROMPT = [0] + [(i * 37) % 500 + 5 for i in range(19)]
RECORDS: list[dict] = []


def emit(**rec) -> None:
    RECORDS.append(rec)
    print(json.dumps(rec), flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def reference_of(weight, x: torch.Tensor) -> torch.Tensor:
    from dsv41.weights.exl3 import reference_matmul

    trellis = weight.words.cpu().view(torch.int16)
    return reference_matmul(x.cpu().double().float(), trellis, weight.suh.cpu(), weight.svh.cpu(), weight.codebook)


def fast_linears(model):
    """(name, Exl3Linear) of every EXL3 linear the fast model holds."""
    from dsv41.runtime.layers.linear import Exl3Linear

    seen, out, stack = set(), [], [model.blocks, model.head, model.engram]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (torch.Tensor, str, int, float, type(None))):
            continue
        seen.add(id(obj))
        if isinstance(obj, Exl3Linear):
            out.append((obj.name, obj))
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("dsv41"):
            stack.extend(v for k, v in vars(obj).items() if k not in ("cfg", "workspace", "ref", "rope", "comm"))
    return sorted(out, key=lambda t: t[0])


def check_linears(model, tag: str) -> None:
    from dsv41.kernels.exl3.matmul import default_config
    from dsv41.runtime.layers.linear import Exl3Launch

    torch.manual_seed(1)
    worst = {}
    for name, lin in fast_linears(model):
        w = lin.weight
        for m in (1, 16):
            x = torch.randn(m, w.k, device=w.device)
            ref = reference_of(w, x)
            runs = {"fused_" + lin.launch.backend: lin.launch}
            if lin.launch.backend == "cuda":
                runs["fused_triton"] = Exl3Launch("triton", config=default_config(w))
            errs = {}
            for key, launch in runs.items():
                out = torch.empty(m, w.n, device=w.device)
                launch.run(x, w, out)
                errs[key] = rel(out, ref)
            if not lin.fused_only:
                errs["prefill"] = rel(lin.workspace.matmul(x, w), ref)
            for key, e in errs.items():
                if e > worst.get(key, (0, ""))[0]:
                    worst[key] = (e, f"{name} k={w.k} n={w.n} K={w.K} m={m}")
            if max(errs.values()) > 1e-3:
                emit(part="linear", tag=tag, name=name, k=w.k, n=w.n, K=w.K, m=m, errors=errs)
    emit(part="linear_worst", tag=tag, worst=worst, count=len(fast_linears(model)))


def check_moe(model, tag: str) -> None:
    from dsv41.kernels.exl3.layout import Exl3Tensor
    from dsv41.runtime.layers.moe import StackedExperts

    torch.manual_seed(2)
    for block in model.blocks:
        s = block.moe.experts
        if not isinstance(s, StackedExperts):
            continue
        m, d = 16, s.w1.k
        x = torch.randn(m, d, device=s.w1.device)
        ids, weights, _, _ = block.moe.route(x)
        got = s.launch.run(x, ids, weights, s.w1, s.w3, s.w2, block.moe.limit)
        ref = torch.zeros(m, d)
        for r in range(m):
            for slot in range(ids.shape[1]):
                e = int(ids[r, slot])
                def mat(st, e=e):
                    return Exl3Tensor(st.words[e], st.suh[e], st.svh[e], st.codebook, st.K, st.k, st.n)

                g = reference_of(mat(s.w1), x[r:r + 1]).clamp(max=block.moe.limit)
                u = reference_of(mat(s.w3), x[r:r + 1]).clamp(-block.moe.limit, block.moe.limit)
                h = torch.nn.functional.silu(g) * u * float(weights[r, slot])
                ref[r] += reference_of(mat(s.w2), h)[0]
        emit(part="moe", tag=tag, layer=block.index, error=rel(got, ref))


def block_drift(model_dir: Path, device: str, backend: str) -> None:
    """Per layer: the fast path's streams / router logits / index scores against the reference's."""
    os.environ["DSV41_EXL3_BACKEND"] = backend
    from dsv41.model.loader import load_model
    from dsv41.runtime.build import build_fast_model

    ref = load_model(model_dir, torch.float32, device, fake_quant=False, dspark=False)
    fast = build_fast_model(model_dir, device, torch.float32, fake_quant=False)
    try:
        rs, fs = ref.new_state(), fast.new_state()
        ids = PROMPT
        for step in range(3):
            rtr, ftr = {}, {}
            r_logits = ref.forward(rs, torch.tensor(ids), trace=rtr)
            f_logits = fast.forward([(fs, ids)], "prefill" if step == 0 else "decode", logits="all", trace=ftr)
            layers = []
            for L in sorted(k for k in rtr if isinstance(k, int)):
                f = ftr[L][0]
                row = {"L": L, "streams": rel(f["streams_out"], rtr[L]["streams_out"]),
                       "router_logits": rel(f["router_logits"], rtr[L]["router_logits"]),
                       "router_flips": int((f["router_ids"].sort(-1).values.cpu()
                                            != rtr[L]["router_ids"].sort(-1).values.cpu()).any(-1).sum())}
                if "index_ids" in f and f["index_scores"][0] is not None:
                    row["index_id_flips"] = int((f["index_ids"][0].sort(-1).values.cpu()
                                                 != rtr[L]["index_topk_ids"].sort(-1).values.cpu()).any(-1).sum())
                layers.append(row)
            emit(part="block_drift", backend=backend, device=device, step=step, logits=rel(f_logits, r_logits),
                 layers=layers)
            ids = [int(r_logits[-1].argmax())]
    finally:
        os.environ.pop("DSV41_EXL3_BACKEND", None)


def two_prompt_drift(model_dir: Path, device: str, backend: str, together: bool) -> None:
    """The parity test's two prompts: per sequence and layer, the fast path's streams, router and index scores
    against the reference's; the prompts prefilled in one fast forward (`together`) or each alone."""
    os.environ["DSV41_EXL3_BACKEND"] = backend
    from test_runtime_fast import PROMPTS, _CaptureSelect

    from dsv41.model.loader import load_model
    from dsv41.runtime.build import build_fast_model

    ref = load_model(model_dir, torch.float32, device, fake_quant=False, dspark=False)
    fast = build_fast_model(model_dir, device, torch.float32, fake_quant=False)
    try:
        rstates, fstates = [ref.new_state() for _ in PROMPTS], [fast.new_state() for _ in PROMPTS]
        rtrs, caps = [], []
        for st, ids in zip(rstates, PROMPTS):
            tr = {}
            with _CaptureSelect() as cap:
                ref.forward(st, torch.tensor(ids), trace=tr)
            rtrs.append(tr)
            caps.append(cap.scores)
        groups = [list(range(len(PROMPTS)))] if together else [[i] for i in range(len(PROMPTS))]
        ftrs = {}
        for g in groups:
            tr = {}
            fast.forward([(fstates[i], PROMPTS[i]) for i in g], "prefill", logits="all", trace=tr)
            for j, i in enumerate(g):
                ftrs[i] = (tr, j, sum(len(PROMPTS[q]) for q in g[:j]))
        for i in range(len(PROMPTS)):
            tr, j, at = ftrs[i]
            T, rtr = len(PROMPTS[i]), rtrs[i]
            scoring = [L for L in sorted(k for k in rtr if isinstance(k, int))
                       if "index_topk_ids" in rtr[L] and rtr[L]["index_topk_ids"].shape[1]]
            layers = []
            for L in sorted(k for k in rtr if isinstance(k, int)):
                f = tr[L][0]
                row = {"L": L, "streams": rel(f["streams_out"][at:at + T], rtr[L]["streams_out"]),
                       "router_logits": rel(f["router_logits"][at:at + T], rtr[L]["router_logits"])}
                if L in scoring:
                    fs, rs = f["index_scores"][j].double().cpu(), caps[i][scoring.index(L)].double().cpu()
                    fin = torch.isfinite(rs)
                    row["index_finite_mismatch"] = int((torch.isfinite(fs) != fin).sum())
                    row["index_score_drift"] = float((fs - rs)[fin].abs().max() / rs[fin].abs().max())
                    fi, ri = f["index_ids"][j].sort(-1).values.cpu(), rtr[L]["index_topk_ids"].sort(-1).values.cpu()
                    row["index_id_flip_rows"] = (fi != ri).any(-1).nonzero().flatten().tolist()
                layers.append(row)
            emit(part="two_prompts", backend=backend, device=device, together=together, seq=i, layers=layers)
    finally:
        os.environ.pop("DSV41_EXL3_BACKEND", None)


def oracle_on_device(model_dir: Path, device: str) -> None:
    from dsv41.model.loader import load_model

    outs = []
    for dev in ("cpu", device):
        m = load_model(model_dir, torch.float32, dev, fake_quant=False, dspark=False)
        outs.append(m.forward(m.new_state(), torch.tensor(PROMPT)).cpu())
    emit(part="oracle", device=device, cpu_vs_device=rel(outs[1], outs[0]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.model is None:
        from dsv41.tiny.model import default_model_dir

        args.model = default_model_dir()
    from dsv41.runtime.build import build_fast_model

    parts = os.environ.get("PROBE_PARTS", "oracle,linear,moe,drift").split(",")
    if "oracle" in parts:
        oracle_on_device(args.model, args.device)
    if "linear" in parts or "moe" in parts:
        fast = build_fast_model(args.model, args.device, torch.float32, fake_quant=False)
        if "linear" in parts:
            check_linears(fast, "tp1")
        if "moe" in parts:
            check_moe(fast, "tp1")
        del fast
        if "linear" in parts:
            from dsv41.parallel.comm import LocalComm

            for rank in (0, 1):
                comm = LocalComm()
                comm.rank, comm.world = rank, 2  # the build only reads the rank; nothing is reduced here
                fast = build_fast_model(args.model, args.device, torch.float32, rank=rank, world=2, comm=comm,
                                        fake_quant=False)
                check_linears(fast, f"tp2-rank{rank}")
                del fast
    if "drift" in parts:
        backends = ["cuda", "triton"] if args.device.startswith("cuda") else ["triton"]
        for backend in backends:
            block_drift(args.model, args.device, backend)
    if "two" in parts:
        for backend in (["cuda", "triton"] if args.device.startswith("cuda") else ["triton"]):
            for together in (True, False):
                two_prompt_drift(args.model, args.device, backend, together)
    if args.out:
        args.out.write_text(json.dumps(RECORDS, indent=1))


if __name__ == "__main__":
    main()
