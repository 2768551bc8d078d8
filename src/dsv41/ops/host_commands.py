"""Running host commands (systemctl, nix, ssh) through one seam, so ops logic is testable without systemd.

`host=None` runs locally; otherwise the command goes through `ssh -o BatchMode=yes HOST -- <quoted argv>`.
Tests pass their own runner that records every command and answers from real processes.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

SSH = ("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10")
# The service user's own key and known hosts (deploy makes them): an operator's root shell on the head reaches the
# worker's service user with them too (`dsv41 status`, `dsv41 preflight`), as the watchdog does.
SERVICE_SSH_DIR = Path("/var/lib/dsv41/.ssh")


@dataclass
class Result:
    rc: int
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.rc == 0


class CommandRunner(Protocol):
    def __call__(self, argv: Sequence[str], host: str | None = None, timeout: float | None = None,
                 input: str | None = None) -> Result: ...


def remote_argv(argv: Sequence[str], host: str | None) -> list[str]:
    """The local argv that runs `argv` on `host` (unchanged when host is None)."""
    if host is None:
        return list(argv)
    return [*SSH, *service_identity(host), host, "--", shlex.join(argv)]


def service_identity(host: str, ssh_dir: Path = SERVICE_SSH_DIR) -> list[str]:
    """ssh options for a `dsv41@...` destination: the service user's key and known hosts, when this process can
    read them (other destinations keep the caller's own ssh setup)."""
    key, known = ssh_dir / "id_ed25519", ssh_dir / "known_hosts"
    if not host.startswith("dsv41@") or not os.access(key, os.R_OK):
        return []
    options = ["-i", str(key), "-o", "IdentitiesOnly=yes"]
    if os.access(known, os.R_OK):
        options += ["-o", f"UserKnownHostsFile={known}"]
    return options


def run(argv: Sequence[str], host: str | None = None, timeout: float | None = 120,
        input: str | None = None) -> Result:
    """The real runner: a subprocess, via ssh for a remote host. A missing program is rc 127, never a crash."""
    full = remote_argv(argv, host)
    try:
        proc = subprocess.run(full, capture_output=True, text=True, timeout=timeout, input=input)
    except FileNotFoundError:
        return Result(127, "", f"{full[0]}: command not found")
    except subprocess.TimeoutExpired:
        return Result(124, "", f"timed out after {timeout} s: {shlex.join(full)}")
    return Result(proc.returncode, proc.stdout, proc.stderr)
