"""Needle in a haystack (RECIPE.md §4.2-4.3: a passkey in filler text, found at 32K / 128K / 299K).

For each context length L and depth d: a haystack of filler sentences (a fixed list, shuffled by `--seed`), with
one needle sentence "The secret number of the <key> is <value>." placed at the fraction d of the haystack, asked
for in one user turn (V4.1 chat encoding, thinking off) so that the whole prompt is at most L tokens. The model
answers greedily (at most `--needle-max-tokens`); it is found when the first number in the reply is the value.
Key and value differ at every (L, d), so nothing is found by a lucky guess shared between cells.
"""

from __future__ import annotations

import random
import re

from .backend import Query
from .prompts import user_ids

FILLER = (
    "The grass grew tall along the edge of the old stone wall.",
    "A light wind moved the clouds slowly across the afternoon sky.",
    "Farmers in the valley planted barley and oats every spring.",
    "The library closed early on the first day of each month.",
    "Boats waited in the harbour for the morning tide to turn.",
    "Children walked to school along the road beside the canal.",
    "The baker opened his shop before sunrise and sold bread until noon.",
    "Rain fell steadily through the night and the streets were quiet.",
    "An old clock in the square struck the hour a little late.",
    "Bees moved between the flowers in the garden behind the house.",
    "The train to the coast left twice a day from the small station.",
    "Snow covered the hills for most of the long winter.",
)
KEYS = ("amber falcon", "silver harbour", "quiet lantern", "northern orchard", "copper violin", "hidden meadow",
        "marble comet", "velvet river")
QUESTION = "What is the secret number of the {key}? Answer with the number only."


def needle_prompt(tokenizer, length: int, depth: float, key: str, value: str, seed: int) -> list[int]:
    """The ids of the (length, depth) prompt: as many filler sentences as fit under `length` tokens."""
    rng = random.Random(seed)
    needle = f"The secret number of the {key} is {value}."
    question = QUESTION.format(key=key)

    def ids_for(sentences: list[str]) -> list[int]:
        cut = round(depth * len(sentences))
        body = " ".join(sentences[:cut] + [needle] + sentences[cut:])
        return user_ids(tokenizer, f"{body}\n\n{question}")

    sentences: list[str] = []
    pool: list[str] = []
    # whole sentences, added in rounds sized by the average sentence's tokens (a sentence in context costs about
    # its own count), then trimmed to fit: a few encodes of the prompt even at 300K tokens
    sentence_tokens = sum(len(tokenizer.encode_literal(" " + s)) for s in FILLER) / len(FILLER)
    ids = ids_for(sentences)
    for _round in range(8):
        more = int((length - len(ids)) / sentence_tokens)
        if more < 1:
            break
        for _ in range(more):
            if not pool:
                pool = list(FILLER)
                rng.shuffle(pool)
            sentences.append(pool.pop())
        ids = ids_for(sentences)
    while len(ids) > length and sentences:
        sentences.pop()
        ids = ids_for(sentences)
    return ids


def first_number(text: str) -> str | None:
    match = re.search(r"\d+", text.replace(",", ""))
    return match.group(0) if match else None


def evaluate(backend, tokenizer, lengths: list[int], depths: list[float], *, seed: int = 0,
             max_tokens: int = 16) -> dict:
    rng = random.Random(seed)
    cells = []
    for length in lengths:
        for depth in depths:
            key, value = rng.choice(KEYS), str(rng.randrange(100000, 1000000))
            ids = needle_prompt(tokenizer, length, depth, key, value, seed=rng.randrange(1 << 30))
            cells.append({"length": length, "depth": depth, "key": key, "value": value, "ids": ids})
    answers = backend.run([Query(c["ids"], max_tokens=max_tokens) for c in cells], "needle")
    results, found = [], 0
    for cell, answer in zip(cells, answers):
        got = None if answer.error else first_number(answer.text)
        hit = got == cell["value"]
        found += hit
        results.append({"length": cell["length"], "depth": cell["depth"], "prompt_tokens": len(cell["ids"]),
                        "value": cell["value"], "reply": answer.text[:200], "found": hit,
                        "seconds": round(answer.seconds, 3), **({"error": answer.error} if answer.error else {})})
    by_length = {}
    for r in results:
        b = by_length.setdefault(str(r["length"]), {"cells": 0, "found": 0})
        b["cells"] += 1
        b["found"] += r["found"]
    return {"cells": len(results), "found": found, "accuracy": found / len(results) if results else None,
            "by_length": by_length, "results": results}
