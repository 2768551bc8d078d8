"""sd_notify and journald logging, tested over a real unix datagram socket and real child processes."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


@pytest.fixture
def notify_socket(tmp_path):
    """A bound AF_UNIX/SOCK_DGRAM socket standing in for systemd's notification socket."""
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    yield sock, str(path)
    sock.close()


def receive_all(sock: socket.socket, until: str | None = None, timeout: float = 5.0) -> list[str]:
    """Datagrams until one contains `until` (or the socket stays quiet for 0.3 s when `until` is None)."""
    messages: list[str] = []
    deadline = time.monotonic() + timeout
    sock.settimeout(0.3 if until is None else 0.2)
    while time.monotonic() < deadline:
        try:
            messages.append(sock.recv(4096).decode("latin-1"))
        except socket.timeout:
            if until is None:
                break
            continue
        if until is not None and until in messages[-1]:
            break
    return messages


def run_child(code: str, env: dict[str, str], **kwargs) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO / "src"), **env}
    kwargs.setdefault("stdout", subprocess.PIPE)
    return subprocess.run([PY, "-c", textwrap.dedent(code)], env=full_env, stderr=subprocess.PIPE, text=True,
                          timeout=60, **kwargs)


def test_child_process_messages_arrive_in_order(notify_socket):
    sock, path = notify_socket
    result = run_child(
        """
        from dsv41.ops.notify import Notifier, LoadProgress
        n = Notifier(debug=True)
        progress = LoadProgress(n, extend_s=180)
        progress.update(1, 4, "shards")
        progress.update(1, 4, "shards")   # no progress: status only, no extension
        progress.update(4, 4, "shards")
        n.ready()
        n.stopping()
        """,
        {"NOTIFY_SOCKET": path},
    )
    assert result.returncode == 0, result.stderr
    messages = receive_all(sock)
    assert messages == [
        "EXTEND_TIMEOUT_USEC=180000000\nSTATUS=loading shards 1/4 (25%)",
        "STATUS=loading shards 1/4 (25%)",
        "EXTEND_TIMEOUT_USEC=180000000\nSTATUS=loading shards 4/4 (100%)",
        "READY=1\nSTATUS=serving",
        "STOPPING=1\nSTATUS=draining",
    ]


def test_abstract_namespace_socket():
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"dsv41-test-{os.getpid()}"
    sock.bind("\0" + name)
    try:
        result = run_child(
            "from dsv41.ops.notify import Notifier\nNotifier(debug=True).status('warming', percent=42.4)\n",
            {"NOTIFY_SOCKET": "@" + name},
        )
        assert result.returncode == 0, result.stderr
        assert receive_all(sock) == ["STATUS=warming (42%)"]
    finally:
        sock.close()


def test_no_socket_is_a_silent_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    from dsv41.ops.notify import Notifier

    notifier = Notifier(debug=True)
    assert not notifier.enabled
    notifier.ready()  # would raise with debug=True if it tried to use a socket
    notifier.watchdog()


