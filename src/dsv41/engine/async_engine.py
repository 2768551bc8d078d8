"""AsyncEngine: the batched `LLMEngine` behind the server's `Engine` interface (the bridge; docs/ENGINE.md §1).

One worker thread owns the `LLMEngine`: between steps it takes the event loop's commands (add a request, cancel
one), then runs a step. Events go back to each request's stream on the event loop. Submitting, cancelling and
reading stats never wait for a step. This module is where policy meets torch: a request's grammar becomes a
`GrammarConstraint` (xgrammar) here.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time

from .interface import (Engine, EngineFailure, EngineOverloaded, EngineStats, FinishEvent, GenerationRequest,
                        RequestStream, check_submittable)
from .llm_engine import LLMEngine
from .request import Sequence


class AsyncEngine(Engine):
    def __init__(self, core: LLMEngine, *, vocab_size: int, max_model_len: int, max_waiting: int = 64,
                 encode_text=None, stall_s: float = 60.0, describe: dict | None = None, park_s: float = 30.0):
        self.core = core
        self.park_s = park_s  # a graceful stop parks session entries for at most about this long
        self.vocab_size, self.max_model_len, self.max_waiting = int(vocab_size), int(max_model_len), max_waiting
        self.encode_text = encode_text
        self.stall_s = stall_s
        self.describe = describe or {}  # static facts for /health (pool bytes per token and per slot, ...)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._pending_adds = 0  # submitted, not yet taken by the worker
        self._pending_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._state = "ready"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._step_since: float | None = None
        self.failure: str | None = None

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="dsv41-engine", daemon=True)
        self._thread.start()

    def begin_drain(self) -> None:
        if self._state == "ready":
            self._state = "draining"

    async def shutdown(self) -> None:
        self._state = "stopped"
        self._commands.put(("stop", None))
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        close = getattr(self.core.executor, "close", None)
        if close is not None:
            close()

    def healthy(self) -> bool:
        if self._thread is None or not self._thread.is_alive() or self._state == "stopped":
            return False
        since = self._step_since
        return since is None or time.monotonic() - since < self.stall_s

    def stats(self) -> EngineStats:
        core = self.core
        detail = {**core.stats(), **self.describe}
        return EngineStats(state=self._state, running=len(core.scheduler.running),
                           waiting=core.scheduler.num_waiting + self._pending_adds,
                           live_sequences=core.blocks.num_used_slots,
                           prompt_tokens_total=core.prompt_tokens_total,
                           generation_tokens_total=core.generation_tokens_total, detail=detail)

    # ---------------------------------------------------------------- requests
    def submit(self, request: GenerationRequest) -> RequestStream:
        check_submittable(request, self._state)
        stream = self._stream(request)
        with self._pending_lock:
            self._pending_adds += 1
        self._commands.put(("add", stream.seq))
        self._wake.set()
        return stream

    def submit_group(self, requests: list[GenerationRequest]) -> list[RequestStream]:
        """One engine group: the prompt prefilled once, its full pages shared, the siblings forked (llm_engine)."""
        if len(requests) == 1:
            return [self.submit(requests[0])]
        for request in requests:
            check_submittable(request, self._state)
            if request.prompt_ids != requests[0].prompt_ids or request.max_tokens != requests[0].max_tokens:
                raise ValueError("the requests of a group need the same prompt and max_tokens")
        streams = [self._stream(request) for request in requests]
        with self._pending_lock:
            self._pending_adds += len(streams)
        self._commands.put(("group", [stream.seq for stream in streams]))
        self._wake.set()
        return streams

    def _stream(self, request: GenerationRequest) -> RequestStream:
        waiting = self.core.scheduler.num_waiting + self._pending_adds
        if waiting >= self.max_waiting:
            raise EngineOverloaded(f"{waiting} requests already waiting")
        starved = self.core.scheduler.starved_since
        if starved is not None and time.monotonic() - starved > self.core.config.scheduler.admit_timeout_s:
            raise EngineOverloaded("free memory has stayed under the floor with nothing running")
        stream = RequestStream(request, self._cancel)
        loop = self._loop

        def emit(event) -> None:
            try:
                loop.call_soon_threadsafe(stream.push, event)
            except RuntimeError:  # the loop is gone (shutdown): nobody is listening
                pass

        stream.seq = self.make_sequence(request, emit)
        return stream

    def make_sequence(self, request: GenerationRequest, emit) -> Sequence:
        """The engine's view of a request: its output budget within the context, its grammar as a constraint."""
        constraint = None
        if request.grammar is not None:
            from .constraint import GrammarConstraint

            constraint = GrammarConstraint(request.grammar, self.vocab_size, self.encode_text)
        limit = max(1, min(request.max_tokens, self.max_model_len - len(request.prompt_ids)))
        seq = Sequence(list(request.prompt_ids), limit, request.sampling, request.stop_token_ids,
                       request.ignore_eos, request.logprobs, request.prompt_logprobs, constraint,
                       request.background, emit)
        seq.draft = getattr(request, "draft", None)
        return seq

    def _cancel(self, stream: RequestStream) -> None:
        stream.seq.cancel_requested = True  # read by a running step between its layers (LLMEngine.step_abandoned)
        self._commands.put(("abort", stream.seq))
        self._wake.set()

    # ---------------------------------------------------------------- worker thread
    def _take_commands(self) -> bool:
        """Apply queued commands; False once asked to stop."""
        while True:
            try:
                kind, seq = self._commands.get_nowait()
            except queue.Empty:
                return True
            if kind == "stop":
                return False
            if kind in ("add", "group"):
                seqs = seq if kind == "group" else [seq]
                with self._pending_lock:
                    self._pending_adds -= len(seqs)
                if self._stopping.is_set():
                    for s in seqs:
                        s.emit(FinishEvent("cancelled", s.prompt_len, 0))
                    continue
                try:
                    self.core.add_group(seqs)
                except ValueError as exc:
                    for s in seqs:
                        s.emit(EngineFailure(str(exc)))
            else:
                self.core.abort(seq)

    def _park_sessions(self) -> None:
        """A graceful stop parks the RAM tier's entries on the NVMe tier (--session-dir), so a restarted server
        resumes the conversations it had; a failure here is logged, the stop goes on."""
        core = self.core
        if core.sessions is None or core.sessions.disk is None:
            return
        started = time.monotonic()
        try:
            parked, left = 0, 0
            while core.sessions.park_recent():  # newest first, one a batch, within the time given
                while core.has_work():
                    core.step()
                parked += 1
                if time.monotonic() - started > self.park_s:
                    left = len(core.sessions.index)
                    break
            print(f"dsv41 engine: session entries parked in {time.monotonic() - started:.2f} s ({parked} left "
                  f"RAM{f'; {left} dropped: --session-park-s {self.park_s:g} is up' if left else ''})",
                  file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001 - the stop must not hang on the cache
            print(f"dsv41 engine: parking session entries failed: {type(exc).__name__}: {exc}", file=sys.stderr,
                  flush=True)

    def _run(self) -> None:
        core = self.core
        while True:
            self._wake.clear()
            if not self._take_commands():
                break
            if not core.has_work():
                self._wake.wait()
                continue
            self._step_since = time.monotonic()
            try:
                ran = core.step()
            except Exception as exc:  # noqa: BLE001 - the step's requests got the error; keep serving the rest
                self.failure = f"{type(exc).__name__}: {exc}"
                print(f"dsv41 engine: step failed: {self.failure}", file=sys.stderr, flush=True)
                ran = True
            finally:
                self._step_since = None
            if not ran:
                self._wake.wait(0.05)  # admission is blocked (memory floor): look again shortly
        # shutdown: whatever is left ends as cancelled, with its slot and pages back
        self._stopping.set()
        for seq in list(core.scheduler.running) + list(core.scheduler.waiting) + list(core.scheduler.waiting_bg):
            core.abort(seq)
        self._park_sessions()
        self._take_commands()
