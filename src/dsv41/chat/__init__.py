"""DeepSeek-V4.1 chat layer: prompt encoding, completion parsing (one-shot and streaming), OpenAI mapping."""

from .encoding import encode_messages, resolve_effort
from .errors import ChatError, EncodingError, ParseError, RequestError
from .parser import parse_completion
from .request_mapping import ChatPrompt, build_chat_prompt, effort_to_mode

__all__ = [
    "ChatError", "EncodingError", "ParseError", "RequestError",
    "encode_messages", "resolve_effort", "parse_completion",
    "ChatPrompt", "build_chat_prompt", "effort_to_mode",
]
