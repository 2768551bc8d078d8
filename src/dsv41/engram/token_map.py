"""The compressed token map (MODEL.md §9.1): tokenizer id -> compressed id, tokens that normalise alike sharing
one id. The Engram hash reads compressed ids, never tokenizer ids."""

from __future__ import annotations

import torch

# Private-use character that shields a token consisting of exactly one space from `Strip`.
_LONE_SPACE_SENTINEL = "\ue000"


def _engram_normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _LONE_SPACE_SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_LONE_SPACE_SENTINEL, " "),
    ])


def build_compressed_token_map(tokenizer) -> tuple[torch.Tensor, int]:
    """(int64 `[len(tokenizer)]` map token id -> compressed id, number of compressed ids).

    `tokenizer` is a `dsv41.tokenizer.Tokenizer` or a raw `tokenizers.Tokenizer`. Each id is decoded alone
    with special tokens kept; a partial-UTF-8 token (its text contains U+FFFD) is keyed by its raw token
    string, any other by its normalised text (or the text itself when that normalises to ""). Compressed ids
    are handed out in order of first appearance.
    """
    backend = getattr(tokenizer, "backend", tokenizer)
    normalizer = _engram_normalizer()
    size = backend.get_vocab_size(with_added_tokens=True)
    ids_by_key: dict[str, int] = {}
    table = torch.empty(size, dtype=torch.int64)
    for token_id in range(size):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        table[token_id] = ids_by_key.setdefault(key, len(ids_by_key))
    return table, len(ids_by_key)

