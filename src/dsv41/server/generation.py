"""What chat and completions share: request fields -> engine request, token text, logprobs, usage, bookkeeping.

`Generation` is one engine request seen from HTTP: it turns token events into text (complete UTF-8 only),
keeps the timing for metrics, and on `close()` (always called, however the response ended) cancels the
engine request if it is still running and records the request in the metrics, the health totals and the
JSONL log.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from typing import TYPE_CHECKING

from ..chat.tokens import THINK_END
from ..engine.constraint import ReasoningBudget
from ..engine import (EngineClosed, EngineFailure, EngineOverloaded, FinishEvent, GenerationRequest, RequestStream, SamplingParams,
                      TokenEvent)
from .context import ServerContext
from .errors import APIError, bad_request, engine_error, engine_failed, overloaded, unavailable

if TYPE_CHECKING:
    from .protocol import SamplingFields


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def reply_id(fields: "SamplingFields", prefix: str) -> str:
    """The reply's id: vLLM's `request_id` when the client gave one (`chatcmpl-<request_id>`), else a fresh one."""
    return f"{prefix}-{fields.request_id}" if fields.request_id else new_id(prefix)


def truncate_prompt(ctx: ServerContext, ids: list[int], fields: "SamplingFields") -> list[int]:
    """vLLM's `truncate_prompt_tokens`: only the last k prompt tokens are kept (-1: the context length)."""
    keep = fields.truncate_prompt_tokens
    if keep is None:
        return ids
    limit = ctx.config.max_model_len
    if keep == -1:
        keep = limit
    if keep > limit:
        raise bad_request(f"truncate_prompt_tokens ({keep}) must not exceed the context length ({limit})",
                          param="truncate_prompt_tokens")
    return ids[-keep:]


def with_reasoning_budget(ctx: ServerContext, grammar, tokens: int | None, thinking: bool):
    """The request's constraint with its reasoning bounded to `tokens` (vLLM's thinking_token_budget, Anthropic's
    budget_tokens): once the reasoning has that many tokens, `</think>` is forced (engine/constraint.py). A reply
    that does not start in reasoning has nothing to bound."""
    if tokens is None or not thinking:
        return grammar
    return ReasoningBudget(tokens, ctx.tokenizer.special(THINK_END), grammar)


