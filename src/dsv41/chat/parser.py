"""One-shot parser of a V4.1 completion, returning what DeepSeek's `parse_message_from_completion_text` returns.

Input is the text generated after the prompt (after `<think>` in thinking mode, after `</think>` in chat mode).
Output: {"role": "assistant", "content", "reasoning_content", "tool_calls": [{"type", "function": {"name",
"arguments"}, "namespace"?}]}. Refusals raise ParseError (ENCODING.md §3 lists them). Values are not unescaped,
and `string="false"` values are spliced into `arguments` unchecked, exactly like the reference.
The server's typed, tool-aware parsing lives in stream_parser.py.
"""

from .dsml import INVOKE_ATTRS, PARAM_ATTRS, join_arguments, official_value, tool_call_dict
from .errors import ParseError
from .tokens import (CALLS_CLOSE, CALLS_START, EOS, FORBIDDEN_IN_OUTPUT, INVOKE_CLOSE, INVOKE_OPEN, PARAM_CLOSE,
                     PARAM_OPEN, THINK_END)

TAG_END = ">\n"


def parse_completion(text: str, thinking_mode: str) -> dict:
    if thinking_mode not in ("chat", "thinking"):
        raise ParseError(f"thinking_mode must be 'chat' or 'thinking', got {thinking_mode!r}")
    if not isinstance(text, str):
        raise ParseError(f"completion must be a string, got {type(text).__name__}")
    reasoning, rest = "", text
    if thinking_mode == "thinking":
        end = text.find(THINK_END)
        if end < 0:
            raise ParseError("Invalid thinking format: missing </think>")
        reasoning, rest = text[:end], text[end + len(THINK_END):]
        if CALLS_START in reasoning:
            raise ParseError("Invalid thinking format: tool calls before </think>")
    start = rest.find(CALLS_START)
    if start >= 0:
        content = rest[:start]
        calls, end = _parse_block(rest, start + 2)
        if rest[end:] not in ("", EOS):
            raise ParseError("Unexpected content after tool calls")
    else:
        if not rest.endswith(EOS):
            raise ParseError("Invalid format: missing EOS token")
        content, calls = rest[:-len(EOS)], []
    for part in (reasoning, content):
        for token in FORBIDDEN_IN_OUTPUT:
            if token in part:
                raise ParseError(f"Unexpected special token '{token}' in content")
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": calls}


def _expect(text: str, pos: int, literal: str, what: str) -> int:
    if not text.startswith(literal, pos):
        got = text[pos:pos + len(literal)]
        raise ParseError(f"{what} format error: expected {literal!r} but got {got!r}")
    return pos + len(literal)


def _parse_block(text: str, pos: int) -> tuple[list, int]:
    """Parse the calls block starting at `pos` ("<｜DSML｜ calls"); returns (calls, position after it)."""
    pos = _expect(text, pos, CALLS_START[2:], "Tool calls")
    pos = _expect(text, pos, TAG_END, "Tool calls")
    calls = []
    while True:
        if text.startswith(CALLS_CLOSE, pos):
            return calls, pos + len(CALLS_CLOSE)
        if not text.startswith(INVOKE_OPEN, pos):
            raise ParseError(f"Invoke format error: {text[pos:pos + 60]!r}")
        call, pos = _parse_invoke(text, pos + len(INVOKE_OPEN))
        calls.append(call)


def _parse_invoke(text: str, pos: int) -> tuple[dict, int]:
    header = INVOKE_ATTRS.match(text, pos)
    if not header:
        raise ParseError(f"Invoke format error: {text[pos:pos + 60]!r}")
    name = header.group(1)
    pos = _expect(text, header.end(), "\n", "Invoke")
    pairs: list[tuple[str, str]] = []
    if not text.startswith(PARAM_OPEN, pos) and text.startswith("\n" + INVOKE_CLOSE, pos):
        pos += 1  # the blank line the encoder writes for a call without arguments
    while text.startswith(PARAM_OPEN, pos):
        attrs = PARAM_ATTRS.match(text, pos + len(PARAM_OPEN))
        value_end = text.find(PARAM_CLOSE, attrs.end()) if attrs else -1
        if value_end < 0:
            raise ParseError(f"Parameter format error: {text[pos + len(PARAM_OPEN):]!r}")
        key, is_string = attrs.group(1), attrs.group(2) == "true"
        if any(k == key for k, _ in pairs):
            raise ParseError(f"Duplicate parameter name: {key!r}")
        pairs.append((key, official_value(text[attrs.end():value_end], is_string)))
        pos = _expect(text, value_end + len(PARAM_CLOSE), TAG_END, "Parameter")
    pos = _expect(text, pos, INVOKE_CLOSE, "Invoke")
    pos = _expect(text, pos, "\n", "Invoke")
    return tool_call_dict(name, join_arguments(pairs)), pos
