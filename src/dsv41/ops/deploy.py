"""`nix run .#deploy -- --head HOST --worker HOST [--config FILE] [--dry-run]`: install dsv41 on both Sparks.

(`nix --extra-experimental-features 'nix-command flakes' run .#deploy -- ...` where flakes are not enabled.)

Steps (each printed as `[n] where: command`, and only printed with --dry-run):
 1. build the aarch64 closure, on the head by default (`--eval-store auto --store ssh-ng://head`: evaluation here,
    the build on a Spark, nothing to cross-compile), or locally with --build-on local;
 2. `nix copy` it to both nodes (ssh-ng with remote-program set, so a non-interactive ssh finds nix-daemon);
 3. on each node: remember the current profile generation, point /nix/var/nix/profiles/dsv41 at the new build
    (skipped when already there), create the service user (systemd-sysusers) and its polkit rule, write
    /etc/dsv41/dsv41.env (from --config; mode 0600, owned by the service user: it holds DSV41_TP_SECRET) and
    node.env, link the units from the profile into /etc/systemd/system, install the driver tmpfiles rules,
    daemon-reload, enable boot (+ watchdog timer on the head); then let the head's service user reach the worker's
    over ssh (its key, the worker's host key: the watchdog restarts rank 1 that way);
 4. restart: stop rank 0 then rank 1; on each node whose profile changed (and without --prepare, which does it),
    `dsv41 warm-kernels` compiles the rank's Triton kernels into its unit's cache (prepared/warm_kernels.py; a
    failure only warns); start rank 1 first (it retries the rendezvous until rank 0 listens), then
    rank 0 under the start lock, and gate on /health plus the canary;
 5. if the gate fails: roll each changed profile back (`nix-env --rollback`), restart the previous build, exit 1.
Re-running with nothing changed rewrites identical files, keeps the profile, and skips the restart when the pair
is healthy: idempotent.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dsv41.errors import ConfigError, DSV41Error
from dsv41.ops import host_commands
from dsv41.ops.host_commands import CommandRunner
from dsv41.ops.knobs import PROFILE, parse_env_file, unknown_keys
from dsv41.ops.units import support_file

NIX = ["nix", "--extra-experimental-features", "nix-command flakes"]
REMOTE_NIX_DAEMON = "/nix/var/nix/profiles/default/bin/nix-daemon"
UNITS = ("dsv41@.service", "dsv41-warm@.service", "dsv41-watchdog.service", "dsv41-watchdog.timer",
         "dsv41-boot.service")
UNIT_DIR = "/etc/systemd/system"
ENV_FILE = "/etc/dsv41/dsv41.env"
NODE_ENV_FILE = "/etc/dsv41/node.env"
SERVICE_USER = "dsv41"  # every unit runs as this user (systemd/dsv41.sysusers); docs/SECURITY.md
SERVICE_HOME = "/var/lib/dsv41"  # its home = the units' StateDirectory (the watchdog's ssh key lives here)
SYSUSERS_FILE = "/etc/sysusers.d/dsv41.conf"
POLKIT_FILE = "/etc/polkit-1/rules.d/50-dsv41.rules"
WORKER_HOST_KEY = "/etc/ssh/ssh_host_ed25519_key.pub"
TMPFILES = "/etc/tmpfiles.d/dsv41-driver.conf"
START_LOCK = "/var/lib/dsv41/start.lock"
OUT = "$OUT"  # the build's store path, known once step 1 ran


@dataclass
class Options:
    head: str
    worker: str
    flake: str
    config: Path | None = None
    dry_run: bool = False
    build_on: str = "head"
    system: str = "aarch64-linux"
    driver_libdir: str = "/usr/lib/aarch64-linux-gnu"
    ready_timeout: float = 900.0
    canary_level: str = "full"
    force_restart: bool = False
    prepare: bool = False


@dataclass
class Node:
    role: str  # head | worker
    host: str
    rank: str
    previous: str | None = None  # profile target before this deploy
    switched: bool = False


def store_url(host: str) -> str:
    return f"ssh-ng://{host}?remote-program={REMOTE_NIX_DAEMON}"


class DeployFailed(DSV41Error):
    exit_code = 1


@dataclass
class Deploy:
    opts: Options
    run: CommandRunner = host_commands.run
    out: Callable[[str], None] = print
    steps: int = 0
    out_path: str = OUT
    log: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ plumbing

    def step(self, where: str | None, argv: list[str], input: str | None = None, note: str = "",
             check: bool = True, timeout: float | None = 600) -> host_commands.Result:
        """Print (dry run) or run one command; `where` None = this machine."""
        self.steps += 1
        argv = [self.out_path if a == OUT else a.replace(OUT, self.out_path) for a in argv]
        line = f"[{self.steps}] {where or 'local'}: {shlex.join(argv)}"
        if input is not None:
            line += f"  <<< {len(input.splitlines())} line(s)"
        if note:
            line += f"  # {note}"
        self.out(line)
        if self.opts.dry_run:
            return host_commands.Result(0, "")
        result = self.run(argv, host=where, timeout=timeout, input=input)
        if check and not result.ok:
            raise DeployFailed(f"step {self.steps} failed on {where or 'local'} (rc {result.rc}): "
                               f"{shlex.join(argv)}\n{(result.stderr or result.stdout).strip()[-2000:]}")
        return result

    def nodes(self) -> list[Node]:
        return [Node("head", self.opts.head, "rank0"), Node("worker", self.opts.worker, "rank1")]

    # ------------------------------------------------------------------ the deploy

    def execute(self) -> int:
        opts = self.opts
        config_text = self.read_config()
        self.out(f"dsv41 deploy{' (dry run)' if opts.dry_run else ''}: head {opts.head}, worker {opts.worker}, "
                 f"flake {opts.flake}, {opts.system}, build on {opts.build_on}")
        if opts.dry_run:
            self.out(f"{OUT} = the store path step 1 builds")
        self.build()
        nodes = self.nodes()
        self.copy(nodes)
        changed = False
        for node in nodes:
            changed |= self.install(node, config_text)
        self.trust_worker(*nodes)
        if opts.prepare:
            self.prepare(nodes)
            changed = True
        healthy_before = False
        if opts.dry_run or (not changed and not opts.force_restart):
            status = self.step(opts.head, [f"{PROFILE}/bin/dsv41", "status"], check=False,
                               note="unchanged and healthy -> no restart")
            healthy_before = not opts.dry_run and status.ok
        if healthy_before:
            self.out("nothing changed and the pair is healthy: no restart")
        else:
            # a new closure may change a Triton kernel: compile them before the start (prepare already did)
            warm = [n for n in nodes if opts.dry_run or n.switched] if not opts.prepare else []
            self.restart(nodes, note="skipped when nothing changed and the pair is healthy" if opts.dry_run else "",
                         warm=warm)
        ok = self.gate(nodes[0])
        if opts.dry_run:
            self.out("on a failed gate: on each switched node `nix-env -p /nix/var/nix/profiles/dsv41 --rollback` "
                     "and `systemctl daemon-reload`, then the restart steps again; exit 1")
            self.out("dry run: nothing was run")
            return 0
        if ok:
            self.out(f"deployed {self.out_path}")
            return 0
        self.rollback(nodes)
        return 1

    def read_config(self) -> str | None:
        if self.opts.config is None:
            return None
        values = parse_env_file(self.opts.config)  # parse errors name the file and line
        unknown = unknown_keys(values)
        if unknown:
            raise ConfigError(f"{self.opts.config}: unknown knob(s) {', '.join(unknown)} "
                              "(see config/dsv41.env.example)")
        return self.opts.config.read_text()

    def build(self) -> None:
        opts = self.opts
        attr = f"{opts.flake}#packages.{opts.system}.default"
        if opts.build_on == "head":
            argv = [*NIX, "build", "--json", "--no-link", "--eval-store", "auto", "--store", store_url(opts.head), attr]
            note = "evaluate here, build on the head (aarch64)"
        else:
            argv = [*NIX, "build", "--json", "--no-link", attr]
            note = "build on this machine"
        result = self.step(None, argv, note=note, timeout=None)
        if not opts.dry_run:
            try:
                self.out_path = json.loads(result.stdout)[0]["outputs"]["out"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise DeployFailed(f"nix build printed no output path: {result.stdout[:300]!r}") from None
            self.out(f"built {self.out_path}")

    def copy(self, nodes: list[Node]) -> None:
        for node in nodes:
            if self.opts.build_on == "head" and node.role == "head":
                continue  # built there
            source = ["--from", store_url(self.opts.head)] if self.opts.build_on == "head" else []
            self.step(None, [*NIX, "copy", "-s", *source, "--to", store_url(node.host), OUT],
                      note=f"closure to the {node.role}", timeout=None)

    def install(self, node: Node, config_text: str | None) -> bool:
        """Switch the profile and install config/units on one node; returns whether anything changed."""
        host = node.host
        current = self.step(host, ["readlink", "-e", PROFILE], check=False, note="current generation")
        target = current.stdout.strip() if current.ok else ""
        node.previous = target if target.startswith("/nix/store/") else None
        changed = False
        if self.opts.dry_run or node.previous != self.out_path:
            self.step(host, ["nix-env", "-p", PROFILE, "--set", OUT], note="new profile generation")
            node.switched = not self.opts.dry_run
            changed = True
        self.step(host, ["install", "-D", "-m", "0644", "/dev/stdin", SYSUSERS_FILE],
                  input=support_file("dsv41.sysusers"))
        self.step(host, ["systemd-sysusers", SYSUSERS_FILE], note=f"the service user {SERVICE_USER}")
        self.step(host, ["install", "-d", "-o", SERVICE_USER, "-g", SERVICE_USER, "-m", "0755", SERVICE_HOME])
        self.step(host, ["install", "-D", "-m", "0644", "/dev/stdin", POLKIT_FILE], input=support_file("dsv41.rules"),
                  note=f"{SERVICE_USER} may start/stop/restart the dsv41 units only")
        owner = ["-o", SERVICE_USER, "-g", SERVICE_USER, "-m", "0600"]  # DSV41_TP_SECRET: service user only
        if config_text is not None:
            before = self.step(host, ["cat", ENV_FILE], check=False, note="current env file")
            changed |= not before.ok or before.stdout != config_text
            self.step(host, ["install", "-D", *owner, "/dev/stdin", ENV_FILE], input=config_text)
        else:
            self.step(host, ["test", "-f", ENV_FILE], note="no --config: the node must have its env file")
            self.step(host, ["chown", f"{SERVICE_USER}:{SERVICE_USER}", ENV_FILE])
            self.step(host, ["chmod", "0600", ENV_FILE])
        node_env = f"DSV41_LOCAL_RANKS={node.rank}\n"
        if node.role == "head":
            node_env += f"DSV41_WORKER_SSH={worker_ssh(self.opts.worker)}\n"
        self.step(host, ["install", "-D", "-m", "0644", "/dev/stdin", NODE_ENV_FILE], input=node_env)
        for unit in UNITS:
            self.step(host, ["ln", "-sfn", f"{PROFILE}/lib/systemd/system/{unit}", f"{UNIT_DIR}/{unit}"])
        self.step(host, ["sh", "-c", f"{PROFILE}/bin/dsv41 driver-tmpfiles --libdir {self.opts.driver_libdir} "
                                     f"> {TMPFILES} && systemd-tmpfiles --create {TMPFILES}"],
                  note="/run/opengl-driver/lib -> host libcuda/libnvidia only")
        self.step(host, ["systemctl", "daemon-reload"])
        enable = ["dsv41-boot.service"] + (["dsv41-watchdog.timer"] if node.role == "head" else [])
        self.step(host, ["systemctl", "enable", *enable])
        if node.role == "head":
            self.step(host, ["systemctl", "start", "dsv41-watchdog.timer"])
        return changed

    def trust_worker(self, head: Node, worker: Node) -> None:
        """The head's service user gets an ssh key (made once) that the worker's service user accepts with
        `restrict` (no pty, no forwarding), and the worker's host key as read over deploy's own ssh connection,
        so the watchdog's BatchMode ssh neither prompts nor trusts a first answer."""
        home_ssh = f"{SERVICE_HOME}/.ssh"
        host_key = self.step(worker.host, ["cat", WORKER_HOST_KEY], note="the worker's host key")
        make_key = (f"mkdir -p -m 0700 {home_ssh} && {{ test -f {home_ssh}/id_ed25519 || ssh-keygen -q -t ed25519 "
                    f'-N "" -C dsv41-watchdog -f {home_ssh}/id_ed25519; }} && cat {home_ssh}/id_ed25519.pub')
        public = self.step(head.host, ["runuser", "-u", SERVICE_USER, "--", "sh", "-c", make_key],
                           note="the watchdog's ssh key (made once)")
        if self.opts.dry_run:
            host_key.stdout, public.stdout = "<the worker's host key>", "<the key step above printed>"
        known = f"{ssh_host(self.opts.worker)} {_one_line(host_key.stdout, WORKER_HOST_KEY)}\n"
        authorized = f"restrict {_one_line(public.stdout, 'the head service user key')}\n"
        owned = ["-o", SERVICE_USER, "-g", SERVICE_USER]
        self.step(head.host, ["install", *owned, "-m", "0644", "/dev/stdin", f"{home_ssh}/known_hosts"], input=known)
        self.step(worker.host, ["install", "-d", *owned, "-m", "0700", home_ssh])
        self.step(worker.host, ["install", *owned, "-m", "0600", "/dev/stdin", f"{home_ssh}/authorized_keys"],
                  input=authorized)
    def prepare(self, nodes: list[Node]) -> None:
        """--prepare: stop both ranks (the build needs the GPU the rank holds), then write each node's prepared
        folder from its env file (DSV41_MODEL, DSV41_PREPARED, DSV41_TP, ...; resumable, a no-op when current)."""
        for node in nodes:
            self.step(node.host, ["systemctl", "stop", f"dsv41@{node.rank}.service"], note="before prepare")
        for node in nodes:
            self.step(node.host, [f"{PROFILE}/bin/dsv41", "prepare", "--env-file", ENV_FILE, "--rank",
                                  node.rank.removeprefix("rank")], timeout=None,
                      note="prepared folder of this rank (docs/WEIGHTS.md)")

    def restart(self, nodes: list[Node], note: str = "", warm: list[Node] = ()) -> None:
        head, worker = nodes
        # rank 0 first: its stop leaves the deliberate-stop marker, so the watchdog stands down meanwhile
        self.step(head.host, ["systemctl", "stop", "dsv41@rank0.service", "dsv41-warm@rank0.service"], note=note)
        self.step(worker.host, ["systemctl", "stop", "dsv41@rank1.service", "dsv41-warm@rank1.service"], note=note)
        for node in warm:  # the rank's start once, with the GPU free, into the unit's Triton cache (as its user)
            result = self.step(node.host, [f"{PROFILE}/bin/dsv41", "warm-kernels", "--env-file", ENV_FILE, "--rank",
                                           node.rank.removeprefix("rank")], check=False, timeout=None,
                               note="compile the Triton kernels before the start (skips without a prepared folder)")
            if not result.ok:
                self.out(f"warning: {node.host}: warm-kernels failed (rc {result.rc}); {node.rank} compiles the "
                         f"Triton kernels at its start instead")
        self.step(worker.host, ["systemctl", "reset-failed", "dsv41@rank1.service"], check=False)
        # rank 1 first and without blocking: its READY needs rank 0, and it retries the rendezvous meanwhile
        self.step(worker.host, ["systemctl", "start", "--no-block", "dsv41@rank1.service"],
                  note="rank 1 waits for rank 0's rendezvous")
        self.step(head.host, ["systemctl", "reset-failed", "dsv41@rank0.service"], check=False)
        self.step(head.host, ["systemctl", "start", "--no-block", "dsv41@rank0.service"])

    def gate(self, head: Node) -> bool:
        """/health ok within the ready timeout, then the canary, on the head, holding the start lock."""
        argv = ["flock", START_LOCK, f"{PROFILE}/bin/dsv41", "canary", "--wait", f"{self.opts.ready_timeout:g}",
                "--level", self.opts.canary_level]
        result = self.step(head.host, argv, check=False, note="gate: /health + canary", timeout=None)
        if not result.ok:
            self.out(f"gate failed:\n{(result.stdout + result.stderr).strip()[-3000:]}")
        return result.ok

    def rollback(self, nodes: list[Node]) -> None:
        self.out("rolling back")
        for node in nodes:
            if not node.switched:
                continue
            if node.previous:
                self.step(node.host, ["nix-env", "-p", PROFILE, "--rollback"], check=False,
                          note=f"back to {node.previous}")
                self.step(node.host, ["systemctl", "daemon-reload"], check=False)
            else:
                self.out(f"{node.host}: no previous generation to roll back to; stopping {node.rank}")
        if any(n.previous for n in nodes):
            self.restart(nodes)
        else:
            for node in nodes:
                self.step(node.host, ["systemctl", "stop", f"dsv41@{node.rank}.service"], check=False)
        self.out("deploy FAILED: the gate did not pass; the previous build is back" if any(n.previous for n in nodes)
                 else "deploy FAILED: the gate did not pass; the ranks are stopped")


