"""A request's grammar (xgrammar) as both engines use it: the allowed-token mask, forced text, acceptance.

`SerialEngine` masks a logits row with `mask_row`; the batched engine ships `mask()` (xgrammar's int32 bitmask as
bytes) inside the step's `Row`, and the runner applies it before sampling. xgrammar (and so torch) is imported
here only: the policy modules call these methods without knowing what is behind them.
"""

from __future__ import annotations

from typing import Callable

from .interface import EngineFailure, EngineRejected


class GrammarConstraint:
    """Per-request xgrammar matcher: masks disallowed ids, finds forced text, follows the accepted tokens."""

    def __init__(self, compiled, vocab_size: int, encode: Callable[[str], list[int]] | None = None):
        import xgrammar as xgr

        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.encode = encode
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self) -> bytes | None:
        """The allowed ids at this point as bitmask bytes, or None when every id is allowed."""
        if not self.matcher.fill_next_token_bitmask(self.bitmask, 0):
            return None
        return self.bitmask[0].numpy().tobytes()

    def mask_row(self, row):
        """`row` with the disallowed ids at -inf (a float32 CPU copy; the bitmask lives on the CPU)."""
        if not self.matcher.fill_next_token_bitmask(self.bitmask, 0):
            return row
        masked = row.to("cpu").float().clone().unsqueeze(0)
        self._xgr.apply_token_bitmask_inplace(masked, self.bitmask, vocab_size=self.vocab_size)
        if not bool(masked.isfinite().any()):
            raise EngineRejected("the grammar allows no token at this point", code="grammar_dead_end")
        return masked[0]

    def forced_tokens(self, encode: Callable[[str], list[int]], budget: int) -> list[int]:
        """Token ids of the text the grammar forces next (accepted into the matcher), or [] to sample."""
        text = self.matcher.find_jump_forward_string()
        if not text or budget <= 0:
            return []
        ids = encode(text)[:budget]
        for accepted, token in enumerate(ids):
            if not self.matcher.accept_token(token):
                # the tokenizer split the forced text in a way the grammar does not follow: sample instead
                if accepted:
                    self.matcher.rollback(accepted)
                return []
        return ids

    def forced(self, budget: int) -> list[int]:
        return self.forced_tokens(self.encode, budget) if self.encode is not None else []

    def accept(self, token: int) -> bool:
        """Advance; True once the grammar has ended (its stop token accepted)."""
        if not self.matcher.accept_token(token):
            raise EngineFailure(f"grammar rejected token {token} that its own mask allowed")
        return self.matcher.is_terminated()