def test_watchdog_pings_only_while_engine_healthy(notify_socket):
    sock, path = notify_socket
    # The child flips its engine to unhealthy after 0.5 s and back to healthy at 1.0 s, then exits at 1.5 s.
    result = run_child(
        """
        import time
        from dsv41.ops.notify import Notifier, WatchdogPinger
        start = time.monotonic()
        def healthy():
            t = time.monotonic() - start
            return not (0.5 <= t < 1.0)
        pinger = WatchdogPinger(Notifier(debug=True), healthy)
        assert abs(pinger.interval_s - 0.1) < 1e-9, pinger.interval_s
        pinger.start()
        time.sleep(1.5)
        pinger.stop()
        print(pinger.pings, pinger.skipped)
        """,
        {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"},
    )
    assert result.returncode == 0, result.stderr
    pings, skipped = map(int, result.stdout.split())
    messages = receive_all(sock)
    assert messages and set(messages) == {"WATCHDOG=1"}
    assert len(messages) == pings
    # ~15 ticks at half of WATCHDOG_USEC, ~5 of them in the unhealthy half second; a loaded CI machine delays
    # ticks, so only the shape is checked: pings while healthy, none while not
    assert 4 <= pings <= 12 and 1 <= skipped <= 6, (pings, skipped)


def test_watchdog_not_armed_for_another_pid(monkeypatch):
    from dsv41.ops.notify import watchdog_interval_s

    monkeypatch.setenv("WATCHDOG_USEC", "60000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval_s() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert watchdog_interval_s() is None


def test_raising_health_probe_withholds_ping(notify_socket, monkeypatch):
    sock, path = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    from dsv41.ops.notify import Notifier, WatchdogPinger

    def broken():
        raise RuntimeError("engine state unreadable")

    pinger = WatchdogPinger(Notifier(debug=True), broken, interval_s=1.0)
    assert pinger.tick() is False
    assert receive_all(sock) == []


# ------------------------------------------------------------------------------------------ journald prefixes

LOG_CHILD = """
import logging
from dsv41.ops.journal import setup_logging
setup_logging(logging.DEBUG)
log = logging.getLogger("dsv41.test")
log.error("disk on fire")
log.warning("slow shard")
log.info("loaded")
log.debug("detail")
try:
    1 / 0
except ZeroDivisionError:
    log.exception("boom")
"""


def test_priority_prefixes_under_journald(tmp_path):
    out = tmp_path / "stdout"
    with out.open("w") as handle:
        st = os.fstat(handle.fileno())
        result = run_child(LOG_CHILD, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}, stdout=handle)
    assert result.returncode == 0, result.stderr
    lines = out.read_text().splitlines()
    assert lines[:4] == ["<3>dsv41.test: disk on fire", "<4>dsv41.test: slow shard", "<6>dsv41.test: loaded",
                         "<7>dsv41.test: detail"]
    # every traceback line keeps the error priority, so the journal entry is not split into info lines
    assert lines[4] == "<3>dsv41.test: boom"
    assert len(lines) > 6 and all(line.startswith("<3>") for line in lines[4:])
    assert lines[-1] == "<3>ZeroDivisionError: division by zero"


def test_plain_lines_outside_journald(tmp_path):
    out = tmp_path / "stdout"
    with out.open("w") as handle:
        # JOURNAL_STREAM naming some other file (inherited from a parent) must not switch prefixes on
        result = run_child(LOG_CHILD, {"JOURNAL_STREAM": "1:1"}, stdout=handle)
    assert result.returncode == 0, result.stderr
    first = out.read_text().splitlines()[0]
    assert not first.startswith("<")
    assert first.endswith("ERROR dsv41.test: disk on fire")


# ------------------------------------------------------------------------------------------ end to end with serve

def serve_available() -> str | None:
    """None when `dsv41 serve` exists, else the reason it cannot be tested yet."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch is not installed here (the ops-only Nix check): `dsv41 serve` cannot run"
    probe = subprocess.run([PY, "-c", "from dsv41.cli import main; main(['serve', '--help'])"], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    if probe.returncode != 0 or "usage" not in probe.stdout.lower():
        return f"`dsv41 serve` is not available yet (rc={probe.returncode}: {(probe.stderr or probe.stdout).strip()[:200]})"
    return None


@pytest.mark.slow
def test_serve_notifies_systemd(notify_socket, tmp_path):
    reason = serve_available()
    if reason:
        print(reason)
        pytest.skip(reason)
    sock, path = notify_socket
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"}
    log = (tmp_path / "serve.log").open("w")
    cli = "import sys; from dsv41.cli import main; main(sys.argv[1:])"
    proc = subprocess.Popen([PY, "-c", cli, "serve", "--host", "127.0.0.1", "--port", "0"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    missing = []
    try:
        before_ready = receive_all(sock, until="READY=1", timeout=600)
        assert before_ready and "READY=1" in before_ready[-1], f"no READY=1; got {before_ready}"
        loading = before_ready[:-1]
        if not any("EXTEND_TIMEOUT_USEC=" in m for m in loading):
            missing.append("EXTEND_TIMEOUT_USEC during load")
        if not any("STATUS=" in m and "%" in m for m in loading):
            missing.append("STATUS= with a percentage during load")
        pings = receive_all(sock, until="WATCHDOG=1", timeout=5)
        if not any("WATCHDOG=1" in m for m in pings):
            missing.append("WATCHDOG=1 pings after READY (WATCHDOG_USEC=2 s)")
        proc.send_signal(signal.SIGTERM)
        after = receive_all(sock, until="STOPPING=1", timeout=60)
        if not any("STOPPING=1" in m for m in after):
            missing.append("STOPPING=1 on SIGTERM")
        assert proc.wait(timeout=120) == 0
        assert not missing, f"dsv41 serve did not send: {'; '.join(missing)} (loading messages: {loading})"
        assert "loading:" not in (tmp_path / "serve.log").read_text()  # no progress bar when stderr is no terminal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_launch_execs_serve_as_the_same_pid(tmp_path):
    """`dsv41 launch rank0` (the unit's ExecStart) must exec the server in place: READY=1 has to come from the PID
    systemd started, or NotifyAccess=main drops it. The sender's PID is read from SCM_CREDENTIALS."""
    reason = serve_available()
    if reason:
        print(reason)
        pytest.skip(reason)
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.bind(str(path))
    sock.settimeout(0.5)
    state = tmp_path / "state"
    state.mkdir()
    (state / "stopped-rank0.json").write_text("{}")
    env_file = tmp_path / "dsv41.env"
    env_file.write_text("DSV41_HOST=127.0.0.1\nDSV41_PORT=0\nDSV41_TP=1\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "NOTIFY_SOCKET": str(path),
           "STATE_DIRECTORY": str(state)}
    log = (tmp_path / "launch.log").open("w")
    proc = subprocess.Popen([PY, "-m", "dsv41.ops.cli", "launch", "rank0", "--env-file", str(env_file)], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        senders = set()
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, f"launch exited {proc.returncode}: {(tmp_path / 'launch.log').read_text()}"
            assert time.monotonic() < deadline, "no READY=1 within 600 s"
            try:
                data, ancdata, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except socket.timeout:
                continue
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    senders.add(struct.unpack("3i", payload[:12])[0])
            if b"READY=1" in data:
                break
        assert senders == {proc.pid}, (senders, proc.pid)
        assert not (state / "stopped-rank0.json").exists()  # a start clears the deliberate-stop marker
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
