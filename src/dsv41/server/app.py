"""The Starlette application: routes, auth, limits, error mapping, health, metrics, drain.

Every API endpoint runs through `_endpoint`, which checks the bearer key (constant-time compare), refuses work
while loading, draining or after the TP group failed (503 + Retry-After), takes JSON bodies only (415), reads
the body under the size limit and deadline (server/body.py), maps every failure to an OpenAI error object, and
races non-streaming handlers against the client's disconnect so a departed client cancels its engine request
(499, never an error). Parsing, rendering and tokenizing run in `ctx.run_cpu`, off the event loop, so a large
request does not hold up /health. Streaming responses settle their own bookkeeping when they end. `server/gate.py`
wraps the app (Host allow-list, trailing slashes); `server/framing.py` gives hypercorn's own 400/431 a body.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import json
import logging
import time
from typing import Awaitable, Callable

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine import EngineFailure, GenerationRequest
from . import framing
from .body import ClientGone, check_json_content_type, note_unknown_fields, parse_json, read_body
from .chat import create_chat_completion, render_chat
from .completions import create_completion, prompt_ids
from .context import ServerContext
from .errors import APIError, bad_request, engine_error, engine_failed, from_validation_error, unavailable
from .gate import Gate
from .messages import anthropic_shaped, count_tokens, create_message
from .generation import HONOURED_EXTRA, Generation, ServerDraining, new_id
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .responses import create_response
from .streaming import GenerationStream

log = logging.getLogger("dsv41.server")
GROUP_FAILED_RETRY_S = 10  # the watchdog restarts both ranks after a fail-fast exit


def _check_auth(ctx: ServerContext, request: Request) -> None:
    key = ctx.config.api_key
    if not key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    # Starlette decodes header bytes as latin-1: back to the bytes the client sent, against the key's UTF-8
    # (strip only blanks: str.strip() would also eat U+00A0, the last byte of a UTF-8 "à")
    ok = scheme.lower() == "bearer" and hmac.compare_digest(given.strip(" \t").encode("latin-1"),
                                                            key.encode("utf-8"))
    if not ok:
        raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _parse(model, body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _parse_body(model, raw: bytes, ctx: ServerContext | None = None, endpoint: str = "") -> tuple[dict, object]:
    """(the JSON object, the validated request) of a body; blocking: run it through `ctx.run_cpu`. With `ctx`, a
    generation request's prompt is first checked by its size (body.check_prompt_size), and the fields the
    endpoint does not implement are logged here, off the event loop (body.note_unknown_fields)."""
    body = parse_json(raw, *((ctx.config.max_model_len, ctx.max_token_chars) if ctx is not None else ()))
    req = _parse(model, body)
    if endpoint:
        note_unknown_fields(endpoint, req.model_extra or {}, HONOURED_EXTRA.get(endpoint, ()))
    return body, req


def _internal_error(what: str) -> APIError:
    """A bug: the details go to the log under an id, the client gets the id only."""
    error_id = new_id("err")
    log.exception("unhandled error %s (%s)", what, error_id)
    return engine_failed(f"internal server error ({error_id}); the server log has the details")


async def _until_disconnect(request: Request, work: Awaitable):
    """Run `work`; if the client disconnects first, cancel it. The caller has read the body already (see
    `body.read_body`): from here on the receive channel carries nothing but the disconnect."""
    task = asyncio.ensure_future(work)

    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not watcher.done():
            watcher.cancel()
    gone = watcher.done() and not watcher.cancelled()
    if task.done():
        result = task.result()
        if not gone:
            return result
        if isinstance(result, GenerationStream):
            result._gen.close()  # the stream will never be sent: free the engine request now
        raise ClientGone()
    task.cancel()
    try:
        await task
    except BaseException:
        pass
    raise ClientGone()


Handler = Callable[[ServerContext, Request], Awaitable[Response]]


def _endpoint(name: str, handler: Handler, *, guarded: bool = True):
    async def endpoint(request: Request) -> Response:
        ctx: ServerContext = request.app.state.ctx
        ctx.inflight += 1
        ctx.requests_total += 1
        started = time.monotonic()
        handed_off = False
        status = 200
        try:
            if guarded:
                _check_auth(ctx, request)
                if ctx.group_failure is not None:
                    raise unavailable("the tensor-parallel group failed; the server is restarting",
                                      retry_after_s=GROUP_FAILED_RETRY_S)
                if ctx.status == "loading":
                    raise unavailable("the model is loading")
                if ctx.status == "draining":
                    raise unavailable("the server is shutting down")
            if request.method == "POST":
                check_json_content_type(request)
                await read_body(ctx, request)
            response = await _until_disconnect(request, handler(ctx, request))
            status = response.status_code
            if isinstance(response, GenerationStream):
                handed_off = True
                response._on_close = lambda: _settle(ctx, name, response._gen.status, started)
            return response
        except APIError as exc:
            status = exc.status
            if guarded and not exc.logged:
                ctx.request_log.write(id=None, endpoint=name, status=exc.status, error=exc.message,
                                      latency_s=round(time.monotonic() - started, 4))
            return exc.response()
        except ClientGone as gone:
            status = 499  # nginx's "client closed request"; counted as such, never as an error
            return gone.response()
        except Exception:  # a bug: answer 500 instead of dropping the connection
            error = _internal_error(f"in {name}")
            status = error.status
            return error.response()
        finally:
            if not handed_off:
                _settle(ctx, name, status, started)

    return endpoint


def _settle(ctx: ServerContext, name: str, status: int, started: float) -> None:
    ctx.inflight -= 1
    ctx.metrics.latency.labels(name).observe(time.monotonic() - started)
    ctx.metrics.requests.labels(name, str(status)).inc()
    if status >= 400 and status != 499:
        ctx.errors_total += 1
        ctx.metrics.errors.labels(name, str(status)).inc()


async def _generate(ctx: ServerContext, gen: Generation, reply, stream: bool) -> Response:
    if stream:
        return GenerationStream(gen, reply, on_close=lambda: None)
    try:
        return JSONResponse(await reply.complete())
    except EngineFailure as exc:
        error = engine_error(exc)
        gen.fail(error)
    except ServerDraining as exc:
        error = unavailable(str(exc))
        gen.fail(error)
    except Exception:  # a bug while building the reply: counted as a 500, not as a client disconnect
        error = _internal_error("while generating")
        gen.fail(error)
    finally:
        gen.close()  # after gen.fail: the log line carries the error status
    error.logged = True
    raise error


# ---------------------------------------------------------------------------- handlers
async def chat_completions(ctx: ServerContext, request: Request) -> Response:
    body, req = await ctx.run_cpu(_parse_body, ChatCompletionRequest, request.state.body, ctx, "chat")
    gen, reply = await create_chat_completion(ctx, req, body)
    return await _generate(ctx, gen, reply, req.stream)


async def completions(ctx: ServerContext, request: Request) -> Response:
    _, req = await ctx.run_cpu(_parse_body, CompletionRequest, request.state.body, ctx, "completions")
    gen, reply = await create_completion(ctx, req)
    return await _generate(ctx, gen, reply, req.stream)


async def messages(ctx: ServerContext, request: Request) -> Response:
    gen, reply = await create_message(ctx, request.state.body)
    if isinstance(reply, GenerationStream):  # Anthropic's own event framing, settled like any stream
        return reply
    return await _generate(ctx, gen, reply, False)


async def responses(ctx: ServerContext, request: Request) -> Response:
    gen, reply = await create_response(ctx, request.state.body)
    if isinstance(reply, GenerationStream):  # the Responses API's typed events, settled like any stream
        return reply
    return await _generate(ctx, gen, reply, False)


def _tokenize(ctx: ServerContext, raw: bytes) -> list[bytes]:
    body, req = _parse_body(TokenizeRequest, raw)
    if req.prompt is not None:
        ids, _ = prompt_ids(ctx, req.prompt, req.add_special_tokens)
    else:
        _, ids = render_chat(ctx, body)
    # vLLM's token_strs: each id's string in the vocabulary (convert_ids_to_tokens), e.g. "Ġword" byte-level
    head = json.dumps({"count": len(ids), "max_model_len": ctx.config.max_model_len}, separators=(",", ":"))
    parts = [head[:-1].encode(), b',"tokens":', *_json_slices(ids, lambda part: ",".join(map(str, part)))]
    if req.return_token_strs:  # json.dumps of 3.7M strings held the GIL for ~0.8 s in one call
        dump = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
        parts += [b',"token_strs":', *_json_slices(ids, lambda part: dump([ctx.tokenizer.id_to_token(i)
                                                                          for i in part])[1:-1])]
    else:
        parts.append(b',"token_strs":null')
    return [*parts, b"}"]


def _json_slices(ids: list[int], dump, step: int = 1 << 16) -> list[bytes]:
    """A JSON array of `dump(slice)` texts (each a comma-separated run), one slice of ids at a time, letting other
    threads (the event loop: /health) in between: one json.dumps of the 3.5M ids of a maximum-size /tokenize held
    the GIL for up to a second."""
    parts = [b"["]
    for start in range(0, len(ids), step):
        if start:
            parts.append(b",")
        parts.append(dump(ids[start:start + step]).encode())
        time.sleep(0)  # releases the GIL
    parts.append(b"]")
    return parts


async def tokenize(ctx: ServerContext, request: Request) -> Response:
    return _PartsResponse(await ctx.run_cpu(_tokenize, ctx, request.state.body))


class _PartsResponse(Response):
    """A JSON body given as parts, sent as one ASGI message per ~1 MiB: the 50 MB reply of a maximum-size
    /tokenize as one message was joined and copied into the socket's buffer on the event loop in one go."""

    CHUNK = 1 << 20

    def __init__(self, parts: list[bytes]):
        self.parts = parts
        super().__init__(media_type="application/json", headers={"content-length": str(sum(map(len, parts)))})

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        pending, size = [], 0
        for part in self.parts:
            pending.append(part)
            size += len(part)
            if size >= self.CHUNK:
                await send({"type": "http.response.body", "body": b"".join(pending), "more_body": True})
                pending, size = [], 0
        await send({"type": "http.response.body", "body": b"".join(pending)})