def prompt_logprobs_list(tokenizer, prompt_ids: list[int], entries) -> list:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {id: {logprob, rank, decoded_token}} for
    the prompt's token and the top ones there (rank: 1 = most likely; null for the prompt's token when it is not
    among the top ones asked for)."""
    out: list = []
    for token, (logprob, top) in zip(prompt_ids, entries):
        if logprob is None:
            out.append(None)
            continue
        ranked = [t for t, _ in top]
        row = {str(token): {"logprob": logprob, "rank": ranked.index(token) + 1 if token in ranked else None,
                            "decoded_token": tokenizer.decode_token(token)}}
        for rank, (t, value) in enumerate(top, 1):
            row.setdefault(str(t), {"logprob": value, "rank": rank, "decoded_token": tokenizer.decode_token(t)})
        out.append(row)
    return out


def stream_failure(exc: Exception, what: str, detail: bool = False) -> APIError:
    """The error an exception past a stream's headers becomes (its `error` event); an unexpected one is logged
    with its traceback (`detail`: its message in the reply too)."""
    if isinstance(exc, EngineFailure):
        return engine_error(exc)
    if isinstance(exc, ServerDraining):
        return unavailable(str(exc))
    logging.getLogger(__name__).exception("unhandled error while streaming %s", what)
    return engine_failed(f"internal error: {type(exc).__name__}" + (f": {exc}" if detail else ""))


class ServerDraining(Exception):
    """Pushed into a stream when the drain grace period is over: the response ends with an error."""


def fresh_seed() -> int:
    """The seed of a request that gave none: drawn fresh (a chat UI's "regenerate" gets a new answer); the reply
    carries it in its `seed` field, so sending it back reproduces the reply."""
    return secrets.randbits(64)


def _token_ids(ctx: ServerContext, ids, param: str) -> list[int]:
    vocab = ctx.vocab_size
    for token in ids:
        if not 0 <= int(token) < vocab:
            raise bad_request(f"{param}: {token} is not a token id (0 <= id < {vocab})", param=param)
    return [int(t) for t in ids]


def sampling_params(ctx: ServerContext, fields: "SamplingFields") -> SamplingParams:
    """The engine's SamplingParams; token ids checked against the vocabulary, bad words tokenized (as written and
    after a space, as vLLM does), a fresh seed when the request gave none. Blocking-light (a few encodes)."""
    top_k = fields.top_k if fields.top_k is not None and fields.top_k > 0 else 0
    seed = fields.seed % (1 << 64) if fields.seed is not None else fresh_seed()
    bias = fields.logit_bias or {}
    bias_ids = _token_ids(ctx, [int(k) for k in bias], "logit_bias")
    bad_words: list[tuple[int, ...]] = []
    for word in fields.bad_words or []:
        for variant in (word, " " + word.lstrip(" ")):
            ids = tuple(ctx.tokenizer.encode_literal(variant))
            if ids and ids not in bad_words:
                bad_words.append(ids)
    allowed = fields.allowed_token_ids
    return SamplingParams(
        temperature=float(fields.temperature) if fields.temperature is not None else 1.0,
        top_p=float(fields.top_p) if fields.top_p is not None else 1.0,
        top_k=top_k,
        min_p=float(fields.min_p) if fields.min_p is not None else 0.0,
        seed=seed,
        presence_penalty=float(fields.presence_penalty or 0.0),
        frequency_penalty=float(fields.frequency_penalty or 0.0),
        repetition_penalty=float(fields.repetition_penalty) if fields.repetition_penalty is not None else 1.0,
        logit_bias=tuple((t, float(b)) for t, b in zip(bias_ids, bias.values())),
        allowed_token_ids=None if allowed is None else tuple(_token_ids(ctx, allowed, "allowed_token_ids")),
        bad_words=tuple(bad_words),
        min_tokens=fields.min_tokens,
    )


def stop_ids(ctx: ServerContext, fields: "SamplingFields") -> frozenset[int]:
    """EOS and the request's stop_token_ids."""
    return frozenset({ctx.tokenizer.eos_id, *_token_ids(ctx, fields.stop_token_ids or [], "stop_token_ids")})


def check_model(ctx: ServerContext, name: str | None) -> None:
    """404 unless `name` is absent, the served name or an alias (every generation route: OpenAI and Anthropic)."""
    if name is not None and name not in ctx.model_names:
        raise APIError(404, f"The model `{name}` does not exist (served: {', '.join(ctx.model_names)}).",
                       param="model", code="model_not_found")


def check_request(ctx: ServerContext, fields: "SamplingFields", endpoint: str, budget: int) -> None:
    """What every generation endpoint checks past the schema: the model name (404 unless the served name or an
    alias) and min_tokens within the budget. The fields accepted but not implemented are logged where the body
    is parsed (body.note_unknown_fields, off the event loop)."""
    check_model(ctx, fields.model)
    if fields.prompt_logprobs is not None and fields.stream:
        raise bad_request("prompt_logprobs is not supported with stream=true", param="prompt_logprobs")
    if fields.priority != 0:
        raise bad_request("priority scheduling is not enabled on this server (requests are served first come, "
                          "first served): priority must be 0", param="priority")
    if fields.min_tokens > budget:
        raise bad_request(f"min_tokens ({fields.min_tokens}) must not exceed max_tokens ({budget})",
                          param="min_tokens")


HONOURED_EXTRA = {"completions": {"best_of"}}  # fields the schema does not name that an endpoint honours
MAX_BEST_OF = 16  # as n (protocol.MAX_N)
MAX_SEQUENCES = 64  # prompts x best_of, as prompts x n (protocol.MAX_CHOICES)


