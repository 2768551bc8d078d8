"""A DSpark drafting round on the full-shape synthetic rank (issue 32): the draft pass, the verify window, the round.

Rank 0 of TP=2 at DeepSeek-V4.1-Flash's shapes with its drafter (`synthetic_rank(drafter=True)`: the three draft
blocks, main_proj, random heads), the reductions and the head's gather through bench/decode_step.py's `StubComm`
(so the pass takes the TP > 1 form: the pass's graph, the vocabulary gather, the chain's graph). Sequences sit at
`--context` positions in a KV pool (window rows, entries, open groups: `synthetic_pool_sequence`; the DSpark stage
rings filled with random FP8 rows), as served. Wall clock, median of `--reps`, each after a synchronisation:

- `draft_pass`: `FastDSpark.propose_pool` for 1/2/4 sequences (`--seqs`) at depth 1..5 (`--depths`: how many of
  the block's drafts are read back; the pass always runs the whole block), greedy and sampled chains (T = 0.7,
  top-p 0.9), with the pass's CUDA graphs and eagerly (`graphs`: on / off);
- `verify`: the in-place verify step of one sequence's window of 2..6 rows (`--verify-rows`: [y, d1..dk]), forward +
  greedy pick + the ids read back, as bench/decode_step.py times a step;
- `rounds`: per sequences count and depth k, the verify step of every sequence's k + 1 rows then the draft pass
  after it (graphs on): what one drafting round costs the engine (`round_ms`; the parts timed alone beside it).

`--layers N` builds the first N backbone layers (an H100 holds ~26 of 40; the JSON says so: `layers`, and the
draft pass does not depend on it, the verify step does). Writes `--out` (JSON, with `BENCH_COMMIT` or git's commit
and the GPU's name). `--config DIR --device cpu` is a smoke run on a small config (Triton's interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if "cpu" in sys.argv:  # the kernels on the CPU run in Triton's interpreter: set before Triton decorates them
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from decode_step import StubComm  # noqa: E402
from step_profile import sync  # noqa: E402

from dsv41.engine.batch import Row  # noqa: E402
from dsv41.engine.params import SamplingParams  # noqa: E402
from dsv41.kernels.step.argmax import greedy_ids  # noqa: E402
from dsv41.model.quant import fp8_block_ue8m0  # noqa: E402
from dsv41.runtime.graphs import PieceGraphs  # noqa: E402
from dsv41.runtime.synthetic import synthetic_pool_sequence, synthetic_rank  # noqa: E402

CHAINS = {"greedy": SamplingParams(temperature=0.0), "sampled": SamplingParams(temperature=0.7, top_p=0.9, seed=1)}


def log(*a):
    print(*a, flush=True)


def timed(fn, reps: int, device, warmup: int) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times


class Bench:
    def __init__(self, model, pool, args, device):
        self.model, self.pool, self.args, self.device = model, pool, args, device
        self.g = torch.Generator().manual_seed(0)
        per = pool.num_pages // pool.num_slots
        self.seqs = [synthetic_pool_sequence(model, pool, i, list(range(i * per, (i + 1) * per)), args.context,
                                             seed=100 + i) for i in range(pool.num_slots)]
        cfg, W = model.cfg, model.cfg.sliding_window
        for i, view in enumerate(self.seqs):  # the stage rings: FP8 rows of the window before the sequence's end
            for s in range(len(model.dspark.blocks)):
                rows = fp8_block_ue8m0(torch.randn(min(W, view.pos), cfg.head_dim, generator=self.g))
                pool.write_ring("dspark", s, i, view.pos - rows.shape[0], rows.to(model.dtype).to(device))

    def token(self) -> int:
        return int(torch.randint(0, self.model.cfg.vocab_size, (1,), generator=self.g))

    def asks(self, q: int, depth: int, chain: str):
        """The draft asks of sequences 0..q-1 at their current ends (what the runner's `_propose` makes)."""
        return [(Row(i, i, [], 0, list(v.row.page_ids)), v.pos - 1, self.token(), CHAINS[chain], v.pos + 1, depth)
                for i, v in enumerate(self.seqs[:q])]

    def draft(self, q: int, depth: int, chain: str):
        out = self.model.dspark.propose_pool(self.model, self.pool, self.asks(q, depth, chain))
        assert [len(t) for t, _ in out] == [depth] * q
        return out

    def verify(self, q: int, rows: int):
        """One in-place verify step of q sequences' windows of `rows` rows (each sequence moves on by `rows`:
        the pool's rows past it are written, as a round writes them)."""
        batch = [(v, torch.randint(0, self.model.cfg.vocab_size, (rows,), generator=self.g)) for v in self.seqs[:q]]
        logits = self.model.forward(batch, "verify", pool=self.pool)
        return greedy_ids(logits).tolist()


def measure(bench: Bench, args, graphs: dict) -> dict:
    """`graphs`: mode ("on", "off") -> the model's PieceGraphs to time the pass under; the verify steps and the
    rounds run under the first."""
    model, dev = bench.model, bench.device
    timed_ = lambda fn: timed(fn, args.reps, dev, args.warmup)  # noqa: E731
    out = {"draft_pass": [], "verify": [], "rounds": []}
    for mode, g in graphs.items():
        model.graphs = g
        for chain in args.chains:
            for q in args.seqs:
                for depth in args.depths:
                    ms, times = timed_(lambda: bench.draft(q, depth, chain))
                    out["draft_pass"].append({"seqs": q, "depth": depth, "chain": chain, "graphs": mode, "ms": ms,
                                              "times_ms": times})
                    log(f"draft pass seqs={q} depth={depth} {chain} graphs {mode}: {ms:.2f} ms")
    model.graphs = next(iter(graphs.values()))
    for rows in args.verify_rows:
        ms, times = timed_(lambda: bench.verify(1, rows))
        out["verify"].append({"rows": rows, "ms": ms, "times_ms": times})
        log(f"verify window rows={rows}: {ms:.2f} ms")
    for q in args.seqs:
        for depth in args.depths:
            def round_():
                bench.verify(q, depth + 1)
                bench.draft(q, depth, "greedy")

            ms, times = timed_(round_)
            v_ms, _ = timed_(lambda: bench.verify(q, depth + 1))
            out["rounds"].append({"seqs": q, "depth": depth, "verify_rows": q * (depth + 1), "round_ms": ms,
                                  "verify_ms": v_ms, "times_ms": times})
            log(f"round seqs={q} depth={depth}: {ms:.2f} ms (verify of {q} x {depth + 1} rows alone {v_ms:.2f} ms)")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda v: [int(x) for x in v.split(",") if x]  # noqa: E731
    p.add_argument("--out", type=Path, default=HERE / "results" / "draft_pass.json")
    p.add_argument("--seqs", type=ints, default=[1, 2, 4], help="drafting sequences a pass")
    p.add_argument("--depths", type=ints, default=[1, 2, 3, 4, 5], help="drafts read back a pass")
    p.add_argument("--verify-rows", type=ints, default=[2, 3, 4, 5, 6], help="rows of one verify window")
    p.add_argument("--chains", type=lambda v: v.split(","), default=["greedy", "sampled"])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before each timing (graphs captured then)")
    p.add_argument("--layers", type=int, default=None, help="backbone layers built (default: all 40)")
    p.add_argument("--config", default=None, help="a model folder whose config.json replaces the real shapes (smoke)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-graphs", action="store_true", help="time the eager pass only")
    args = p.parse_args(argv)
    if not set(args.chains) <= set(CHAINS):
        p.error(f"--chains: of {sorted(CHAINS)}")
    if any(not 1 <= d <= 5 for d in args.depths) or any(not 1 <= q <= 6 for q in args.seqs) or any(
            not 1 <= r <= 6 for r in args.verify_rows) or args.reps < 1 or args.warmup < 0:
        p.error("--depths in 1..5, --seqs and --verify-rows in 1..6, --reps >= 1, --warmup >= 0")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    commit = os.environ.get("BENCH_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                                                              capture_output=True, text=True).stdout.strip()
    from dsv41.config import ModelConfig
    from dsv41.runtime.fast_forward import pool_layout
    from dsv41.runtime.kv_pool import pool_for_model

    cfg = ModelConfig.from_file(args.config) if args.config else None
    t0 = time.perf_counter()
    model = synthetic_rank(cfg, rank=0, world=2, device=device, dtype=torch.bfloat16 if cuda else torch.float32,
                           comm=StubComm(), layers=args.layers, drafter=True)
    cfg = model.cfg
    sync(device)
    results = {"commit": commit or "unknown", "gpu": torch.cuda.get_device_name() if cuda else "cpu",
               "layers": len(model.blocks), "layers_real": cfg.num_hidden_layers, "context": args.context,
               "reps": args.reps, "build_s": time.perf_counter() - t0, "args": vars(args) | {"out": str(args.out)}}
    if len(model.blocks) < cfg.num_hidden_layers:
        results["note"] = (f"{len(model.blocks)} of {cfg.num_hidden_layers} backbone layers: the verify and round "
                           f"times count scaled to all of them; the draft pass's do not depend on them")
    slots = max(args.seqs)
    # how far sequence 0 moves: every timed or warm-up verify step (alone and in each round) writes its rows
    moved = (args.reps + args.warmup) * (sum(args.verify_rows) + 2 * len(args.seqs) * sum(d + 1 for d in args.depths))
    per = -(-(args.context + moved + 64) // 256)
    pool = pool_for_model(pool_layout(model), num_slots=slots, num_pages=slots * per, page_tokens=256,
                          verify_rows=cfg.dspark_block_size + 1, device=device)
    results["pool"] = pool.describe()
    on = PieceGraphs(device, model.comm, enabled=not args.no_graphs)
    graphs = {"on": on} if on.active else {}  # (not on the CPU: there the pass is eager only)
    graphs["off"] = PieceGraphs(device, model.comm, enabled=False)
    results["graphs"] = "on" if on.active else "off"
    log(f"built {len(model.blocks)} layers in {results['build_s']:.1f} s; graphs {results['graphs']}")
    results.update(measure(Bench(model, pool, args, device), args, graphs))
    results["graph_stats"] = {mode: g.stats.as_dict() for mode, g in graphs.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
