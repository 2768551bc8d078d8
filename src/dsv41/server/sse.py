"""Server-sent events framing for the OpenAI streaming shape: `data: <json>` events, then `data: [DONE]`."""

from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


def error_event(body: dict) -> bytes:
    """An error after the SSE headers went out: the official client raises APIError on `{"error": ...}`."""
    return event(body)
