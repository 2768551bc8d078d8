"""Fail-fast: one rank failing takes the whole group down quickly and loudly, with exit status 70.

A TP group is only useful whole: a rank that raised, ran out of memory or vanished leaves the others waiting in a
collective that can never complete. So every rank runs a monitor thread on its own connection to rank 0's store:

- it bumps its heartbeat counter `tp/hb/{rank}` every `interval_s` and watches the peers' counters; a counter that
  stops moving for `peer_timeout_s` (kill -9, power loss, a wedged host) means the peer is lost;
- it watches `tp/abort`: a rank that fails writes its reason there, everyone sees it within one interval;
- if the store itself becomes unreachable, rank 0 is gone.

On any of these the monitor marks the group aborted (blocked callers are released with `TPAborted` so rank 0 can
answer every in-flight request with an error), runs the registered callbacks, waits `grace_s` for those error
responses to leave, and ends the process with `os._exit(70)` (the watchdog restarts on that code). `os._exit` is
deliberate: the main thread may sit inside a collective that no Python exception can interrupt.

The monitor also carries the memory side channel: each rank publishes `tp/mem/{rank}` about once a second and
rank 0 keeps the latest reports for admission control.

An abort is signed with the group's secret (`TPGroup.secret`, rendezvous.py): the store is plain TCP, so a
`tp/abort` written by anything else that reaches it is logged once and ignored. `abort_reason()` tells the HTTP
server (without importing this module unless TP is in use) that the group failed, so it answers 503 +
Retry-After while the grace runs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import sys
import threading
import time

import torch

EXIT_CODE = 70
ABORT_KEY = "tp/abort"
INJECT_ENV = "DSV41_TEST_FAIL_AT_ROUND"


_ABORTED: list[str] = []  # this process's group failure reason, once there is one


class TPAborted(RuntimeError):
    """The tensor-parallel group failed; the message says which rank and why. The process exits 70 shortly."""


def abort_reason() -> str | None:
    """Why this process's tensor-parallel group failed (the process exits 70 after the grace), or None."""
    return _ABORTED[0] if _ABORTED else None


def sign_abort(secret: bytes, message: str) -> str:
    mac = hmac.new(secret, b"dsv41-tp-abort|" + message.encode(), hashlib.sha256).hexdigest()
    return f"{message}\n{mac}"


