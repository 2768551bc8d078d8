"""Reasoning memory (RECIPE.md §1.3): the reasoning of the server's recent replies, put back into a later request's
history where the client resent the reply without it.

Most OpenAI-style agent clients keep an assistant turn's `content` and `tool_calls` but drop `reasoning_content`.
With tools declared (drop_thinking off, ENCODING.md) the V4.1 encoding renders every earlier turn with its
reasoning, so such a history reads `<think></think>` where the model wrote `<think>…</think>`: the model sees a
history it did not write, and the prompt stops being a prefix of the session entry the reply left (docs/SESSIONS.md)
right after the previous prompt. Remembering the reasoning by the reply's tool-call ids (`call_<24 hex>`, unique to
this server) and by a digest of its content, and restoring it when the client omits it, keeps the prompt the one
the model produced, so the next turn resumes from the end of the reply.

Only a message with no reasoning field at all is filled in (an explicit `reasoning_content: ""` is the client's
word); the encoder then drops it again wherever drop_thinking applies.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

CAPACITY = 1024


def _content_key(content: str) -> str:
    return "text:" + hashlib.blake2b(content.encode(), digest_size=16).hexdigest()


class ReasoningMemory:
    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._items: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()  # remembered on the event loop, restored in the preparation threads
        self.restored_total = 0

    def __len__(self) -> int:
        return len(self._items)

    def remember(self, reasoning: str, call_ids: list[str], content: str) -> None:
        """A reply's reasoning, under each of its tool-call ids and its content (when it has any)."""
        if not reasoning:
            return
        keys = ["call:" + i for i in call_ids if i] + ([_content_key(content)] if content else [])
        with self._lock:
            for key in keys:
                self._items[key] = reasoning
                self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def _find(self, message: dict) -> str | None:
        for call in message.get("tool_calls") or ():
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                found = self._items.get("call:" + call["id"])
                if found is not None:
                    return found
        content = message.get("content")
        if isinstance(content, str) and content:
            return self._items.get(_content_key(content))
        return None

    def restore(self, body: dict) -> dict:
        """`body` with the remembered reasoning put into its assistant messages that carry none (a new body and
        message dicts where anything changes: the client's objects are left as they are)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not self._items:
            return body
        out, changed = [], False
        with self._lock:
            for message in messages:
                if isinstance(message, dict) and message.get("role") == "assistant" \
                        and message.get("reasoning_content") is None and message.get("reasoning") is None:
                    found = self._find(message)
                    if found is not None:
                        message = {**message, "reasoning_content": found}
                        changed = True
                        self.restored_total += 1
                out.append(message)
        return {**body, "messages": out} if changed else body
