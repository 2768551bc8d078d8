"""Small stdlib HTTP helpers shared by watchdog, canary, status and deploy (no third-party client needed)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass
class Reply:
    status: int  # 0 = no HTTP reply at all (refused, timeout, reset)
    body: Any = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def base_url(env: Mapping[str, str]) -> str:
    """http://HOST:PORT of rank 0 as seen from the head (a wildcard bind is reached on loopback)."""
    host = env.get("DSV41_HOST", "").strip() or "127.0.0.1"
    if host in ("0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = env.get("DSV41_PORT", "").strip() or "8000"
    return f"http://{host}:{port}"


def request(url: str, payload: Any = None, timeout: float = 10.0, api_key: str | None = None) -> Reply:
    """GET (payload None) or POST JSON; a JSON body is decoded, anything else is kept as text."""
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return Reply(0, None, f"{url}: {reason}")
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = raw.decode("utf-8", "replace")
    return Reply(status, body)


def health(base: str, timeout: float = 5.0) -> Reply:
    """/health: ok means HTTP 2xx and, when the body says so, `"ok": true`."""
    reply = request(base + "/health", timeout=timeout)
    if reply.ok and isinstance(reply.body, dict) and reply.body.get("ok") is False:
        return Reply(503, reply.body, "health reports ok=false")
    return reply