def best_of(fields: "SamplingFields", prompts: int = 1) -> int | None:
    """The completions `best_of` (vLLM's): how many sequences to generate per prompt, of which the n with the
    highest cumulative logprob are returned; None when absent or equal to n (then choice i is seed + i, in order).
    400 unless an integer in [n, MAX_BEST_OF], not with stream=true, prompts x best_of within MAX_SEQUENCES."""
    value = (fields.model_extra or {}).get("best_of")
    if value is None:
        return None
    if type(value) is not int or not 1 <= value <= MAX_BEST_OF:
        raise bad_request(f"best_of must be an integer between 1 and {MAX_BEST_OF}", param="best_of")
    if value < fields.n:
        raise bad_request(f"best_of must be greater than or equal to n, got n={fields.n} and best_of={value}",
                          param="best_of")
    if fields.stream and value > 1:
        raise bad_request("best_of is not supported with stream=true (the best sequences are known only at the "
                          "end)", param="best_of")
    if prompts * value > MAX_SEQUENCES:
        raise bad_request(f"prompts x best_of must not exceed {MAX_SEQUENCES}, got {prompts} x {value}",
                          param="best_of")
    return value if value > fields.n else None


def completion_budget(ctx: ServerContext, prompt_len: int, requested: int | None, param: str,
                      limit_param: str = "max_tokens") -> int:
    """max_tokens after the context check: prompt + max_tokens must fit max_model_len (else 400)."""
    limit = ctx.config.max_model_len
    if prompt_len >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens, but the prompt has {prompt_len} tokens "
            f"(leaving no room for a reply); shorten the prompt or raise --max-model-len.",
            param=param, code="context_length_exceeded")
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion). "
            f"Reduce the prompt or max_tokens, or raise --max-model-len.",
            param=limit_param, code="context_length_exceeded")
    return requested


class Generation:
    """One engine request as seen by an HTTP handler."""

    def __init__(self, ctx: ServerContext, endpoint: str, request: GenerationRequest, *, stream: bool,
                 engine_stream: RequestStream | None = None):
        self.ctx = ctx
        self.endpoint = endpoint
        self.request = request
        self.is_stream = stream
        self.arrived = time.monotonic()
        self.first_token_at: float | None = None
        self.completion_tokens = 0
        self.reasoning_tokens: int | None = None  # of those, the reasoning's (counted by the chat reply)
        self.cumulative_logprob = 0.0  # of the tokens read so far (best_of ranks by it)
        self.finish: FinishEvent | None = None
        self.final_reason: str | None = None  # set by the handler once the reply is complete
        self.status = 200
        self.error: str | None = None
        self.disconnected = False
        self.closed = False
        self.choices = 1  # sequences generated for this prompt (n, best_of): submit_generations sets it
        self.engine_stream: RequestStream = engine_stream or ctx.submit(request)
        ctx.active.add(self)

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens resumed from a session entry instead of prefilled: the FinishEvent's count, and before it
        the engine's (known from admission on, before the first token; 0 while queued or without sessions)."""
        if self.finish is not None:
            return self.finish.cached_tokens
        return resumed_tokens(self.engine_stream)

    async def events(self):
        """Token and finish events; EngineFailure / ServerDraining propagate to the caller."""
        async for event in self.engine_stream:
            if isinstance(event, TokenEvent):
                if self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                self.completion_tokens += 1
                if event.logprob is not None:
                    self.cumulative_logprob += event.logprob
            elif isinstance(event, FinishEvent):
                self.finish = event
            yield event

    def abort_for_drain(self) -> None:
        self.engine_stream.push(ServerDraining("the server is shutting down"))
        self.engine_stream.cancel()

    def done(self, reason: str) -> None:
        """The reply is complete (finish reason as sent); whatever the engine still does is cancelled."""
        self.final_reason = reason
        if not self.engine_stream.finished:
            self.engine_stream.cancel()

    def usage(self) -> dict:
        """OpenAI's usage of this generation so far (the final figures once the engine finished)."""
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.reasoning_tokens)

    def fail(self, error: APIError) -> None:
        self.status = error.status
        self.error = error.message

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.engine_stream.finished:
            self.engine_stream.cancel()
        self.disconnected = self.final_reason is None and self.error is None
        self.ctx.active.discard(self)
        now = time.monotonic()
        ttft = self.first_token_at - self.arrived if self.first_token_at is not None else None
        reason = self.final_reason or ("abort" if self.disconnected else "error")
        ctx = self.ctx
        cached = self.cached_tokens
        ctx.prompt_tokens_total += self.prompt_tokens
        ctx.cached_tokens_total += cached
        ctx.completion_tokens_total += self.completion_tokens
        if self.disconnected:
            ctx.metrics.disconnects.inc()
        ctx.metrics.finished_generation(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                                        cached_tokens=cached, ttft_s=ttft, e2e_s=now - self.arrived,
                                        finish_reason=reason, max_tokens=self.request.max_tokens, n=self.choices)
        ctx.request_log.write(
            id=self.request.request_id, endpoint=self.endpoint, stream=self.is_stream, status=self.status,
            prompt_tokens=self.prompt_tokens, cached_tokens=cached, completion_tokens=self.completion_tokens,
            finish_reason=reason, disconnected=self.disconnected, error=self.error,
            ttft_s=None if ttft is None else round(ttft, 4), latency_s=round(now - self.arrived, 4),
            tokens_per_round=getattr(self.finish, "tokens_per_round", None))  # drafting: accepted drafts + 1


