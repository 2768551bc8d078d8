"""Incremental parser of a V4.1 completion for the server: text pieces in, OpenAI-shaped events out.

Feed decoded text pieces (or token strings, special tokens included) with `feed()`; call `finish()` once the
engine stops. Events, in order:

  ReasoningDelta(text)                      reasoning text (thinking mode, before `</think>`)
  ContentDelta(text)                        answer text
  ToolCallStart(index, id, name, namespace) a DSML invoke whose name is complete (and, with tools, declared)
  ToolCallArgumentsDelta(index, fragment)   JSON text; a call's fragments concatenate to its `arguments`
  ToolCallEnd(index, arguments)             the invoke closed; `arguments` is the complete JSON text
  Finished(result)                          last event of finish(): the CompletionResult

Text that could be the start of a marker (`</think>`, `\\n\\n<｜DSML｜ calls`, `<｜end▁of▁sentence｜>`, a
parameter's closing tag) is held back until the next piece decides; nothing after EOS is parsed. Between DSML
tags any whitespace is accepted (the encoder writes single newlines; grammar-constrained decoding with
xgrammar's `deepseek_v4_1` structural tag may write other whitespace there).

`tools=None` accepts every tool name and reproduces the official parser (string values JSON-quoted,
`string="false"` text spliced unchecked, bare `name` + `namespace`); on every completion the official parser
accepts, the result equals `parse_completion`'s. With `tools` given (the request's list, [] for none):
- a call naming a tool that is not declared is not a call: that invoke and all text after it stay content
  (and when it is the block's first invoke, so does the whole block);
- values are typed by the tool's JSON schema (tool_schema.py): arguments are always valid JSON;
- the reported name is the function name as declared (namespace separately when declared separately).
Malformed DSML never raises: completed calls stand, an open call's arguments are closed to valid JSON, and the
unparsed rest becomes content. A call cut by max_tokens (`finish(truncated=True)` while it is open) is dropped,
never reported with arguments the model did not finish; its markup is not content either.
`hold_calls=True` (what `ChatPrompt.new_parser` asks for, so every endpoint does the same) emits a call's events
only once its invoke has closed (ToolCallStart, its arguments in one fragment, ToolCallEnd together), so a streamed
reply never shows a call that a cut later drops, and streamed and whole replies agree.
`<think>` and `</think>` are never reasoning or content text: a stray one (thinking off, a second `</think>`) is
dropped (docs/SERVER.md "Clean text").
"""

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Callable

from .dsml import json_key, official_value, split_call_name
from .errors import ParseError
from .tokens import (CALLS_CLOSE, CALLS_START, EOS, INVOKE_CLOSE, INVOKE_OPEN, PARAM_CLOSE, PARAM_OPEN, THINK_END,
                     THINK_START)
from .tool_schema import ToolSpec, tool_specs

