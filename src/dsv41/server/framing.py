"""OpenAI error bodies for the HTTP/1.1 framing errors hypercorn answers itself.

A request h11 cannot parse (bad request line or header, a malformed or conflicting Content-Length, broken
chunked encoding, a body that ends before its Content-Length, headers over 16 KiB) never reaches the app:
hypercorn's `H11Protocol._send_error_response` answers 400 or 431 with an empty body and closes. `install()`
wraps that one method (hypercorn 0.18; on another version without it, nothing changes) so the same status
carries `{"error": {...}}`, like every other error of this server. HTTP/2 framing errors (h2c) stay
hypercorn's own (docs/SERVER.md).
"""

from __future__ import annotations

import json

from .errors import APIError

MESSAGES = {
    400: "malformed HTTP request (request line, header, Content-Length or chunked body framing)",
    431: "request header fields too large",
}


def error_body(status: int) -> bytes:
    message = MESSAGES.get(status, f"HTTP protocol error {status}")
    return json.dumps(APIError(status, message, code="bad_http_framing").body()).encode()


def install() -> bool:
    """Patch hypercorn's h11 error response once; False if this hypercorn has no such method."""
    try:
        import h11
        from hypercorn.protocol.h11 import H11Protocol
    except ImportError:
        return False
    original = getattr(H11Protocol, "_send_error_response", None)
    if original is None:
        return False
    if getattr(original, "_dsv41", False):
        return True

    async def send_error_response(self, status_code: int) -> None:
        body = error_body(status_code)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close"), *self.config.response_headers("h11")]
        await self._send_h11_event(h11.Response(status_code=status_code, headers=headers))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())

    send_error_response._dsv41 = True
    H11Protocol._send_error_response = send_error_response
    return True
