"""A rendered prompt as pieces: template text the encoder writes, and content that came from the request.

The encoder's output string is the pieces joined, byte for byte. The split only matters to the tokenizer
(`Tokenizer.encode_pieces`): control tokens are recognised in template text alone, so content that spells
`<｜Assistant｜>` or `</think>` stays plain text and cannot forge a turn.
"""

from __future__ import annotations


class Pieces(list):
    """`[(text, is_content), ...]`; empty strings are never stored."""

    def t(self, text: str) -> "Pieces":
        """Template text (control tokens allowed)."""
        if text:
            self.append((text, False))
        return self

    def c(self, text: str) -> "Pieces":
        """Content from the request (tokenized as plain text)."""
        if text:
            self.append((text, True))
        return self

    def add(self, other) -> "Pieces":
        self.extend(other)
        return self

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self)