def _detokenize(ctx: ServerContext, raw: bytes) -> bytes:
    # at most a context of ids (no reply is longer), refused before the parse when the commas already say more:
    # parsing and decoding a body of 1.6M ids held the GIL for ~0.2 s at a time, /health waiting
    limit = ctx.config.max_model_len
    if raw.count(b",") > limit + 16:  # the other fields: a few commas at most
        raise bad_request(f"tokens: more than {limit} token ids (the context, --max-model-len)", param="tokens")
    _, req = _parse_body(DetokenizeRequest, raw)
    if len(req.tokens) > limit:
        raise bad_request(f"tokens: {len(req.tokens)} token ids, more than {limit} (the context, --max-model-len)",
                          param="tokens")
    for i, token in enumerate(req.tokens):
        if not 0 <= token < ctx.vocab_size:
            raise bad_request(f"tokens[{i}] = {token} is not a token id (0 <= id < {ctx.vocab_size})",
                              param="tokens")
    return json.dumps({"prompt": ctx.tokenizer.decode(req.tokens)}, ensure_ascii=False).encode()


async def detokenize(ctx: ServerContext, request: Request) -> Response:
    return Response(await ctx.run_cpu(_detokenize, ctx, request.state.body), media_type="application/json")


def _model_card(ctx: ServerContext, name: str) -> dict:
    names = ctx.model_names
    return {"id": name, "object": "model", "created": ctx.created, "owned_by": ctx.config.owned_by,
            "root": ctx.config.served_name, "parent": None if name == ctx.config.served_name else names[0],
            "max_model_len": ctx.config.max_model_len, "context_length": ctx.config.max_model_len,
            "aliases": [n for n in names if n != name]}


