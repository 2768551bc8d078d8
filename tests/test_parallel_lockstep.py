"""LeaderModel's recording, in one process: a TP group of one rank (real store, real gloo group, tiny model).

What rank 0 writes into the round plans is read back from the store and decoded, as a follower would."""

from __future__ import annotations

import gc
import socket

import pytest
import torch

from dsv41.parallel.failfast import FailFast, TPAborted
from dsv41.parallel.lockstep import LeaderModel
from dsv41.parallel.plan import PlanChannel, StateRef, decode_plan
from dsv41.parallel.rendezvous import init_tp


@pytest.fixture(scope="module")
def leader():
    from dsv41.model.loader import load_model
    from dsv41.tiny.model import default_model_dir

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group = init_tp(0, 1, f"127.0.0.1:{port}", deadline_s=10)
    exits = []
    failfast = FailFast(group, exit_fn=exits.append, grace_s=0.0).start()
    model = load_model(default_model_dir(), torch.float32, "cpu", comm=group.comm)
    yield LeaderModel(model, PlanChannel(group.store, 0), failfast), group, model
    failfast.stop()
    group.close()


def plan(group, n):
    return decode_plan(group.store.get(f"tp/plan/{n}"))


def test_calls_states_and_frees_are_recorded(leader):
    lead, group, model = leader
    start = lead.rounds
    state = lead.new_state()
    assert lead.rounds == start  # new_state has no collectives: it waits for the next forward
    logits = lead.forward(state, torch.tensor([0, 5, 9]))
    assert torch.equal(logits, model.forward(model.new_state(), torch.tensor([0, 5, 9])))
    first = plan(group, start)
    assert [c.method for c in first.calls] == ["new_state", "forward"]
    slot = first.calls[0].result_slot
    assert first.calls[1].args[0] == StateRef(slot) and first.calls[1].args[1].tolist() == [0, 5, 9]
    assert state.pos == 3  # reads reach the real state
    with pytest.raises(AttributeError, match="read-only"):
        state.pos = 0
    del state
    gc.collect()
    other = lead.new_state()
    lead(other, torch.tensor([1]))  # calling the model is a forward too
    second = plan(group, start + 1)
    assert second.freed == [slot] and lead.live_states == 1


def test_an_unencodable_argument_is_refused_before_anything_is_sent(leader):
    lead, group, _ = leader
    state = lead.new_state()
    before = lead.rounds
    with pytest.raises(TypeError, match="cannot run forward under tensor parallelism"):
        lead.forward(state, torch.tensor([3]), trace=lambda: None)
    assert lead.rounds == before and not group.store.check([f"tp/plan/{before}"])
    lead.forward(state, torch.tensor([3]))  # the group is still in step
    assert [c.method for c in plan(group, before).calls] == ["new_state", "forward"]


def test_a_failing_forward_aborts_the_group(leader):
    lead, group, _ = leader
    state = lead.new_state()
    with pytest.raises(TPAborted, match="rank 0"):
        lead.forward(state, torch.tensor([10_000]))  # beyond the vocabulary: the model raises
    assert lead._failfast.aborted.is_set()
    with pytest.raises(TPAborted):  # every later call fails at once (queued requests get their error fast)
        lead.new_state()
