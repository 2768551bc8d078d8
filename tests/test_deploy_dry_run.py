"""`nix run .#deploy -- --dry-run` step by step, the deploy decisions (idempotence, rollback), the Nix app wrapper
running the real deploy program, and the env file -> `dsv41 serve` argv mapping it installs."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsv41.ops.deploy import Deploy, Options, main as deploy_main
from dsv41.ops.host_commands import Result
from dsv41.ops.knobs import OPS_KNOBS, SERVE_KNOBS, parse_env_file, serve_argv, unknown_keys

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "config" / "dsv41.env.example"
PROFILE = "/nix/var/nix/profiles/dsv41"
HEAD, WORKER = "root@spark-a", "root@spark-b"
STORE = "'ssh-ng://{}?remote-program=/nix/var/nix/profiles/default/bin/nix-daemon'"
NIX = "nix --extra-experimental-features 'nix-command flakes'"
SYSUSERS_LINES = len((REPO / "systemd" / "dsv41.sysusers").read_text().splitlines())
POLKIT_LINES = len((REPO / "systemd" / "dsv41.rules").read_text().splitlines())
UNITS = ["dsv41@.service", "dsv41-warm@.service", "dsv41-watchdog.service", "dsv41-watchdog.timer",
         "dsv41-boot.service"]


def node_steps(host: str, config_lines: int, node_lines: int, head: bool) -> list[str]:
    steps = [
        f"{host}: readlink -e {PROFILE}  # current generation",
        f"{host}: nix-env -p {PROFILE} --set '$OUT'  # new profile generation",
        f"{host}: install -D -m 0644 /dev/stdin /etc/sysusers.d/dsv41.conf  <<< {SYSUSERS_LINES} line(s)",
        f"{host}: systemd-sysusers /etc/sysusers.d/dsv41.conf  # the service user dsv41",
        f"{host}: install -d -o dsv41 -g dsv41 -m 0755 /var/lib/dsv41",
        f"{host}: install -D -m 0644 /dev/stdin /etc/polkit-1/rules.d/50-dsv41.rules  <<< {POLKIT_LINES} line(s)"
        "  # dsv41 may start/stop/restart the dsv41 units only",
        f"{host}: cat /etc/dsv41/dsv41.env  # current env file",
        f"{host}: install -D -o dsv41 -g dsv41 -m 0600 /dev/stdin /etc/dsv41/dsv41.env  <<< {config_lines} line(s)",
        f"{host}: install -D -m 0644 /dev/stdin /etc/dsv41/node.env  <<< {node_lines} line(s)",
    ]
    steps += [f"{host}: ln -sfn {PROFILE}/lib/systemd/system/{u} /etc/systemd/system/{u}" for u in UNITS]
    steps += [
        f"{host}: sh -c '{PROFILE}/bin/dsv41 driver-tmpfiles --libdir /usr/lib/aarch64-linux-gnu > "
        "/etc/tmpfiles.d/dsv41-driver.conf && systemd-tmpfiles --create /etc/tmpfiles.d/dsv41-driver.conf'"
        "  # /run/opengl-driver/lib -> host libcuda/libnvidia only",
        f"{host}: systemctl daemon-reload",
        f"{host}: systemctl enable dsv41-boot.service" + (" dsv41-watchdog.timer" if head else ""),
    ]
    if head:
        steps.append(f"{host}: systemctl start dsv41-watchdog.timer")
    return steps


def expected_dry_run(config_lines: int) -> list[str]:
    skip = "  # skipped when nothing changed and the pair is healthy"
    steps = [
        f"local: {NIX} build --json --no-link --eval-store auto --store {STORE.format(HEAD)} "
        "'/src#packages.aarch64-linux.default'  # evaluate here, build on the head (aarch64)",
        f"local: {NIX} copy -s --from {STORE.format(HEAD)} --to {STORE.format(WORKER)} '$OUT'  # closure to the worker",
        *node_steps(HEAD, config_lines, 2, head=True),
        *node_steps(WORKER, config_lines, 1, head=False),
        f"{WORKER}: cat /etc/ssh/ssh_host_ed25519_key.pub  # the worker's host key",
        f"{HEAD}: runuser -u dsv41 -- sh -c 'mkdir -p -m 0700 /var/lib/dsv41/.ssh && {{ test -f "
        "/var/lib/dsv41/.ssh/id_ed25519 || ssh-keygen -q -t ed25519 -N \"\" -C dsv41-watchdog -f "
        "/var/lib/dsv41/.ssh/id_ed25519; } && cat /var/lib/dsv41/.ssh/id_ed25519.pub'  # the watchdog's ssh key "
        "(made once)",
        f"{HEAD}: install -o dsv41 -g dsv41 -m 0644 /dev/stdin /var/lib/dsv41/.ssh/known_hosts  <<< 1 line(s)",
        f"{WORKER}: install -d -o dsv41 -g dsv41 -m 0700 /var/lib/dsv41/.ssh",
        f"{WORKER}: install -o dsv41 -g dsv41 -m 0600 /dev/stdin /var/lib/dsv41/.ssh/authorized_keys  <<< 1 line(s)",
        f"{HEAD}: {PROFILE}/bin/dsv41 status  # unchanged and healthy -> no restart",
        f"{HEAD}: systemctl stop dsv41@rank0.service dsv41-warm@rank0.service" + skip,
        f"{WORKER}: systemctl stop dsv41@rank1.service dsv41-warm@rank1.service" + skip,
        *(f"{host}: {PROFILE}/bin/dsv41 warm-kernels --env-file /etc/dsv41/dsv41.env --rank {rank}  # compile the "
          "Triton kernels before the start (skips without a prepared folder)" for host, rank in ((HEAD, 0), (WORKER, 1))),
        f"{WORKER}: systemctl reset-failed dsv41@rank1.service",
        f"{WORKER}: systemctl start --no-block dsv41@rank1.service  # rank 1 waits for rank 0's rendezvous",
        f"{HEAD}: systemctl reset-failed dsv41@rank0.service",
        f"{HEAD}: systemctl start --no-block dsv41@rank0.service",
        f"{HEAD}: flock /var/lib/dsv41/start.lock {PROFILE}/bin/dsv41 canary --wait 900 --level full"
        "  # gate: /health + canary",
    ]
    return [f"[{i}] {step}" for i, step in enumerate(steps, 1)]


def dry_run(argv: list[str]) -> tuple[int, list[str]]:
    lines: list[str] = []

    def never(*args, **kwargs):
        raise AssertionError("a dry run must not run anything")

    opts = Options(head=HEAD, worker=WORKER, flake="/src", dry_run=True)
    for flag, value in zip(argv[::2], argv[1::2]):
        setattr(opts, flag, value)
    rc = Deploy(opts, run=never, out=lines.append).execute()
    return rc, lines


def test_dry_run_prints_every_step_in_order():
    config_lines = len(EXAMPLE.read_text().splitlines())
    rc, lines = dry_run(["config", EXAMPLE])
    assert rc == 0
    assert lines[0] == f"dsv41 deploy (dry run): head {HEAD}, worker {WORKER}, flake /src, aarch64-linux, build on head"
    assert lines[1] == "$OUT = the store path step 1 builds"
    steps = [line for line in lines if line.startswith("[")]
    expected = expected_dry_run(config_lines)
    for got, want in zip(steps, expected):
        assert got == want
    assert len(steps) == len(expected)
    assert lines[-2].startswith("on a failed gate: on each switched node `nix-env -p /nix/var/nix/profiles/dsv41 "
                                "--rollback`")
    assert lines[-1] == "dry run: nothing was run"


def test_dry_run_order_facts():
    """The facts behind the order, independent of wording: worker starts before head, gate last, both nodes set."""
    _, lines = dry_run(["config", EXAMPLE])
    index = {name: next(i for i, line in enumerate(lines) if name in line) for name in
             ("start --no-block dsv41@rank1", "start --no-block dsv41@rank0", "canary", "copy -s")}
    assert index["copy -s"] < index["start --no-block dsv41@rank1"] < index["start --no-block dsv41@rank0"] \
        < index["canary"]
    assert sum("--set '$OUT'" in line for line in lines) == 2


def test_local_build_copies_to_both_nodes():
    _, lines = dry_run(["build_on", "local"])
    assert lines[2] == f"[1] local: {NIX} build --json --no-link '/src#packages.aarch64-linux.default'  " \
                       "# build on this machine"
    assert lines[3] == f"[2] local: {NIX} copy -s --to {STORE.format(HEAD)} '$OUT'  # closure to the head"
    assert lines[4] == f"[3] local: {NIX} copy -s --to {STORE.format(WORKER)} '$OUT'  # closure to the worker"
    # without --config each node must already have its env file
    at = lines.index(f"[10] {HEAD}: test -f /etc/dsv41/dsv41.env  # no --config: the node must have its env file")
    # ... and is made the service user's, 0600 (it holds DSV41_TP_SECRET), also when an older deploy left it 0644
    assert lines[at + 1:at + 3] == [f"[11] {HEAD}: chown dsv41:dsv41 /etc/dsv41/dsv41.env",
                                    f"[12] {HEAD}: chmod 0600 /etc/dsv41/dsv41.env"]


def test_bad_config_is_refused_before_anything_runs(tmp_path, capsys):
    bad = tmp_path / "dsv41.env"
    bad.write_text("DSV41_MODEL=/srv/model\nDSV41_PROT=8000\n")
    assert deploy_main(["--head", HEAD, "--worker", WORKER, "--config", str(bad), "--dry-run"]) == 2
    assert "unknown knob(s) DSV41_PROT" in capsys.readouterr().err
    bad.write_text("DSV41_MODEL /srv/model\n")
    assert deploy_main(["--head", HEAD, "--worker", WORKER, "--config", str(bad), "--dry-run"]) == 2
    assert f"{bad}:1: expected KEY=VALUE" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ run mode decisions

class Nodes:
    """Stands in for nix and ssh (no Sparks here): keeps each node's profile, env files and rank states."""

    def __init__(self, gate_ok: bool = True, built: str = "/nix/store/new-dsv41-appliance"):
        self.built, self.gate_ok = built, gate_ok
        self.profile = {HEAD: None, WORKER: None}
        self.generations = {HEAD: [], WORKER: []}
        self.files: dict[tuple[str, str], str] = {}
        self.active = {HEAD: False, WORKER: False}
        self.calls: list[tuple[str | None, str]] = []
        self.warm_rc = 0  # `dsv41 warm-kernels` (compiles the rank's Triton kernels)

    def __call__(self, argv, host=None, timeout=None, input=None) -> Result:
        self.calls.append((host, shlex.join(argv)))
        cmd = argv[0]
        if host is None:
            if argv[3] == "build":
                return Result(0, json.dumps([{"drvPath": "/nix/store/x.drv", "outputs": {"out": self.built}}]))
            return Result(0)  # nix copy
        if cmd == "readlink":
            current = self.profile[host]
            return Result(0, current + "\n") if current else Result(1, "", "")
        if cmd == "nix-env":
            if argv[3] == "--set":
                self.generations[host].append(argv[4])
            else:  # --rollback
                self.generations[host].pop()
            self.profile[host] = self.generations[host][-1] if self.generations[host] else None
            return Result(0)
        if cmd == "cat" and argv[1] == "/etc/ssh/ssh_host_ed25519_key.pub":
            return Result(0, "ssh-ed25519 AAAAworker root@spark-b\n")
        if cmd == "runuser":  # the service user's key, made once
            return Result(0, "ssh-ed25519 AAAAhead dsv41-watchdog\n")
        if cmd == "cat":
            text = self.files.get((host, argv[1]))
            return Result(0, text) if text is not None else Result(1, "", "No such file")
        if cmd == "install":
            self.files[(host, argv[-1])] = input
            return Result(0)
        if cmd.endswith("/dsv41") and argv[1] == "status":
            return Result(0 if all(self.active.values()) else 1)
        if cmd.endswith("/dsv41") and argv[1] == "warm-kernels":
            assert not self.active[host], "warm-kernels needs the GPU: the rank must be stopped"
            return Result(self.warm_rc, "", "warning: the start failed" if self.warm_rc else "")
        if cmd == "flock":  # the gate
            return Result(0 if self.gate_ok else 1, "canary: FAILED: forced-tool-call" if not self.gate_ok else "ok")
        if cmd == "systemctl" and argv[1] == "start" and "--no-block" in argv:
            self.active[host] = True
        if cmd == "systemctl" and argv[1] == "stop":
            self.active[host] = False
        return Result(0)

    def commands(self, host):
        return [c for h, c in self.calls if h == host]


