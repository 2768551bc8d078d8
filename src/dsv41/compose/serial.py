"""SerialEngine: one request at a time, the model running in a worker thread.

Requests wait in a bounded FIFO. A single asyncio task hands the oldest one to a one-thread executor, which
prefills the prompt in chunks and decodes token by token, pushing each event to the request's stream on the
event loop. Cancellation is a flag the worker checks before every forward, so a departed client costs at most
one more step. The HTTP side never blocks the worker: events go into an unbounded per-request queue, which
`max_tokens` bounds.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from ..engine.interface import (
    Engine,
    EngineFailure,
    EngineRejected,
    EngineOverloaded,
    EngineStats,
    FinishEvent,
    GenerationRequest,
    PromptLogprobsEvent,
    RequestStream,
    TokenEvent,
    check_submittable,
)
from ..engine.constraint import GrammarConstraint
from ..runtime.sampling import adjust_logits, banned_ids, derive_seed, sample_token, token_logprobs


class SerialEngine(Engine):
    def __init__(self, model, *, max_model_len: int, max_waiting: int = 64, prefill_chunk: int = 512,
                 encode_text: Callable[[str], list[int]] | None = None, stall_s: float = 60.0):
        """`encode_text` (the tokenizer's encode) enables jump-forward: text a grammar forces is tokenized and
        run through the model in one forward instead of being sampled token by token."""
        self.model = model
        self.encode_text = encode_text
        config = getattr(model, "config", None) or model.cfg
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = int(max_model_len)
        self.max_waiting = max_waiting
        self.prefill_chunk = prefill_chunk
        self._waiting: deque[RequestStream] = deque()
        self._stop_flags: dict[int, threading.Event] = {}
        self._running: RequestStream | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv41-engine")
        self._state = "ready"
        self._live = 0
        self._live_lock = threading.Lock()
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        # a forward that has not returned after `stall_s` means a wedged engine (hung collective, stuck device)
        self.stall_s = stall_s
        self._forward_since: float | None = None

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._serve_forever(), name="dsv41-engine-loop")

    def begin_drain(self) -> None:
        if self._state == "ready":
            self._state = "draining"

    async def shutdown(self) -> None:
        self._state = "stopped"
        for stream in list(self._waiting) + ([self._running] if self._running else []):
            stream.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        # the worker notices its flag within one step; wait for it so no state outlives the engine
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)

    def stats(self) -> EngineStats:
        return EngineStats(
            state=self._state,
            running=1 if self._running is not None else 0,
            waiting=len(self._waiting),
            live_sequences=self._live,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
        )

    def healthy(self) -> bool:
        if self._task is None or self._task.done() or self._state == "stopped":
            return False
        since = self._forward_since
        return since is None or time.monotonic() - since < self.stall_s

    def _forward(self, state, ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        self._forward_since = time.monotonic()
        try:
            return self.model.forward(state, ids, last_only=last_only)
        finally:
            self._forward_since = None

    # ---------------------------------------------------------------- requests
    def submit(self, request: GenerationRequest) -> RequestStream:
        check_submittable(request, self._state)
        if len(self._waiting) >= self.max_waiting:
            raise EngineOverloaded(f"{len(self._waiting)} requests already waiting")
        stream = RequestStream(request, self._cancel)
        self._stop_flags[id(stream)] = threading.Event()
        self._waiting.append(stream)
        self._wakeup.set()
        return stream

    def _cancel(self, stream: RequestStream) -> None:
        flag = self._stop_flags.get(id(stream))
        if flag is not None:
            flag.set()
        try:
            self._waiting.remove(stream)
            self._stop_flags.pop(id(stream), None)
        except ValueError:
            pass  # already running: the worker sees the flag

    async def _serve_forever(self) -> None:
        while True:
            while not self._waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
            stream = self._waiting.popleft()
            flag = self._stop_flags.get(id(stream))
            if flag is None or flag.is_set():
                continue
            self._running = stream
            try:
                await asyncio.shield(self._loop.run_in_executor(self._executor, self._generate, stream, flag))
            finally:
                self._running = None
                self._stop_flags.pop(id(stream), None)

    # ---------------------------------------------------------------- worker thread
    def _generate(self, stream: RequestStream, stop_flag: threading.Event) -> None:
        loop = self._loop

        def emit(item) -> None:
            loop.call_soon_threadsafe(stream.push, item)

        try:
            with torch.inference_mode():
                self._run_request(stream.request, stop_flag, emit)
        except EngineRejected as exc:  # the request's own dead end (its grammar): a 400, not a fault
            emit(exc)
        except Exception as exc:  # any other failure inside the model is the engine's, not the caller's
            emit(EngineFailure(f"{type(exc).__name__}: {exc}"))

    def _run_request(self, req: GenerationRequest, stop_flag: threading.Event, emit) -> None:
        prompt_len = len(req.prompt_ids)
        state = self.model.new_state()
        with self._live_lock:
            self._live += 1
        try:
            reason, produced = self._decode(state, req, stop_flag, emit)
        finally:
            del state
            with self._live_lock:
                self._live -= 1
        # the finish event goes out only after the state is freed, so "finished" implies "no resources held"
        emit(FinishEvent(reason=reason, prompt_tokens=prompt_len, completion_tokens=produced))

    def _decode(self, state, req: GenerationRequest, stop_flag: threading.Event, emit) -> tuple[str, int]:
        prompt_len = len(req.prompt_ids)
        limit = min(req.max_tokens, self.max_model_len - prompt_len)
        seed = req.sampling.seed if req.sampling.seed is not None else derive_seed(req.prompt_ids)
        grammar = GrammarConstraint(req.grammar, self.vocab_size) if req.grammar is not None else None
        ids = torch.tensor(req.prompt_ids, dtype=torch.long)
        logits = None
        scored: list = [(None, ())]  # prompt token 0 has no context
        for start in range(0, prompt_len, self.prefill_chunk):
            if stop_flag.is_set():
                return "cancelled", 0
            previous = logits[-1:] if logits is not None else logits
            logits = self._forward(state, ids[start : start + self.prefill_chunk],
                                   last_only=req.prompt_logprobs is None)
            if req.prompt_logprobs is not None:
                # row j predicts token j+1: score this chunk's tokens with the rows before them
                rows = logits[:-1] if previous is None else torch.cat((previous, logits[:-1]))
                first = start + (1 if previous is None else 0)
                for row, token in zip(rows, req.prompt_ids[first:start + logits.shape[0]]):
                    chosen, top = token_logprobs(row, token, req.prompt_logprobs)
                    scored.append((chosen, tuple(top)))
        if req.prompt_logprobs is not None:
            emit(PromptLogprobsEvent(tuple(scored)))
        self._prompt_tokens_total += prompt_len
        row = logits[-1]
        produced = 0
        output: list[int] = []  # the request's own tokens so far (penalties, bad words, min_tokens)

        def report(token: int, dist: torch.Tensor) -> None:
            if req.logprobs is not None:
                chosen, top = token_logprobs(dist, token, req.logprobs)
                emit(TokenEvent(token, chosen, tuple(top)))
            else:
                emit(TokenEvent(token))

        while True:
            if stop_flag.is_set():
                return "cancelled", produced
            forced = grammar.forced_tokens(self.encode_text, limit - produced) \
                if grammar is not None and self.encode_text is not None else []
            if forced:
                # text the grammar allows in exactly one way: one forward for all of it
                out = self._forward(state, torch.tensor(forced, dtype=torch.long))
                for k, token in enumerate(forced):
                    report(token, row if k == 0 else out[k - 1])
                produced += len(forced)
                output += forced
                self._generation_tokens_total += len(forced)
                row = out[-1]
                if produced >= limit:
                    return "length", produced
                continue
            masked = row
            p = req.sampling
            if p.adjusts:
                banned = banned_ids(p, output, () if req.ignore_eos else req.stop_token_ids)
                masked = adjust_logits(row, p, output, req.prompt_ids, banned)
                if not torch.isfinite(masked).any():
                    raise EngineRejected("the sampling parameters (allowed_token_ids, bad_words, min_tokens) allow "
                                         "no token here", code="no_token_allowed")
            masked = grammar.mask_row(masked) if grammar is not None else masked
            token = sample_token(masked, req.sampling, seed, produced)
            output.append(token)
            produced += 1
            self._generation_tokens_total += 1
            report(token, row)
            if grammar is not None and grammar.accept(token):
                return "stop", produced
            if token in req.stop_token_ids and not req.ignore_eos:
                return "stop", produced
            if produced >= limit:
                return "length", produced
            row = self._forward(state, torch.tensor([token], dtype=torch.long))[-1]
