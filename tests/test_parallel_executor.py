"""The batched engine at TP=2 over gloo: rank 0's LeaderExecutor sends every step's Batch, rank 1 follows, both
run the same ModelRunner.execute on their shards. Concurrent requests (different lengths, temperatures, seeds,
budgets, start steps, logprobs) reply bit for bit as each does alone in the same group; the follower ran every
step and leaves on the stop batch. (The codec itself: tests/test_parallel_plan.py.)"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
from pathlib import Path

import torch


def requests():
    from dsv41.engine import GenerationRequest, SamplingParams

    def prompt(k, n):
        return [0] + [(i * 53 + 7 * k) % 500 + 7 for i in range(n - 1)]

    return [GenerationRequest(prompt(0, 9), 7, SamplingParams(temperature=0.0), logprobs=1),
            GenerationRequest(prompt(1, 26), 5, SamplingParams(temperature=0.7, seed=3)),
            GenerationRequest(prompt(2, 14), 8, SamplingParams(temperature=0.7, seed=9, top_p=0.8), logprobs=0),
            GenerationRequest(prompt(3, 4), 6, SamplingParams(temperature=0.0), prompt_logprobs=2)]


def run_engine(engine, reqs, arrivals):
    from dsv41.engine import FinishEvent

    core = engine.core
    events = [[] for _ in reqs]
    seqs = [engine.make_sequence(r, events[i].append) for i, r in enumerate(reqs)]
    step = 0
    while True:
        for i, at in enumerate(arrivals):
            if at == step:
                core.add(seqs[i])
        if not core.step() and step > max(arrivals):
            break
        step += 1
    assert core.pool_idle()
    # the reply's bits; how much of the prompt a session entry gave is kept apart (it differs by design)
    return [[repr(dataclasses.replace(e, cached_tokens=0) if isinstance(e, FinishEvent) else e) for e in evs]
            + [f"cached={evs[-1].cached_tokens}"] for evs in events]


def worker(rank: int, master: str, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    from dsv41.compose.build import build_engine, build_runner, engine_defaults
    from dsv41.model.loader import load_model
    from dsv41.parallel.executor import LeaderExecutor, follow_batches
    from dsv41.parallel.failfast import FailFast
    from dsv41.parallel.plan import PlanChannel
    from dsv41.parallel.rendezvous import init_tp

    group = init_tp(rank, 2, master, deadline_s=120, backend="gloo")
    failfast = FailFast(group, peer_timeout_s=30.0).start()
    channel = PlanChannel(group.store, rank, failfast.aborted)
    model = load_model(model_dir, torch.float32, "cpu", rank=rank, world=2, comm=group.comm, dspark=False)
    # the 26-token prompt is prefilled in three chunks; entries leaving RAM are parked per rank under sessions/
    args = engine_defaults(prefill_chunk=11, prefill_chunk_alone=0, session_dir=str(Path(out).parent / "sessions"),
                           session_disk_min_tokens=16)
    runner = build_runner(args, model, 256, driver=rank == 0, log=lambda line: None)
    if rank == 1:
        rounds = follow_batches(runner, channel, failfast)
        group.store.set("test/stopped1", str(runner.abort_watch.stopped_at))
        group.store.set("test/bye", str(rounds))
    else:
        leader = LeaderExecutor(runner, channel, failfast)
        engine = build_engine(args, leader, max_model_len=256, log=lambda line: None)
        reqs = requests()
        together = run_engine(engine, reqs, arrivals=[0, 0, 2, 5])
        alone = [run_engine(engine, [r], arrivals=[0])[0] for r in reqs]
        # every RAM entry parked (each rank writes its shards), then the 26-token prompt again: loaded on both
        core = engine.core
        core.sessions.config.disk_gain = 1
        core.sessions.park_all()
        while core.has_work():
            core.step()
        parked = run_engine(engine, [reqs[1]], arrivals=[0])[0]
        disk_hits = core.stats()["sessions"]["disk_hits"]
        # a client that leaves during its prompt's second chunk: both ranks stop between the same layers
        # (runtime/abort.py: rank 0's answer, issued before layer 1, read before layer 2) and stay in step
        from dsv41.engine import GenerationRequest, SamplingParams

        left = []
        leaving = engine.make_sequence(GenerationRequest([0] + [(i * 29) % 400 + 9 for i in range(30)], 4,
                                                         SamplingParams(temperature=0.0)), left.append)
        core.add(leaving)
        core.step()  # the first 11 rows, whole
        leaving.cancel_requested = True  # what the server's event loop sets when the client goes
        core.step()
        cut = {"stopped0": runner.abort_watch.stopped_at, "aborted": core.aborted_steps,
               "reason": left[-1].reason, "idle": core.pool_idle()}
        cut["after"] = run_engine(engine, [reqs[0]], arrivals=[0])[0]
        rounds = leader.rounds
        leader.close()
        followed = int(group.store.get("test/bye"))
        cut["stopped1"] = int(group.store.get("test/stopped1"))
        Path(out).write_text(json.dumps({"together": together, "alone": alone, "rounds": rounds,
                                         "followed": followed, "parked": parked, "disk_hits": disk_hits,
                                         "cut": cut}))
    failfast.stop()
    group.close()


def test_tp2_batched_equals_alone_bitwise(tmp_path, tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master = f"127.0.0.1:{s.getsockname()[1]}"
    out = tmp_path / "rank0.json"
    procs = [subprocess.Popen([sys.executable, __file__, str(r), master, str(tiny_model_dir), str(out)])
             for r in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    got = json.loads(out.read_text())
    assert [evs[:-1] for evs in got["together"]] == [evs[:-1] for evs in got["alone"]]
    # sent again, the 26-token prompt resumes from the entry its first run left on both ranks just before its last
    # token (the others are under --session-min-tokens 16, and the fourth asks prompt logprobs: they prefill afresh)
    assert [evs[-1] for evs in got["together"]] == ["cached=0"] * 4
    assert [evs[-1] for evs in got["alone"]] == ["cached=0", "cached=25", "cached=0", "cached=0"]
    assert all("TokenEvent" in evs[0] or "PromptLogprobsEvent" in evs[0] for evs in got["together"])
    assert got["parked"] == got["alone"][1] and got["disk_hits"] == 1  # from the files of both ranks
    files = [len(list((tmp_path / "sessions" / f"rank{r}").glob("*.ses"))) for r in range(2)]
    assert files[0] == files[1] >= 1, files  # each rank parked its own shards of every entry
    assert got["followed"] == got["rounds"]  # rank 1 ran every step and left on the stop batch
    cut = got["cut"]
    assert (cut["stopped0"], cut["stopped1"], cut["aborted"]) == (2, 2, 1)
    assert cut["reason"] == "cancelled" and cut["idle"]
    assert cut["after"][:-1] == got["alone"][0][:-1]  # the group goes on in step, with the same bits
    assert "logprob=-" in got["together"][0][0] and "PromptLogprobsEvent" in got["together"][3][0]


if __name__ == "__main__":
    worker(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
