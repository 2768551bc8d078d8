"""SSE responses tied to a Generation: errors become an in-stream error event, the end always cleans up.

Hypercorn speaks ASGI HTTP 2.1, so Starlette watches `receive()` for `http.disconnect` next to the body and
cancels the body when the client leaves; the `finally` around the whole response then cancels the engine
request and settles the bookkeeping, also when the body never started.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator, Callable

from starlette.responses import StreamingResponse

from ..engine import EngineFailure
from . import sse
from .errors import engine_error, engine_failed, unavailable
from .generation import Generation, ServerDraining

log = logging.getLogger(__name__)


async def sse_body(gen: Generation, payloads: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Frame the payloads; an engine failure or a drain timeout ends the stream with an error event."""
    try:
        async for payload in payloads:
            yield sse.event(payload)
    except EngineFailure as exc:
        error = engine_error(exc)
        gen.fail(error)
        yield sse.error_event(error.body())
    except ServerDraining as exc:
        error = unavailable(str(exc))
        gen.fail(error)
        yield sse.error_event(error.body())
    except Exception as exc:  # a bug past the headers: still an error event and [DONE], not a dropped stream
        log.exception("unhandled error while streaming")
        error = engine_failed(f"internal error: {type(exc).__name__}: {exc}")
        gen.fail(error)
        yield sse.error_event(error.body())
    yield sse.DONE


class GenerationStream(StreamingResponse):
    def __init__(self, gen: Generation, payloads: AsyncIterator[dict], on_close: Callable[[], None]):
        super().__init__(sse_body(gen, payloads), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen = gen
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.close()
            self._on_close()