def deploy(nodes: Nodes, config: Path = EXAMPLE) -> tuple[int, list[str]]:
    lines: list[str] = []
    opts = Options(head=HEAD, worker=WORKER, flake="/src", config=config)
    return Deploy(opts, run=nodes, out=lines.append).execute(), lines


def test_first_deploy_then_idempotent_rerun():
    nodes = Nodes()
    rc, lines = deploy(nodes)
    assert rc == 0 and lines[-1] == "deployed /nix/store/new-dsv41-appliance"
    assert nodes.profile == {HEAD: nodes.built, WORKER: nodes.built}
    assert nodes.files[(HEAD, "/etc/dsv41/dsv41.env")] == EXAMPLE.read_text()
    assert nodes.files[(HEAD, "/etc/dsv41/node.env")] == "DSV41_LOCAL_RANKS=rank0\nDSV41_WORKER_SSH=dsv41@spark-b\n"
    # the head's service user reaches the worker's with its own key, restricted, and knows the worker's host key
    assert nodes.files[(WORKER, "/var/lib/dsv41/.ssh/authorized_keys")] == "restrict ssh-ed25519 AAAAhead dsv41-watchdog\n"
    assert nodes.files[(HEAD, "/var/lib/dsv41/.ssh/known_hosts")] == "spark-b ssh-ed25519 AAAAworker root@spark-b\n"
    assert nodes.files[(WORKER, "/etc/dsv41/node.env")] == "DSV41_LOCAL_RANKS=rank1\n"
    order = [c for _, c in nodes.calls if "start --no-block" in c]
    assert order == ["systemctl start --no-block dsv41@rank1.service", "systemctl start --no-block dsv41@rank0.service"]

    nodes.calls.clear()
    rc, lines = deploy(nodes)
    assert rc == 0
    assert "nothing changed and the pair is healthy: no restart" in lines
    assert not any("--set" in c or "systemctl stop" in c or "start --no-block" in c for _, c in nodes.calls)
    assert nodes.generations == {HEAD: [nodes.built], WORKER: [nodes.built]}


