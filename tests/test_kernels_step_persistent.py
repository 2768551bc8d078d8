"""The persistent step's executor (kernels/step/persistent.py, issue 37 item 1) on a toy step — two GEMVs from one
input, their SwiGLU product, a GEMV of that, a residual add — against the same ops launched one by one: bitwise
equal, step after step without resetting a flag (the counters' epochs), and a wait that can never be met is
recorded and fails the host's check instead of hanging. CPU: Triton's interpreter (programs run one after
another there, so it checks the tables, the item dispatch and the counters' arithmetic; the GPU test runs the
programs side by side)."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from step_harness import caught, interpreted, need_compiled_cuda


def _toy(device, programs, k=32, n=48, seed=0):
    from dsv41.kernels.step.persistent import ADD, GEMV, SWIGLU, PersistentStep, Step

    g = torch.Generator().manual_seed(seed)
    at = {}
    sizes = [("x", k), ("w1", k * n), ("w3", k * n), ("w2", n * k), ("h1", n), ("h3", n), ("g", n), ("y", k),
             ("out", k)]
    off = 0
    for name, size in sizes:
        at[name] = off
        off += size
    arena = torch.randn(off, generator=g).to(device)
    for name in ("h1", "h3", "g", "y", "out"):
        arena[at[name]:at[name] + (n if name in ("h1", "h3", "g") else k)] = float("nan")
    steps = [
        Step("up1", GEMV, a=at["x"], w=at["w1"], out=at["h1"], k=k, n=n),
        Step("up3", GEMV, a=at["x"], w=at["w3"], out=at["h3"], k=k, n=n),
        Step("act", SWIGLU, a=at["h1"], b=at["h3"], out=at["g"], n=n, reads=("up1", "up3")),
        Step("down", GEMV, a=at["g"], w=at["w2"], out=at["y"], k=n, n=k, reads=("act",)),
        Step("res", ADD, a=at["y"], b=at["x"], out=at["out"], n=k, reads=("down",)),
    ]
    return PersistentStep(steps, arena, programs, wait_s=0.05), at, k, n


def _reference(arena, at, k, n):
    a = arena.double()
    x = a[at["x"]:at["x"] + k]
    w1, w3 = (a[at[w]:at[w] + k * n].view(k, n) for w in ("w1", "w3"))
    w2 = a[at["w2"]:at["w2"] + n * k].view(n, k)
    h1, h3 = x @ w1, x @ w3
    return (h1 / (1 + torch.exp(-h1)) * h3) @ w2 + x


def _run(device, programs):
    """Two steps both ways (a new input before the second), then a step whose table waits for a count that never
    comes: what the checks below read."""
    step, at, k, n = _toy(device, programs)
    launched = _toy(device, programs)[0]
    out = {"at": at, "k": k, "n": n, "epochs": []}
    for epoch in range(2):
        if epoch:  # a new input: the second step must see it, not the first's
            new = torch.randn(k, generator=torch.Generator().manual_seed(9)).to(device)
            step.arena[at["x"]:at["x"] + k] = new
            launched.arena[at["x"]:at["x"] + k] = new
        step.run()
        launched.run_launches()
        out["epochs"].append((step.arena.cpu().clone(), launched.arena.cpu().clone(), caught(step.check)))
    out["flags"], out["targets"] = step.flags.cpu(), torch.tensor(step.plan.flag_targets, dtype=torch.int64)
    out["queue"], out["items"], out["epoch"] = int(step.queue), len(step.plan.items), int(step.state)
    broken = _toy(device, programs)[0]
    act = next(i for i, it in enumerate(broken.plan.items) if broken.plan.ops[it.op].name == "act")
    broken.table[act, 6] += 1000  # a corrupted count: the flag never gets there
    broken.run()
    out["broken"], out["act"] = caught(broken.check), act
    return out


def _check(r, programs):
    at, k, n = r["at"], r["k"], r["n"]
    for epoch, (persistent, launched, checked) in enumerate(r["epochs"]):
        assert checked is None, checked
        assert torch.equal(persistent, launched), f"epoch {epoch + 1}: persistent != a launch an op"
        ref = _reference(persistent, at, k, n)
        got = persistent[at["out"]:at["out"] + k].double()
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert not torch.equal(r["epochs"][0][0], r["epochs"][1][0]), "the second step saw the new input"
    assert torch.equal(r["flags"], 2 * r["targets"]), "flags count on: twice a step's counts after two steps"
    assert r["queue"] == 2 * (r["items"] + programs)
    assert r["epoch"] == 3, "the kernel counted its steps: the next is the third"
    # the corrupted item's wait times out; on a GPU its dependents wait beside it and may time out too, so every
    # recorded ticket is that item's or a later one (never an item before it), and it is among them
    assert isinstance(r["broken"], dict) and "timed out" in r["broken"]["error"], r["broken"]
    tickets = [int(t) for t in re.search(r"queue tickets \[([^]]*)\]", r["broken"]["error"]).group(1).split(",")]
    assert r["act"] in tickets and min(tickets) == r["act"], r["broken"]


def _interp_worker(out_path: str) -> None:
    torch.save({p: _run("cpu", p) for p in (1, 3)}, out_path)


def test_interpreted_persistent_step_equals_a_launch_an_op_and_never_hangs(tmp_path_factory):
    results = interpreted(tmp_path_factory, __file__, "persistent", timeout=300)
    for programs, r in results.items():
        _check(r, programs)


def test_ops_must_fill_whole_items():
    from dsv41.kernels.step.persistent import GEMV, PersistentStep, Step

    with pytest.raises(ValueError, match="multiples"):
        PersistentStep([Step("a", GEMV, a=0, out=0, n=20, k=16)], torch.zeros(8), 1)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [8, 132])
def test_gpu_persistent_step_equals_a_launch_an_op(programs):
    need_compiled_cuda()
    _check(_run(torch.device("cuda"), programs), programs)


@pytest.mark.gpu
def test_gpu_persistent_step_replays_in_a_cuda_graph():
    """The step's number lives on the device: a graph of one launch replays step after step (new input each)."""
    need_compiled_cuda()
    dev = torch.device("cuda")
    step, at, k, n = _toy(dev, 16)
    launched = _toy(dev, 16)[0]
    step.run()  # compiled, and step 1
    launched.run_launches()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run()
    for i in range(3):
        new = torch.randn(k, generator=torch.Generator().manual_seed(20 + i)).to(dev)
        step.arena[at["x"]:at["x"] + k] = new
        launched.arena[at["x"]:at["x"] + k] = new
        graph.replay()
        launched.run_launches()
        torch.cuda.synchronize()
        assert torch.equal(step.arena, launched.arena), f"replay {i + 1}"
    step.check()
    assert int(step.state) == 5 and torch.equal(step.flags.cpu(), 4 * torch.tensor(step.plan.flag_targets))


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    _interp_worker(sys.argv[2])
