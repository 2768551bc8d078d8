"""Drafting at TP = 2 over gloo (tiny model, CPU): rank 0's LeaderExecutor sends every step's Batch (verify rows,
their drafts' samplings, DSpark proposals asked), rank 1 follows, both run the verify rows and the DSpark pass on
their shards (the follower chooses the same tokens from the same gathered logits, so the draft pass's
collectives stay in step). Requests drafting (DSpark + lookup, different caps) reply bit for bit as with drafting
off in the same group."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import torch


def requests(draft):
    from dsv41.engine import GenerationRequest, SamplingParams

    def prompt(k, n):
        return [0] + [(i * 53 + 7 * k) % 500 + 7 for i in range(n - 1)]

    return [GenerationRequest(prompt(0, 9), 9, SamplingParams(temperature=0.0), logprobs=1, draft=draft and 5),
            GenerationRequest(prompt(1, 20), 8, SamplingParams(temperature=0.7, seed=3), logprobs=2,
                              draft=draft and 2),
            GenerationRequest([0] + [7, 11, 15] * 6, 10, SamplingParams(temperature=0.0, allowed_token_ids=(7, 11, 15)),
                              draft=draft and 4)]


def worker(rank: int, master: str, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    from dataclasses import replace

    from dsv41.engine import FinishEvent
    from dsv41.compose.build import build_engine, build_runner, engine_defaults
    from dsv41.model.loader import load_model
    from dsv41.parallel.executor import LeaderExecutor, follow_batches
    from dsv41.parallel.failfast import FailFast
    from dsv41.parallel.plan import PlanChannel
    from dsv41.parallel.rendezvous import init_tp

    group = init_tp(rank, 2, master, deadline_s=120, backend="gloo")
    failfast = FailFast(group, peer_timeout_s=30.0).start()
    channel = PlanChannel(group.store, rank, failfast.aborted)
    model = load_model(model_dir, torch.float32, "cpu", rank=rank, world=2, comm=group.comm)
    args = engine_defaults(draft_dspark="on", draft_lookup="on", draft_cost="1:0.01")
    runner = build_runner(args, model, 256, driver=rank == 0, log=lambda line: None)
    if rank == 1:
        follow_batches(runner, channel, failfast)
    else:
        leader = LeaderExecutor(runner, channel, failfast)
        engine = build_engine(args, leader, max_model_len=256, log=lambda line: None)
        core, result = engine.core, {}
        for draft in (0, 1):
            reqs = requests(draft)
            events = [[] for _ in reqs]
            for i, r in enumerate(reqs):
                core.add(engine.make_sequence(r, events[i].append))
            while core.has_work():
                core.step()
            # tokens_per_round and cached_tokens are no part of the reply (FinishEvent's equality leaves them out;
            # its repr does not): the drafted run resumes from the session entries the serial run left
            result[draft] = [[repr(replace(e, tokens_per_round=None, cached_tokens=0)
                                   if isinstance(e, FinishEvent) else e) for e in evs] for evs in events]
        result["drafting"] = core.stats()["drafting"]
        leader.close()
        Path(out).write_text(json.dumps(result))
    failfast.stop()
    group.close()


def test_tp2_drafted_equals_serial_bitwise(tmp_path, tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master = f"127.0.0.1:{s.getsockname()[1]}"
    out = tmp_path / "rank0.json"
    procs = [subprocess.Popen([sys.executable, __file__, str(r), master, str(tiny_model_dir), str(out)])
             for r in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    got = json.loads(out.read_text())
    assert got["1"] == got["0"] and "logprob=-" in got["0"][0][0]
    d = got["drafting"]
    assert d["dspark"]["num_draft_tokens"] > 0  # the verify rows and the draft pass ran on both ranks


if __name__ == "__main__":
    worker(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
