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
- A prompt that cannot fit the context is refused by its size before anything tokenizes it (`check_prompt_size`):
  a token covers at most `Tokenizer`'s longest spelling, so more characters than `max_model_len` times that
  cannot be fewer tokens than the context (a prompt 1,000x the context took seconds of CPU and gigabytes to
  tokenize before its token count was checked). What passes is then checked by tokens.
- A body of more than `MAX_OBJECT_KEYS` object keys is a 400 before it is parsed (counted in C): the parse holds
  the GIL, so an 8 MiB body of tiny members stalled every other request, /health included.
- Fields a request names that an endpoint does not implement are logged once per request, as one bounded line,
  and only names not seen lately: the most recent 1,024 names are remembered (`note_unknown_fields`). Thousands of
  unique names in one body wrote one warning each and were kept forever.
Parsing runs in the caller's worker thread (`ServerContext.run_cpu`), never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import threading
from collections import OrderedDict
from typing import Iterable

from starlette.requests import ClientDisconnect, Request

from .errors import APIError, bad_request, unavailable

MAX_JSON_DEPTH = 64
# json.loads holds the GIL for the whole parse, and a body of small members is the slowest to parse per byte
# (600k unique keys in 8 MiB held it ~0.9 s on a loaded 2-core box, /health waiting throughout); 50k keys parse in
# well under 100 ms there, far above what a real request carries (tools and schemas included).
MAX_OBJECT_KEYS = 50_000
_SURROGATE = re.compile("[\ud800-\udfff]")
log = logging.getLogger("dsv41.server")


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


def object_keys(body: bytes) -> int:
    """About how many object keys a JSON body has, counted in C without parsing it: each key is a string followed
    by a colon (`"k":` compact, `"k": ` as json.dumps writes it); a quote escaped inside a string is not one."""
    return body.count(b'":') - body.count(b'\\":')


def parse_json(body: bytes, max_model_len: int | None = None, max_token_chars: int | None = None) -> dict:
    """The body as a JSON object, or a 400 (see the module docstring). With `max_model_len` and `max_token_chars`
    a generation request's prompt is checked by its size first (`check_prompt_size`), before the walk over every
    string: an oversized prompt costs the parse only."""
    keys = object_keys(body)
    if keys > MAX_OBJECT_KEYS:
        raise bad_request(f"request body has {keys} object keys; at most {MAX_OBJECT_KEYS} are accepted")
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
    if max_model_len and max_token_chars:
        check_prompt_size(data, max_model_len, max_token_chars)
    # a lone surrogate can only come from a \u escape (strict UTF-8 decoding refuses encoded ones): without one
    # in the body, the walk skips the string search (0.05-0.3 s of GIL over an 8 MiB prompt)
    check_tree(data, surrogates=b"\\u" in body)
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


def check_tree(data, surrogates: bool = True) -> None:
    """Depth and Unicode checks over a parsed JSON value (iterative: no recursion on hostile input). With
    `surrogates` false (the body has no \\u escape) strings are not searched for lone surrogates."""
    stack = [(data, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            if surrogates and _has_surrogate(node):
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


def _has_surrogate(text: str, step: int = 1 << 18) -> bool:
    """A regex search holds the GIL to its end: a long string is searched in slices (a surrogate is one
    character, so no match spans two)."""
    return any(_SURROGATE.search(text, start, start + step) for start in range(0, len(text), step))


def _surrogate(path) -> APIError:
    where = _where(path)
    return bad_request(f"{where or 'request body'} contains a lone UTF-16 surrogate (not a Unicode character)",
                       param=where or None)


def _where(path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# ---------------------------------------------------------------------------- the prompt's size, before tokenizing
# Top-level fields whose text all goes into the prompt (chat messages, Anthropic's system, a completions prompt,
# the Responses API's input/instructions). Other text (tools, schemas, stop strings) is not counted: the check
# may only let too much through, never refuse a prompt that fits.
PROMPT_FIELDS = ("messages", "system", "prompt", "input", "instructions")


def prompt_sizes(data: dict) -> list[tuple[str, int, int]]:
    """(field, characters, token ids) per prompt the body carries: a completions `prompt` list is one prompt per
    item (each must fit on its own); everything else is summed into one."""
    sizes, chars, ids = [], 0, 0
    for field in PROMPT_FIELDS:
        value = data.get(field)
        if field == "prompt" and isinstance(value, list) and value and isinstance(value[0], (str, list)):
            for i, item in enumerate(value):
                c, n = _text_size(item)
                sizes.append((f"prompt[{i}]", c, n))
            continue
        c, n = _text_size(value)
        chars, ids = chars + c, ids + n
    if chars or ids:
        sizes.append(("prompt" if "prompt" in data else "messages" if "messages" in data else "input", chars, ids))
    return sizes


def _text_size(value) -> tuple[int, int]:
    """(characters of every string, count of integers) inside a JSON value (iterative)."""
    chars = ids = 0
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            chars += len(node)
        elif isinstance(node, bool) or node is None:
            continue
        elif isinstance(node, int):
            ids += 1
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return chars, ids


def check_prompt_size(data: dict, max_model_len: int, max_token_chars: int) -> None:
    """400 `context_length_exceeded` when a prompt cannot fit `max_model_len` tokens, decided without the
    tokenizer: token ids counted, text by `max_token_chars` (the longest spelling one token covers)."""
    for field, chars, ids in prompt_sizes(data):
        fewest = ids + -(-chars // max(max_token_chars, 1))  # ceil: no tokenization can use fewer tokens
        if fewest > max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens, but the prompt ({field}: "
                f"{chars} characters{f', {ids} token ids' if ids else ''}) needs at least {fewest} tokens (a token "
                f"covers at most {max_token_chars} characters); it was refused without tokenizing it.",
                param=field.split("[")[0], code="context_length_exceeded")


# ---------------------------------------------------------------------------- fields accepted, not implemented
MAX_REMEMBERED = 1024  # the (endpoint, name) pairs logged most recently; older ones may be logged again
MAX_SHOWN = 8  # names in one log line
MAX_NAME_CHARS = 64

_remembered: OrderedDict[tuple[str, str], None] = OrderedDict()
_remembered_lock = threading.Lock()


def note_unknown_fields(endpoint: str, names: Iterable[str], honoured: Iterable[str] = ()) -> list[str]:
    """Log, once for this request, the fields it names that `endpoint` accepts but does not implement, leaving
    out names already logged; returns the new names (at most MAX_SHOWN of them, shortened). Runs where the
    body is parsed (`ServerContext.run_cpu`), not on the event loop."""
    honoured = set(honoured)
    new, count = [], 0
    with _remembered_lock:
        for name in names:
            key = (endpoint, name)
            if name in honoured:
                continue
            if key in _remembered:
                _remembered.move_to_end(key)
                continue
            count += 1
            if len(new) < MAX_SHOWN:
                new.append(name if len(name) <= MAX_NAME_CHARS else name[:MAX_NAME_CHARS] + "...")
            _remembered[key] = None
            if len(_remembered) > MAX_REMEMBERED:
                _remembered.popitem(last=False)  # the least recently seen
    if count == 1:
        log.warning("%s: the request field %r is accepted but not implemented (ignored); further requests with it "
                    "are not logged", endpoint, new[0])
    elif count:
        more = f" (+{count - len(new)} more)" if count > len(new) else ""
        log.warning("%s: %d request fields are accepted but not implemented (ignored): %s%s; names already logged "
                    "are not logged again", endpoint, count, ", ".join(map(repr, new)), more)
    return new
