"""Rendezvous: the ranks find each other through a TCPStore that rank 0 hosts at `--master HOST:PORT`.

Ranks start in any order (systemd starts the two Sparks independently), so every wait here retries until a
deadline and says what it waits for; past the deadline it raises `RendezvousError` naming the address or the
missing ranks. The store stays up for the life of rank 0: the fail-fast monitor, the round plans and the memory
reports all travel through it.

Exposure: rank 0 binds the store to the `--master` address only (torch's own TCPStore server would listen on
every interface), so local ranks (127.0.0.1) are unreachable from the network and two hosts meet on the link
address. The ranks prove to each other that they hold the same secret (`DSV41_TP_SECRET`, from the env file;
required when the master address is not loopback): rank 0 and each rank exchange fresh nonces and HMAC-SHA256
proofs over them, and a rank with another secret is refused with a message naming it (host, pid) on both
sides. The secret also signs `tp/abort` (failfast.py). Without a configured secret, local mode generates one
for its children; separately started ranks on one host then run unauthenticated, on loopback.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dsv41.errors import DSV41Error
from dsv41.parallel.torch_comm import TorchComm

LOG_EVERY_S = 5.0
SECRET_ENV = "DSV41_TP_SECRET"
MIN_SECRET_CHARS = 16


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
    secret: bytes = b""  # shared by the ranks (proofs at join, signed aborts)

    def store_client(self, timeout_s: float) -> dist.TCPStore:
        """A second connection to rank 0's store, for a thread that must not share the main one."""
        return store_client(self.master, self.world, timeout_s)

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


def is_loopback_host(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_secret(master: str, local_mode: bool) -> bytes:
    """The ranks' shared secret: DSV41_TP_SECRET; required across hosts; generated for local children."""
    value = os.environ.get(SECRET_ENV, "").strip()
    host, _ = parse_master(master)
    if not value:
        if not is_loopback_host(host):
            raise RendezvousError(f"{SECRET_ENV} is not set: ranks on different hosts (--master {master}) must "
                                  f"share a secret; put the same {SECRET_ENV}=<random, e.g. `openssl rand -hex "
                                  "32`> in the env file of every host")
        if not local_mode:
            return b""  # separately started ranks on one host: loopback only, unauthenticated
        value = secrets.token_hex(32)
        os.environ[SECRET_ENV] = value  # the local ranks are started from this environment
    elif len(value) < MIN_SECRET_CHARS:
        raise RendezvousError(f"{SECRET_ENV} is too short ({len(value)} characters; use at least "
                              f"{MIN_SECRET_CHARS}, e.g. `openssl rand -hex 32`)")
    return value.encode("utf-8")


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on exactly host:port, for the store's server to use."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        # IPv4 first: a name like "localhost" resolves to both, and the ranks' clients try IPv4 first
        family, kind, proto, _, address = sorted(found, key=lambda a: a[0] != socket.AF_INET)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise RendezvousError(f"rank 0 cannot resolve the --master host {host!r} ({exc.strerror})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise RendezvousError(f"rank 0 cannot listen on {format_master(host, port)} ({exc.strerror}); --master "
                              "must be this host's own address (its IP on the link to the other ranks)") from None
    return sock


def _open_store(rank: int, world: int, master: str, deadline: float, log) -> dist.TCPStore:
    host, port = parse_master(master)
    if port == 0 and rank != 0:
        raise RendezvousError(f"rank {rank} needs rank 0's real port in --master, got {master!r}")
    if rank == 0:
        sock = _listen(host, port)
        try:
            store = dist.TCPStore(host, sock.getsockname()[1], world, True, datetime.timedelta(seconds=60),
                                  wait_for_workers=False, master_listen_fd=sock.fileno())
        except Exception as exc:  # noqa: BLE001 - torch raises several types here; all mean the same to the user
            sock.close()
            raise RendezvousError(f"rank 0 cannot host the TP store on port {port} ({master}): "
                                  f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        sock.detach()  # the store's server owns the descriptor now
        return store
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


def _proof(secret: bytes, rank: int, nonce0: str, nonce: str) -> str:
    return hmac.new(secret, f"dsv41-tp|{rank}|{nonce0}|{nonce}".encode(), hashlib.sha256).hexdigest()


def _who(peer: dict) -> str:
    return f"host {peer.get('host', '?')}, pid {peer.get('pid', '?')}"


def _handshake(store, rank: int, world: int, backend: str, master: str, deadline: float, log,
               secret: bytes = b"") -> dict:
    if rank == 0:
        nonce0 = secrets.token_hex(16)
        store.set("tp/nonce/0", nonce0)
        store.set("tp/world", str(world))
    else:
        store.set_timeout(datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())))
        rank0_world = int(store.get("tp/world").decode())
        if rank0_world != world:
            raise RendezvousError(f"rank {rank} was started with --tp {world} but rank 0 at {master} with "
                                  f"--tp {rank0_world}")
        nonce0 = store.get("tp/nonce/0").decode()
    if store.add(f"tp/claim/{rank}", 1) != 1:
        raise RendezvousError(f"two processes were started as rank {rank} against {master}; each --rank once")
    hello = {"host": socket.gethostname(), "pid": os.getpid(), "backend": backend}
    if rank != 0:
        hello["nonce"] = secrets.token_hex(16)
        hello["proof"] = _proof(secret, rank, nonce0, hello["nonce"])
    store.set(f"tp/hello/{rank}", json.dumps(hello))
    _wait_for_ranks(store, rank, world, master, deadline, log)
    peers = {r: json.loads(store.get(f"tp/hello/{r}")) for r in range(world)}
    _authenticate(store, rank, world, master, peers, nonce0, secret, deadline)
    backends = {r: p["backend"] for r, p in peers.items()}
    if len(set(backends.values())) != 1:
        raise RendezvousError(f"ranks disagree on the backend: {backends}")
    return peers


