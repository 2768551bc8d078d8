"""The async engine interface the HTTP server talks to.

A request goes in as token ids plus sampling/stopping rules; what comes back is a `RequestStream`, an async
iterator of `TokenEvent`s ending with one `FinishEvent`. The consumer may `cancel()` at any time (client gone,
stop string matched); the engine then frees the request's state. Engine failures surface as `EngineFailure`
raised from the iterator. `SerialEngine` (compose/serial.py) runs one request at a time over the reference model;
`AsyncEngine` (engine/async_engine.py) batches requests over the paged KV pool behind the same class, so the
server does not change (docs/ENGINE.md).
"""

from __future__ import annotations

import asyncio
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from .params import SamplingParams


class EngineFailure(Exception):
    """The engine could not produce the request's tokens (a bug or a device fault, not the caller's input)."""


class EngineRejected(EngineFailure):
    """The request cannot be served as asked — its grammar reaches a dead end, or it cannot fit in memory even with
    nothing else running. The caller's request, not a fault of the engine: the server answers 400 with `code`."""

    def __init__(self, message: str, code: str = "request_not_servable"):
        super().__init__(message)
        self.code = code


class EngineOverloaded(Exception):
    """The wait queue is full; the caller should retry later."""


class EngineClosed(Exception):
    """The engine is draining or stopped and takes no new requests."""


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False  # keep going past stop tokens (run to max_tokens)
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: plus the k most likely
    prompt_logprobs: int | None = None  # same, for every prompt token (one PromptLogprobsEvent before any token)
    grammar: Any = None  # an xgrammar CompiledGrammar; the engine masks every step with a matcher over it
    request_id: str = ""
    background: bool = False  # the batched engine admits foreground requests first (FIFO within each class)
    draft: int | None = None  # speculative drafting: None = the engine's default, 0 = off, k = at most k a round


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PromptLogprobsEvent:
    """Per prompt token: (its logprob given the tokens before it, the top (id, logprob) there); the first
    token has no context, so (None, ())."""

    entries: tuple[tuple[float | None, tuple[tuple[int, float], ...]], ...]


@dataclass(frozen=True)
class FinishEvent:
    reason: str  # "stop" (stop token or grammar end), "length", "cancelled"
    prompt_tokens: int
    completion_tokens: int
    # prompt tokens resumed from a session entry instead of prefilled; not part of the reply (equality ignores it:
    # a resumed reply equals the fresh one bit for bit)
    cached_tokens: int = field(default=0, compare=False)
    tag: str = ""  # the approximate engine settings the reply was computed under ("" = exact; docs/ENGINE.md)
    # decode tokens per engine round (drafting: accepted drafts + 1); not part of the reply (equality ignores it)
    tokens_per_round: float | None = field(default=None, compare=False)


@dataclass(frozen=True)
class EngineStats:
    state: str  # "ready" | "draining" | "stopped"
    running: int
    waiting: int
    live_sequences: int  # model states allocated and not yet freed
    prompt_tokens_total: int
    generation_tokens_total: int
    detail: dict = field(default_factory=dict)  # engine-specific figures (pool, rounds, ...) for /health


_ids = itertools.count()


class RequestStream:
    """The consumer side of one request: `async for event in stream`, `stream.cancel()`."""

    def __init__(self, request: GenerationRequest, on_cancel):
        self.request = request
        self.request_id = request.request_id or f"req-{next(_ids)}"
        self._queue: asyncio.Queue = asyncio.Queue()
        self._on_cancel = on_cancel
        self.cancelled = False
        self.finished = False

    # -- producer side (called on the event loop) --
    def push(self, item) -> None:
        self._queue.put_nowait(item)

    # -- consumer side --
    def cancel(self) -> None:
        if not self.cancelled and not self.finished:
            self.cancelled = True
            self._on_cancel(self)

    def __aiter__(self) -> AsyncIterator[TokenEvent | FinishEvent]:
        return self._iterate()

    async def _iterate(self):
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                yield item
                if isinstance(item, FinishEvent):
                    self.finished = True
                    return
        finally:
            # leaving the loop early (disconnect, stop string, exception in the consumer) frees the request
            if not self.finished:
                self.cancel()


def check_submittable(request: GenerationRequest, state: str) -> None:
    """What every engine's `submit` refuses before queueing: no prompt token, max_tokens < 1, not ready."""
    if not request.prompt_ids:
        raise ValueError("a request needs at least one prompt token")
    if request.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
    if state != "ready":
        raise EngineClosed(f"engine is {state}")


class Engine(ABC):
    """What the server needs from an engine."""

    max_model_len: int
    vocab_size: int

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request; raises ValueError (no prompt token, max_tokens < 1), EngineOverloaded (queue full) or
        EngineClosed (draining)."""

    def submit_group(self, requests: list[GenerationRequest]) -> list[RequestStream]:
        """Siblings over one prompt (n > 1, best_of: the same prompt and max_tokens, each its own seed): one stream
        per request, each the stream the request gets alone. The batched engine prefills the prompt once and
        shares its pages; this default submits them one by one (what `SerialEngine` does)."""
        streams: list[RequestStream] = []
        try:
            for request in requests:
                streams.append(self.submit(request))
        except BaseException:
            for stream in streams:
                stream.cancel()
            raise
        return streams

    @abstractmethod
    def begin_drain(self) -> None:
        """Refuse new requests; running and queued ones continue."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Cancel whatever is left and stop the worker."""

    @abstractmethod
    def stats(self) -> EngineStats: ...

    @abstractmethod
    def healthy(self) -> bool:
        """Whether the engine loop is alive and making progress (systemd's WATCHDOG=1 is sent only then)."""
