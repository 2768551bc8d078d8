"""The ASGI layer in front of the Starlette app: the Host allow-list and trailing slashes.

Host allow-list (DNS rebinding): a web page can make the user's browser send requests to a name it controls
that resolves to 127.0.0.1; the browser then treats our loopback server as that page's own origin. The request
still names the attacker's host in its `Host` header, so a server bound to a loopback address answers only
requests whose Host is a loopback name (`localhost`, `127.x.x.x`, `[::1]`, any port) or one listed with
`--allowed-hosts`; anything else gets 421 before it reaches a route. `--allowed-hosts '*'` turns the check off
(for a server behind a proxy that rewrites Host). On a non-loopback bind the check applies only when
`--allowed-hosts` is given.

Trailing slashes: `/v1/chat/completions/` is served as `/v1/chat/completions` (Starlette would answer a 307
whose Location is built from the Host header, and the POST body would have to be sent again).
"""

from __future__ import annotations

import ipaddress

from .errors import APIError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind_host: str, extra: list[str] | None) -> frozenset[str] | None:
    """The Host names to accept (None: any) for a server bound to `bind_host` with `--allowed-hosts extra`."""
    extra = [h.strip().lower() for h in extra or [] if h.strip()]
    if "*" in extra:
        return None
    if not extra and not is_loopback(bind_host):
        return None
    return frozenset({"localhost", *[h.strip("[]") for h in extra]})


def host_name(header: str) -> str:
    """`Host` header -> the name without port, lower case (`[::1]:8000` -> `::1`)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    name, _, port = header.rpartition(":")
    return name if name and port.isdigit() else header


class Gate:
    def __init__(self, app, allowed: frozenset[str] | None):
        self.app = app
        self.allowed = allowed
        self.state = app.state  # what callers of build_app read (ctx)

    def _host_ok(self, scope) -> bool:
        if self.allowed is None:
            return True
        headers = [v for k, v in scope.get("headers", ()) if k == b"host"]
        if not headers:  # HTTP/1.0 without Host: no browser sends that
            return True
        name = host_name(headers[0].decode("latin-1"))
        return name in self.allowed or is_loopback(name)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            if not self._host_ok(scope):
                if scope["type"] == "http":
                    await _refuse_host(send, scope.get("path", ""))
                return
            path = scope.get("path", "")
            if len(path) > 1 and path.endswith("/"):
                scope = dict(scope, path=path.rstrip("/") or "/")
        await self.app(scope, receive, send)


async def _refuse_host(send, path: str) -> None:
    from .messages_protocol import error_bytes

    error = APIError(421, "this server does not answer for that Host header (list the name with "
                          "--allowed-hosts to serve it)", code="misdirected_request")
    body = error_bytes(error, path)
    await send({"type": "http.response.start", "status": 421,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
