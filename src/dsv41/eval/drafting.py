"""Drafting statistics: decode tokens per engine round on code, prose and structured prompts (RECIPE.md §4.3's
three decode workloads), read from the engine's own figures.

Each workload is one chat turn (thinking off), run alone and greedy with drafting asked for (at most
`--draft-depth` drafts a round), so the round count is the request's own. Per workload: the request's
`FinishEvent.tokens_per_round` (accepted drafts + 1, the engine's figure), its decode tokens/s, and the engine's
drafting counters over that request (vLLM's num_drafts / num_draft_tokens / num_accepted_tokens per drafter).
Needs the batched engine in this process with a drafter: lookup drafts (`--draft-lookup on`, any device) or
DSpark (on a GPU with the checkpoint's draft blocks, `--draft-dspark auto|on`).
"""

from __future__ import annotations

from ..errors import DSV41Error
from .backend import Query
from .prompts import WORKLOADS, user_ids


def _counters(figures: dict | None) -> dict:
    """The counters of the drafters in use ({name: {num_drafts, ...}})."""
    active = (figures or {}).get("drafters") or []
    return {name: dict(value) for name, value in (figures or {}).items() if name in active and isinstance(value, dict)}


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for name, fig in after.items():
        old = before.get(name, {})
        out[name] = {key: value - old.get(key, 0) for key, value in fig.items() if isinstance(value, int)}
    return out


def evaluate(backend, tokenizer, *, max_tokens: int = 384, depth: int = 5, workloads: dict | None = None) -> dict:
    figures = backend.drafting_figures()
    if figures is None:
        raise DSV41Error("drafting: needs the batched engine in this process (not --url, not --engine reference)")
    if not figures.get("drafters") or not figures.get("depth"):
        raise DSV41Error("drafting: the engine drafts with nothing: pass --draft-lookup on (any device) or run on a "
                         "GPU with the checkpoint's DSpark blocks (--draft-dspark auto), and --draft-depth > 0")
    results = {}
    for kind, text in (workloads or WORKLOADS).items():
        before = _counters(backend.drafting_figures())
        [answer] = backend.run([Query(user_ids(tokenizer, text), max_tokens=max_tokens, draft=depth)], kind)
        after = _counters(backend.drafting_figures())
        results[kind] = {"tokens": answer.completion_tokens, "tokens_per_round": answer.tokens_per_round,
                         "tok_s": round(answer.completion_tokens / answer.seconds, 3) if answer.seconds else None,
                         "finish_reason": answer.finish_reason, "drafters": _delta(after, before),
                         **({"error": answer.error} if answer.error else {})}
    return {"drafters": figures["drafters"], "depth": min(depth, figures["depth"]), "workloads": results}
