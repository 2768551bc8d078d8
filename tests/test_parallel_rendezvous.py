"""Rendezvous: ranks start in any order, and failures say what they waited for, in bounded time; the store
listens on the master address only, ranks prove they share DSV41_TP_SECRET, and aborts must be signed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from dsv41.parallel.rendezvous import RendezvousError, init_tp, parse_master
from dsv41.errors import DSV41Error
from conftest import free_port


def spawn(rank: int, world: int, master: str, deadline: float = 60.0, secret: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "DSV41_TP_SECRET"}
    if secret is not None:
        env["DSV41_TP_SECRET"] = secret
    return subprocess.Popen([sys.executable, __file__, str(rank), str(world), master, str(deadline)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def listeners(port: int) -> list[str]:
    """Local addresses in LISTEN state on `port` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.append(address)
    return found


def abort_probe(master: str) -> int:
    """Rank 0 of a group of one: an unsigned tp/abort is ignored, a signed one aborts."""
    import datetime

    import torch.distributed as dist

    from dsv41.parallel.failfast import ABORT_KEY, FailFast, sign_abort

    group = init_tp(0, 1, master, deadline_s=10)
    logged, exits = [], []
    failfast = FailFast(group, exit_fn=exits.append, grace_s=0.0, log=logged.append).start()
    host, port = parse_master(group.master)
    outsider = dist.TCPStore(host, port, 1, False, datetime.timedelta(seconds=5), wait_for_workers=False)
    outsider.set(ABORT_KEY, "rank 1: forged failure")
    time.sleep(0.6)
    print(f"after unsigned: aborted={failfast.aborted.is_set()} logged={logged!r}", flush=True)
    outsider.set(ABORT_KEY, sign_abort(group.secret, "rank 1: real failure"))
    failfast.aborted.wait(3)
    time.sleep(0.2)
    print(f"after signed: aborted={failfast.aborted.is_set()} reason={failfast.reason!r} exits={exits}", flush=True)
    return 0


def worker(rank: int, world: int, master: str, deadline: float) -> int:
    try:
        group = init_tp(rank, world, master, deadline_s=deadline)
    except RendezvousError as exc:
        print(f"RendezvousError: {exc}", flush=True)
        return 2
    total = group.comm.sum_partials(torch.tensor([float(rank + 1)]))
    print(f"joined sum={total.item():g}", flush=True)
    group.close()
    return 0


@pytest.mark.slow
def test_rank1_started_10s_before_rank0_still_joins():
    master = f"127.0.0.1:{free_port()}"
    rank1 = spawn(1, 2, master)
    time.sleep(10.0)
    assert rank1.poll() is None, "rank 1 gave up before rank 0 started"
    rank0 = spawn(0, 2, master)
    out0, _ = rank0.communicate(timeout=60)
    out1, err1 = rank1.communicate(timeout=60)
    assert rank0.returncode == 0 and rank1.returncode == 0, (out0, out1, err1[-2000:])
    assert "joined sum=3" in out0 and "joined sum=3" in out1
    assert f"waiting for rank 0 at {master}" in err1  # it told the operator what it waited for


def test_wrong_master_address_fails_clearly_in_bounded_time():
    master = f"127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        init_tp(1, 2, master, deadline_s=3.0, log=lambda m: None)
    elapsed = time.monotonic() - t0
    assert elapsed < 8.0, f"took {elapsed:.1f} s for a 3 s deadline"
    message = str(info.value)
    assert master in message and "rank 0" in message and "refused" in message


def test_unresolvable_master_host_names_the_host():
    with pytest.raises(RendezvousError) as info:
        init_tp(1, 2, "no-such-host.invalid:29500", deadline_s=1.0, log=lambda m: None)
    assert "no-such-host.invalid" in str(info.value)


@pytest.mark.slow
def test_mismatched_world_sizes_are_reported_on_both_sides():
    master = f"127.0.0.1:{free_port()}"
    rank0 = spawn(0, 2, master, deadline=6.0)
    rank1 = spawn(1, 4, master, deadline=20.0)
    out1, _ = rank1.communicate(timeout=60)
    out0, _ = rank0.communicate(timeout=60)
    assert rank1.returncode == 2 and "started with --tp 4 but rank 0" in out1, out1
    # rank 0 never saw a valid rank 1 and says so, naming the rank and the address
    assert rank0.returncode == 2 and "rank(s) 1 did not join" in out0 and master in out0, out0


@pytest.mark.parametrize("bad", ["29500", "host:", ":29500", "host:port", "host:70000"])
def test_bad_master_strings_are_rejected(bad):
    with pytest.raises(DSV41Error, match="HOST:PORT"):
        parse_master(bad)


