"""Lockstep execution: rank 0 decides, every rank runs the same model calls in the same order.

`LeaderModel` wraps rank 0's model and looks like a model to the engine: `new_state()` and `forward(state, ids)`
(and any other method named in `mirrored`) are recorded into a round plan, sent to the followers, then run
locally. The followers run `follow()`, which replays each plan on their own model and their own decode states
(kept under the same slot numbers). Calls without collectives (`new_state`) and freed states ride along with the
next plan that has a forward, so a round is one store round-trip plus the forward itself.

Failure handling: a mirrored call on rank 0 runs in a worker thread while the calling (engine) thread waits for it
or for the fail-fast monitor, whichever comes first. So when a peer dies mid-collective the engine gets
`TPAborted` at once and can fail its in-flight requests, although the worker stays stuck in the collective until
the monitor ends the process. Any exception in a mirrored call, on any rank, aborts the group: the ranks would
otherwise disagree on what comes next.
"""

from __future__ import annotations

import threading
import traceback
import weakref

import torch

from dsv41.parallel.executor import RoundWorker, describe as _describe
from dsv41.parallel.failfast import FailureInjector, TPAborted
from dsv41.parallel.plan import Call, PlanChannel, RoundPlan, StateRef, encode_plan

DEFAULT_MIRRORED = ("new_state", "forward")
STATE_FACTORIES = ("new_state",)


class StateHandle:
    """Rank 0's stand-in for a decode state: reads go to the real state, the slot names it in plans."""

    __slots__ = ("_slot", "_state", "__weakref__")

    def __init__(self, slot: int, state):
        object.__setattr__(self, "_slot", slot)
        object.__setattr__(self, "_state", state)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_state"), name)

    def __setattr__(self, name, value):
        raise AttributeError(f"decode state is read-only under tensor parallelism (set {name!r}); change it "
                             "through a mirrored model call so that every rank sees the change")

    def __len__(self):
        return len(self._state)


