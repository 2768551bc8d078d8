"""Executors: how the engine's `Batch` of each step reaches every rank's `ModelRunner.execute` (docs/ENGINE.md §1).

- `LocalExecutor`: TP=1, the runner in this process.
- `LeaderExecutor` (rank 0): sends the step's `Batch` (with the slots and pages freed since the last one) to
  every rank over the plan channel, then runs the same `execute` itself; the forward's collectives keep the ranks
  in step. The round runs on a worker thread so that the engine thread is released with `TPAborted` the moment
  the group fails (a collective with a dead peer cannot be interrupted).
  `launch` does the same for a step of the overlapped loop (docs/ENGINE.md §6): the batch travels marked
  `launch`, every rank's runner launches it, and rank 0's tokens are read later (`LeaderPending`).
- `follow_batches` (every other rank): receive the next `Batch`, run `execute` (or `launch`, as rank 0 did), until
  the stop batch.

Fail-fast is the group's (parallel/failfast.py): any exception in a round, on any rank, aborts the group (the
ranks would otherwise disagree on what comes next); the heartbeat notices a vanished peer. The test hook
`DSV41_TEST_FAIL_AT_ROUND` counts these rounds (round 0 = the first step).
"""

from __future__ import annotations

import queue
import threading
import traceback

import torch

from dsv41.engine.batch import StepAborted
from dsv41.parallel.failfast import FailureInjector, TPAborted
from dsv41.parallel.plan import PlanChannel, decode_round, encode_batch
from dsv41.parallel.rendezvous import store_client
from dsv41.runtime.engram_gate import GateTimeout


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def current_cuda_device() -> int | None:
    return torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