def verify_abort(secret: bytes, value: str) -> str | None:
    """The reason in a signed `tp/abort` value, or None when the signature is missing or wrong."""
    message, _, mac = value.rpartition("\n")
    if not message or not hmac.compare_digest(sign_abort(secret, message), value):
        return None
    return message


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def memory_snapshot() -> dict:
    """This rank's memory in bytes: GPU free/total when CUDA is in use, else host available/total; plus RSS."""
    report = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        free, total = torch.cuda.mem_get_info()
        report.update(device="cuda", free=free, total=total, allocated=torch.cuda.memory_allocated())
    else:
        meminfo = {}
        with open("/proc/meminfo") as f:
            for line in f:
                name, value = line.split(":", 1)
                meminfo[name] = int(value.split()[0]) * 1024
        report.update(device="cpu", free=meminfo.get("MemAvailable", 0), total=meminfo.get("MemTotal", 0))
    with open("/proc/self/statm") as f:
        report["rss"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return report


class FailFast:
    """The per-rank monitor described in the module docstring. `start()` it right after `init_tp`."""

    def __init__(self, group, peer_timeout_s: float = 3.0, interval_s: float = 0.1, grace_s: float = 1.0,
                 memory_every_s: float = 1.0, exit_fn=os._exit, log=_stderr):
        self.rank, self.world, self.master = group.rank, group.world, group.master
        self._secret = getattr(group, "secret", b"")
        self._ignored_abort: bytes | None = None
        self.peer_timeout_s, self.interval_s, self.grace_s = peer_timeout_s, interval_s, grace_s
        self.memory_every_s = memory_every_s
        self._exit, self._log = exit_fn, log
        # Its own connection: the main thread's store client may be blocked in a long wait for a plan.
        self._store = group.store_client(timeout_s=max(2.0, peer_timeout_s))
        self._store_lock = threading.Lock()
        self._trigger_lock = threading.Lock()
        self.aborted = threading.Event()
        self._stopping = threading.Event()
        self.reason: str | None = None
        self._memory: dict[int, dict] = {}
        self._thread = threading.Thread(target=self._run, name=f"dsv41-failfast-r{self.rank}", daemon=True)

    # ---- API ---------------------------------------------------------------------------------------------------

    def start(self) -> "FailFast":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Normal shutdown: stop watching (the peers are leaving too) and wait for the thread to end."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def abort(self, reason: str) -> None:
        """This rank failed: tell the others through the store, then go down like them."""
        message = f"rank {self.rank}: {reason}"
        try:
            with self._store_lock:
                self._store.set(ABORT_KEY, sign_abort(self._secret, message))
        except Exception:  # noqa: BLE001 - the store may be what failed; the peers then notice us missing
            pass
        self._trigger(message)

    def check(self) -> None:
        """Raise TPAborted if the group failed (call before starting work that needs the peers)."""
        if self.aborted.is_set():
            raise TPAborted(f"tensor-parallel group aborted: {self.reason}")

    def memory_reports(self) -> dict[int, dict]:
        """Rank -> latest memory report (rank 0 collects them all; other ranks know only their own)."""
        reports = dict(self._memory)
        reports[self.rank] = memory_snapshot()
        return reports

    # ---- monitor thread --------------------------------------------------------------------------------------

    def _trigger(self, reason: str) -> None:
        with self._trigger_lock:
            if self.aborted.is_set():
                return
            self.reason = reason
            self.aborted.set()
            _ABORTED.append(reason)
        self._log(f"dsv41 tp: rank {self.rank} aborting the tensor-parallel group: {reason}; exit {EXIT_CODE} "
                  f"in {self.grace_s:.1f} s")
        threading.Thread(target=self._exit_after_grace, name="dsv41-failfast-exit", daemon=True).start()

    def _exit_after_grace(self) -> None:
        time.sleep(self.grace_s)
        sys.stdout.flush()
        sys.stderr.flush()
        self._exit(EXIT_CODE)

    def _run(self) -> None:
        peers = [r for r in range(self.world) if r != self.rank]
        last_seen = {r: (-1, time.monotonic()) for r in peers}
        next_memory = 0.0
        while not self.aborted.is_set() and not self._stopping.is_set():
            now = time.monotonic()
            try:
                with self._store_lock:
                    self._store.add(f"tp/hb/{self.rank}", 1)
                    if self._store.check([ABORT_KEY]) and self._peer_abort():
                        return
                    counts = {r: self._store.add(f"tp/hb/{r}", 0) for r in peers}
                    if now >= next_memory:
                        self._exchange_memory(peers)
                        next_memory = now + self.memory_every_s
            except Exception as exc:  # noqa: BLE001 - any store failure means rank 0 (the store host) is gone
                if self._stopping.is_set():
                    return
                who = "rank 0 (store host)" if self.rank != 0 else "the local store"
                self._trigger(f"lost {who} at {self.master}: {str(exc).splitlines()[0] if str(exc) else exc!r}")
                return
            for r, count in counts.items():
                previous, since = last_seen[r]
                if count != previous:
                    last_seen[r] = (count, now)
                elif now - since > self.peer_timeout_s:
                    self._trigger(f"lost rank {r}: no heartbeat for {now - since:.1f} s")
                    return
            time.sleep(self.interval_s)

    def _peer_abort(self) -> bool:
        """Act on a signed abort (True); log an unsigned one once and carry on (False)."""
        value = self._store.get(ABORT_KEY)
        reason = verify_abort(self._secret, value.decode("utf-8", "replace"))
        if reason is not None:
            self._trigger(f"peer failure: {reason}")
            return True
        if value != self._ignored_abort:
            self._ignored_abort = value
            self._log(f"dsv41 tp: rank {self.rank} ignores a write to {ABORT_KEY} at {self.master} that no rank "
                      "signed (something else reaches the TP store)")
        return False

    def _exchange_memory(self, peers) -> None:
        self._store.set(f"tp/mem/{self.rank}", json.dumps(memory_snapshot()))
        if self.rank == 0:
            for r in peers:
                if self._store.check([f"tp/mem/{r}"]):
                    self._memory[r] = json.loads(self._store.get(f"tp/mem/{r}"))


def parse_injection(spec: str | None) -> tuple[int, int, str] | None:
    """`RANK:ROUND[:KIND]` (KIND raise | oom | kill | hang, default raise) -> (rank, round, kind)."""
    if not spec:
        return None
    parts = spec.split(":")
    kinds = ("raise", "oom", "kill", "hang")
    if len(parts) not in (2, 3) or not parts[0].isdigit() or not parts[1].isdigit() or \
            (len(parts) == 3 and parts[2] not in kinds):
        raise ValueError(f"{INJECT_ENV} must be RANK:ROUND[:{'|'.join(kinds)}], got {spec!r}")
    return int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else "raise"


class FailureInjector:
    """Test hook: make rank R fail at round N (see `parse_injection`); inert unless the env var is set."""

    def __init__(self, rank: int, spec: str | None = None):
        spec = os.environ.get(INJECT_ENV) if spec is None else spec
        self.rank = rank
        self.target = parse_injection(spec)

    def at_round(self, round_no: int) -> None:
        if self.target is None or self.target[0] != self.rank or self.target[1] != round_no:
            return
        kind = self.target[2]
        what = f"injected failure ({INJECT_ENV}={kind}) on rank {self.rank} at round {round_no}"
        print(f"dsv41 tp: {what} at unix time {time.time():.3f}", file=sys.stderr, flush=True)
        if kind == "raise":
            raise RuntimeError(what)
        if kind == "oom":
            raise torch.OutOfMemoryError(what)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang: the peers' collective timeout (or their watchdog) must catch this
            time.sleep(3600)