def ssh_host(destination: str) -> str:
    """`root@spark-b` -> `spark-b`."""
    return destination.rpartition("@")[2]


def worker_ssh(destination: str) -> str:
    """The head's watchdog reaches the worker as the service user (its key, authorized there with `restrict`)."""
    return f"{SERVICE_USER}@{ssh_host(destination)}"


def _one_line(text: str, what: str) -> str:
    line = text.strip()
    if not line or "\n" in line:
        raise DeployFailed(f"{what}: expected one key line, got {text[:200]!r}")
    return line


def add_arguments(p: argparse.ArgumentParser) -> None:
    """deploy's options: on its own parser (`nix run .#deploy --`) and on `dsv41 deploy`."""
    from dsv41.cli import number  # argparse and the stdlib only
    p.add_argument("--head", required=True, help="ssh destination of the head (rank 0), e.g. root@spark-a")
    p.add_argument("--worker", required=True, help="ssh destination of the worker (rank 1), e.g. root@spark-b")
    p.add_argument("--config", type=Path, help="env file installed as /etc/dsv41/dsv41.env on both nodes")
    p.add_argument("--dry-run", action="store_true", help="print every step, run nothing")
    p.add_argument("--flake", default=".", help="flake to deploy (the app passes its own source)")
    p.add_argument("--build-on", choices=("head", "local"), default="head",
                   help="build on the head (default) or on this machine (needs aarch64 or a remote builder)")
    p.add_argument("--system", default="aarch64-linux", help="the nodes' Nix system (default aarch64-linux)")
    p.add_argument("--driver-libdir", default="/usr/lib/aarch64-linux-gnu",
                   help="where the nodes' NVIDIA driver libraries live")
    p.add_argument("--ready-timeout", type=number(float, 0, above=True), default=900.0, metavar="S",
                   help="seconds to wait for /health before the canary (default 900)")
    p.add_argument("--canary-level", choices=("full", "structural"), default="full")
    p.add_argument("--restart", action="store_true", help="restart even when nothing changed")
    p.add_argument("--prepare", action="store_true",
                   help="run `dsv41 prepare` on each node (its rank's prepared folder) before the restart")


def options(args: argparse.Namespace) -> Options:
    if args.head == args.worker:
        raise ConfigError("--head and --worker must be different hosts")
    return Options(head=args.head, worker=args.worker, flake=args.flake, config=args.config, dry_run=args.dry_run,
                   build_on=args.build_on, system=args.system, driver_libdir=args.driver_libdir,
                   ready_timeout=args.ready_timeout, canary_level=args.canary_level, force_restart=args.restart,
                   prepare=getattr(args, "prepare", False))


def parse_args(argv: list[str] | None) -> Options:
    from dsv41.cli import OneLineParser  # argparse and the stdlib only

    p = OneLineParser(prog="nix run .#deploy --", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return options(args)
    except ConfigError as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None, run: CommandRunner = host_commands.run) -> int:
    opts = parse_args(argv)
    try:
        return Deploy(opts, run).execute()
    except DSV41Error as exc:
        print(f"deploy: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