async def models(ctx: ServerContext, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(ctx, name) for name in ctx.model_names]})


async def model(ctx: ServerContext, request: Request) -> Response:
    """GET /v1/models/{model} (`client.models.retrieve`): the served name or an alias, else 404."""
    name = request.path_params["model"]
    if name not in ctx.model_names:
        raise APIError(404, f"The model `{name[:200]}` does not exist (served: {', '.join(ctx.model_names)}).",
                       param="model", code="model_not_found")
    return JSONResponse(_model_card(ctx, name))


async def ping(ctx: ServerContext, request: Request) -> Response:
    """GET /ping (vLLM's liveness probe): an empty 200 when ready, else /health's 503 and Retry-After."""
    answer = await health(ctx, request)
    return Response(status_code=answer.status_code, headers={k: v for k, v in answer.headers.items()
                                                             if k.lower() == "retry-after"})


async def openapi(ctx: ServerContext, request: Request) -> Response:
    """GET /openapi.json: the routes served (server/openapi.py), built once."""
    document = getattr(request.app.state, "openapi", None)
    if document is None:
        from .. import __version__
        from .openapi import openapi_document

        document = await ctx.run_cpu(lambda: openapi_document(request.app.routes, __version__, "dsv41",
                                                              auth=bool(ctx.config.api_key)))
        request.app.state.openapi = document
    return JSONResponse(document)


async def health(ctx: ServerContext, request: Request) -> Response:
    stats = ctx.engine.stats()
    failure = ctx.group_failure
    ok = ctx.status == "ready" and failure is None
    body = {
        "ok": ok,
        "status": "failed" if failure is not None else ctx.status,
        "model": ctx.config.served_name,
        "uptime_s": round(time.monotonic() - ctx.started, 3),
        "inflight": ctx.inflight - 1,  # not counting this health request itself
        "generations": len(ctx.active),
        "requests_total": ctx.requests_total,
        "errors_total": ctx.errors_total,
        "prompt_tokens_total": ctx.prompt_tokens_total,
        "cached_tokens_total": ctx.cached_tokens_total,
        "completion_tokens_total": ctx.completion_tokens_total,
        "max_model_len": ctx.config.max_model_len,
        "engine": {"state": stats.state, "running": stats.running, "waiting": stats.waiting,
                   "live_sequences": stats.live_sequences, "prompt_tokens_total": stats.prompt_tokens_total,
                   "generation_tokens_total": stats.generation_tokens_total},
        **ctx.config.extra_health,
    }
    headers = {} if ok else {"Retry-After": str(GROUP_FAILED_RETRY_S if failure is not None else 5)}
    return JSONResponse(body, status_code=200 if ok else 503, headers=headers)


