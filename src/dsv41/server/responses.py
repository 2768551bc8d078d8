"""POST /v1/responses: the OpenAI Responses API over the chat path.

The request becomes a chat completions body (`responses_protocol.chat_body`) and runs exactly as that chat
request would (`chat.create_chat_completion`: the same encoder, grammars, sampling, parser and detokenisation);
the chat reply's steps (reasoning / content / tool-call deltas per engine token) become Responses output items
and typed events (`responses_stream.ResponseEvents`). The non-streaming reply is the final response object of
the very same events, so streamed == whole by construction.
"""

from __future__ import annotations

import re

from pydantic import ValidationError

from ..chat import effort_to_mode
from .chat import create_chat_completion
from .context import ServerContext
from .errors import APIError, from_validation_error
from .protocol import ChatCompletionRequest
from .body import parse_json
from .responses_protocol import PARAMS, ResponsesRequest, chat_body, responses_param
from .responses_stream import ResponseEvents, ResponseStream


def _validated(model, data: dict):
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _prepare(raw: bytes, max_model_len: int, max_token_chars: int) -> tuple[ResponsesRequest, dict,
                                                                            ChatCompletionRequest]:
    """(the Responses request, its chat body, that body validated); blocking: run it through `ctx.run_cpu`. A
    prompt that cannot fit the context is refused by its size before anything walks it (`body.parse_json`)."""
    req = _validated(ResponsesRequest, parse_json(raw, max_model_len, max_token_chars))
    body = chat_body(req)
    try:
        return req, body, _validated(ChatCompletionRequest, body)
    except APIError as exc:
        raise _renamed(exc) from None


_CHAT_NAMES = re.compile(r"\bmessages(\[\d+\])?|(tools\[\d+\])\.function\b|"
                         + "|".join(re.escape(chat) for chat, _ in PARAMS[:-1]))


def _our_name(match: re.Match) -> str:
    text = match.group(0)
    if text.startswith("messages"):
        return "input"
    return match.group(2) if match.group(2) else dict(PARAMS)[text]


def _renamed(exc: APIError) -> APIError:
    """A chat-side error named as the Responses request names its fields."""
    exc.param = responses_param(exc.param)
    exc.message = _CHAT_NAMES.sub(_our_name, exc.message)
    return exc


async def create_response(ctx: ServerContext, raw: bytes):
    """(Generation, its ResponseStream when streaming, else the ResponseEvents to complete)."""
    req, body, chat_req = await ctx.run_cpu(_prepare, raw, ctx.config.max_model_len, ctx.max_token_chars)
    try:
        gen, reply = await create_chat_completion(ctx, chat_req, body)
    except APIError as exc:
        raise _renamed(exc) from None
    gen.endpoint, gen.is_stream = "responses", req.stream  # the log and metrics name this endpoint
    thinking, _ = effort_to_mode(req.effort)
    events = ResponseEvents(ctx, gen, reply, req, thinking=thinking)
    return gen, (ResponseStream(gen, events) if req.stream else events)
