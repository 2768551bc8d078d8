"""`dsv41 watchdog --once`: one tick of the pair watchdog (run by dsv41-watchdog.timer on the head, every minute).

A tick is bad when a rank is dead (unit failed/inactive, or stuck activating past the loading grace) or rank 0's
/health is not ok outside the loading grace. Healing restarts both ranks (worker first: rank 1 waits for rank 0's
rendezvous, rank 0 then finds it ready):
- after `DSV41_WATCH_FAILS` (3) bad ticks in a row, at most once per `DSV41_WATCH_MIN_HEAL_S` (30 min);
- at the first bad tick when a rank ended with the fail-fast status 70, at most once per
  `DSV41_WATCH_FF_MIN_HEAL_S` (2 min).
It stands down while a start holds the start lock and after a deliberate stop of rank 0. An unreachable worker
(ssh failure) is reported but not counted: a network blip must not restart a healthy pair.

State lives in `<StateDirectory>/watchdog.json`; time is a parameter so tests never sleep for 30 minutes.
"""

from __future__ import annotations

import fcntl
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from dsv41.ops.host_commands import CommandRunner
from dsv41.ops.health import Reply, base_url, health
from dsv41.ops.knobs import ops_number, ops_value, tp_ranks
from dsv41.ops.lifecycle import read_marker, state_dir

log = logging.getLogger(__name__)

FAILFAST_STATUS = 70
HEAD_RANK, WORKER_RANK = "rank0", "rank1"
SHOW_PROPERTIES = "ActiveState,SubState,Result,ExecMainCode,ExecMainStatus,InactiveExitTimestamp"
CLD_EXITED = 1  # ExecMainCode for a normal exit (2 = killed by a signal, 3 = dumped core)


@dataclass
class RankState:
    instance: str
    reachable: bool
    active: str = ""  # ActiveState: active | activating | deactivating | inactive | failed
    result: str = ""
    exit_code: int = 0  # ExecMainCode
    exit_status: int = 0  # ExecMainStatus
    since: float | None = None  # when the current (or last) start began, unix seconds

    @property
    def dead(self) -> bool:
        return self.reachable and self.active in ("failed", "inactive", "deactivating")

    @property
    def failfast(self) -> bool:
        return self.dead and self.exit_code == CLD_EXITED and self.exit_status == FAILFAST_STATUS

    def loading(self, now: float, grace: float) -> bool:
        return self.since is not None and now - self.since < grace and self.active in ("activating", "active")


def parse_show(instance: str, text: str) -> RankState:
    """Parse `systemctl show --timestamp=unix -p ...` (KEY=VALUE lines)."""
    props = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)

    def number(key: str) -> int:
        try:
            return int(props.get(key, "0") or 0)
        except ValueError:
            return 0

    since = None
    stamp = props.get("InactiveExitTimestamp", "")
    if stamp.startswith("@"):
        try:
            since = float(stamp[1:])
        except ValueError:
            since = None
    return RankState(instance, True, props.get("ActiveState", ""), props.get("Result", ""),
                     number("ExecMainCode"), number("ExecMainStatus"), since)


def rank_state(instance: str, host: str | None, run: CommandRunner) -> RankState:
    unit = f"dsv41@{instance}.service"
    result = run(["systemctl", "show", "--timestamp=unix", "-p", SHOW_PROPERTIES, unit], host=host, timeout=30)
    if not result.ok:
        return RankState(instance, False)
    return parse_show(instance, result.stdout)


@dataclass
class WatchState:
    fails: int = 0
    last_heal: float = 0.0
    last_ff_heal: float = 0.0
    last_tick: float = 0.0
    last_outcome: str = ""

    @classmethod
    def load(cls, path: Path) -> "WatchState":
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return cls()
        known = {k: data[k] for k in asdict(cls()) if k in data}
        return cls(**known)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)) + "\n")
        tmp.replace(path)


@dataclass
class Tick:
    outcome: str  # ok | loading | bad | healed | stand-down
    reason: str
    fails: int = 0
    commands: list[list[str]] = field(default_factory=list)


def lock_held(path: Path) -> bool:
    """True when another process holds the start lock (flock), as `flock <lock> dsv41 ...` starts do."""
    try:
        handle = path.open("r")  # flock needs no write access: deploy's gate (root) may own the file
    except OSError:
        return False  # no lock file: nobody ever held it
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


