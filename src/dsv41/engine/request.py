"""One request inside the batched engine: its tokens, how far the cache has absorbed them, where it lives.

`tokens` is the prompt followed by every output token decided so far (sampled, or forced by a grammar); the
cache holds the first `num_computed` of them. The next step absorbs `tokens[num_computed:]` (a prefill chunk, or
the last sampled token plus any forced text) and, when that reaches the end, samples the next token.

A `SequenceGroup` is several sequences over one prompt (n > 1, best_of), each with its own seed: the first live
one (the leader) prefills the prompt but its last token (`hold_at`), then the others fork from it (they start at
that position with a copy of its ring slot and of the page the prompt leaves partial; the full pages are one set,
ref-counted) and each absorbs the last prompt token and samples on its own (docs/ENGINE.md §3).
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from .params import SamplingParams, derive_seed

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    limit: int  # most output tokens (max_tokens capped by the context)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    constraint: Any = None  # grammar: .mask() -> bytes | None, .accept(token) -> ended, .forced(budget) -> ids
    background: bool = False
    emit: Callable[[Any], None] = lambda event: None  # TokenEvent / PromptLogprobsEvent / FinishEvent / error
    seq_id: int = field(default_factory=lambda: next(_ids))
    arrival: float = 0.0
    # ---- engine state
    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    produced: int = 0  # output tokens decided (sampled + forced)
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    replay_start: int = 0
    unreported: deque = field(default_factory=deque)  # forced ids decided, emitted once their step has run
    prompt_scores: list = field(default_factory=list)
    group: "SequenceGroup | None" = None
    hold_at: int | None = None  # a group's leader: prefill up to here, then its siblings fork
    awaiting_fork: bool = False  # a sibling admitted with its group, waiting for the leader's prefill
    forked: bool = False  # a sibling that forked: its prompt was prefilled (and counted) by the leader
    draft: int | None = None  # the request's drafting: None = the engine's default, 0 = off, k = at most k a round
    proposal: list[int] = field(default_factory=list)  # DSpark's drafts for the next round (and their confidences)
    confidence: list[float] = field(default_factory=list)
    lookup_drafted: int = 0  # this sequence's lookup drafts verified and accepted (its lookup confidence)
    lookup_accepted: int = 0
    cached: int = 0  # prompt tokens resumed from a session entry instead of prefilled
    loading: bool = False  # a parked session entry is being loaded into its slot and pages (no rows meanwhile)
    mark_at: int | None = None  # where the prompt's session entry is taken (engine/sessions.py prompt_mark)
    # set from the server's event loop the moment the client leaves (the abort command follows, between steps):
    # a forward whose every row is such a sequence stops between layers (runtime/abort.py)
    cancel_requested: bool = False
    decode_rounds: int = 0  # rounds that emitted sampled tokens, and those tokens (tokens per round)
    round_tokens: int = 0

    def __post_init__(self):
        self.tokens = list(self.prompt)
        self.seed = self.sampling.seed if self.sampling.seed is not None else derive_seed(self.prompt)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prompt_len

    @property
    def pending(self) -> int:
        """Tokens decided but not yet in the cache."""
        return len(self.tokens) - self.num_computed

    @property
    def reserve_tokens(self) -> int:
        """Positions the page table must cover: every absorbed token (the last sampled one never is)."""
        return self.prompt_len + self.limit


@dataclass(eq=False)
class SequenceGroup:
    """Siblings over one prompt, admitted together; `fork_at` positions of the prompt are prefilled once."""

    members: list[Sequence]

    def __post_init__(self):
        for m in self.members:
            m.group = self

    @property
    def fork_at(self) -> int:
        return self.members[0].prompt_len - 1

    def shared_pages(self, page_tokens: int) -> int:
        """The prompt's pages full at the fork: one set for the whole group."""
        return self.fork_at // page_tokens

    def awaiting(self) -> list[Sequence]:
        """Admitted siblings still waiting for the leader's prefill."""
        return [m for m in self.members if m.awaiting_fork and m.status is Status.RUNNING]