class RoundWorker:
    """One long-lived thread that runs rank 0's rounds, so that the calling (engine) thread can stop waiting
    when the group aborts: a worker stuck in a collective with a dead peer cannot be interrupted."""

    def __init__(self):
        # the rank's GPU was chosen by init_tp in the main thread; the current device is per thread
        self._device = current_cuda_device()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="dsv41-tp-round", daemon=True)
        self._thread.start()

    def _loop(self):
        if self._device is not None:
            torch.cuda.set_device(self._device)
        while True:
            fn, box, done, grad, inference = self._jobs.get()
            try:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    box["result"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc
            finally:
                done.set()

    def run(self, fn, failfast, poll_s: float = 0.02):
        """`fn()`'s result or exception, or TPAborted as soon as the group is aborted."""
        done, box = threading.Event(), {}
        # grad mode is per thread: carry the caller's over
        self._jobs.put((fn, box, done, torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        while not done.wait(poll_s):
            if failfast.aborted.is_set():
                raise TPAborted(f"tensor-parallel group aborted during a round: {failfast.reason}")
        if "error" in box:
            raise box["error"]
        return box["result"]


class LocalExecutor:
    def __init__(self, runner):
        self.runner = runner

    @property
    def cfg(self):
        """The model configuration the runner runs (what the server sizes its limits from)."""
        return self.runner.forward.model.cfg

    def execute(self, batch):
        return self.runner.execute(batch)

    def launch(self, batch):
        """The step enqueued, its tokens read later (`.result()`): the overlapped loop (docs/ENGINE.md §6)."""
        return self.runner.launch(batch)

    def watch_aborts(self, probe) -> None:
        self.runner.watch_aborts(probe)

    def free_bytes(self) -> int | None:
        return self.runner.free_bytes()

    def close(self) -> None:
        pass


class LeaderExecutor:
    def __init__(self, runner, channel: PlanChannel, failfast, injector=None):
        self.runner, self._channel, self._failfast = runner, channel, failfast
        self._injector = injector or FailureInjector(rank=0)
        self._worker = RoundWorker()
        self._lock = threading.Lock()
        self._closed = False
        self._verdicts: PlanChannel | None = None
        self.rounds = 0  # steps sent (the stop batch is not one)

    cfg = LocalExecutor.cfg

    def execute(self, batch):
        return self._round(batch, self.runner.execute, launch=False)

    def launch(self, batch) -> "LeaderPending":
        """The overlapped loop at TP > 1 (docs/ENGINE.md §6): the step is sent marked `launch`, every rank's runner
        launches it (its follow rows take their ids from the sample of the step each rank launched before: the
        same logits on every rank, the same keyed choice), and its tokens are read later on the round worker."""
        round_no = self.rounds
        return LeaderPending(self, self._round(batch, self.runner.launch, launch=True), round_no)

    def _round(self, batch, run, launch: bool):
        self._failfast.check()
        with self._lock:
            self._failfast.check()
            round_no = self.rounds
            data = encode_batch(round_no, batch, launch)  # a TypeError here sent nothing: still in step
            self.rounds += 1
            try:
                self._channel.send_encoded(round_no, data)
            except Exception as exc:  # noqa: BLE001 - the store is ours: failing to write it is fatal
                self._failfast.abort(f"cannot send step batch {round_no}: {describe(exc)}")
                raise TPAborted(f"cannot send step batch {round_no}: {describe(exc)}") from exc

            def work():
                try:
                    self._channel.trim(round_no)
                except Exception:  # noqa: BLE001 - a stale key costs memory only; the monitor watches the store
                    pass
                self._injector.at_round(round_no)
                return run(batch)

            return self.on_worker(work, round_no)

    def verdicts(self) -> PlanChannel:
        """Where the followers' verdicts are read (the Engram gate: `LeaderPending`), opened at the first."""
        if self._verdicts is None:
            self._verdicts = verdict_channel(self._channel, self._failfast)
        return self._verdicts

    def on_worker(self, work, round_no: int):
        """`work()` on the round worker: TPAborted as soon as the group aborts; any failure but a step abort
        (every rank stopped at the same layer, still in step) aborts the group."""
        try:
            return self._worker.run(work, self._failfast)
        except (TPAborted, StepAborted, GateTimeout):  # a gate's timeout: every rank ran the step, still in step
            raise
        except BaseException as exc:
            self._failfast.abort(f"round {round_no} failed: {describe(exc)}")
            raise TPAborted(f"round {round_no} failed on rank 0: {describe(exc)}") from exc

    def watch_aborts(self, probe) -> None:
        self.runner.watch_aborts(probe)

    def free_bytes(self) -> int | None:
        """The tightest rank's free memory (every rank's monitor reports it about once a second)."""
        reports = self._failfast.memory_reports()
        reports[0] = {"free": self.runner.free_bytes()}
        return min(int(r.get("free", 0)) for r in reports.values())

    def memory_reports(self) -> dict[int, dict]:
        return self._failfast.memory_reports()

    def close(self) -> None:
        """Tell the followers to leave their loop (normal shutdown)."""
        from dsv41.engine.batch import Batch

        with self._lock:
            if not self._failfast.aborted.is_set() and not self._closed:
                self._channel.send_encoded(self.rounds, encode_batch(self.rounds, Batch(-1, [], stop=True)))
                self._closed = True


def verdict_channel(channel: PlanChannel, failfast) -> PlanChannel:
    """The channel over a second store connection, for the verdicts: a client blocked in a get (a follower waiting
    for its next plan) serves no other thread."""
    return PlanChannel(store_client(failfast.master, failfast.world, 60.0), channel.rank, failfast.aborted)


class LeaderPending:
    """Rank 0's launched step: `result()` reads its tokens on the round worker (a read behind a collective with a
    dead peer would never return), a failure there aborts the group like a failed round. With the Engram gate
    (`runner.gated`) it also waits for every follower's verdict of the step's check: a follower whose gate timed
    out computed its partials from stale rows, so the gathered logits are wrong on every rank and the step's
    requests fail (`GateTimeout`, the group still in step) rather than get its tokens."""

    def __init__(self, executor: LeaderExecutor, pending, round_no: int):
        self._executor, self._pending, self.round_no = executor, pending, round_no

    def result(self):
        return self._executor.on_worker(self._joined, self.round_no)

    def _joined(self):
        out = self._pending.result()
        ex = self._executor
        if ex.runner.gated:
            for rank in range(1, ex._failfast.world):
                verdict = ex.verdicts().receive_verdict(self.round_no, rank)
                if verdict:
                    raise GateTimeout(f"rank {rank}: {verdict}")
        return out


class Verdicts:
    """A follower's checks of its launched steps (the Engram gate at TP > 1): one thread runs each step's check
    once that step's sample is in (`PendingStep.verdict`) and sends rank 0 the verdict, never behind the loop's
    next receive (rank 0 may read step k before it sends step k + 1)."""

    def __init__(self, channel: PlanChannel, failfast):
        self._channel, self._failfast = verdict_channel(channel, failfast), failfast
        self._device = current_cuda_device()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="dsv41-tp-verdicts", daemon=True).start()

    def put(self, number: int, pending) -> None:
        self._jobs.put((number, pending))

    def _loop(self):
        if self._device is not None:
            torch.cuda.set_device(self._device)
        while True:
            number, pending = self._jobs.get()
            try:
                with torch.inference_mode():
                    self._channel.send_verdict(number, pending.verdict())
            except BaseException as exc:  # noqa: BLE001 - rank 0 waits for this verdict: fail the group instead
                self._failfast.abort(f"round {number}: cannot send the check's verdict: {describe(exc)}")
                return


def follow_batches(runner, channel: PlanChannel, failfast, injector=None, log=None,
                   device: int | None = None) -> int:
    """A follower's main loop: run rank 0's step batches until the stop batch. Returns the rounds run.

    Any failure aborts the group (the monitor then ends this process with status 70)."""
    injector = injector or FailureInjector(rank=channel.rank)
    if device is not None:
        torch.cuda.set_device(device)
    number = 0
    verdicts = Verdicts(channel, failfast) if getattr(runner, "gated", False) else None
    try:
        with torch.inference_mode():
            while True:
                got, batch, launch = decode_round(channel.receive_bytes(number))
                if got != number:
                    raise ValueError(f"step batch tp/plan/{number} carries round {got}")
                if batch.stop:
                    return number
                injector.at_round(number)
                try:
                    # launched (the overlapped loop): enqueued, not waited for; the next round's follow rows take
                    # their ids from its sample, and the loop is at the next receive while it runs
                    pending = (runner.launch if launch else runner.execute)(batch)
                    if launch and verdicts is not None:
                        verdicts.put(number, pending)
                except StepAborted:  # rank 0 stopped at the same layer (runtime/abort.py): the group is in step
                    pass
                number += 1
    except TPAborted:
        failfast.aborted.wait()
        raise
    except BaseException as exc:
        if log is not None:
            log(traceback.format_exc())
        failfast.abort(f"round {number} failed: {describe(exc)}")
        raise TPAborted(f"round {number} failed on rank {channel.rank}: {describe(exc)}") from exc
