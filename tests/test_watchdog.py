"""Watchdog ticks against real processes: a real HTTP /health server as rank 0, a real process as rank 1.

systemd is not running here, so `systemctl` goes through a command runner that answers `systemctl show` from the real
processes' states (alive, killed by a signal, exited 70) and records (and performs) restarts. Time is injected.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dsv41.ops.host_commands import Result
from dsv41.ops.health import request
from dsv41.ops.lifecycle import boot, marker_path, record_stop
from dsv41.ops.watchdog import Watchdog, parse_show
from conftest import free_port

HEALTH_SERVER = textwrap.dedent("""
    import http.server, json, sys
    status = int(sys.argv[2])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"ok": status == 200}).encode()
            self.send_response(status if self.path == "/health" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")
SLEEPER = "import time; time.sleep(600)"
FAILFAST = "raise SystemExit(70)"
LOCK_HOLDER = ("import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
               "print('locked', flush=True); time.sleep(60)")


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeSystemd:
    """A command runner standing in for systemctl (local and over ssh) on top of real processes."""

    def __init__(self, clock: Clock, programs: dict[str, list[str]]):
        self.clock, self.programs = clock, programs
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: dict[str, float] = {}
        self.commands: list[tuple[str | None, list[str]]] = []
        self.unreachable: set[str] = set()

    def start(self, instance: str) -> None:
        self.procs[instance] = subprocess.Popen(self.programs[instance])
        self.started[instance] = self.clock()

    def wait_exited(self, instance: str) -> None:
        self.procs[instance].wait(timeout=30)

    def __call__(self, argv, host=None, timeout=None, input=None) -> Result:
        argv = list(argv)
        self.commands.append((host, argv))
        if host in self.unreachable:
            return Result(255, "", f"ssh: connect to host {host}: No route to host")
        assert argv[0] == "systemctl", argv
        unit = argv[-1]
        instance = unit.removeprefix("dsv41@").removesuffix(".service")
        if argv[1] == "show":
            return Result(0, self.show(instance))
        if argv[1] == "restart":
            proc = self.procs.get(instance)
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            self.start(instance)
            return Result(0)
        if argv[1] in ("reset-failed", "start", "is-system-running"):
            return Result(0, "running\n" if argv[1] == "is-system-running" else "")
        raise AssertionError(f"unexpected command {argv}")

    def show(self, instance: str) -> str:
        proc = self.procs.get(instance)
        if proc is None:
            props = dict(ActiveState="inactive", Result="success", ExecMainCode=0, ExecMainStatus=0)
        elif proc.poll() is None:
            props = dict(ActiveState="active", Result="success", ExecMainCode=0, ExecMainStatus=0)
        elif proc.returncode < 0:
            props = dict(ActiveState="failed", Result="signal", ExecMainCode=2, ExecMainStatus=-proc.returncode)
        elif proc.returncode == 0:
            props = dict(ActiveState="inactive", Result="success", ExecMainCode=1, ExecMainStatus=0)
        else:
            props = dict(ActiveState="failed", Result="exit-code", ExecMainCode=1, ExecMainStatus=proc.returncode)
        stamp = f"@{self.started[instance]:.0f}" if instance in self.started else ""
        return "".join(f"{k}={v}\n" for k, v in props.items()) + f"SubState=x\nInactiveExitTimestamp={stamp}\n"

    def restarts(self) -> list[tuple[str | None, str]]:
        return [(host, argv[-1]) for host, argv in self.commands if argv[1] == "restart"]

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def pair(tmp_path):
    """A running healthy pair (rank 0 = real /health server, rank 1 = a real process) and a watchdog on it."""
    port = free_port()
    clock = Clock()
    systemd = FakeSystemd(clock, {"rank0": [sys.executable, "-c", HEALTH_SERVER, str(port), "200"],
                                  "rank1": [sys.executable, "-c", SLEEPER]})
    env = {"DSV41_PORT": str(port), "DSV41_HOST": "127.0.0.1", "DSV41_WORKER_SSH": "root@worker",
           "STATE_DIRECTORY": str(tmp_path / "state"), "DSV41_WATCH_GRACE_S": "600"}
    systemd.start("rank0")
    systemd.start("rank1")
    wait_healthy(port)
    clock.t += 3600  # both started an hour ago: outside the loading grace
    yield systemd, clock, env, port
    systemd.stop_all()


def wait_healthy(port: int, status: int = 200) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if request(f"http://127.0.0.1:{port}/health", timeout=1).status == status:
            return
        time.sleep(0.05)
    raise AssertionError(f"health server on {port} did not come up")


def ticks(watchdog: Watchdog, clock: Clock, n: int, step: float = 60.0):
    out = []
    for _ in range(n):
        clock.t += step
        out.append(watchdog.tick())
    return out


def test_healthy_pair_no_action(pair):
    systemd, clock, env, _ = pair
    results = ticks(Watchdog(env, systemd, now=clock), clock, 5)
    assert [r.outcome for r in results] == ["ok"] * 5
    assert systemd.restarts() == []
    # rank 1 is queried on the worker over ssh, rank 0 locally
    hosts = {argv[-1]: host for host, argv in systemd.commands}
    assert hosts == {"dsv41@rank0.service": None, "dsv41@rank1.service": "root@worker"}


def test_killed_rank_heals_after_three_ticks_then_rate_limited(pair):
    systemd, clock, env, port = pair
    watchdog = Watchdog(env, systemd, now=clock)
    systemd.procs["rank1"].send_signal(signal.SIGKILL)
    systemd.wait_exited("rank1")
    results = ticks(watchdog, clock, 3)
    assert [r.outcome for r in results] == ["bad", "bad", "healed"]
    assert "rank1 failed (signal, status 9)" in results[0].reason
    # worker first (it waits for rank 0's rendezvous), then the head
    assert systemd.restarts() == [("root@worker", "dsv41@rank1.service"), (None, "dsv41@rank0.service")]
    wait_healthy(port)
    assert systemd.procs["rank1"].poll() is None
    assert [r.outcome for r in ticks(watchdog, clock, 2)] == ["ok", "ok"]

    # killed again 5 minutes after the heal: 3 bad ticks, but the 30-minute limit holds the next heal back
    clock.t += 300
    systemd.procs["rank0"].send_signal(signal.SIGKILL)
    systemd.wait_exited("rank0")
    results = ticks(watchdog, clock, 5)
    assert [r.outcome for r in results] == ["bad"] * 5
    assert "rate-limited" in results[-1].reason
    assert len(systemd.restarts()) == 2
    # 30 minutes after the first heal the next bad tick heals
    clock.t += 1800
    assert watchdog.tick().outcome == "healed"
    assert len(systemd.restarts()) == 4


def test_failfast_exit_heals_at_first_tick_at_most_every_two_minutes(pair):
    systemd, clock, env, port = pair
    systemd.programs["rank0"], health_program = [sys.executable, "-c", FAILFAST], systemd.programs["rank0"]
    watchdog = Watchdog(env, systemd, now=clock)

    systemd.procs["rank0"].kill()
    systemd.procs["rank0"].wait()
    systemd.start("rank0")  # the real server now exits 70, as both ranks do on fail-fast
    systemd.wait_exited("rank0")
    clock.t += 3600
    first = watchdog.tick()
    assert first.outcome == "healed" and "fail-fast exit 70" in first.reason
    assert len(systemd.restarts()) == 2

    # the restarted rank fails fast again at once: the next heal waits for the 2-minute limit
    systemd.wait_exited("rank0")
    clock.t += 60
    second = watchdog.tick()
    assert second.outcome == "bad" and "fail-fast heal rate-limited" in second.reason
    clock.t += 61
    systemd.programs["rank0"] = health_program
    assert watchdog.tick().outcome == "healed"
    assert len(systemd.restarts()) == 4
    wait_healthy(port)


def test_loading_grace_and_health_503(pair, tmp_path):
    systemd, clock, env, port = pair
    # rank 0 restarted just now and answers 503 while it loads: not a bad tick inside the grace ...
    systemd.procs["rank0"].kill()
    systemd.procs["rank0"].wait()
    systemd.programs["rank0"] = [sys.executable, "-c", HEALTH_SERVER, str(port), "503"]
    systemd.start("rank0")
    wait_healthy(port, 503)
    watchdog = Watchdog(env, systemd, now=clock)
    assert [r.outcome for r in ticks(watchdog, clock, 3)] == ["loading"] * 3
    # ... but once the grace (600 s here) is over, 503 counts
    clock.t += 600
    results = ticks(watchdog, clock, 3)
    assert [r.outcome for r in results] == ["bad", "bad", "healed"]
    assert "/health 503" in results[0].reason


def test_unreachable_worker_is_not_counted(pair):
    systemd, clock, env, _ = pair
    systemd.unreachable.add("root@worker")
    assert [r.outcome for r in ticks(Watchdog(env, systemd, now=clock), clock, 4)] == ["ok"] * 4


def test_stands_down_while_a_start_holds_the_lock(pair):
    systemd, clock, env, _ = pair
    systemd.procs["rank1"].kill()
    systemd.wait_exited("rank1")
    state = Path(env["STATE_DIRECTORY"])
    state.mkdir(parents=True, exist_ok=True)
    # a real other process holds the lock, as `flock start.lock ...` does during a deploy
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(state / "start.lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        results = ticks(Watchdog(env, systemd, now=clock), clock, 4)
        assert [r.outcome for r in results] == ["stand-down"] * 4
        assert systemd.restarts() == []
    finally:
        holder.kill()
        holder.wait()
    assert Watchdog(env, systemd, now=clock).tick().outcome == "bad"


def test_stands_down_after_deliberate_stop_and_boot_respects_it(pair):
    systemd, clock, env, _ = pair
    systemd.procs["rank0"].terminate()
    systemd.wait_exited("rank0")
    # ExecStopPost of a `systemctl stop`: SERVICE_RESULT=success, the system is running
    assert record_stop("rank0", {**env, "SERVICE_RESULT": "success"}, systemd, now=clock())
    results = ticks(Watchdog(env, systemd, now=clock), clock, 4)
    assert [r.outcome for r in results] == ["stand-down"] * 4
    assert systemd.restarts() == []
    # boot starts the ranks without a marker only
    started = boot({**env, "DSV41_LOCAL_RANKS": "rank0 rank1"}, systemd)
    assert started == ["rank1"]
    marker_path(Path(env["STATE_DIRECTORY"]), "rank0").unlink()
    assert boot({**env, "DSV41_LOCAL_RANKS": "rank0"}, systemd) == ["rank0"]


def test_crash_and_shutdown_are_not_deliberate(tmp_path):
    env = {"STATE_DIRECTORY": str(tmp_path)}

    def systemctl(state):
        return lambda argv, host=None, timeout=None, input=None: Result(0, state + "\n")

    assert not record_stop("rank0", {**env, "SERVICE_RESULT": "exit-code"}, systemctl("running"))
    assert not record_stop("rank0", {**env, "SERVICE_RESULT": "watchdog"}, systemctl("running"))
    assert not record_stop("rank0", {**env, "SERVICE_RESULT": "success"}, systemctl("stopping"))
    assert not marker_path(tmp_path, "rank0").exists()


def test_state_survives_between_ticks(pair):
    systemd, clock, env, _ = pair
    systemd.procs["rank1"].kill()
    systemd.wait_exited("rank1")
    # a new Watchdog per tick, as the timer starts a new process each minute
    outcomes = []
    for _ in range(3):
        clock.t += 60
        outcomes.append(Watchdog(env, systemd, now=clock).tick().outcome)
    assert outcomes == ["bad", "bad", "healed"]
    assert (Path(env["STATE_DIRECTORY"]) / "heal.log").read_text().count("\n") == 1


def test_parse_show_real_format():
    text = ("ActiveState=failed\nSubState=failed\nResult=exit-code\nExecMainCode=1\nExecMainStatus=70\n"
            "InactiveExitTimestamp=@1764415949\n")
    state = parse_show("rank0", text)
    assert state.dead and state.failfast and state.since == 1764415949.0
    assert not parse_show("rank0", "ActiveState=active\nInactiveExitTimestamp=\n").dead