def _authenticate(store, rank: int, world: int, master: str, peers: dict, nonce0: str, secret: bytes,
                  deadline: float) -> None:
    """Rank 0 checks every rank's proof and answers each with its own (or a refusal); a rank checks rank 0's."""
    if rank == 0:
        for r in range(1, world):
            peer = peers[r]
            expected = _proof(secret, r, nonce0, str(peer.get("nonce", "")))
            if not hmac.compare_digest(expected, str(peer.get("proof", ""))):
                store.set(f"tp/auth/{r}", "refused")
                try:  # the store dies with this process: let the refused rank read why first (bounded)
                    store.wait([f"tp/auth/{r}/seen"], datetime.timedelta(seconds=5))
                except Exception:  # noqa: BLE001 - it left or never reads: this rank's own message still stands
                    pass
                raise RendezvousError(f"rank 0 refused rank {r} ({_who(peer)}) at {master}: it does not hold this "
                                      f"group's secret ({SECRET_ENV} differs between the hosts)")
            store.set(f"tp/auth/{r}", _proof(secret, 0, nonce0, peer["nonce"]))
        return
    store.set_timeout(datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())))
    try:
        answer = store.get(f"tp/auth/{rank}").decode()
        store.set(f"tp/auth/{rank}/seen", "1")
    except Exception as exc:  # noqa: BLE001 - torch raises several types when the store goes away
        raise RendezvousError(f"rank 0 at {master} ({_who(peers[0])}) closed the store before answering rank "
                              f"{rank}'s proof ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                              f"check that {SECRET_ENV} is the same on every host") from None
    if answer == "refused":
        raise RendezvousError(f"rank 0 at {master} ({_who(peers[0])}) refused rank {rank}: this rank's secret "
                              f"({SECRET_ENV}) differs from rank 0's")
    if not hmac.compare_digest(answer, _proof(secret, 0, nonce0, peers[rank]["nonce"])):
        raise RendezvousError(f"the rank 0 at {master} ({_who(peers[0])}) does not hold this group's secret "
                              f"({SECRET_ENV} differs between the hosts); not joining it")


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
    secret = resolve_secret(master, local_mode=on_listening is not None)
    deadline = time.monotonic() + deadline_s
    store = _open_store(rank, world, master, deadline, log)
    if rank == 0:
        master = format_master(parse_master(master)[0], store.port)
        if on_listening is not None:
            on_listening(master)
    peers = _handshake(store, rank, world, backend, master, deadline, log, secret)
    store.set_timeout(datetime.timedelta(seconds=60))
    dist.init_process_group(backend, store=dist.PrefixStore("tp/pg", store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=collective_timeout_s))
    return TPGroup(rank=rank, world=world, master=master, backend=backend, store=store, comm=TorchComm(),
                   peers=peers, secret=secret)


def store_client(master: str, world: int, timeout_s: float) -> dist.TCPStore:
    """A new connection to rank 0's store at `master` (a store client blocked in a get serves no other thread)."""
    host, port = parse_master(master)
    return dist.TCPStore(host, port, world, False, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