def test_changed_config_restarts_without_new_generation(tmp_path):
    nodes = Nodes()
    deploy(nodes)
    changed = tmp_path / "dsv41.env"
    changed.write_text(EXAMPLE.read_text().replace("DSV41_PORT=8000", "DSV41_PORT=8001"))
    nodes.calls.clear()
    rc, _ = deploy(nodes, changed)
    assert rc == 0
    assert not any("--set" in c for _, c in nodes.calls)
    assert any("start --no-block dsv41@rank0" in c for _, c in nodes.calls)


def test_a_new_closure_compiles_the_kernels_before_the_start():
    """Each switched node runs `dsv41 warm-kernels` with its rank stopped, before the rank starts (so the start is a
    restart); a config-only change does not; a failed warm step warns and the deploy goes on."""
    nodes = Nodes()
    deploy(nodes)
    warm = f"{PROFILE}/bin/dsv41 warm-kernels --env-file /etc/dsv41/dsv41.env --rank "
    for host, rank in ((HEAD, 0), (WORKER, 1)):
        cmds = nodes.commands(host)
        assert cmds.index(f"systemctl stop dsv41@rank{rank}.service dsv41-warm@rank{rank}.service") \
            < cmds.index(f"{warm}{rank}") < cmds.index(f"systemctl start --no-block dsv41@rank{rank}.service")
    nodes.calls.clear()
    nodes.active[HEAD] = False  # unhealthy: restarted, same closure -> its kernels are in the cache already
    deploy(nodes)
    assert any("start --no-block" in c for _, c in nodes.calls) and not any("warm-kernels" in c for _, c in nodes.calls)
    nodes.built, nodes.warm_rc = "/nix/store/newer-dsv41-appliance", 1
    rc, lines = deploy(nodes)
    assert rc == 0 and f"warning: {HEAD}: warm-kernels failed (rc 1); rank0 compiles the Triton kernels at its " \
                      "start instead" in lines


