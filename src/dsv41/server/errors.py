"""Errors as OpenAI error objects: `{"error": {"message", "type", "param", "code"}}` with the right status.

`code` is OpenAI's string identifier where one applies (`context_length_exceeded`, ...) and null otherwise.
Status mapping: 400 validation, 401 bad key, 404 unknown route, 405 wrong method, 408 body not sent in time,
413 body too large, 415 not JSON, 421 foreign Host header, 429 queue full and 503 loading/draining/TP group
failed (both with Retry-After), 500 engine failure (`x-should-retry: false`, so the official client does not
repeat deterministic work). Messages never carry exception text from libraries: `public_text` strips source
paths (torch/xgrammar build trees) from the engine's reasons.
"""

from __future__ import annotations

import json
import re

from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    421: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        self.logged = False  # already in the request log (a generation that failed logs itself)

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        headers = dict(self.headers)
        if self.status == 500:
            headers.setdefault("x-should-retry", "false")
        return Response(json.dumps(self.body()), status_code=self.status, headers=headers,
                        media_type="application/json")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, retry_after_s: int = 5) -> APIError:
    return APIError(503, message, code="service_unavailable", headers={"Retry-After": str(retry_after_s)})


def overloaded(message: str, retry_after_s: int = 1) -> APIError:
    return APIError(429, message, code="rate_limit_exceeded", headers={"Retry-After": str(retry_after_s)})


def engine_failed(message: str) -> APIError:
    return APIError(500, public_text(message)[:500], code="engine_error")


def engine_error(exc) -> APIError:
    """An engine's failure event as the client sees it: 400 when the request itself cannot be served
    (`EngineRejected`: its grammar's dead end, more memory than exists), else a 500."""
    from ..engine import EngineRejected

    if isinstance(exc, EngineRejected):
        return bad_request(public_text(str(exc))[:500], code=exc.code)
    return engine_failed(f"engine failure: {exc}")


# "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534]", "/project/cpp/x.cc:52: ", "File "/usr/x.py", line 3"
_SOURCE_PATH = re.compile(r'\[?(?:File ")?(?:/[^\s"\]:]+)+\.(?:cc|cpp|cxx|c|h|hpp|cu|cuh|py)"?(?::\d+|, line \d+)?\]?:? ?')


def public_text(text: str) -> str:
    """`text` without source-file paths and line numbers (build trees of torch, gloo, xgrammar)."""
    return _SOURCE_PATH.sub("", text).strip()


def from_validation_error(exc) -> APIError:
    """A pydantic ValidationError -> 400 naming the first offending field."""
    errors = exc.errors()
    # for a union (e.g. stop: str | list[str]) the first error is often "not a string"; prefer a specific one
    specific = [e for e in errors if not e.get("msg", "").startswith("Input should be a valid")]
    first = (specific or errors)[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if not _is_union_tag(p))
    msg = first.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    text = f"{loc}: {msg}" if loc else msg
    return bad_request(text, param=loc or None)


def _is_union_tag(part) -> bool:
    # pydantic puts the tried union member ("int", "list[int]", "function-after[...]") into the location
    return isinstance(part, str) and (part in {"str", "int", "float", "bool"} or "[" in part)