def resumed_tokens(stream: RequestStream) -> int:
    """The prompt tokens the engine resumed for `stream` from a session entry so far. The batched engine sets its
    sequence's `cached` when it admits it (engine/scheduler.py), before any token event goes out; an engine
    without sessions (serial) has none."""
    return getattr(getattr(stream, "seq", None), "cached", 0) or 0


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage; `cached_tokens`: prompt tokens resumed from a session entry (docs/SERVER.md, Sessions);
    `reasoning_tokens` (chat only): of the completion tokens, those before the answer, `</think>` included
    (`completion_tokens_details`, as DeepSeek's and OpenAI's APIs report it)."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


class StreamedReply:
    """What the chat and completions replies share: `chunks()` over their own `_chunks()` (`self.req`, `self.gen`)."""

    async def chunks(self):
        """The SSE payloads; with stream_options.continuous_usage_stats every chunk carries the usage so far."""
        options = self.req.stream_options
        continuous = bool(options and options.continuous_usage_stats)
        async for chunk in self._chunks():
            if continuous and chunk["choices"]:
                chunk["usage"] = self.gen.usage()
            yield chunk


def submit_generations(ctx: ServerContext, endpoint: str, requests: list[GenerationRequest], *,
                       stream: bool) -> list[Generation]:
    """The requests of one prompt's choices (n > 1, best_of: each its own seed) as ONE engine group: the prompt
    prefilled once and its pages shared (engine/llm_engine.py); a Generation per request."""
    if len(requests) == 1:
        return [Generation(ctx, endpoint, requests[0], stream=stream)]
    try:
        streams = ctx.engine.submit_group(requests)
    except EngineOverloaded as exc:
        raise overloaded(f"the server is busy ({exc}); retry shortly") from None
    except EngineClosed:
        raise unavailable("the server is shutting down") from None
    gens = [Generation(ctx, endpoint, r, stream=stream, engine_stream=s) for r, s in zip(requests, streams)]
    for gen in gens:
        gen.choices = len(requests)
    return gens


def draft_of(fields: "SamplingFields") -> int | None:
    """The request's `draft` field as the engine reads it: None = the server's default, 0 = off, k = at most k
    drafts a round (true: as many as the server allows)."""
    draft = getattr(fields, "draft", None)
    if draft is None or isinstance(draft, int) and not isinstance(draft, bool):
        return draft
    return 5 if draft else 0


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of an n > 1 request: seed + index (mod 2**64), so choice i equals a single
    request sent with that seed."""
    return (seed + index) % (1 << 64)


class GenerationGroup:
    """Several Generations answered as one reply (n > 1, a list of prompts): what the app needs of a Generation
    (status, fail, close) over all of them."""

    def __init__(self, members: list[Generation]):
        self.members = members

    @property
    def status(self) -> int:
        return max(g.status for g in self.members)

    def fail(self, error: APIError) -> None:
        for g in self.members:
            g.fail(error)

    def close(self) -> None:
        for g in self.members:
            g.close()


async def merged(iterators):
    """(index, item) from several async iterators as the items come; the first exception ends it."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i, iterator):
        try:
            async for item in iterator:
                queue.put_nowait((i, item))
            queue.put_nowait((i, end))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


