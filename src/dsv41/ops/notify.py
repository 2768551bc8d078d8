"""sd_notify for the server process: readiness, progress, start-timeout extension, health-gated watchdog pings.

The unit is `Type=notify` with `NotifyAccess=main`, so every message must come from the main PID (call these from
the server process itself, never from a helper subprocess). Without `NOTIFY_SOCKET` (run by hand, in tests) every
call is a no-op. sdnotify connects once in its constructor, so `Notifier` builds it lazily on first use, after the
environment is final.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

import sdnotify

log = logging.getLogger(__name__)


class Notifier:
    """One sd_notify channel. `debug=True` makes socket errors raise instead of being swallowed (tests)."""

    def __init__(self, debug: bool = False):
        self._debug = debug
        self._notifier: sdnotify.SystemdNotifier | None = None
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))

    def send(self, **fields: object) -> None:
        """Send several assignments in one datagram, e.g. send(STATUS="loading", EXTEND_TIMEOUT_USEC=...)."""
        if not self.enabled or not fields:
            return
        if self._notifier is None:
            self._notifier = sdnotify.SystemdNotifier(debug=self._debug)
        self._notifier.notify("\n".join(f"{key}={value}" for key, value in fields.items()))

    def status(self, text: str, percent: float | None = None) -> None:
        if percent is not None:
            text = f"{text} ({percent:.0f}%)"
        self.send(STATUS=text)

    def extend_timeout(self, seconds: float, status: str | None = None) -> None:
        fields: dict[str, object] = {"EXTEND_TIMEOUT_USEC": int(seconds * 1_000_000)}
        if status is not None:
            fields["STATUS"] = status
        self.send(**fields)

    def ready(self, status: str = "serving") -> None:
        self.send(READY=1, STATUS=status)

    def watchdog(self) -> None:
        self.send(WATCHDOG=1)

    def stopping(self, status: str = "draining") -> None:
        self.send(STOPPING=1, STATUS=status)


class LoadProgress:
    """Reports loading as STATUS lines with a percentage, extending the start timeout only while progress advances.

    A stuck load therefore stops extending and systemd kills it after `extend_s`, while a slow but moving load
    survives any number of extensions.
    """

    def __init__(self, notifier: Notifier, extend_s: float = 180.0):
        self.notifier = notifier
        self.extend_s = extend_s
        self._last_done: float | None = None

    def update(self, done: float, total: float, what: str) -> None:
        percent = 100.0 * done / total if total else 0.0
        text = f"loading {what} {done:g}/{total:g} ({percent:.0f}%)"
        if self._last_done is None or done > self._last_done:
            self._last_done = done
            self.notifier.extend_timeout(self.extend_s, status=text)
        else:
            self.notifier.send(STATUS=text)


def watchdog_interval_s() -> float | None:
    """Half of systemd's `WATCHDOG_USEC` (the documented ping rate), or None when no watchdog is armed for us."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None  # the watchdog belongs to another process (we were forked or exec'd into a helper)
    return int(usec) / 2_000_000


class WatchdogPinger:
    """Sends WATCHDOG=1 every interval, but only while `is_healthy()` says the engine loop is healthy.

    A hung engine (a collective that never returns, a wedged GPU) must make the pings stop even though the
    asyncio event loop and this thread are fine, so health is whatever the engine reports, not "we are running".
    """

    def __init__(self, notifier: Notifier, is_healthy: Callable[[], bool], interval_s: float | None = None):
        self.notifier = notifier
        self.is_healthy = is_healthy
        self.interval_s = interval_s if interval_s is not None else watchdog_interval_s()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pings = 0
        self.skipped = 0

    def tick(self) -> bool:
        """One check: ping if healthy. Returns whether a ping was sent."""
        try:
            healthy = bool(self.is_healthy())
        except Exception:  # a failing health probe is an unhealthy engine, not a crashed pinger
            log.exception("engine health probe raised; withholding the watchdog ping")
            healthy = False
        if healthy:
            self.notifier.watchdog()
            self.pings += 1
        else:
            self.skipped += 1
        return healthy

    def start(self) -> None:
        if self.interval_s is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="sd-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