class LeaderModel:
    """Rank 0's model as the engine sees it (see module docstring)."""

    def __init__(self, model, channel: PlanChannel, failfast, mirrored=DEFAULT_MIRRORED, injector=None):
        self._model, self._channel, self._failfast = model, channel, failfast
        self._mirrored = frozenset(mirrored)
        self._injector = injector or FailureInjector(rank=0)
        self._lock = threading.Lock()
        self._worker = RoundWorker()
        self._round = 0
        self._next_slot = 0
        self._pending: list[Call] = []
        self._freed: list[int] = []
        # re-entrant: a state handle's finaliser may run from a garbage collection inside this lock
        self._freed_lock = threading.RLock()
        self._released = 0

    @property
    def rounds(self) -> int:
        return self._round

    def memory_reports(self) -> dict[int, dict]:
        """Every rank's latest memory report (bytes: free, total, rss, ...), for admission control."""
        return self._failfast.memory_reports()

    def __call__(self, *args, **kwargs):
        return self._call("forward", args, kwargs)

    @property
    def live_states(self) -> int:
        """Decode states the followers still hold for us (created, not yet freed)."""
        with self._freed_lock:
            return self._next_slot - self._released

    def __getattr__(self, name):
        attr = getattr(self._model, name)
        if name in self._mirrored and callable(attr):
            return lambda *args, **kwargs: self._call(name, args, kwargs)
        return attr

    def close(self) -> None:
        """Tell the followers to leave their loop (normal shutdown)."""
        with self._lock:
            if not self._failfast.aborted.is_set():
                self._channel.send(RoundPlan(number=self._round, stop=True))
                self._round += 1

    # ---- recording -------------------------------------------------------------------------------------------

    def _to_ref(self, value):
        if isinstance(value, StateHandle):
            return StateRef(value._slot)
        if isinstance(value, (list, tuple)):
            return type(value)(self._to_ref(v) for v in value)
        if isinstance(value, dict):
            return {k: self._to_ref(v) for k, v in value.items()}
        return value

    def _to_local(self, value):
        if isinstance(value, StateHandle):
            return value._state
        if isinstance(value, (list, tuple)):
            return type(value)(self._to_local(v) for v in value)
        if isinstance(value, dict):
            return {k: self._to_local(v) for k, v in value.items()}
        return value

    def _release(self, slot: int) -> None:
        with self._freed_lock:
            self._freed.append(slot)
            self._released += 1

    def _call(self, name: str, args: tuple, kwargs: dict):
        self._failfast.check()
        with self._lock:
            self._failfast.check()
            local = getattr(self._model, name)
            local_args, local_kwargs = self._to_local(args), self._to_local(kwargs)
            makes_state = name in STATE_FACTORIES
            slot = None
            if makes_state:
                slot, self._next_slot = self._next_slot, self._next_slot + 1
            call = Call(name, self._to_ref(args), self._to_ref(kwargs), slot)
            if makes_state:
                # No collectives inside: run it now, send it with the next plan that has a forward.
                try:
                    state = local(*local_args, **local_kwargs)
                except BaseException as exc:
                    self._failfast.abort(f"{name} failed: {_describe(exc)}")
                    raise TPAborted(f"{name} failed on rank 0: {_describe(exc)}") from exc
                self._pending.append(call)
                handle = StateHandle(slot, state)
                weakref.finalize(handle, self._release, slot)
                return handle
            with self._freed_lock:
                freed = list(self._freed)
            plan = RoundPlan(number=self._round, calls=self._pending + [call], freed=freed)
            try:
                data = encode_plan(plan)
            except (TypeError, ValueError) as exc:  # nothing was sent: the group is still in step
                raise TypeError(f"cannot run {name} under tensor parallelism: {exc}") from exc
            with self._freed_lock:
                del self._freed[:len(freed)]
            self._pending = []
            round_no = self._round
            self._round += 1
            try:
                self._channel.send_encoded(round_no, data)
            except Exception as exc:  # noqa: BLE001 - the store is ours: failing to write it is fatal
                self._failfast.abort(f"cannot send round plan {round_no}: {_describe(exc)}")
                raise TPAborted(f"cannot send round plan {round_no}: {_describe(exc)}") from exc

            def work():
                self._injector.at_round(round_no)
                return local(*local_args, **local_kwargs)

            def trim_then_work():
                try:
                    self._channel.trim(round_no)
                except Exception:  # noqa: BLE001 - a stale key costs memory only; the monitor watches the store
                    pass
                return work()

            try:
                return self._worker.run(trim_then_work, self._failfast)
            except TPAborted:
                raise
            except BaseException as exc:
                self._failfast.abort(f"round {round_no} ({name}) failed: {_describe(exc)}")
                raise TPAborted(f"round {round_no} ({name}) failed on rank 0: {_describe(exc)}") from exc


def follow(model, channel: PlanChannel, failfast, injector=None, log=None, device: int | None = None) -> int:
    """A follower's main loop: replay rank 0's plans until the stop plan. Returns the number of rounds run.

    Any failure aborts the group (the monitor then ends this process with status 70)."""
    injector = injector or FailureInjector(rank=channel.rank)
    if device is not None:
        torch.cuda.set_device(device)
    states: dict[int, object] = {}

    def local(value):
        if isinstance(value, StateRef):
            return states[value.slot]
        if isinstance(value, (list, tuple)):
            return type(value)(local(v) for v in value)
        if isinstance(value, dict):
            return {k: local(v) for k, v in value.items()}
        return value

    number = 0
    try:
        while True:
            plan = channel.receive(number)
            if plan.stop:
                return number
            injector.at_round(number)
            for call in plan.calls:
                result = getattr(model, call.method)(*local(call.args), **local(call.kwargs))
                if call.result_slot is not None:
                    states[call.result_slot] = result
            # after the calls: a state created by this plan's new_state may already be dropped by rank 0
            for slot in plan.freed:
                states.pop(slot, None)
            number += 1
    except TPAborted:
        failfast.aborted.wait()
        raise
    except BaseException as exc:
        if log is not None:
            log(traceback.format_exc())
        failfast.abort(f"round {number} failed: {_describe(exc)}")
        raise TPAborted(f"round {number} failed on rank {channel.rank}: {_describe(exc)}") from exc