class Watchdog:
    def __init__(self, env: Mapping[str, str], run: CommandRunner, now: Callable[[], float] = time.time,
                 probe: Callable[[str], Reply] = health):
        self.env, self.run, self.now, self.probe = env, run, now, probe
        self.state_dir = state_dir(env)
        self.state_path = self.state_dir / "watchdog.json"
        self.lock_path = self.state_dir / "start.lock"
        self.worker = ops_value(env, "DSV41_WORKER_SSH") or None
        self.instances = tp_ranks(env)  # rank0 only at DSV41_TP=1
        self.fails_needed = int(ops_number(env, "DSV41_WATCH_FAILS"))
        self.min_heal = ops_number(env, "DSV41_WATCH_MIN_HEAL_S")
        self.ff_min_heal = ops_number(env, "DSV41_WATCH_FF_MIN_HEAL_S")
        self.grace = ops_number(env, "DSV41_WATCH_GRACE_S")
        self.heal_enabled = ops_value(env, "DSV41_WATCH_HEAL") not in ("0", "no", "false")

    def tick(self) -> Tick:
        now = self.now()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        state = WatchState.load(self.state_path)
        result = self._decide(now, state)
        state.last_tick, state.last_outcome = now, f"{result.outcome}: {result.reason}"
        state.save(self.state_path)
        log.log(logging.WARNING if result.outcome in ("bad", "healed") else logging.INFO,
                "watchdog %s: %s", result.outcome, result.reason)
        return result

    def _decide(self, now: float, state: WatchState) -> Tick:
        if lock_held(self.lock_path):
            return Tick("stand-down", f"a start holds {self.lock_path}", state.fails)
        if read_marker(self.state_dir, HEAD_RANK) is not None:
            state.fails = 0
            return Tick("stand-down", f"{HEAD_RANK} was stopped deliberately", 0)

        ranks = [rank_state(instance, None if instance == HEAD_RANK else self.worker, self.run)
                 for instance in self.instances]
        problems = []
        for rank in ranks:
            if not rank.reachable:
                log.warning("%s: state unknown (host unreachable); not counted", rank.instance)
            elif rank.dead:
                problems.append(f"{rank.instance} {rank.active} ({rank.result or 'no result'}, "
                                f"status {rank.exit_status})")
            elif rank.active == "activating" and not rank.loading(now, self.grace):
                problems.append(f"{rank.instance} still activating past the {self.grace:.0f} s grace")
        loading = any(rank.loading(now, self.grace) for rank in ranks)
        reply = self.probe(base_url(self.env))
        if not reply.ok and not loading and not any(r.dead for r in ranks):
            problems.append(f"/health {reply.status or 'unreachable'} {reply.error}".rstrip())

        if not problems:
            state.fails = 0
            if not reply.ok:
                return Tick("loading", f"/health {reply.status or 'unreachable'} within the loading grace", 0)
            return Tick("ok", "both ranks up, /health ok", 0)

        state.fails += 1
        reason = "; ".join(problems)
        failfast = any(rank.failfast for rank in ranks)
        if failfast:
            if now - state.last_ff_heal >= self.ff_min_heal:
                state.last_ff_heal = now
                return self._heal(state, f"fail-fast exit {FAILFAST_STATUS}: {reason}")
            wait = self.ff_min_heal - (now - state.last_ff_heal)
            return Tick("bad", f"{reason}; fail-fast heal rate-limited ({wait:.0f} s left)", state.fails)
        if state.fails >= self.fails_needed:
            if now - state.last_heal >= self.min_heal:
                state.last_heal = now
                return self._heal(state, f"{state.fails} bad ticks: {reason}")
            wait = self.min_heal - (now - state.last_heal)
            return Tick("bad", f"{reason}; heal rate-limited ({wait:.0f} s left)", state.fails)
        return Tick("bad", f"{reason} ({state.fails}/{self.fails_needed})", state.fails)

    def _heal(self, state: WatchState, reason: str) -> Tick:
        fails, state.fails = state.fails, 0
        if not self.heal_enabled:
            return Tick("bad", f"{reason}; healing disabled (DSV41_WATCH_HEAL=0)", fails)
        commands = []
        for instance, host in [(i, self.worker) for i in self.instances if i != HEAD_RANK] + [(HEAD_RANK, None)]:
            unit = f"dsv41@{instance}.service"
            for argv in (["systemctl", "reset-failed", unit], ["systemctl", "restart", "--no-block", unit]):
                self.run(argv, host=host, timeout=60)
                commands.append(argv if host is None else ["ssh", host, *argv])
        with (self.state_dir / "heal.log").open("a") as handle:
            handle.write(json.dumps({"time": self.now(), "reason": reason}) + "\n")
        return Tick("healed", reason, fails, commands)