def test_rank_outside_world_is_rejected():
    with pytest.raises(RendezvousError, match="--rank must be in 0..1"):
        init_tp(2, 2, "127.0.0.1:1")


def test_store_listens_on_the_master_address_only_and_ranks_join_with_the_secret():
    port = free_port()
    master = f"127.0.0.1:{port}"
    rank0 = spawn(0, 2, master, deadline=30, secret="s" * 32)
    deadline = time.monotonic() + 30
    while not listeners(port):
        assert time.monotonic() < deadline and rank0.poll() is None, rank0.communicate()
        time.sleep(0.05)
    assert listeners(port) == ["0100007F"], listeners(port)  # 127.0.0.1 only: no 0.0.0.0, no [::]
    rank1 = spawn(1, 2, master, deadline=30, secret="s" * 32)
    out0, err0 = rank0.communicate(timeout=60)
    out1, err1 = rank1.communicate(timeout=60)
    assert rank0.returncode == 0 and rank1.returncode == 0, (out0, err0[-2000:], out1, err1[-2000:])
    assert "joined sum=3" in out0 and "joined sum=3" in out1


def test_a_rank_with_the_wrong_secret_is_refused_naming_the_peer():
    master = f"127.0.0.1:{free_port()}"
    rank0 = spawn(0, 2, master, deadline=30, secret="a" * 32)
    rank1 = spawn(1, 2, master, deadline=30, secret="b" * 32)
    out1, _ = rank1.communicate(timeout=60)
    out0, _ = rank0.communicate(timeout=60)
    assert rank0.returncode == 2 and rank1.returncode == 2, (out0, out1)
    host = socket.gethostname()
    assert f"rank 0 refused rank 1 (host {host}, pid {rank1.pid})" in out0 and "DSV41_TP_SECRET" in out0, out0
    assert f"rank 0 at {master} (host {host}, pid {rank0.pid}) refused rank 1" in out1, out1


def test_ranks_on_different_hosts_need_a_secret(monkeypatch):
    monkeypatch.delenv("DSV41_TP_SECRET", raising=False)
    with pytest.raises(RendezvousError, match="DSV41_TP_SECRET is not set"):
        init_tp(1, 2, "10.255.255.1:29500", deadline_s=1.0, log=lambda m: None)
    monkeypatch.setenv("DSV41_TP_SECRET", "short")
    with pytest.raises(RendezvousError, match="too short"):
        init_tp(1, 2, "10.255.255.1:29500", deadline_s=1.0, log=lambda m: None)


def test_rank0_refuses_a_master_address_that_is_not_its_own(monkeypatch):
    monkeypatch.setenv("DSV41_TP_SECRET", "k" * 32)
    with pytest.raises(RendezvousError, match="cannot listen on 192.0.2.1"):
        init_tp(0, 2, "192.0.2.1:29500", deadline_s=1.0, log=lambda m: None)


def test_unsigned_abort_is_ignored_and_a_signed_one_aborts():
    env = dict(os.environ, DSV41_TP_SECRET="k" * 32)
    result = subprocess.run([sys.executable, __file__, "abort-probe", f"127.0.0.1:{free_port()}"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "after unsigned: aborted=False" in result.stdout and "no rank signed" in result.stdout, result.stdout
    assert "after signed: aborted=True reason='peer failure: rank 1: real failure' exits=[70]" in result.stdout


if __name__ == "__main__":
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if sys.argv[1] == "abort-probe":
        sys.exit(abort_probe(sys.argv[2]))
    sys.exit(worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])))


def test_every_rank_learns_the_group_s_fewest_pool_pages_when_all_have_loaded():
    """Each rank sizes its KV pool from its own free memory, so two machines come up with other page counts; rank 0
    must hand out only page ids every rank holds (parallel/launch.py `_wait_loaded`, over a real store)."""
    import threading
    import types
    from datetime import timedelta

    from torch.distributed import HashStore

    from dsv41.parallel.launch import _wait_loaded

    store = HashStore()
    store.set_timeout(timedelta(seconds=10))
    failfast = types.SimpleNamespace(check=lambda: None, abort=lambda message: None)
    got = {}

    def rank(r, pages):
        group = types.SimpleNamespace(store=store, rank=r, world=2)
        got[r] = _wait_loaded(group, failfast, 10.0, pages)

    late = threading.Thread(target=rank, args=(1, 3_990))
    first = threading.Thread(target=rank, args=(0, 4_096))
    first.start()
    time.sleep(0.2)
    assert first.is_alive()  # rank 0 waits for rank 1
    late.start()
    first.join(10)
    late.join(10)
    assert got == {0: 3_990, 1: 3_990}