class MultiReply:
    """n choices (and/or one per prompt) of one request: member i's choices get index i; usage is summed (the
    prompt of an n > 1 request counted once, as OpenAI does). With `rank` = (best_of, n) the replies come in
    blocks of best_of per prompt, and of each block the n with the highest cumulative logprob of their generated
    tokens are the choices (ties: the lower index), best first; usage counts the choices returned."""

    def __init__(self, replies: list, include_usage: bool, prompt_tokens: int, rank: tuple[int, int] | None = None):
        self.replies, self.include_usage, self.prompt_tokens = replies, include_usage, prompt_tokens
        self.rank = rank
        self.kept = list(range(len(replies)))

    def _usage(self) -> dict:
        gens = [self.replies[k].gen for k in self.kept]
        reasoning = [g.reasoning_tokens for g in gens if g.reasoning_tokens is not None]
        return usage(self.prompt_tokens, sum(g.completion_tokens for g in gens), self._cached(),
                     sum(reasoning) if reasoning else None)

    def _cached(self) -> int:
        """The prompt's cached tokens, counted once per prompt as the prompt is: those of each prompt's first
        sequence (choice seed + 0, the group's leader, which prefills the shared prompt). The siblings of a group
        share the leader's prompt pages and never resume from a session entry themselves (their count is 0)."""
        cached, k = 0, 0
        while k < len(self.replies):
            gen = self.replies[k].gen
            cached += gen.cached_tokens
            k += max(gen.choices, 1)
        return cached

    def _ranked(self) -> list[int]:
        per, n = self.rank
        kept = []
        for at in range(0, len(self.replies), per):
            block = range(at, at + per)
            kept += sorted(block, key=lambda k: (-self.replies[k].gen.cumulative_logprob, k))[:n]
        return kept

    def _relabel(self, body: dict, index: int) -> dict:
        first = self.replies[0]
        body["id"], body["seed"] = first.gen.request.request_id, first.gen.request.sampling.seed
        for choice in body["choices"]:
            choice["index"] = index
        return body

    async def complete(self) -> dict:
        bodies = await asyncio.gather(*(r.complete() for r in self.replies))
        if self.rank is not None:
            self.kept = self._ranked()
        out = self._relabel(bodies[self.kept[0]], 0)
        out["choices"] = [self._relabel(bodies[k], i)["choices"][0] for i, k in enumerate(self.kept)]
        out["usage"] = self._usage()
        return out

    async def chunks(self):
        if self.rank is not None:
            raise RuntimeError("best_of does not stream (best_of() refuses it)")
        last = None
        async for i, chunk in merged([r.chunks() for r in self.replies]):
            if not chunk["choices"]:  # a member's usage chunk: one summed chunk comes at the end instead
                last = chunk
                continue
            if "usage" in chunk:  # continuous_usage_stats: the whole request's so far
                chunk["usage"] = self._usage()
            yield self._relabel(chunk, i)
        if self.include_usage and last is not None:
            last = self._relabel(last, 0)
            last["usage"] = self._usage()
            yield last


def reply_of(replies: list, req, prompt_tokens: int, rank: tuple[int, int] | None = None):
    """(generation, reply) of a request's built replies: the one reply as it is, or n / per-prompt replies (with
    `rank` = (best_of, n): best_of per prompt, the n best kept) as one MultiReply over a GenerationGroup.
    `reply.chunks()` when the request streams."""
    if len(replies) == 1:
        reply = replies[0]
        return reply.gen, (reply.chunks() if req.stream else reply)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    multi = MultiReply(replies, include_usage, prompt_tokens, rank)
    return GenerationGroup([r.gen for r in replies]), (multi.chunks() if req.stream else multi)