def test_failed_gate_rolls_back_to_the_previous_build():
    nodes = Nodes()
    deploy(nodes)
    old = nodes.built
    nodes.built, nodes.gate_ok = "/nix/store/broken-dsv41-appliance", False
    nodes.calls.clear()
    rc, lines = deploy(nodes)
    assert rc == 1
    assert nodes.profile == {HEAD: old, WORKER: old}
    assert "gate failed:\ncanary: FAILED: forced-tool-call" in lines
    assert lines[-1] == "deploy FAILED: the gate did not pass; the previous build is back"
    head = nodes.commands(HEAD)
    rollback_at = head.index(f"nix-env -p {PROFILE} --rollback")
    assert "systemctl start --no-block dsv41@rank0.service" in head[rollback_at:]
    assert f"nix-env -p {PROFILE} --rollback" in nodes.commands(WORKER)


def test_failed_first_deploy_stops_the_ranks():
    nodes = Nodes(gate_ok=False)
    rc, lines = deploy(nodes)
    assert rc == 1 and lines[-1] == "deploy FAILED: the gate did not pass; the ranks are stopped"
    assert "systemctl stop dsv41@rank0.service" in nodes.commands(HEAD)[-1]
    assert "systemctl stop dsv41@rank1.service" in nodes.commands(WORKER)[-1]