async def version(ctx: ServerContext, request: Request) -> Response:
    from .. import __version__

    return JSONResponse({"version": __version__})


async def metrics(ctx: ServerContext, request: Request) -> Response:
    stats = ctx.engine.stats()
    ctx.metrics.engine_gauges(stats.running, stats.waiting, stats.detail)
    ctx.metrics.inflight.set(ctx.inflight - 1)
    return Response(ctx.metrics.render(), media_type=ctx.metrics.content_type)


# ---------------------------------------------------------------------------- app
async def _not_found(request: Request, exc: HTTPException) -> Response:
    from .messages_protocol import error_bytes

    path = request.url.path
    if exc.status_code == 405:
        err = APIError(405, f"method {request.method} is not allowed on {path}")
    else:
        err = APIError(exc.status_code, f"no route {request.method} {path}",
                       code="not_found" if exc.status_code == 404 else None)
    return Response(error_bytes(err, path), status_code=err.status, media_type="application/json")


def build_app(ctx: ServerContext, *, warmup: bool = True) -> Gate:
    api = [
        ("chat", ["/v1/chat/completions", "/chat/completions"], chat_completions, ["POST"]),
        ("completions", ["/v1/completions", "/completions"], completions, ["POST"]),
        ("tokenize", ["/tokenize", "/v1/tokenize"], tokenize, ["POST"]),
        ("detokenize", ["/detokenize", "/v1/detokenize"], detokenize, ["POST"]),
        ("models", ["/v1/models", "/models"], models, ["GET"]),
        ("responses", ["/v1/responses", "/responses"], responses, ["POST"]),
        ("models", ["/v1/models/{model:path}"], model, ["GET"]),
    ]
    routes = [Route(path, _endpoint(name, handler), methods=methods)
              for name, paths, handler, methods in api for path in paths]
    # the Anthropic Messages API: the same endpoint machinery, Anthropic's error objects and x-api-key
    routes += [Route("/v1/messages", anthropic_shaped(_endpoint("messages", messages)), methods=["POST"]),
               Route("/v1/messages/count_tokens", anthropic_shaped(_endpoint("count_tokens", count_tokens)),
                     methods=["POST"])]
    routes += [
        Route("/health", _endpoint("health", health, guarded=False), methods=["GET"]),
        Route("/v1/health", _endpoint("health", health, guarded=False), methods=["GET"]),
        Route("/metrics", _endpoint("metrics", metrics, guarded=False), methods=["GET"]),
        Route("/version", _endpoint("version", version, guarded=False), methods=["GET"]),
        Route("/ping", _endpoint("ping", ping, guarded=False), methods=["GET"]),
        Route("/openapi.json", _endpoint("openapi", openapi, guarded=False), methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await ctx.engine.start()
        if warmup:
            await _warm_up(ctx)
        if ctx.status == "loading":  # a SIGTERM during the warm-up already moved it on to draining
            ctx.status = "ready"
        # what start-up made (torch, the model, the tokenizer: ~220k tracked objects) lives as long as the process:
        # out of the collector's sight, a full collection, which holds the GIL (and /health), takes a few ms
        # instead of ~0.2 s
        gc.freeze()
        try:
            yield
        finally:
            await ctx.engine.shutdown()
            ctx.request_log.close()
            ctx.close()

    app = Starlette(routes=routes, lifespan=lifespan, middleware=_cors(ctx.config.allowed_origins),
                    exception_handlers={404: _not_found, 405: _not_found})
    app.router.redirect_slashes = False  # its redirect is built from the Host header; Gate strips the slash
    app.state.ctx = ctx
    framing.install()
    return Gate(app, ctx.config.allowed_hosts)


def _cors(origins: tuple[str, ...]) -> list[Middleware]:
    """--allowed-origins: Starlette's CORS middleware, inside the Host gate (off when no origin is given).
    Preflights are answered before auth (browsers send no key with them); the bearer key travels as a header,
    not a cookie, so credentials stay off."""
    if not origins:
        return []
    return [Middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST"],
                       allow_headers=["*"], expose_headers=["Retry-After", "x-should-retry"], max_age=600)]


async def _warm_up(ctx: ServerContext) -> None:
    """One token through the engine before reporting ready (READY=1 means a token really came out)."""
    stream = ctx.engine.submit(GenerationRequest(prompt_ids=[ctx.tokenizer.bos_id], max_tokens=1,
                                                 request_id="warmup"))
    async for _ in stream:
        pass
