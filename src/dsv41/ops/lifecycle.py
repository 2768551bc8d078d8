"""The rank services' life cycle around the server: launch, deliberate-stop markers, start at boot.

A stop marker (`<state>/stopped-rankN.json`) records that the last stop of a rank was deliberate: `systemctl stop`
ends the unit with SERVICE_RESULT=success outside a system shutdown. `launch` removes it, so a restart (stop +
start) leaves none behind. The boot unit and the watchdog stand down while a marker exists.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Mapping

from dsv41.ops.host_commands import CommandRunner
from dsv41.ops.knobs import ops_value, rank_of_instance, serve_argv

log = logging.getLogger(__name__)

STATE_DIR = Path("/var/lib/dsv41")
CLI_MAIN = "import sys; from dsv41.cli import main; sys.exit(main(sys.argv[1:]))"


def state_dir(env: Mapping[str, str]) -> Path:
    """systemd's StateDirectory= (exported as STATE_DIRECTORY), else /var/lib/dsv41."""
    value = env.get("STATE_DIRECTORY", "").split(":")[0]
    return Path(value) if value else STATE_DIR


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def marker_path(state: Path, instance: str) -> Path:
    return state / f"stopped-{instance}.json"


def read_marker(state: Path, instance: str) -> dict | None:
    try:
        return json.loads(marker_path(state, instance).read_text())
    except (OSError, ValueError):
        return None


def launch_command(instance: str, env: Mapping[str, str]) -> list[str]:
    """The exact command `dsv41@<instance>` runs: `python -c <cli> serve <flags from the env file> --rank N`."""
    return [sys.executable, "-c", CLI_MAIN, "serve", *serve_argv(env, rank_of_instance(instance))]


def launch(instance: str, env: Mapping[str, str]) -> None:
    """Clear this rank's stop marker and exec the server in place (it stays systemd's main PID for sd_notify).

    The Nix wrapper of `dsv41` extends sys.path inside the process rather than through the environment, so the
    exec'd interpreter gets this process's sys.path as PYTHONPATH to find the same packages.
    """
    argv = launch_command(instance, env)
    marker_path(state_dir(env), instance).unlink(missing_ok=True)
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    log.info("exec dsv41 %s", " ".join(argv[3:]))
    os.execve(argv[0], argv, child_env)


def record_stop(instance: str, env: Mapping[str, str], run: CommandRunner, now: float | None = None) -> bool:
    """ExecStopPost: write the marker when the stop was asked for (success, and the system is not shutting down)."""
    result = env.get("SERVICE_RESULT", "")
    if result != "success":
        return False  # a crash, timeout or watchdog kill is not deliberate
    system = run(["systemctl", "is-system-running"]).stdout.strip()
    if system == "stopping":
        return False  # stopped by a shutdown: boot should start it again
    state = state_dir(env)
    state.mkdir(parents=True, exist_ok=True)
    marker = {"instance": instance, "time": time.time() if now is None else now, "boot_id": boot_id()}
    marker_path(state, instance).write_text(json.dumps(marker) + "\n")
    return True


def local_ranks(env: Mapping[str, str]) -> list[str]:
    return ops_value(env, "DSV41_LOCAL_RANKS").split()


def boot(env: Mapping[str, str], run: CommandRunner) -> list[str]:
    """Start this node's ranks unless their last stop was deliberate. Returns the instances started."""
    state = state_dir(env)
    started = []
    ranks = local_ranks(env)
    if not ranks:
        log.warning("DSV41_LOCAL_RANKS is empty (no /etc/dsv41/node.env?): nothing to start")
    for instance in ranks:
        if read_marker(state, instance) is not None:
            log.info("%s: last stop was deliberate (%s); not starting", instance, marker_path(state, instance))
            continue
        result = run(["systemctl", "start", "--no-block", f"dsv41@{instance}.service"])
        if result.ok:
            started.append(instance)
        else:
            log.error("%s: systemctl start failed: %s", instance, result.stderr.strip())
    return started
