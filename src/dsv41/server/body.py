"""Request bodies: content type, size limit, read deadline, and JSON that is safe to hand to the rest.

- A JSON endpoint takes `application/json` (or `*/*+json`) only: any other type, or none, is 415. The three
  types a browser may send cross-origin without a CORS preflight (`text/plain`, form encodings) are thereby
  refused before the body is read.
- The body is read whole (at most `--max-body-bytes`) before the disconnect watcher starts, within
  `--body-timeout` seconds: a client that stops halfway gets 408; a drain cuts every read at once (503), so a
  half-sent body never keeps the server from stopping. A client that leaves mid-body is `ClientGone` (499).
- JSON is parsed as strict UTF-8 without NaN/Infinity, at most `MAX_JSON_DEPTH` levels deep, and every string
  (keys too) must be valid Unicode: `"\\ud800"` (a lone surrogate) is legal JSON but no text, and the tokenizer
  and the grammar compiler cannot take it. Each is a 400 naming where it is.
Parsing runs in the caller's worker thread (`ServerContext.run_cpu`), never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import math
import re

from starlette.requests import ClientDisconnect, Request

from .errors import APIError, bad_request, unavailable

MAX_JSON_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


class ClientGone(Exception):
    """The client disconnected before its reply was ready (its body unfinished, or the reply not yet sent).

    Counted as 499 (nginx's "client closed request"), never as an error. A client that only half-closed
    mid-body can still read the 400 `response()` explains; one that left reads nothing."""

    def __init__(self, mid_body: bool = False):
        super().__init__("client disconnected")
        self.mid_body = mid_body

    def response(self):
        from starlette.responses import Response

        if not self.mid_body:
            return Response(status_code=499)
        error = APIError(400, "the request body ended before its Content-Length (the client closed the "
                              "connection)", code="incomplete_body", headers={"Connection": "close"})
        return error.response()


def check_json_content_type(request: Request) -> None:
    given = request.headers.get("content-type")
    mime = (given or "").split(";", 1)[0].strip().lower()
    if mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json")):
        return
    shown = f"{given[:60]!r}" if given else "missing"
    raise APIError(415, f"Content-Type must be application/json (got {shown})", code="unsupported_media_type")


async def read_body(ctx, request: Request) -> bytes:
    """The whole body, read once and kept on the request (see the module docstring for the limits)."""
    if hasattr(request.state, "body"):
        return request.state.body
    limit = ctx.config.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _closing(APIError(413, f"request body of {declared} bytes is larger than the limit of {limit} bytes",
                                code="request_too_large"))
    chunks, size = [], 0
    try:
        async with asyncio.timeout(ctx.config.body_timeout_s) as scope:
            ctx.body_reads.add(scope)
            try:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise _closing(APIError(413, f"request body is larger than the limit of {limit} bytes",
                                                code="request_too_large"))
                    chunks.append(chunk)
            finally:
                ctx.body_reads.discard(scope)
    except TimeoutError:
        if ctx.status != "ready":
            raise _closing(unavailable("the server is shutting down")) from None
        raise _closing(APIError(408, f"the request body did not arrive within {ctx.config.body_timeout_s:g} s",
                                code="request_timeout")) from None
    except ClientDisconnect:
        raise ClientGone(mid_body=True) from None
    request.state.body = b"".join(chunks)
    return request.state.body


def _closing(error: APIError) -> APIError:
    """The rest of the body is never read: the connection cannot carry another request."""
    error.headers.setdefault("Connection", "close")
    return error


def parse_json(body: bytes) -> dict:
    """The body as a JSON object, or a 400 (see the module docstring)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise bad_request(f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        raise bad_request(f"request body is not valid JSON: {_short(exc)}") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    check_tree(data)
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:20]}... is out of range")
    return value


def _short(exc: Exception) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


def check_tree(data) -> None:
    """Depth and Unicode checks over a parsed JSON value (iterative: no recursion on hostile input)."""
    stack = [(data, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise _surrogate(path)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"request body nests deeper than {MAX_JSON_DEPTH} levels", param=_where(path) or None)
        if isinstance(node, dict):
            for key, value in node.items():
                if _SURROGATE.search(key):
                    raise _surrogate(path)
                if isinstance(value, (dict, list, str)):
                    stack.append((value, depth + 1, (*path, key)))
        else:
            for index, value in enumerate(node):
                if isinstance(value, (dict, list, str)):
                    stack.append((value, depth + 1, (*path, index)))


def _surrogate(path) -> APIError:
    where = _where(path)
    return bad_request(f"{where or 'request body'} contains a lone UTF-16 surrogate (not a Unicode character)",
                       param=where or None)


def _where(path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
