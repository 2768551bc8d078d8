"""`dsv41 status`: both ranks' unit states, rank 0's /health, the active profile and the watchdog's last word."""

from __future__ import annotations

import json
import os
from typing import Mapping

from dsv41.ops.host_commands import CommandRunner
from dsv41.ops.health import base_url, health
from dsv41.ops.knobs import PROFILE, ops_value, tp_ranks
from dsv41.ops.lifecycle import read_marker, state_dir
from dsv41.ops.watchdog import HEAD_RANK, WatchState, rank_state


def collect_status(env: Mapping[str, str], run: CommandRunner) -> dict:
    worker = ops_value(env, "DSV41_WORKER_SSH") or None
    ranks = {}
    for instance in tp_ranks(env):  # rank 0 only at DSV41_TP=1
        host = None if instance == HEAD_RANK else worker
        state = rank_state(instance, host, run)
        ranks[instance] = {"host": host or "local", "reachable": state.reachable, "active": state.active,
                           "result": state.result, "exit_status": state.exit_status}
    base = base_url(env)
    reply = health(base)
    state = state_dir(env)
    watch = WatchState.load(state / "watchdog.json")
    try:
        profile = os.path.realpath(PROFILE) if os.path.lexists(PROFILE) else None
    except OSError:
        profile = None
    return {
        "ranks": ranks,
        "health": {"url": base + "/health", "status": reply.status, "body": reply.body, "error": reply.error},
        "profile": profile,
        "stopped_deliberately": read_marker(state, HEAD_RANK) is not None,
        "watchdog": {"last_tick": watch.last_tick, "last_outcome": watch.last_outcome, "fails": watch.fails},
        "healthy": reply.ok and all(r["active"] == "active" for r in ranks.values() if r["reachable"]),
    }


def format_status(status: dict) -> str:
    lines = []
    for instance, rank in status["ranks"].items():
        where = rank["host"]
        if not rank["reachable"]:
            lines.append(f"{instance} ({where}): unknown (unreachable)")
        else:
            extra = f", {rank['result']} status {rank['exit_status']}" if rank["active"] != "active" else ""
            lines.append(f"{instance} ({where}): {rank['active']}{extra}")
    h = status["health"]
    body = json.dumps(h["body"])[:200] if h["body"] is not None else h["error"]
    lines.append(f"health: HTTP {h['status'] or 'no reply'} {body}")
    lines.append(f"profile: {status['profile'] or 'not installed'}")
    if status["stopped_deliberately"]:
        lines.append("stopped deliberately: boot and watchdog stand down")
    if status["watchdog"]["last_outcome"]:
        lines.append(f"watchdog: {status['watchdog']['last_outcome']}")
    lines.append("healthy" if status["healthy"] else "NOT healthy")
    return "\n".join(lines)