def test_dsv41_deploy_is_the_deploy_program():
    """`dsv41 deploy` (a subcommand like the other ops commands) prints the same dry run as the program behind
    `nix run .#deploy --`, and has its own --help."""
    argv = ["--head", HEAD, "--worker", WORKER, "--config", str(EXAMPLE), "--flake", "/src", "--dry-run"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}

    def run(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True, env=env, timeout=60)

    sub, program = run("dsv41.cli", "deploy", *argv), run("dsv41.ops.deploy", *argv)
    assert sub.returncode == 0 and program.returncode == 0, sub.stderr + program.stderr
    assert sub.stdout == program.stdout and sub.stdout.rstrip().endswith("dry run: nothing was run")
    usage = run("dsv41.cli", "deploy", "--help")
    assert usage.returncode == 0 and usage.stdout.startswith("usage: dsv41 deploy") and "--dry-run" in usage.stdout
    same = run("dsv41.cli", "deploy", "--head", HEAD, "--worker", HEAD)
    assert same.returncode == 2 and same.stderr == "dsv41: error: --head and --worker must be different hosts\n"


# ------------------------------------------------------------------------------------------ the Nix app wrapper

def test_nix_app_wrapper_runs_the_deploy_program(tmp_path):
    """The exact script nix/appliance.nix renders for apps.deploy, run for real with --dry-run."""
    tool = shutil.which("nix-instantiate")
    if tool is None:
        print("nix-instantiate not installed (apt-get install nix-bin): wrapper text not checked")
        pytest.skip("nix-instantiate not installed")
    expr = f'(import ./nix/appliance.nix {{ }}).deployScript {{ python = "{sys.executable}"; flake = "{REPO}"; }}'
    result = subprocess.run([tool, "--eval", "--strict", "--json", "-E", expr], cwd=REPO, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    script = tmp_path / "deploy"
    script.write_text(json.loads(result.stdout))
    script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([str(script), "--head", HEAD, "--worker", WORKER, "--dry-run"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    assert f"flake {REPO}," in run.stdout.splitlines()[0]
    assert run.stdout.rstrip().endswith("dry run: nothing was run")


# ------------------------------------------------------------------------------------------ env file -> argv

def test_example_maps_to_serve_flags():
    env = parse_env_file(EXAMPLE)
    assert unknown_keys(env) == []
    assert serve_argv(env, 1) == [
        "--model", "/srv/dsv41/model", "--engram-dir", "/srv/dsv41/engram", "--host", "127.0.0.1", "--port", "8000",
        "--served-name", "DeepSeek-V4.1-Flash", "--alias", "deepseek-v4.1-flash",
        "--drain-timeout", "20", "--request-log", "/var/lib/dsv41/requests.jsonl",
        "--session-dir", "/var/lib/dsv41/sessions", "--tp", "2", "--master", "10.0.0.1:29571", "--tp-backend", "nccl", "--tp-deadline", "900",
        "--rank", "1",
    ]


def test_every_knob_is_documented_once():
    text = EXAMPLE.read_text()
    lines = text.splitlines()
    for knob in [*SERVE_KNOBS, *OPS_KNOBS]:
        at = [i for i, line in enumerate(lines) if line.startswith(knob.env + "=")]
        assert len(at) == 1, knob.env
        assert lines[at[0] - 1].startswith("# "), f"{knob.env} has no comment line above it"
    for knob in SERVE_KNOBS:
        assert knob.flag in text, f"{knob.env}: its flag {knob.flag} is not named in the example"


def test_aliases_split_and_empty_knobs_pass_no_flag():
    env = {"DSV41_ALIASES": "a 'b c'", "DSV41_PORT": "", "DSV41_TP": " 2 "}
    assert serve_argv(env, 0) == ["--alias", "a", "--alias", "b c", "--tp", "2", "--rank", "0"]


def test_launch_print(tmp_path):
    env_file = tmp_path / "dsv41.env"
    env_file.write_text("DSV41_PORT=9000\nDSV41_TP=2\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    result = subprocess.run([sys.executable, "-m", "dsv41.ops.cli", "launch", "rank1", "--print", "--env-file",
                             str(env_file)], capture_output=True, text=True, env={**env, "PYTHONPATH": str(REPO / "src")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "serve --port 9000 --tp 2 --rank 1"
    bad = subprocess.run([sys.executable, "-m", "dsv41.ops.cli", "launch", "head", "--print", "--env-file",
                          str(env_file)], capture_output=True, text=True, env={**env, "PYTHONPATH": str(REPO / "src")})
    assert bad.returncode == 2 and "instance 'head': expected rankN" in bad.stderr


def test_serve_parser_accepts_the_flags():
    """The real `dsv41 serve` argument parser takes every flag the env file can produce."""
    import argparse

    from dsv41.server.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    env = {knob.env: "2" for knob in SERVE_KNOBS}
    env.update(DSV41_MODEL="/m", DSV41_HOST="127.0.0.1", DSV41_SERVED_NAME="x", DSV41_ALIASES="a b",
               DSV41_API_KEY_FILE="/k", DSV41_REQUEST_LOG="/l", DSV41_MASTER="h:1", DSV41_TP_BACKEND="nccl",
               DSV41_DEVICE="cuda", DSV41_DTYPE="bfloat16", DSV41_ENGINE="reference", DSV41_PREFILL="replay",
               DSV41_PROMPT_SPECIAL_TOKENS="text", DSV41_PREFILL_SHARE="0.25", DSV41_EXPERT_TOPP="0.9",
               DSV41_FORWARD="reference", DSV41_DRAFT_DSPARK="off", DSV41_DRAFT_LOOKUP="on",
               DSV41_DRAFT_COST="1:0.01", DSV41_PREPARED="/p", DSV41_PREPARED_FALLBACK="1", DSV41_SESSIONS="on",
               DSV41_SESSION_DIR="/var/lib/dsv41/sessions")
    args = parser.parse_args(["serve", *serve_argv(env, 1)])
    assert args.prepared_fallback is True and args.draft_lookup == "on" and args.draft_depth == 2
    assert args.rank == 1 and args.tp == 2 and args.alias == ["a", "b"] and args.master == "h:1"
    assert args.device == "cuda" and args.dtype == "bfloat16"
    assert args.engine == "reference" and args.prefill == "replay" and args.parallel == 2
    assert args.prompt_special_tokens == "text" and args.prefill_share == 0.25 and args.expert_topp == 0.9
