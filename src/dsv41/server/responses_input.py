"""Responses API input items -> chat messages (`responses_protocol.chat_messages` drives it).

`message` items (input_text / output_text / refusal parts; images, files and audio refused), `reasoning` items
(their reasoning text, else their summary, becomes the next assistant turn's `reasoning_content`),
`function_call` items (joined to the assistant turn before them, else a new one: its `tool_calls`) and
`function_call_output` items (`tool` messages, each answering a call that came before it). Anything else is a
400 naming the item: `item_reference` (nothing is stored) and the built-in tools' items.
"""

from __future__ import annotations

import json

from .errors import bad_request

TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
FILE_PARTS = ("input_image", "input_file", "input_audio", "image_url")


def _text(content, where: str, *, role: str) -> str | list[dict]:
    """A message's content: a string, or its text parts as chat text parts (images and files refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in FILE_PARTS:
            raise bad_request(f"{kind} inputs are not supported: this server runs the text model only",
                              param=f"{where}[{j}]")
        key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise bad_request(f"{where}[{j}]: unknown content part type {str(kind)[:40]!r} (input_text, "
                              "output_text or refusal)", param=f"{where}[{j}].type")
        if (kind in ("output_text", "refusal")) != (role == "assistant") and kind != "text":
            raise bad_request(f"{where}[{j}]: {kind} parts belong to {'assistant' if role != 'assistant' else 'user'}"
                              f" messages, not {role}", param=f"{where}[{j}].type")
        if not isinstance(part.get(key), str):
            raise bad_request(f"{where}[{j}].{key} must be a string", param=f"{where}[{j}].{key}")
        parts.append({"type": "text", "text": part[key]})
    return parts


def _joined(content) -> str:
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


class Conversation:
    """Responses input items -> chat messages, in order."""

    def __init__(self):
        self.messages: list[dict] = []
        self.reasoning: str | None = None  # a reasoning item waiting for its assistant turn
        self.calls: set[str] = set()

    def _assistant(self) -> dict:
        """The assistant turn a function_call joins: the last message when it is an assistant's, else a new one."""
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": None}
            self.messages.append(last)
        if self.reasoning is not None:
            last["reasoning_content"] = self.reasoning
            self.reasoning = None
        return last

    def add(self, item, i: int) -> None:
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            self._message(item, where)
        elif kind == "reasoning":
            self._reasoning(item, where)
        elif kind == "function_call":
            self._call(item, where)
        elif kind == "function_call_output":
            self._output(item, where)
        elif kind == "item_reference":
            raise bad_request("item_reference is not supported: this server keeps no items; send the item itself",
                              param=f"{where}.type")
        elif isinstance(kind, str):
            raise bad_request(f"{where}: input items of type {kind[:60]!r} are not supported (message, reasoning, "
                              "function_call, function_call_output)", param=f"{where}.type")
        else:
            raise bad_request(f"{where} needs a type (or a role for a message)", param=f"{where}.type")

    def _message(self, item: dict, where: str) -> None:
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad_request(f"{where}.role must be one of user, assistant, system, developer, got "
                              f"{str(role)[:40]!r}", param=f"{where}.role")
        content = _text(item.get("content"), f"{where}.content", role=role)
        if role == "assistant":
            message = {"role": "assistant", "content": _joined(content)}
            if self.reasoning is not None:
                message["reasoning_content"], self.reasoning = self.reasoning, None
            self.messages.append(message)
        else:
            self.messages.append({"role": "system" if role == "developer" else role, "content": content})

    def _reasoning(self, item: dict, where: str) -> None:
        texts = []
        for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
            parts = item.get(key)
            if parts is None:
                continue
            if not isinstance(parts, list):
                raise bad_request(f"{where}.{key} must be a list", param=f"{where}.{key}")
            for j, part in enumerate(parts):
                if not isinstance(part, dict) or part.get("type") != part_type or not isinstance(part.get("text"), str):
                    raise bad_request(f"{where}.{key}[{j}] must be a {part_type} part with text",
                                      param=f"{where}.{key}[{j}]")
                texts.append(part["text"])
            if texts:  # the full reasoning when given; the summary otherwise
                break
        self.reasoning = (self.reasoning or "") + "".join(texts)

    def _call(self, item: dict, where: str) -> None:
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
                raise bad_request(f"{where}.{key} must be a {'non-empty ' if key != 'arguments' else ''}string",
                                  param=f"{where}.{key}")
        try:
            json.loads(item["arguments"] or "{}")
        except ValueError:
            raise bad_request(f"{where}.arguments is not valid JSON", param=f"{where}.arguments") from None
        turn = self._assistant()
        turn.setdefault("tool_calls", []).append(
            {"id": item["call_id"], "type": "function",
             "function": {"name": item["name"], "arguments": item["arguments"] or "{}"}})
        self.calls.add(item["call_id"])

    def _output(self, item: dict, where: str) -> None:
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"{where}.call_id must be a non-empty string", param=f"{where}.call_id")
        if call_id not in self.calls:
            raise bad_request(f"{where}: no function_call with call_id {call_id[:80]!r} comes before this output",
                              param=f"{where}.call_id")
        output = _text(item.get("output"), f"{where}.output", role="tool")
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": _joined(output)})
