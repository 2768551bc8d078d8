"""DSpark drafting on the fast path at TP = 2 over gloo (CPU, Triton's interpreter, the slimmed tiny model of
tests/test_runtime_fast_dspark.py): rank 0's LeaderExecutor sends every step's Batch, rank 1 follows; both run the
verify rows and the draft pass over the pool in place on their shards (its TP > 1 form: the pass, the vocabulary
gather, the chain on the device), so the pass's collectives stay in step. A seeded T > 0 request (top-p)
replies bit for bit as with drafting off in the same group."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from test_runtime_fast_dspark import FLAT, SLIM

MAX_TOKENS = 3  # ~47 s on the 2-core box (5 tokens: ~90 s)


def requests(draft: bool):
    from dsv41.engine import GenerationRequest, SamplingParams

    return [GenerationRequest([0] + [(i * 91) % 500 + 7 for i in range(8)], MAX_TOKENS,
                              SamplingParams(temperature=0.7, seed=3, top_p=0.9), logprobs=2, draft=5 if draft else 0)]


def worker(rank: int, master: str, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    from dsv41.compose.build import build_engine, build_runner, engine_defaults
    from dsv41.parallel.executor import LeaderExecutor, follow_batches
    from dsv41.parallel.failfast import FailFast
    from dsv41.parallel.plan import PlanChannel
    from dsv41.parallel.rendezvous import init_tp
    from dsv41.runtime.build import build_fast_model

    group = init_tp(rank, 2, master, deadline_s=120, backend="gloo")
    failfast = FailFast(group, peer_timeout_s=60.0).start()
    channel = PlanChannel(group.store, rank, failfast.aborted)
    model = build_fast_model(model_dir, "cpu", torch.float32, rank=rank, world=2, comm=group.comm, dspark=True)
    args = engine_defaults(forward="fast", draft_dspark="on", draft_cost=FLAT, sessions="off")
    runner = build_runner(args, model, 64, driver=rank == 0, log=lambda line: None)
    if rank == 1:
        follow_batches(runner, channel, failfast)
    else:
        leader = LeaderExecutor(runner, channel, failfast)
        engine = build_engine(args, leader, max_model_len=64, log=lambda line: None)
        core, result = engine.core, {}
        for draft in (False, True):
            reqs = requests(draft)
            events = [[] for _ in reqs]
            for i, r in enumerate(reqs):
                core.add(engine.make_sequence(r, events[i].append))
            while core.has_work():
                core.step()
            result[str(draft)] = [[repr(e) for e in evs] for evs in events]
        result["drafting"] = core.stats()["drafting"]
        leader.close()
        Path(out).write_text(json.dumps(result))
    failfast.stop()
    group.close()


def test_tp2_fast_drafted_equals_serial_bitwise(tmp_path):
    from dsv41.tiny.model import make_tiny

    model = make_tiny(tmp_path / "model", "exl3", seed=0, overrides=SLIM)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master = f"127.0.0.1:{s.getsockname()[1]}"
    out = tmp_path / "rank0.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, str(r), master, str(model), str(out)], env=env)
             for r in range(2)]
    assert [p.wait(timeout=600) for p in procs] == [0, 0]
    got = json.loads(out.read_text())
    print(f"drafting: {got['drafting']['dspark']}")
    assert got["True"] == got["False"] and "logprob=-" in got["False"][0][0]
    assert got["drafting"]["dspark"]["num_draft_tokens"] > 0  # the verify rows and the pass ran on both ranks


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    worker(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
