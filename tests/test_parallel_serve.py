"""`run_rank` end to end: real rank processes, the real engine (the batched engine) on rank 0, the tiny model.

The worker below is what `dsv41 serve --tp N` does minus HTTP: `run_rank` with a `load` that builds each rank's
ModelRunner and a `serve` callback that submits greedy requests to the engine over the TP leader executor and
records the tokens (or the engine error, with its time). Checked here: TP=2 greedy generation equals TP=1 (spawned ranks and explicit --rank/--master ranks), and
fail-fast (an exception injected on rank 1 at round 3, or rank 1 killed with SIGKILL) ends both ranks with status
70 in time while rank 0's in-flight request receives an error.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import free_port

PROMPTS = [[0] + [(i * 53) % 500 + 7 for i in range(20)], [0, 100, 200, 300, 400]]
MAX_TOKENS = 12


# ---- the worker ------------------------------------------------------------------------------------------------

def worker(argv: list[str]) -> int:
    torch.set_num_threads(1)
    from dsv41.parallel.args import register_tp_args
    from dsv41.parallel.launch import run_rank

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--idle-s", type=float, default=0.0, help="serve nothing for this long (an idle server)")
    register_tp_args(parser)
    args = parser.parse_args(argv)

    def load(rank, world, comm):
        from dsv41.compose.build import build_runner, engine_defaults
        from dsv41.model.loader import load_model

        # no fake quantisation: TP's summation order must not flip an FP4/FP8 code (docs/MODEL_NOTES.md)
        model = load_model(args.model, torch.float32, "cpu", rank=rank, world=world, comm=comm, fake_quant=False)
        # sessions off: the round counts below are a plain prefill's (a session mark adds a step per prompt)
        return build_runner(engine_defaults(sessions="off"), model, 4096, driver=rank == 0, log=lambda line: None)

    def serve(model):
        if args.idle_s:
            Path(args.out).with_name("progress").write_text("idle")
            time.sleep(args.idle_s)
            return
        asyncio.run(generate(model, args))

    marker = Path(args.out).with_name("follower-ready")
    return run_rank(args, load=load, serve=serve, argv=argv, child_cmd=[sys.executable, __file__],
                    on_ready=lambda: marker.write_text("ready"),
                    watchdog=lambda: marker.write_text(marker.read_text() + "."))


async def generate(leader, args) -> None:
    from dsv41.engine import EngineFailure, GenerationRequest, SamplingParams, TokenEvent
    from dsv41.compose.build import build_engine, engine_defaults

    engine = build_engine(engine_defaults(sessions="off"), leader, max_model_len=4096)
    await engine.start()
    record = {"tokens": [], "memory": None}
    out = Path(args.out)
    for prompt in PROMPTS * args.repeat:
        stream = engine.submit(GenerationRequest(prompt_ids=prompt, max_tokens=args.max_tokens,
                                                 sampling=SamplingParams(temperature=0.0)))
        tokens = []
        try:
            async for event in stream:
                if isinstance(event, TokenEvent):
                    tokens.append(event.token_id)
                    if len(tokens) == 1:
                        out.with_name("progress").write_text("generating")
        except EngineFailure as exc:
            record["error"] = str(exc)
            record["error_time"] = time.time()
            out.write_text(json.dumps(record))
            return
        record["tokens"].append(tokens)
    record["rounds"] = leader.rounds
    record["live_states"] = engine.stats().live_sequences
    record["memory"] = {str(k): v for k, v in leader.memory_reports().items()}
    await engine.shutdown()
    out.write_text(json.dumps(record))


# ---- helpers for the tests -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir():
    from dsv41.tiny.model import default_model_dir

    return default_model_dir()


@functools.lru_cache(maxsize=None)  # the two TP=2 runs compare with the same TP=1 tokens: computed once
def tp1_greedy(model_dir) -> list[list[int]]:
    from dsv41.model.loader import load_model

    model = load_model(model_dir, torch.float32, "cpu", fake_quant=False)
    result = []
    for prompt in PROMPTS:
        state = model.new_state()
        row = model.forward(state, torch.tensor(prompt))[-1]
        tokens = []
        for _ in range(MAX_TOKENS):
            tokens.append(int(torch.argmax(row)))
            row = model.forward(state, torch.tensor(tokens[-1:]))[-1]
        result.append(tokens)
    return result


def start(args: list[str], env_extra: dict | None = None) -> subprocess.Popen:
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR", **(env_extra or {}))
    return subprocess.Popen([sys.executable, __file__, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> tuple[list[int | None], list[float | None]]:
    """Exit codes and wall-clock exit times (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    codes: list[int | None] = [None] * len(procs)
    times: list[float | None] = [None] * len(procs)
    while time.monotonic() < deadline and None in codes:
        for i, p in enumerate(procs):
            if codes[i] is None and p.poll() is not None:
                codes[i], times[i] = p.returncode, time.time()
        time.sleep(0.01)
    for i, p in enumerate(procs):
        if codes[i] is None:
            p.kill()
    return codes, times


def injected_at(stderr: str) -> float:
    for line in stderr.splitlines():
        if "injected failure" in line and "at unix time" in line:
            return float(line.rsplit("at unix time", 1)[1].split()[0])
    raise AssertionError(f"no injection record in rank 1's stderr:\n{stderr[-3000:]}")


# ---- tests -----------------------------------------------------------------------------------------------------

def test_spawned_tp2_generation_equals_tp1(tiny_dir, tmp_path):
    out = tmp_path / "out.json"
    proc = start(["--model", str(tiny_dir), "--out", str(out), "--tp", "2"])
    codes, _ = wait_all([proc], timeout=300)
    _, err = proc.communicate()
    assert codes == [0], err[-3000:]
    record = json.loads(out.read_text())
    assert record["tokens"] == tp1_greedy(tiny_dir)
    assert record["rounds"] == len(PROMPTS) * MAX_TOKENS  # one prefill + MAX_TOKENS-1 decode steps per prompt
    assert record["live_states"] == 0  # finished requests' states were released on every rank
    assert set(record["memory"]) == {"0", "1"} and all(m["free"] > 0 for m in record["memory"].values())


def test_explicit_ranks_generation_equals_tp1(tiny_dir, tmp_path):
    out = tmp_path / "out.json"
    master = f"127.0.0.1:{free_port()}"
    common = ["--model", str(tiny_dir), "--out", str(out), "--tp", "2", "--master", master]
    rank1 = start(common + ["--rank", "1"])
    rank0 = start(common + ["--rank", "0"])
    codes, _ = wait_all([rank0, rank1], timeout=300)
    assert codes == [0, 0], rank0.communicate()[1][-2000:] + rank1.communicate()[1][-2000:]
    assert json.loads(out.read_text())["tokens"] == tp1_greedy(tiny_dir)
    assert (tmp_path / "follower-ready").read_text().startswith("ready")  # rank 1 reported ready


@pytest.mark.parametrize("kind", ["raise", "oom"])
def test_exception_on_rank1_ends_both_ranks_with_70_within_2s(tiny_dir, tmp_path, kind):
    out = tmp_path / "out.json"
    master = f"127.0.0.1:{free_port()}"
    common = ["--model", str(tiny_dir), "--out", str(out), "--tp", "2", "--master", master, "--repeat", "3"]
    env = {"DSV41_TEST_FAIL_AT_ROUND": f"1:3:{kind}"}
    rank1 = start(common + ["--rank", "1"], env)
    rank0 = start(common + ["--rank", "0"], env)
    codes, times = wait_all([rank0, rank1], timeout=120)
    err0, err1 = rank0.communicate()[1], rank1.communicate()[1]
    assert codes == [70, 70], f"exit codes {codes}\n{err0[-2000:]}\n{err1[-2000:]}"
    t_fail = injected_at(err1)
    print(f"\n{kind}: exits {[round(t - t_fail, 2) for t in times]} s after the failure")
    assert max(times) - t_fail < 2.0, f"exits {[t - t_fail for t in times]} s after the failure"
    record = json.loads(out.read_text())
    assert "error" in record and "rank 1" in record["error"], record  # the in-flight request got the reason
    assert record["error_time"] - t_fail < 2.0
    assert "injected failure" in err0  # rank 0's log names the failing rank's reason


def start_pair(tiny_dir, tmp_path, extra: list[str]) -> tuple[subprocess.Popen, subprocess.Popen]:
    master = f"127.0.0.1:{free_port()}"
    common = ["--model", str(tiny_dir), "--out", str(tmp_path / "out.json"), "--tp", "2", "--master", master,
              "--tp-peer-timeout", "1.5", *extra]
    rank1 = start(common + ["--rank", "1"])
    rank0 = start(common + ["--rank", "0"])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and rank0.poll() is None and not _peek(tmp_path):
        time.sleep(0.1)
    time.sleep(0.5)
    assert rank0.poll() is None and rank1.poll() is None, "ranks ended before the kill"
    return rank0, rank1


def test_a_hung_rank_is_caught_by_the_collective_timeout(tiny_dir, tmp_path):
    """Rank 1 stops inside round 3 but its heartbeat goes on: rank 0's collective times out (3 s here),
    rank 0 aborts, rank 1 sees the abort key; both exit 70 and the request gets the error."""
    out = tmp_path / "out.json"
    master = f"127.0.0.1:{free_port()}"
    common = ["--model", str(tiny_dir), "--out", str(out), "--tp", "2", "--master", master, "--repeat", "3",
              "--tp-collective-timeout", "3"]
    env = {"DSV41_TEST_FAIL_AT_ROUND": "1:3:hang"}
    rank1 = start(common + ["--rank", "1"], env)
    rank0 = start(common + ["--rank", "0"], env)
    codes, times = wait_all([rank0, rank1], timeout=120)
    err0, err1 = rank0.communicate()[1], rank1.communicate()[1]
    assert codes == [70, 70], f"exit codes {codes}\n{err0[-2000:]}\n{err1[-2000:]}"
    t_hang = injected_at(err1)
    print(f"\nhang: exits {[round(t - t_hang, 2) for t in times]} s after rank 1 stopped")
    assert 3.0 <= min(times) - t_hang and max(times) - t_hang < 3.0 + 3.0
    assert "error" in json.loads(out.read_text())


def test_kill_9_of_rank1_mid_generation_fails_the_request_and_rank0_exits_70(tiny_dir, tmp_path):
    rank0, rank1 = start_pair(tiny_dir, tmp_path, ["--repeat", "200"])
    t_kill = time.time()
    rank1.send_signal(signal.SIGKILL)
    codes, times = wait_all([rank0], timeout=30)
    err0 = rank0.communicate()[1]
    assert codes == [70], f"rank 0 exit {codes}\n{err0[-3000:]}"
    # the collective notices the closed connection, or the heartbeat stops (1.5 s); then 1 s grace
    print(f"\nrank 1 killed mid-generation: rank 0 exited 70 after {times[0] - t_kill:.2f} s")
    assert times[0] - t_kill < 1.5 + 0.5 + 1.0 + 0.5, f"rank 0 exited {times[0] - t_kill:.2f} s after the kill"
    record = json.loads((tmp_path / "out.json").read_text())
    assert "error" in record and record["error_time"] - t_kill < 2.5, record


def test_kill_9_of_idle_rank1_is_noticed_by_heartbeat(tiny_dir, tmp_path):
    rank0, rank1 = start_pair(tiny_dir, tmp_path, ["--idle-s", "60"])
    time.sleep(2.0)
    assert (tmp_path / "follower-ready").read_text().startswith("ready.")  # an idle follower pings its watchdog
    t_kill = time.time()
    rank1.send_signal(signal.SIGKILL)
    codes, times = wait_all([rank0], timeout=30)
    err0 = rank0.communicate()[1]
    assert codes == [70], f"rank 0 exit {codes}\n{err0[-3000:]}"
    print(f"\nidle rank 1 killed: rank 0 exited 70 after {times[0] - t_kill:.2f} s")
    assert "lost rank 1: no heartbeat" in err0, err0[-2000:]
    waited = times[0] - t_kill  # peer timeout 1.5 s, then at most a heartbeat, a check period and the grace
    assert waited >= 1.5 and waited < 1.5 + 0.5 + 1.0 + 0.5, f"rank 0 exited {waited:.2f} s after"


def test_kill_9_of_rank0_ends_rank1_with_70(tiny_dir, tmp_path):
    rank0, rank1 = start_pair(tiny_dir, tmp_path, ["--idle-s", "60"])
    t_kill = time.time()
    rank0.send_signal(signal.SIGKILL)
    codes, times = wait_all([rank1], timeout=30)
    err1 = rank1.communicate()[1]
    assert codes == [70], f"rank 1 exit {codes}\n{err1[-3000:]}"
    assert "lost rank 0" in err1, err1[-2000:]
    assert times[0] - t_kill < 2.5, f"rank 1 exited {times[0] - t_kill:.2f} s after the kill"


def test_sigterm_to_a_standalone_follower_takes_the_group_down_naming_it(tiny_dir, tmp_path):
    rank0, rank1 = start_pair(tiny_dir, tmp_path, ["--idle-s", "60"])
    rank1.send_signal(signal.SIGTERM)
    codes, _ = wait_all([rank0, rank1], timeout=30)
    err0 = rank0.communicate()[1]
    assert codes == [70, 70], f"exit codes {codes}\n{err0[-2000:]}"
    assert "rank 1 received SIGTERM" in err0, err0[-2000:]


def _peek(tmp_path: Path) -> str:
    marker = tmp_path / "progress"
    return marker.read_text() if marker.exists() else ""


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
