"""A request's constraint as both engines use it: the allowed-token mask, forced text, acceptance.

The constraint is an xgrammar grammar, a reasoning budget (`ReasoningBudget`: at most N reasoning tokens, then
the end-of-thinking token forced; Anthropic's `thinking.budget_tokens`), or both. `SerialEngine` masks a logits
row with `mask_row`; the batched engine ships `mask()` (xgrammar's int32 bitmask as bytes) inside the step's
`Row`, and the runner applies it before sampling. Everything here follows the request's own tokens only, so a
request is constrained identically batched or alone. xgrammar (and so torch) is imported here only: the policy
modules call these methods without knowing what is behind them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .interface import EngineFailure, EngineRejected


@dataclass(frozen=True)
class ReasoningBudget:
    """A request's `grammar` when its reasoning is bounded: the reply starts in reasoning; once `tokens` of it
    are written and the reasoning is still open, `end_id` (`</think>`) is the only token allowed (and forced).
    `grammar`: the compiled grammar of the whole reply (reasoning included), or None."""

    tokens: int
    end_id: int
    grammar: Any = None


class GrammarConstraint:
    """Per-request constraint: masks disallowed ids, finds forced text, follows the accepted tokens."""

    def __init__(self, compiled, vocab_size: int, encode: Callable[[str], list[int]] | None = None):
        self.budget = compiled if isinstance(compiled, ReasoningBudget) else None
        if self.budget is not None:
            compiled = self.budget.grammar
        self.reasoning = self.budget is not None  # inside the budgeted reasoning (until its end token)
        self.thought = 0  # reasoning tokens accepted so far
        self.vocab_size = vocab_size
        self.encode = encode
        self.matcher = None
        if compiled is not None:
            import xgrammar as xgr

            self._xgr = xgr
            self.matcher = xgr.GrammarMatcher(compiled)
            self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    # ------------------------------------------------------------------ the reasoning budget
    def _must_end(self) -> bool:
        """The budget is spent and the end token can come now (a grammar may need a character finished first)."""
        if not self.reasoning or self.thought < self.budget.tokens:
            return False
        if self.matcher is None:
            return True
        end = self.budget.end_id
        if not self.matcher.fill_next_token_bitmask(self.bitmask, 0):
            return True
        word = int(self.bitmask[0, end // 32])
        return bool((word >> (end % 32)) & 1)

    def _only_end(self) -> bytes:
        import numpy as np

        words = np.zeros((self.vocab_size + 31) // 32, dtype=np.uint32)
        end = self.budget.end_id
        words[end // 32] = np.uint32(1) << np.uint32(end % 32)
        return words.view(np.int32).tobytes()

    def _follow(self, token: int) -> None:
        if self.reasoning:
            if token == self.budget.end_id:
                self.reasoning = False
            else:
                self.thought += 1

    # ------------------------------------------------------------------ what the engines call
    def mask(self) -> bytes | None:
        """The allowed ids at this point as bitmask bytes, or None when every id is allowed."""
        if self._must_end():
            return self._only_end()
        if self.matcher is None or not self.matcher.fill_next_token_bitmask(self.bitmask, 0):
            return None
        return self.bitmask[0].numpy().tobytes()

    def mask_row(self, row):
        """`row` with the disallowed ids at -inf (a float32 CPU copy; the bitmask lives on the CPU)."""
        if self._must_end():
            masked = row.to("cpu").float().clone()
            end = self.budget.end_id
            kept = masked[end].clone()
            masked.fill_(float("-inf"))
            masked[end] = kept
            return masked
        if self.matcher is None or not self.matcher.fill_next_token_bitmask(self.bitmask, 0):
            return row
        masked = row.to("cpu").float().clone().unsqueeze(0)
        self._xgr.apply_token_bitmask_inplace(masked, self.bitmask, vocab_size=self.vocab_size)
        if not bool(masked.isfinite().any()):
            raise EngineRejected("the grammar allows no token at this point", code="grammar_dead_end")
        return masked[0]

    def forced_tokens(self, encode: Callable[[str], list[int]] | None, budget: int) -> list[int]:
        """Token ids forced next (accepted into the constraint), or [] to sample: the end of a reasoning whose
        budget is spent, or the text the grammar allows in one way only."""
        if budget <= 0:
            return []
        if self._must_end():
            end = self.budget.end_id
            if self.matcher is not None and not self.matcher.accept_token(end):
                return []
            self._follow(end)
            return [end]
        if self.matcher is None or encode is None:
            return []
        text = self.matcher.find_jump_forward_string()
        if not text:
            return []
        ids = encode(text)[:budget]
        if self.reasoning:  # forced text inside the budgeted reasoning: never past the budget
            ids = ids[:max(0, self.budget.tokens - self.thought)]
        for accepted, token in enumerate(ids):
            if not self.matcher.accept_token(token):
                # the tokenizer split the forced text in a way the grammar does not follow: sample instead
                if accepted:
                    self.matcher.rollback(accepted)
                return []
        for token in ids:
            self._follow(token)
        return ids

    def forced(self, budget: int) -> list[int]:
        return self.forced_tokens(self.encode, budget)

    def speculate(self, tokens: list[int]) -> list[bytes | None]:
        """Drafting (engine/drafting.py): the masks after each prefix of `tokens` at which the next token is
        sampled as usual — it stops before a token the grammar rejects, and at a state that ends the grammar,
        forces text or ends the reasoning budget (a serial run would not sample there). The constraint is left
        as it was (the matcher rolled back)."""
        masks: list[bytes | None] = []
        saved, accepted = (self.reasoning, self.thought), 0
        try:
            for token in tokens:
                if self.matcher is not None and not self.matcher.accept_token(token):
                    break
                accepted += 1
                self._follow(token)
                if self._must_end() or (self.matcher is not None and (
                        self.matcher.is_terminated() or self.matcher.find_jump_forward_string())):
                    break
                masks.append(self.mask())
        finally:
            if self.matcher is not None and accepted:
                self.matcher.rollback(accepted)
            self.reasoning, self.thought = saved
        return masks

    def accept(self, token: int) -> bool:
        """Advance; True once the grammar has ended (its stop token accepted)."""
        if self.matcher is not None and not self.matcher.accept_token(token):
            raise EngineFailure(f"grammar rejected token {token} that its own mask allowed")
        self._follow(token)
        return self.matcher is not None and self.matcher.is_terminated()
