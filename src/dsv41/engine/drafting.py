"""Drafting policy, torch-free (docs/ENGINE.md §6 "Drafting"; RECIPE.md §2.6-2.7): which drafts a round verifies.

Two drafters propose continuations of a decoding sequence; the engine runs `[y, d1..dk]` as one verify row and
keeps the drafts up to the first whose target choice differs (runtime/model_runner.py), so a reply never depends
on them: they change only how many tokens a round emits.
- **DSpark** (the checkpoint's draft blocks, runtime/draft_dspark.py): up to `block` drafts with a confidence each
  (the conditional probability that the draft is accepted given the ones before it), proposed at the end of the
  step that chose y.
- **Lookup** (`lookup_draft`): the continuation of the latest earlier occurrence of the sequence's last n tokens
  in its own prompt + output (n from `max_ngram` down to `min_ngram`), like vLLM's n-gram / prompt-lookup
  decoding; its confidence is the sequence's own lookup acceptance so far.

Depth from cost (`choose_depth`): a round of k drafts emits E(k) = 1 + Σ_{i≤k} Π_{j≤i} c_j tokens on average and
costs the step time at the step's rows + k (`CostTable`, measured at start); the engine keeps the k in 0..cap
that gives the most tokens per second, so a stream that drafts poorly does not pay for a long window.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

DRAFTERS = ("dspark", "lookup")


@dataclass
class CostTable:
    """Seconds of a step by its row count: measured points, linear between them, flat past the ends."""

    points: list[tuple[int, float]] = field(default_factory=list)

    def __call__(self, rows: int) -> float:
        pts = self.points
        if not pts:
            return 1.0  # not measured: every row count costs the same (depth = the cap)
        xs = [p[0] for p in pts]
        i = bisect.bisect_left(xs, rows)
        if i == 0:
            return pts[0][1]
        if i == len(pts):
            return pts[-1][1]
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)

    @classmethod
    def parse(cls, text: str) -> "CostTable":
        """"rows:seconds,rows:seconds,..." (the `DSV41_DRAFT_COST` form)."""
        points = []
        for part in text.split(","):
            rows, _, seconds = part.partition(":")
            points.append((int(rows), float(seconds)))
        if not points or any(r < 1 or s <= 0 for r, s in points):
            raise ValueError(f"a step cost table is rows:seconds pairs with rows >= 1, seconds > 0: {text!r}")
        return cls(sorted(points))

    def describe(self) -> str:
        return ", ".join(f"{r} rows {s * 1e3:.1f} ms" for r, s in self.points) or "not measured"


@dataclass
class DraftConfig:
    dspark: bool = False  # the DSpark drafter is loaded and drafts by default
    lookup: bool = False  # lookup drafts (off by default: a knob)
    depth: int = 5  # most drafts a round (DSV41_DRAFT_DEPTH)
    default_on: bool = True  # requests that say nothing draft (DSV41_DRAFT=0: only those that ask)
    block: int = 5  # DSpark's block (its most drafts)
    cost: CostTable = field(default_factory=CostTable)
    min_ngram: int = 2
    max_ngram: int = 4

    @property
    def active(self) -> bool:
        return (self.dspark or self.lookup) and self.depth > 0


@dataclass
class DrafterStats:
    """vLLM's spec-decode counters for one drafter."""

    drafts: int = 0  # rounds that verified drafts of this drafter
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def count(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        while len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.append(0)
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def figures(self) -> dict:
        return {"num_drafts": self.drafts, "num_draft_tokens": self.draft_tokens,
                "num_accepted_tokens": self.accepted_tokens, "num_accepted_tokens_per_pos": list(self.accepted_per_pos)}


LOOKUP_SPAN = 16384  # lookup searches the last this many ids (a step's host time stays bounded at long contexts)


def lookup_draft(tokens: list[int], n: int, min_ngram: int = 2, max_ngram: int = 4,
                 span: int = LOOKUP_SPAN) -> list[int]:
    """Up to `n` ids that followed the latest earlier occurrence of the sequence's last m ids (m from `max_ngram`
    down to `min_ngram`, the longest match first) within its last `span` ids; [] when none occurs."""
    L = len(tokens)
    if n <= 0:
        return []
    for m in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = tokens[L - m:]
        first = suffix[0]
        for j in range(L - m - 1, max(-1, L - span - 1), -1):  # the latest occurrence before the suffix itself
            if tokens[j] == first and tokens[j:j + m] == suffix:
                return tokens[j + m:j + m + n]
    return []


def expected_tokens(conf: list[float], k: int) -> float:
    """Tokens a round of the first k drafts emits on average: 1 + Σ_{i<k} Π_{j≤i} conf[j]."""
    total, survive = 1.0, 1.0
    for c in conf[:k]:
        survive *= min(max(c, 0.0), 1.0)
        total += survive
    return total


def choose_depth(conf: list[float], cap: int, cost: CostTable, base_rows: int) -> tuple[int, float]:
    """(k, tokens per second) maximising E(k) / cost(base_rows + 1 + k) over k in 0..min(cap, len(conf)) (ties to
    the shorter window)."""
    best_k, best = 0, expected_tokens(conf, 0) / cost(base_rows + 1)
    for k in range(1, min(cap, len(conf)) + 1):
        rate = expected_tokens(conf, k) / cost(base_rows + 1 + k)
        if rate > best * (1 + 1e-9):
            best_k, best = k, rate
    return best_k, best


def measure_step_costs(execute, *, slots: int, pages: int, max_rows: int, window: int, knobs_tag: str = "",
                       clock=None) -> list[tuple[int, float]]:
    """The step time by row count (the `CostTable` the depth policy weighs), measured before serving: scratch
    verify windows of at most `window` rows on slots and pages nobody holds yet (their rows are overwritten by the
    first requests before anything reads them; nothing is sampled). Best of two runs a count, after a warm-up."""
    import time

    from .batch import VERIFY, Batch, Row

    clock = clock or time.perf_counter
    max_rows = max(1, min(max_rows, slots * window))
    counts = sorted({c for c in (1, 2, 4, 8, 16, 32, 64) if c <= max_rows} | {max_rows})

    def batch(n: int) -> Batch:
        rows, i = [], 0
        while n > 0:
            take = min(n, window)
            rows.append(Row(-1 - i, i, [0] * take, 0, [i % pages], VERIFY))
            n, i = n - take, i + 1
        return Batch(-1, rows, knobs_tag=knobs_tag)

    execute(batch(counts[-1]))
    points = []
    for n in counts:
        best = float("inf")
        for _ in range(2):
            t0 = clock()
            execute(batch(n))
            best = min(best, clock() - t0)
        points.append((n, max(best, 1e-6)))
    return points
