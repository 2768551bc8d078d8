"""Rendezvous: ranks start in any order, and failures say what they waited for, in bounded time."""

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(rank: int, world: int, master: str, deadline: float = 60.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, str(rank), str(world), master, str(deadline)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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


if __name__ == "__main__":
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    sys.exit(worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])))
