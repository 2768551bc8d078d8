"""DeepSeek-V4.1 chat layer: prompt encoding, completion parsing (one-shot and streaming), OpenAI mapping.

See docs/CHAT.md. The server uses `build_chat_prompt` (request -> prompt text) and `StreamParser` /
`parse_output` (generated text -> reasoning, content and tool calls); `encode_messages` and `parse_completion`
are the official encoder/parser reproduced exactly.
"""

from .encoding import encode_messages, encode_pieces, resolve_effort
from .errors import ChatError, EncodingError, ParseError, RequestError
from .parser import parse_completion
from .request_mapping import ChatPrompt, build_chat_prompt, effort_to_mode
from .stream_parser import (CompletionResult, ContentDelta, Finished, ReasoningDelta, StreamParser,
                            ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart, new_call_id, parse_output)
from . import tokens

__all__ = [
    "ChatError", "EncodingError", "ParseError", "RequestError",
    "encode_messages", "encode_pieces", "resolve_effort", "parse_completion",
    "ChatPrompt", "build_chat_prompt", "effort_to_mode",
    "StreamParser", "parse_output", "new_call_id", "CompletionResult",
    "ReasoningDelta", "ContentDelta", "ToolCallStart", "ToolCallArgumentsDelta", "ToolCallEnd", "Finished",
    "tokens",
]
