"""The one detokenisation rule of every reply (chat, completions, messages, responses): token ids -> the text a
client sees.

- Special tokens (tokenizer.json's added tokens flagged `special`: BOS, `<｜▁pad▁｜>`, the turn and task tokens,
  the place-holders, ...) are never in a text field unless the request says `skip_special_tokens: false`.
- Stop tokens: EOS is never text. A parsed reply (chat, messages, responses) hands it to the parser, which ends
  the reply there; raw text (completions) drops it. Other `stop_token_ids` are hidden unless
  `include_stop_str_in_output`. With `ignore_eos` the stop tokens are ordinary tokens.
- The markup tokens `<think>`, `</think>`, `｜DSML｜` (not flagged special) reach the parser, which turns them into
  reasoning / content / tool-call boundaries and drops a stray `<think>` / `</think>`
  (`dsv41.chat.StreamParser`): `</think>` is never content. Completions show them, as raw text.
- Text comes out in complete UTF-8 characters only (`IncrementalDecoder`).
"""

from __future__ import annotations


def hidden_ids(tokenizer, *, parsed: bool, skip_special_tokens: bool = True, stop_token_ids=frozenset(),
               include_stop_str_in_output: bool = False, ignore_eos: bool = False) -> frozenset[int]:
    """The ids whose text a reply never shows (the rule above). `parsed`: the text goes through the chat parser."""
    eos = tokenizer.eos_id
    hidden: set[int] = set()
    if not ignore_eos:
        if not include_stop_str_in_output:
            hidden |= set(stop_token_ids) - {eos}
        if not parsed:
            hidden.add(eos)
    if skip_special_tokens:
        hidden |= tokenizer.special_ids() - ({eos} if parsed else set())
    return frozenset(hidden)


class TokenText:
    """Token ids -> text for one reply: complete characters only, `hidden` ids not shown."""

    def __init__(self, tokenizer, hidden: frozenset[int]):
        self.tokenizer = tokenizer
        self.decoder = tokenizer.incremental_decoder(skip_special_tokens=False)
        self.hidden = hidden

    def feed(self, token_id: int) -> str:
        return "" if token_id in self.hidden else self.decoder.feed(token_id)

    def flush(self) -> str:
        return self.decoder.flush()

    def token_string(self, token_id: int) -> str:
        return self.tokenizer.decode_token(token_id)

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self.decoder.token_bytes(token_id))


def reply_text(tokenizer, *, parsed: bool, skip_special_tokens: bool = True, stop_token_ids=frozenset(),
               include_stop_str_in_output: bool = False, ignore_eos: bool = False) -> TokenText:
    """The TokenText of one reply under the rule above (the arguments are the request's fields of those names)."""
    return TokenText(tokenizer, hidden_ids(
        tokenizer, parsed=parsed, skip_special_tokens=skip_special_tokens, stop_token_ids=stop_token_ids,
        include_stop_str_in_output=include_stop_str_in_output, ignore_eos=ignore_eos))
