"""Rendezvous: the ranks find each other through a TCPStore that rank 0 hosts at `--master HOST:PORT`.

Ranks start in any order (systemd starts the two Sparks independently), so every wait here retries until a
deadline and says what it waits for; past the deadline it raises `RendezvousError` naming the address or the
missing ranks. The store stays up for the life of rank 0: the fail-fast monitor, the round plans and the memory
reports all travel through it.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dsv41.errors import DSV41Error
from dsv41.parallel.torch_comm import TorchComm

LOG_EVERY_S = 5.0


class RendezvousError(DSV41Error):
    """The ranks could not be brought together (address, deadline, mismatched launch arguments)."""


def parse_master(master: str) -> tuple[str, int]:
    """'HOST:PORT' or '[V6]:PORT' -> (host, port)."""
    host, sep, port = master.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise RendezvousError(f"--master must be HOST:PORT (e.g. 10.0.0.1:29500), got {master!r}")
    return host.strip("[]"), int(port)


def format_master(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class TPGroup:
    """What a rank holds after `init_tp`: who it is, the store, and the communicator for the model."""

    rank: int
    world: int
    master: str
    backend: str
    store: dist.TCPStore
    comm: TorchComm
    peers: dict = field(default_factory=dict)  # rank -> the hello record it published (host, pid, ...)

    def store_client(self, timeout_s: float) -> dist.TCPStore:
        """A second connection to rank 0's store, for a thread that must not share the main one."""
        host, port = parse_master(self.master)
        return dist.TCPStore(host, port, self.world, False, datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _probe(host: str, port: int, timeout_s: float) -> str | None:
    """None when something accepts connections at host:port, else why not (quietly: torch's own connect logs
    a C++ stack trace per failed attempt)."""
    try:
        with socket.create_connection((host, port), timeout=max(0.1, timeout_s)):
            return None
    except socket.gaierror as exc:
        return f"cannot resolve host {host!r} ({exc.strerror})"
    except ConnectionRefusedError:
        return "connection refused (rank 0 not listening yet?)"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def _open_store(rank: int, world: int, master: str, deadline: float, log) -> dist.TCPStore:
    host, port = parse_master(master)
    if port == 0 and rank != 0:
        raise RendezvousError(f"rank {rank} needs rank 0's real port in --master, got {master!r}")
    if rank == 0:
        try:
            return dist.TCPStore(host, port, world, True, datetime.timedelta(seconds=60), wait_for_workers=False)
        except Exception as exc:  # noqa: BLE001 - torch raises several types here; all mean the same to the user
            raise RendezvousError(f"rank 0 cannot host the TP store on port {port} ({master}): {exc}") from exc
    last_log = 0.0
    while True:
        left = deadline - time.monotonic()
        reason = _probe(host, port, min(2.0, left))
        if reason is None:
            try:
                return dist.TCPStore(host, port, world, False, datetime.timedelta(seconds=max(1.0, min(10.0, left))),
                                     wait_for_workers=False)
            except Exception as exc:  # noqa: BLE001
                reason = f"store handshake failed: {str(exc).splitlines()[0]}"
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(f"rank {rank} of {world}: rank 0 did not answer at {master} before the rendezvous "
                                  f"deadline (last error: {reason}); check --master and that rank 0 is running")
        if time.monotonic() - last_log >= LOG_EVERY_S:
            log(f"dsv41 tp: rank {rank} waiting for rank 0 at {master}: {reason}; {left:.0f} s left")
            last_log = time.monotonic()
        time.sleep(min(0.5, max(0.0, left)))


def _wait_for_ranks(store, rank: int, world: int, master: str, deadline: float, log) -> None:
    last_log = 0.0
    keys = {r: f"tp/hello/{r}" for r in range(world)}
    while True:
        missing = [r for r, key in keys.items() if not store.check([key])]
        if not missing:
            return
        left = deadline - time.monotonic()
        names = ", ".join(str(r) for r in missing)
        if left <= 0:
            raise RendezvousError(f"rank {rank} of {world}: rank(s) {names} did not join at {master} before the "
                                  f"rendezvous deadline; start them with --tp {world} --rank R --master {master}")
        if time.monotonic() - last_log >= LOG_EVERY_S:
            log(f"dsv41 tp: rank {rank} waiting for rank(s) {names} to join at {master}; {left:.0f} s left")
            last_log = time.monotonic()
        time.sleep(0.05)


def _handshake(store, rank: int, world: int, backend: str, master: str, deadline: float, log) -> dict:
    if rank == 0:
        store.set("tp/world", str(world))
    else:
        store.set_timeout(datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())))
        rank0_world = int(store.get("tp/world").decode())
        if rank0_world != world:
            raise RendezvousError(f"rank {rank} was started with --tp {world} but rank 0 at {master} with "
                                  f"--tp {rank0_world}")
    if store.add(f"tp/claim/{rank}", 1) != 1:
        raise RendezvousError(f"two processes were started as rank {rank} against {master}; each --rank once")
    hello = {"host": socket.gethostname(), "pid": os.getpid(), "backend": backend}
    store.set(f"tp/hello/{rank}", json.dumps(hello))
    _wait_for_ranks(store, rank, world, master, deadline, log)
    peers = {r: json.loads(store.get(f"tp/hello/{r}")) for r in range(world)}
    backends = {r: p["backend"] for r, p in peers.items()}
    if len(set(backends.values())) != 1:
        raise RendezvousError(f"ranks disagree on the backend: {backends}")
    return peers


def init_tp(rank: int, world: int, master: str, deadline_s: float = 120.0, backend: str | None = None,
            collective_timeout_s: float = 300.0, device_index: int | None = None, log=_stderr,
            on_listening=None) -> TPGroup:
    """Join the tensor-parallel group: rank 0 hosts the store at `master`, the others connect to it.

    Waits at most `deadline_s` for the peers; every collective afterwards times out after `collective_timeout_s`.
    With NCCL the rank's GPU is `device_index` (default: rank modulo the visible GPUs). Rank 0 may pass port 0
    (any free port); `on_listening(master)` is then called with the real address before it waits for the others
    (that is when a local launcher starts them).
    """
    if not isinstance(world, int) or world < 1:
        raise RendezvousError(f"--tp must be a positive integer, got {world!r}")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise RendezvousError(f"--rank must be in 0..{world - 1} for --tp {world}, got {rank!r}")
    if dist.is_initialized():
        raise RendezvousError("this process already joined a process group")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(device_index if device_index is not None else rank % torch.cuda.device_count())
    deadline = time.monotonic() + deadline_s
    store = _open_store(rank, world, master, deadline, log)
    if rank == 0:
        master = format_master(parse_master(master)[0], store.port)
        if on_listening is not None:
            on_listening(master)
    peers = _handshake(store, rank, world, backend, master, deadline, log)
    store.set_timeout(datetime.timedelta(seconds=60))
    dist.init_process_group(backend, store=dist.PrefixStore("tp/pg", store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=collective_timeout_s))
    return TPGroup(rank=rank, world=world, master=master, backend=backend, store=store, comm=TorchComm(),
                   peers=peers)
