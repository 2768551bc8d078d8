"""The ops subcommands of `dsv41`: `register(subparsers)` adds them to the main CLI's argparse subparsers.

Each subcommand sets `func(args) -> int` (the exit status). `main(argv)` runs just these subcommands (tests, and
a fallback entry point). The knobs come from /etc/dsv41/dsv41.env and node.env (or --env-file), with the process
environment on top, so a unit's EnvironmentFile= and a shell on the node see the same values.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from dsv41.errors import DSV41Error
from dsv41.ops.knobs import DEFAULT_ENV_FILE, PROFILE, parse_env_file

NODE_ENV_FILE = DEFAULT_ENV_FILE.with_name("node.env")


def load_env(env_file: str | None) -> dict[str, str]:
    """Knobs from the env file(s), overridden by the process environment."""
    values: dict[str, str] = {}
    files = [Path(env_file)] if env_file else [p for p in (DEFAULT_ENV_FILE, NODE_ENV_FILE) if p.exists()]
    for path in files:
        values.update(parse_env_file(path))
    values.update(os.environ)
    return values


def _env_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env-file", metavar="FILE",
                        help=f"knobs file (default: {DEFAULT_ENV_FILE} and {NODE_ENV_FILE} when present)")


def _setup_logging() -> None:
    from dsv41.ops.journal import setup_logging

    setup_logging(logging.INFO)


def _run_preflight(args) -> int:
    from dsv41.ops.preflight import exit_status, format_results, run_preflight

    results = run_preflight(load_env(args.env_file), remote=not args.local)
    print(json.dumps([r.as_dict() for r in results], indent=2) if args.json else format_results(results))
    return exit_status(results)


def _run_watchdog(args) -> int:
    from dsv41.ops import host_commands
    from dsv41.ops.watchdog import Watchdog

    _setup_logging()
    tick = Watchdog(load_env(args.env_file), host_commands.run).tick()
    print(f"{tick.outcome}: {tick.reason}")
    return 0


def _run_status(args) -> int:
    from dsv41.ops import host_commands
    from dsv41.ops.status import collect_status, format_status

    status = collect_status(load_env(args.env_file), host_commands.run)
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0 if status["healthy"] else 1


def _run_canary(args) -> int:
    from dsv41.ops.canary import run_canary

    env = load_env(args.env_file)
    return run_canary(env, url=args.url, api_key_file=args.api_key_file, wait_s=args.wait, model=args.model,
                      level=args.level)


def _run_render_units(args) -> int:
    from dsv41.ops.units import render_units, write_units

    if args.out:
        for path in write_units(Path(args.out), args.prefix):
            print(path)
    else:
        print(json.dumps(render_units(args.prefix), indent=2, sort_keys=True))
    return 0


def _run_launch(args) -> int:
    from dsv41.ops.lifecycle import launch, launch_command

    env = load_env(args.env_file)
    if args.print:
        print(" ".join(launch_command(args.instance, env)[3:]))
        return 0
    _setup_logging()
    launch(args.instance, env)
    return 0  # not reached: launch exec()s the server


def _run_record_stop(args) -> int:
    from dsv41.ops import host_commands
    from dsv41.ops.lifecycle import record_stop

    _setup_logging()
    record_stop(args.instance, load_env(None), host_commands.run)
    return 0


def _run_boot(args) -> int:
    from dsv41.ops import host_commands
    from dsv41.ops.lifecycle import boot

    _setup_logging()
    boot(load_env(args.env_file), host_commands.run)
    return 0


def _run_warm(args) -> int:
    from dsv41.ops.warm import warm

    _setup_logging()
    return warm(args.instance, load_env(args.env_file))


def _run_deploy(args) -> int:
    from dsv41.ops import host_commands
    from dsv41.ops.deploy import Deploy, options

    return Deploy(options(args), host_commands.run).execute()


def _run_driver_tmpfiles(args) -> int:
    from dsv41.ops.driver import tmpfiles_text

    sys.stdout.write(tmpfiles_text(Path(args.libdir)))
    return 0


def register(subparsers) -> None:
    """Add preflight, watchdog, status, canary, deploy, render-units and the unit helpers to `dsv41`'s subparsers."""
    from dsv41.cli import number
    from dsv41.ops import deploy  # argparse and the stdlib only

    p = subparsers.add_parser("preflight", help="check both nodes are ready to start (files, ports, GPUs, RoCE, memory)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--local", action="store_true", help="check this node only (no ssh to the worker)")
    _env_arg(p)
    p.set_defaults(func=_run_preflight)

    p = subparsers.add_parser("watchdog", help="one watchdog tick (run by dsv41-watchdog.timer)")
    p.add_argument("--once", action="store_true", required=True, help="run a single tick (the only mode)")
    _env_arg(p)
    p.set_defaults(func=_run_watchdog)

    p = subparsers.add_parser("status", help="both ranks' unit states and /health")
    p.add_argument("--json", action="store_true")
    _env_arg(p)
    p.set_defaults(func=_run_status)

    p = subparsers.add_parser("canary", help="the five end-to-end probes against the running server")
    p.add_argument("--url", help="server base URL (default: http://DSV41_HOST:DSV41_PORT)")
    p.add_argument("--api-key-file", help="bearer key file (default: DSV41_API_KEY_FILE)")
    p.add_argument("--model", help="model id to send (default: DSV41_SERVED_NAME or the first of /v1/models)")
    p.add_argument("--level", choices=("full", "structural"), default="full",
                   help="structural: skip the knowledge checks (for random-weight test models)")
    p.add_argument("--wait", type=number(float, 0), default=0.0, metavar="S",
                   help="first wait up to S seconds for /health to be ok")
    _env_arg(p)
    p.set_defaults(func=_run_canary)

    p = subparsers.add_parser("deploy", help="install dsv41 on both Sparks (what `nix run .#deploy --` runs)",
                              description="Install dsv41 on both Sparks: build the closure, copy it, switch the "
                                          "profile, restart the pair, gate on the canary, roll back on failure "
                                          "(docs/OPERATIONS.md section 2).")
    deploy.add_arguments(p)
    p.set_defaults(func=_run_deploy)

    p = subparsers.add_parser("render-units", help="render the systemd units for a profile prefix")
    p.add_argument("--prefix", default=PROFILE, help=f"installed dsv41 profile (default {PROFILE})")
    p.add_argument("--out", metavar="DIR", help="write unit files here (default: print them as JSON)")
    p.set_defaults(func=_run_render_units)

    p = subparsers.add_parser("launch", help="(dsv41@.service) exec `dsv41 serve` with flags from the env file")
    p.add_argument("instance", help="rank0, rank1, ...")
    p.add_argument("--print", action="store_true", help="print the serve arguments instead of running")
    _env_arg(p)
    p.set_defaults(func=_run_launch)

    p = subparsers.add_parser("record-stop", help="(ExecStopPost) remember a deliberate stop")
    p.add_argument("instance")
    p.set_defaults(func=_run_record_stop)

    p = subparsers.add_parser("boot", help="(dsv41-boot.service) start this node's ranks unless stopped on purpose")
    _env_arg(p)
    p.set_defaults(func=_run_boot)

    p = subparsers.add_parser("warm", help="(dsv41-warm@.service) check the Engram shards, build the kernel caches")
    p.add_argument("instance")
    _env_arg(p)
    p.set_defaults(func=_run_warm)

    p = subparsers.add_parser("driver-tmpfiles", help="tmpfiles.d lines linking the host driver into /run/opengl-driver/lib")
    p.add_argument("--libdir", default="/usr/lib/aarch64-linux-gnu", help="where the host driver's libcuda lives")
    p.set_defaults(func=_run_driver_tmpfiles)


def main(argv: list[str] | None = None) -> int:
    from dsv41.cli import OneLineParser

    parser = OneLineParser(prog="dsv41")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except DSV41Error as exc:
        print(f"dsv41 {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