CALL_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An OpenAI-style tool call id: `call_` + 24 random alphanumerics."""
    return "call_" + "".join(secrets.choice(CALL_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str
    namespace: str | None = None


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    index: int
    fragment: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    arguments: str


@dataclass
class CompletionResult:
    content: str
    reasoning_content: str
    tool_calls: list = field(default_factory=list)   # [{"id", "type": "function", "function": {...}}]
    finish_reason: str = "stop"                       # hint: "stop" | "length" | "tool_calls"

    def message(self) -> dict:
        """The parsed assistant message (the official parser's keys, plus call ids)."""
        return {"role": "assistant", "content": self.content, "reasoning_content": self.reasoning_content,
                "tool_calls": self.tool_calls}


@dataclass(frozen=True)
class Finished:
    result: CompletionResult


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd | Finished

# Tiny grammar for tag attributes, matched on a buffer that may still be incomplete.
_WS, _LIT, _UNTIL, _CHOICE = "ws", "lit", "until", "choice"
_NEED, _FAIL = "need", "fail"
# A value ends at the complete closing tag (the official parser stops at "</｜DSML｜ parameter" and then demands
# ">\n"; xgrammar's DSML grammar only excludes the complete tag from string values).
VALUE_END = PARAM_CLOSE + ">"
INVOKE_ATTRS = ((_WS,), (_LIT, 'name="'), (_UNTIL, '"'), (_WS,), (_LIT, ">"))
PARAM_ATTRS = ((_WS,), (_LIT, 'name="'), (_UNTIL, '"'), (_WS,), (_LIT, 'string="'), (_CHOICE, ("true", "false")),
               (_LIT, '"'), (_WS,), (_LIT, ">"))


def _match(buf: str, pattern) -> tuple[int, list[str]] | str:
    """Match `pattern` at the start of `buf`: (end, captures), _NEED (could still match) or _FAIL."""
    pos, captures = 0, []
    for element in pattern:
        kind = element[0]
        if kind == _WS:
            while pos < len(buf) and buf[pos].isspace():
                pos += 1
            if pos == len(buf):
                return _NEED
        elif kind == _LIT:
            status = _literal(buf, pos, element[1])
            if status != "ok":
                return status
            pos += len(element[1])
        elif kind == _UNTIL:
            end = buf.find(element[1], pos)
            if end < 0:
                return _NEED
            captures.append(buf[pos:end])
            pos = end + len(element[1])
        else:
            statuses = [(_literal(buf, pos, option), option) for option in element[1]]
            chosen = [option for status, option in statuses if status == "ok"]
            if chosen:
                captures.append(chosen[0])
                pos += len(chosen[0])
            elif any(status == _NEED for status, _ in statuses):
                return _NEED
            else:
                return _FAIL
    return pos, captures


STRAY_MARKUP = (THINK_START, THINK_END)  # dropped wherever they are not the end of the reasoning


def _literal(buf: str, pos: int, literal: str) -> str:
    chunk = buf[pos:pos + len(literal)]
    if chunk == literal:
        return "ok"
    return _NEED if literal.startswith(chunk) else _FAIL


def _held_suffix(buf: str, markers) -> int:
    """Length of the longest end of `buf` that is a proper prefix of a marker (it must wait for more text)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(buf)), longest, -1):
            if buf.endswith(marker[:size]):
                longest = size
                break
    return longest


@dataclass
class _OpenCall:
    index: int                 # position among reported calls (-1: parsed but not reported)
    id: str
    name: str
    namespace: str | None
    spec: ToolSpec | None
    keys: list = field(default_factory=list)
    fragments: list = field(default_factory=list)
    key: str = ""
    is_string: bool = False
    streaming_value: bool = False
    value_open: bool = False
    value: list = field(default_factory=list)


class StreamParser:
    """Incremental V4.1 completion parser; see the module docstring for the event model."""

    def __init__(self, thinking_mode: str, tools: list | None = None, *, parallel_tool_calls: bool = True,
                 new_call_id: Callable[[], str] = new_call_id, hold_calls: bool = False):
        if thinking_mode not in ("chat", "thinking"):
            raise ParseError(f"thinking_mode must be 'chat' or 'thinking', got {thinking_mode!r}")
        self._specs = tool_specs(tools)
        self._parallel = parallel_tool_calls
        self._new_call_id = new_call_id
        self._state = "reasoning" if thinking_mode == "thinking" else "content"
        self._buf = ""
        self._events: list = []
        self._hold_calls = hold_calls
        self._held: list = []  # the open call's events while hold_calls keeps them back
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[dict] = []
        self._saw_eos = False
        self._truncated = False  # finish(truncated=True): cut by max_tokens
        self._after_block = False
        self._result: CompletionResult | None = None
        # block state
        self._at = ""
        self._block_raw = ""
        self._block_calls = 0
        self._call: _OpenCall | None = None
        self._parsed_calls = 0

    # -- public ---------------------------------------------------------------------------------------------------
    def feed(self, piece: str) -> list:
        if self._result is not None:
            raise ParseError("feed() after finish()")
        if piece and self._state != "done":
            self._buf += piece
            self._run(final=False)
        return self._take_events()

    def finish(self, truncated: bool = False) -> list:
        """End of the completion. `truncated`: it was cut by max_tokens, so an open tool call is recorded with the
        arguments the model wrote (nothing invented to close them) and cut markup is dropped, never content."""
        if self._result is None:
            self._truncated = truncated
            self._run(final=True)
            if self._call is not None:
                self._close_open_call()
            self._result = CompletionResult(
                content="".join(self._content), reasoning_content="".join(self._reasoning),
                tool_calls=self._calls, finish_reason=self._finish_reason())
            self._events.append(Finished(self._result))
        return self._take_events()

    @property
    def result(self) -> CompletionResult | None:
        return self._result

    @property
    def in_reasoning(self) -> bool:
        """Still before `</think>` (the reply's reasoning; what `usage.completion_tokens_details` counts)."""
        return self._state == "reasoning"

    # -- driving --------------------------------------------------------------------------------------------------
    def _run(self, final: bool):
        steps = {"reasoning": self._step_reasoning, "content": self._step_content, "raw": self._step_raw,
                 "block": self._step_block, "done": lambda final: False}
        while steps[self._state](final):
            pass
        if self._state == "done":
            self._buf = ""

    def _finish_reason(self) -> str:
        if not self._saw_eos and not (self._after_block and self._state == "content"):
            return "length"
        return "tool_calls" if self._calls else "stop"

    def _take_events(self) -> list:
        """This call's events, adjacent deltas of one kind merged (one SSE chunk each)."""
        merged: list = []
        for event in self._events:
            last = merged[-1] if merged else None
            if isinstance(event, (ContentDelta, ReasoningDelta)) and type(last) is type(event):
                merged[-1] = type(event)(last.text + event.text)
            elif (isinstance(event, ToolCallArgumentsDelta) and isinstance(last, ToolCallArgumentsDelta)
                  and last.index == event.index):
                merged[-1] = ToolCallArgumentsDelta(event.index, last.fragment + event.fragment)
            else:
                merged.append(event)
        self._events = []
        return merged

    # -- plain text states ----------------------------------------------------------------------------------------
    def _scan(self, markers, emit, final: bool) -> str | None:
        """Emit text up to the first marker (returned, and consumed) or up to a possibly-partial marker."""
        found = min(((self._buf.find(m), m) for m in markers if m in self._buf), default=None)
        if found:
            position, marker = found
            emit(self._buf[:position])
            self._buf = self._buf[position + len(marker):]
            return marker
        keep = 0 if final and not self._truncated else _held_suffix(self._buf, markers)
        emit(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return None

    def _emit_reasoning(self, text: str):
        if text:
            self._reasoning.append(text)
            self._events.append(ReasoningDelta(text))

    def _emit_content(self, text: str):
        if text:
            self._after_block = False
            self._content.append(text)
            self._events.append(ContentDelta(text))

    def _step_reasoning(self, final: bool) -> bool:
        marker = self._scan((THINK_END, EOS, THINK_START), self._emit_reasoning, final)
        if marker == THINK_START:
            return True  # markup, never reasoning text
        if marker == THINK_END:
            self._state = "content"
        elif marker == EOS:
            self._saw_eos, self._state = True, "done"
        return marker is not None

    def _step_content(self, final: bool) -> bool:
        marker = self._scan((CALLS_START, EOS) + STRAY_MARKUP, self._emit_content, final)
        if marker in STRAY_MARKUP:
            return True  # a stray <think> / </think> is markup, never content
        if marker == CALLS_START:
            self._state, self._at = "block", "open"
            self._block_raw, self._block_calls = CALLS_START, 0
        elif marker == EOS:
            self._saw_eos, self._state = True, "done"
        return marker is not None

    def _step_raw(self, final: bool) -> bool:
        """After malformed or undeclared DSML: everything is content until EOS."""
        marker = self._scan((EOS,) + STRAY_MARKUP, self._emit_content, final)
        if marker == EOS:
            self._saw_eos, self._state = True, "done"
        return marker is not None

    # -- the DSML block -------------------------------------------------------------------------------------------
    def _consume(self, size: int) -> str:
        text, self._buf = self._buf[:size], self._buf[size:]
        if self._block_calls == 0:
            # Kept only while the block may still turn out to be plain text (see _open_invoke and _fail).
            self._block_raw += text
        return text

    def _expect(self, options, final: bool):
        """Match one of the literal `options` at the buffer start: the option, None (wait) or _FAIL."""
        statuses = [(_literal(self._buf, 0, option), option) for option in options]
        for status, option in statuses:
            if status == "ok":
                self._consume(len(option))
                return option
        if not final and any(status == _NEED for status, _ in statuses):
            return None
        return _FAIL

    def _step_block(self, final: bool) -> bool:
        at = self._at
        if at == "param_value":
            return self._step_value(final)
        if at in ("invoke_attrs", "param_attrs"):
            matched = _match(self._buf, INVOKE_ATTRS if at == "invoke_attrs" else PARAM_ATTRS)
            if matched == _NEED and not final:
                return False
            if matched in (_NEED, _FAIL):
                return self._fail(final)
            end, captures = matched
            raw = self._consume(end)
            return self._open_invoke(captures[0], raw, final) if at == "invoke_attrs" else \
                self._open_param(captures[0], captures[1] == "true", final)
        if at in ("item", "invoke_body"):
            # Between tags the encoder writes one newline (a blank line in an empty invoke); grammar-constrained
            # decoding (xgrammar's deepseek_v4_1 tag) may write any whitespace there, so any is accepted.
            spaces = len(self._buf) - len(self._buf.lstrip(" \t\r\n"))
            self._consume(spaces)
            if not self._buf and not final:
                return False
        options = {"open": (">",), "item": (INVOKE_OPEN, CALLS_CLOSE), "invoke_body": (PARAM_OPEN, INVOKE_CLOSE)}[at]
        found = self._expect(options, final)
        if found is None:
            return False
        if found == _FAIL:
            return self._fail(final)
        if found == CALLS_CLOSE:
            self._state, self._after_block = "content", True
        elif found == INVOKE_OPEN:
            self._at = "invoke_attrs"
        elif found == PARAM_OPEN:
            self._at = "param_attrs"
        elif found == INVOKE_CLOSE:
            self._end_call()
            self._at = "item"
        else:  # the ">" closing the block opener
            self._at = "item"
        return True

    def _open_invoke(self, qualified: str, attrs_raw: str, final: bool) -> bool:
        spec = None
        if self._specs is None:
            try:
                name, namespace = split_call_name(qualified)
            except ParseError:
                return self._fail(final)
        else:
            spec = self._specs.get(qualified)
            if spec is None:
                # An undeclared tool: this invoke (or the whole block, when it is the first) stays text.
                rest = self._block_raw if self._block_calls == 0 else INVOKE_OPEN + attrs_raw
                self._buf, self._state = rest + self._buf, "raw"
                return True
            name, namespace = spec.name, spec.namespace
        reported = self._parallel or self._parsed_calls == 0
        self._parsed_calls += 1
        self._block_calls += 1
        self._call = _OpenCall(index=len(self._calls) if reported else -1, id=self._new_call_id() if reported
                               else "", name=name, namespace=namespace, spec=spec)
        if reported:
            self._call_event(ToolCallStart(self._call.index, self._call.id, name, namespace))
        self._at = "invoke_body"
        return True

    def _argument(self, fragment: str):
        call = self._call
        call.fragments.append(fragment)
        if call.index >= 0 and fragment:
            self._call_event(ToolCallArgumentsDelta(call.index, fragment))

    def _call_event(self, event):
        (self._held if self._hold_calls else self._events).append(event)

    def _open_param(self, key: str, is_string: bool, final: bool) -> bool:
        call = self._call
        if key in call.keys:
            return self._fail(final)
        self._argument(("{" if not call.keys else ", ") + json_key(key) + ": ")
        call.keys.append(key)
        call.key, call.is_string, call.value, call.value_open = key, is_string, [], True
        call.streaming_value = call.spec.streams_as_string(key, is_string) if call.spec else is_string
        if call.streaming_value:
            self._argument('"')
        self._at = "param_value"
        return True

    def _value_text(self, text: str):
        if not text:
            return
        if self._call.streaming_value:
            self._argument(json.dumps(text, ensure_ascii=False)[1:-1])
        else:
            self._call.value.append(text)

    def _close_value(self):
        call = self._call
        if call.streaming_value:
            self._argument('"')
        else:
            raw = "".join(call.value)
            self._argument(call.spec.value_json(call.key, raw, call.is_string) if call.spec
                           else official_value(raw, call.is_string))
        call.value_open = False

    def _step_value(self, final: bool) -> bool:
        end = self._buf.find(VALUE_END)
        if end >= 0:
            self._value_text(self._consume(end))
            self._consume(len(VALUE_END))
            self._close_value()
            self._at = "invoke_body"
            return True
        if final:
            return self._fail(final)
        size = len(self._buf) - _held_suffix(self._buf, (VALUE_END,))
        self._value_text(self._consume(size))
        return False

    def _end_call(self):
        call = self._call
        self._argument("}" if call.keys else "{}")
        self._call = None
        arguments = "".join(call.fragments)
        if call.index < 0:
            return
        self._events += self._held
        self._held = []
        self._events.append(ToolCallEnd(call.index, arguments))
        record = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}
        if call.namespace is not None:
            record["namespace"] = call.namespace
        self._calls.append(record)

    def _close_open_call(self):
        """Make an interrupted call's arguments valid JSON and record it; a call cut by max_tokens is dropped (its
        arguments are unfinished: a required one may be missing, a value half written)."""
        call = self._call
        if self._truncated:
            self._call, self._held = None, []
            return
        if call.value_open:
            self._argument('"' if call.streaming_value else "null")
        self._end_call()

    def _fail(self, final: bool) -> bool:
        """Malformed or truncated DSML: keep finished calls, close an open one, the rest is content."""
        if self._call is not None:
            self._close_open_call()
            rest = "" if final else self._buf
        elif self._block_calls == 0:
            rest = self._block_raw + self._buf
        else:
            rest = self._buf
        if final and self._truncated:
            rest = ""  # markup cut by max_tokens is not content
        self._buf, self._state = rest, "raw"
        return True


def parse_output(text: str, thinking_mode: str, tools: list | None = None, *, parallel_tool_calls: bool = True,
                 new_call_id: Callable[[], str] = new_call_id) -> CompletionResult:
    """The non-streaming server path: the whole completion through the same parser."""
    parser = StreamParser(thinking_mode, tools, parallel_tool_calls=parallel_tool_calls, new_call_id=new_call_id)
    parser.feed(text)
    parser.finish()
    return parser.result
