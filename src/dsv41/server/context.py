"""What every request handler shares: the server's configuration and the `ServerContext` (engine, tokenizer,
grammars, counters, the live generations, drain).

It imports no handler module (app, chat, completions, generation, streaming): they all import it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..engine import Engine, EngineClosed, EngineOverloaded, GenerationRequest, RequestStream
from .errors import overloaded, unavailable
from .metrics import Metrics
from .reasoning_memory import ReasoningMemory
from .request_log import RequestLog
from .tokenize_process import attach as attach_tokenizer_process


@dataclass
class ServerConfig:
    served_name: str = "dsv41"
    aliases: tuple[str, ...] = ()
    max_model_len: int = 4096
    max_body_bytes: int = 8 << 20
    api_key: str | None = None
    drain_timeout_s: float = 20.0
    body_timeout_s: float = 30.0
    request_log: str | None = None
    owned_by: str = "dsv41"
    extra_health: dict = field(default_factory=dict)
    # Host header allow-list (None: any Host); see server/gate.py
    allowed_hosts: frozenset[str] | None = None
    # /v1/completions text prompts: "parse" turns control-token text into control tokens (vLLM's behaviour),
    # "text" tokenizes it as plain text like chat message content
    prompt_special_tokens: str = "parse"
    # CORS: origins a browser may call the API from (empty: no CORS headers at all); see build_app
    allowed_origins: tuple[str, ...] = ()


def max_token_chars(tokenizer) -> int | None:
    """The most characters of text one token can stand for: its longest vocabulary spelling (a byte-level spelling
    has one character per byte, and text has at most one character per byte), x4 where a normalizer could shrink
    text before the model sees it. None when the tokenizer does not say (no bound, the token count decides)."""
    backend = getattr(tokenizer, "backend", None)
    try:
        vocab = backend.get_vocab(with_added_tokens=True)
        normalizer = backend.normalizer
    except AttributeError:
        return None
    longest = max(map(len, vocab), default=0)
    return longest * (1 if normalizer is None else 4) or None


class ServerContext:
    """What every handler shares: engine, tokenizer, grammars, counters, the set of live generations."""

    def __init__(self, config: ServerConfig, engine: Engine, tokenizer, grammars):
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.vocab_size = min(engine.vocab_size, tokenizer.vocab_size)
        # a prompt of more characters than max_model_len x this is refused before tokenizing (body.check_prompt_size)
        self.max_token_chars = max_token_chars(tokenizer)
        self.status = "loading"
        self.started = time.monotonic()
        self.created = int(time.time())
        self.inflight = 0
        self.requests_total = 0
        self.errors_total = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0  # of those, resumed from a session entry instead of prefilled
        self.completion_tokens_total = 0
        self.active: set = set()  # the live server.generation.Generation objects
        self.reasoning_memory = ReasoningMemory()  # replies' reasoning, restored where a client drops it
        self.metrics = Metrics(config.served_name)
        self.request_log = RequestLog(config.request_log)
        self.body_reads: set = set()  # asyncio.Timeout scopes of bodies being read (a drain expires them)
        # parsing, rendering and tokenizing run here, never on the event loop (/health must stay quick)
        self._cpu = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dsv41-prepare")
        # ...and long texts in a child process (their ids would hold the GIL here: server/tokenize_process.py)
        self.tokenizer_process = attach_tokenizer_process(tokenizer)

    async def run_cpu(self, fn, *args):
        """`fn(*args)` in the request-preparation threads."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    def close(self) -> None:
        self._cpu.shutdown(wait=False, cancel_futures=True)
        if self.tokenizer_process is not None:
            self.tokenizer_process.close()

    @property
    def group_failure(self) -> str | None:
        """The tensor-parallel group's abort reason while fail-fast's grace runs (the process exits 70 next)."""
        failfast = sys.modules.get("dsv41.parallel.failfast")  # never imported: no TP group, nothing failed
        return failfast.abort_reason() if failfast is not None else None

    @property
    def model_names(self) -> list[str]:
        return [self.config.served_name, *[a for a in self.config.aliases if a != self.config.served_name]]

    def response_model_name(self, requested: str | None) -> str:
        return requested if requested in self.model_names else self.config.served_name

    def submit(self, request: GenerationRequest) -> RequestStream:
        try:
            return self.engine.submit(request)
        except EngineOverloaded as exc:
            raise overloaded(f"the server is busy ({exc}); retry shortly") from None
        except EngineClosed:
            raise unavailable("the server is shutting down") from None

    async def drain(self) -> None:
        """SIGTERM: refuse new work, let running requests finish for drain_timeout_s, then end them."""
        if self.status == "draining":
            return
        self.status = "draining"
        self.engine.begin_drain()
        self.cut_body_reads()
        deadline = time.monotonic() + self.config.drain_timeout_s
        while (self.active or self.inflight) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for gen in list(self.active):
            gen.abort_for_drain()
        # give the aborted responses a moment to write their error event and [DONE]
        await self._let_errors_out(2.0)

    def cut_body_reads(self) -> None:
        now = asyncio.get_running_loop().time()
        for scope in list(self.body_reads):
            scope.reschedule(now)

    async def abort_now(self) -> None:
        """A second SIGTERM: end every generation at once (error event + [DONE], or 503), without the grace."""
        self.status = "draining"
        self.engine.begin_drain()
        self.cut_body_reads()
        for gen in list(self.active):
            gen.abort_for_drain()
        await self._let_errors_out(1.0)

    async def _let_errors_out(self, seconds: float) -> None:
        # give the aborted responses a moment to write their error event and [DONE]
        deadline = time.monotonic() + seconds
        while (self.active or self.inflight) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
