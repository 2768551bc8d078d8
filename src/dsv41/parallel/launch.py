"""Launching a tensor-parallel `dsv41 serve`: one process per rank.

Two ways in, both through `run_rank`:

- `dsv41 serve --tp N --rank R --master HOST:PORT`: this process is rank R (what each Spark's systemd unit runs;
  rank 0 also serves HTTP, the others run rank 0's step batches);
- `dsv41 serve --tp N` (no --rank): this process becomes rank 0 and starts ranks 1..N-1 on this host as child
  processes with the same arguments plus `--rank R --master 127.0.0.1:PORT` (PORT: any free one unless --master
  says otherwise). A child that exits aborts the group.

Exit status: 0 after a normal shutdown; 70 when the group failed (any rank: exception, OOM, lost peer), so the
watchdog restarts it; 2 for a launch error (bad arguments, rendezvous deadline) like other user-facing errors.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import torch

from dsv41.errors import DSV41Error
from dsv41.parallel.executor import LeaderExecutor, follow_batches
from dsv41.parallel.failfast import EXIT_CODE, FailFast, FailureInjector, TPAborted
from dsv41.parallel.plan import PlanChannel
from dsv41.parallel.rendezvous import init_tp

CLI_MAIN = "import sys; from dsv41.cli import main; sys.exit(main(sys.argv[1:]))"
LOCAL_CHILD_ENV = "DSV41_TP_LOCAL_CHILD"


class _LocalRanks:
    """Ranks 1..N-1 as children of rank 0 on one host."""

    def __init__(self, world: int, argv: list[str], child_cmd: list[str]):
        self.world, self.argv, self.child_cmd = world, argv, child_cmd
        self.procs: list[subprocess.Popen] = []

    def start(self, master: str) -> None:
        for rank in range(1, self.world):
            cmd = [*self.child_cmd, *self.argv, "--rank", str(rank), "--master", master]
            env = dict(os.environ, **{LOCAL_CHILD_ENV: "1"})
            # only the main process may talk to systemd (NotifyAccess=main); children would be refused noisily
            for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                env.pop(key, None)
            self.procs.append(subprocess.Popen(cmd, env=env))

    def watch(self, failfast: FailFast) -> None:
        def run():
            while not failfast.aborted.is_set():
                for rank, proc in enumerate(self.procs, start=1):
                    code = proc.poll()
                    if code is not None and code != 0:
                        failfast.abort(f"local rank {rank} (pid {proc.pid}) exited with status {code}")
                        return
                time.sleep(0.1)

        threading.Thread(target=run, name="dsv41-tp-children", daemon=True).start()

    def stop(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait_loaded(group, failfast: FailFast, deadline_s: float, pages: int = 0) -> int:
    """Rank 0 reports ready only when every rank holds its shard of the model. Returns the fewest KV pool pages
    of any rank (0 if a rank has no pool): each rank sizes its pool from its own free memory, which differs
    between two machines, and rank 0 must hand out only page ids that every rank holds."""
    group.store.set(f"tp/loaded/{group.rank}", str(int(pages)))
    deadline = time.monotonic() + deadline_s
    keys = [f"tp/loaded/{r}" for r in range(group.world)]
    while not all(group.store.check([k]) for k in keys):
        failfast.check()
        if time.monotonic() > deadline:
            missing = [str(r) for r, k in enumerate(keys) if not group.store.check([k])]
            failfast.abort(f"rank(s) {', '.join(missing)} did not finish loading within {deadline_s:.0f} s")
            failfast.check()
        time.sleep(0.05)
    return min(int(group.store.get(k)) for k in keys)


def _follower_signals(rank: int, failfast: FailFast) -> None:
    """SIGTERM/SIGINT on a follower: a local child ignores them (rank 0 drains and then sends the stop batch; a
    terminal's Ctrl-C reaches the whole process group); a rank of its own (a systemd unit) takes the group down,
    naming itself, instead of leaving rank 0 to discover a missing heartbeat."""
    def stop(signum, frame):
        failfast.abort(f"rank {rank} received {signal.Signals(signum).name}")

    handler = signal.SIG_IGN if os.environ.get(LOCAL_CHILD_ENV) == "1" else stop
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)
    except ValueError:  # not the main thread (embedded use): keep the defaults
        pass


def _follow_in_thread(runner, channel: PlanChannel, failfast: FailFast, injector, watchdog=None) -> bool:
    """Run the follower loop in a thread and keep the main thread free: it sits in a store call for as long as
    the server is idle, and Python runs signal handlers (SIGTERM) only in the main thread. True on the stop batch."""
    done, outcome = threading.Event(), {}
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run():
        try:
            follow_batches(runner, channel, failfast, injector=injector,
                           log=lambda m: print(m, file=sys.stderr, flush=True), device=device)
            outcome["stopped"] = True
        except BaseException:  # noqa: BLE001 - follow_batches() already aborted the group with the reason
            outcome["stopped"] = False
        finally:
            done.set()

    threading.Thread(target=run, name="dsv41-tp-follow", daemon=True).start()
    while not done.wait(1.0):
        if watchdog is not None and not failfast.aborted.is_set():
            watchdog()
    return outcome["stopped"]


def _die_with_group(failfast: FailFast) -> int:
    """After an abort the monitor ends the process (status 70); park this thread until it does."""
    failfast.aborted.wait()
    time.sleep(failfast.grace_s + 5.0)
    return EXIT_CODE  # only reached if the monitor could not exit the process


def run_rank(args, *, load, serve, argv: list[str] | None = None, child_cmd: list[str] | None = None,
             grace_s: float = 1.0, on_ready=None, watchdog=None) -> int:
    """Run this process as one rank of `dsv41 serve --tp N`; returns the exit status.

    `load(rank, world, comm)` builds this rank's `ModelRunner` (e.g. `compose.build.build_runner` over
    `load_model(path, ..., rank=rank, world=world, comm=comm)`); rank 0's `serve(leader)` gets a `LeaderExecutor`
    over it, serves HTTP and returns at shutdown, the others run `follow_batches`. In local mode (no
    `--rank`) `argv` (default `sys.argv[1:]`) is handed to the children, run as `child_cmd` (default: the dsv41
    CLI with this Python). `on_ready()` runs on ranks other than 0 once every rank has loaded (e.g. systemd
    READY=1; rank 0's `serve` notifies for itself when it accepts connections); `watchdog()` runs there about
    once a second while the follower is healthy (systemd WATCHDOG=1).
    """
    world = args.tp
    if world < 1:
        raise DSV41Error(f"--tp must be >= 1, got {world}")
    local = None
    rank = args.rank
    master = args.master
    if rank is None:
        rank = 0
        master = master or "127.0.0.1:0"
        if world > 1:
            local = _LocalRanks(world, list(sys.argv[1:] if argv is None else argv),
                                child_cmd or [sys.executable, "-c", CLI_MAIN])
    elif master is None:
        raise DSV41Error("--rank needs --master HOST:PORT (rank 0's address)")

    group = init_tp(rank, world, master, deadline_s=args.tp_deadline, backend=args.tp_backend,
                    collective_timeout_s=args.tp_collective_timeout,
                    on_listening=local.start if local is not None else None)
    failfast = FailFast(group, peer_timeout_s=args.tp_peer_timeout, grace_s=grace_s if rank == 0 else 0.2).start()
    if local is not None:
        local.watch(failfast)
    channel = PlanChannel(group.store, rank, failfast.aborted)
    injector = FailureInjector(rank)
    try:
        model = load(rank, world, group.comm)
        pages = _wait_loaded(group, failfast, args.tp_deadline, getattr(getattr(model, "pool", None), "num_pages", 0))
    except TPAborted:
        return _die_with_group(failfast)
    except BaseException as exc:  # noqa: BLE001 - a rank that cannot load takes the group down
        failfast.abort(f"loading failed: {type(exc).__name__}: {exc}")
        return _die_with_group(failfast)

    if rank != 0:
        _follower_signals(rank, failfast)
        if on_ready is not None:
            on_ready()
        if not _follow_in_thread(model, channel, failfast, injector, watchdog):
            return _die_with_group(failfast)
        failfast.stop()
        group.store.set(f"tp/bye/{rank}", "1")
        return 0

    leader = LeaderExecutor(model, channel, failfast, injector=injector)
    if pages:
        leader.num_pages = pages  # the group's fewest: the block manager hands out only these
    try:
        serve(leader)
    except BaseException as exc:  # noqa: BLE001
        if not failfast.aborted.is_set():
            failfast.abort(f"server failed: {type(exc).__name__}: {exc}")
        return _die_with_group(failfast)
    if failfast.aborted.is_set():
        return _die_with_group(failfast)
    leader.close()
    _wait_bye(group, timeout_s=10.0)
    failfast.stop()
    if local is not None:
        local.stop()
    return 0


def _wait_bye(group, timeout_s: float) -> None:
    """Keep the store (hosted here) up until every follower has read the stop batch."""
    deadline = time.monotonic() + timeout_s
    keys = [f"tp/bye/{r}" for r in range(1, group.world)]
    while time.monotonic() < deadline and not all(group.store.check([k]) for k in keys):
        time.sleep(0.02)
