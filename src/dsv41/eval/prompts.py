"""The prompts of the parts: chat turns encoded as the server encodes them, and the built-in texts.

`chat_ids` renders OpenAI-style messages with the V4.1 encoding (chat/request_mapping.build_chat_prompt, the
server's own path) and tokenizes them as the server does (content never becomes control tokens), so a query sent
as ids to `/v1/completions` or to the engine is the prompt `/v1/chat/completions` would have run.
"""

from __future__ import annotations

# The recipe's decode workloads (RECIPE.md §4.3): an LRU-cache class with tests (code), a 400-word essay (prose),
# counting 1 to 200 (structured).
WORKLOADS = {
    "code": "Write a Python class LRUCache(capacity) with get and put in O(1), then unit tests for it with unittest.",
    "prose": "Write a 400-word essay on why cities grew around rivers.",
    "structured": "Count from 1 to 200, separated by commas, and nothing else.",
}

# Texts a reference's logprobs are taken over when no --prompts file is given (each repeated to the asked length,
# as the recipe's 8 prompts were to 2,048 tokens): code, prose, a list, a dialogue.
REFERENCE_TEXTS = {
    "code": ("def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
             "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
             "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n\n"),
    "prose": ("The river was wide and slow where the town began, and the first houses stood on the higher bank, "
              "away from the spring floods. Merchants came by boat long before the road was built. "),
    "list": "1. apples\n2. pears\n3. plums\n4. cherries\n5. figs\n6. grapes\n7. lemons\n8. oranges\n",
    "dialogue": ("User: What is the capital of France?\nAssistant: The capital of France is Paris.\n"
                 "User: And of Italy?\nAssistant: Rome.\n"),
}


def chat_ids(tokenizer, messages: list[dict], *, thinking: bool = False) -> list[int]:
    """Token ids of `messages` with the generation prompt, thinking on or off (BOS included)."""
    from ..chat.request_mapping import build_chat_prompt

    prompt = build_chat_prompt({"messages": messages, "chat_template_kwargs": {"thinking": thinking}})
    return tokenizer.encode_pieces(prompt.pieces)


def user_ids(tokenizer, text: str, *, thinking: bool = False) -> list[int]:
    return chat_ids(tokenizer, [{"role": "user", "content": text}], thinking=thinking)


def repeated_ids(tokenizer, text: str, length: int) -> list[int]:
    """BOS and `text`'s ids repeated until `length` ids (the last copy cut)."""
    body = tokenizer.encode_literal(text)
    if not body:
        raise ValueError("an empty prompt text")
    ids = [tokenizer.bos_id]
    while len(ids) < length:
        ids.extend(body)
    return ids[:length]
