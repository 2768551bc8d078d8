"""Control tokens in xgrammar's view of the vocabulary: never generated as text, markup only where a grammar asks.

xgrammar matches a token by its decoded text, so a control token whose text is printable (`<｜User｜>`, a
place-holder, `｜DSML｜`) would be allowed wherever its characters are, e.g. inside a JSON string. The
vocabulary handed to xgrammar (`grammar_vocab`) therefore gives every added token of tokenizer.json:

- the stop tokens (EOS): their own text; xgrammar allows a stop token only where the grammar may end;
- the markup tokens the grammars write (`<think>`, `</think>`, `｜DSML｜`): a byte string no text can contain
  (NUL, then the invalid UTF-8 byte 0xFF, then the marker's index), so JSON, regexes, choices and raw text never
  match them; a grammar asks for one by id (`literal`: xgrammar's TokenFormat, matched by id only);
- every other added token (BOS, pad, the turn and task tokens, the image token, the place-holders): the empty
  string, which xgrammar treats as a special token and never allows.

Free-text regions (reasoning, raw DSML string values) exclude `NO_TEXT` (NUL), which keeps the markup tokens out
of them too (xgrammar's any-text would otherwise take any bytes).
"""

from __future__ import annotations

from dsv41.chat.tokens import DSML, THINK_END, THINK_START

MARKUP = (THINK_START, THINK_END, DSML)
NO_TEXT = "\x00"  # excluded from every free-text region: a markup token's xgrammar text starts with it


def grammar_vocab(tokenizer_json_path, vocab_size: int, stop_token_ids) -> tuple[list[bytes], dict[str, int]]:
    """(the vocabulary as xgrammar decodes it, bytes for a RAW TokenizerInfo; the markup tokens' ids)."""
    import json
    from pathlib import Path

    import xgrammar as xgr
    from tokenizers import Tokenizer as HFTokenizer

    path = Path(tokenizer_json_path)
    backend = HFTokenizer.from_file(str(path))
    vocab = backend.get_vocab(with_added_tokens=True)
    width = max(vocab_size, max(vocab.values()) + 1)
    encoded = [""] * width  # ids missing from tokenizer.json (padding rows) become never-allowed tokens
    for text, idx in vocab.items():
        encoded[idx] = text
    kind = vocab_type(json.loads(path.read_text(encoding="utf-8")))
    # xgrammar's own decoding of the stored strings (byte-level alphabet, byte fallback) into bytes
    decoded = list(xgr.TokenizerInfo(encoded, kind, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids),
                                     add_prefix_space=False).decoded_vocab)
    markup: dict[str, int] = {}
    for idx, token in backend.get_added_tokens_decoder().items():
        if idx in stop_token_ids or idx >= len(decoded):
            continue
        if token.content in MARKUP:
            markup[token.content] = idx
            decoded[idx] = NO_TEXT.encode() + b"\xff" + bytes([MARKUP.index(token.content) + 1])
        else:
            decoded[idx] = b""
    return decoded, markup


def literal(fmt, text: str, markup: dict[str, int]):
    """`text` as a format: its markup spellings as those tokens (by id), the rest as constant strings."""
    parts: list = []
    rest = text
    while rest:
        hits = [(rest.find(m), m) for m in markup if m in rest]
        if not hits:
            parts.append(fmt.ConstStringFormat(value=rest))
            break
        at, marker = min(hits)
        if at:
            parts.append(fmt.ConstStringFormat(value=rest[:at]))
        parts.append(fmt.TokenFormat(token=markup[marker]))
        rest = rest[at + len(marker):]
    if not parts:
        return fmt.ConstStringFormat(value="")
    return parts[0] if len(parts) == 1 else fmt.SequenceFormat(elements=parts)


def reasoning_then(fmt, body, markup: dict[str, int]):
    """Free reasoning (no think markers, no control token), then `</think>` (the token), then `body`."""
    end = fmt.TokenFormat(token=markup[THINK_END]) if THINK_END in markup else THINK_END
    reasoning = fmt.TagFormat(begin="", content=fmt.AnyTextFormat(excludes=[THINK_START, THINK_END, NO_TEXT]),
                              end=end)
    return fmt.SequenceFormat(elements=[reasoning, body])


def vocab_type(tokenizer_json: dict):
    """xgrammar's VocabType for a tokenizer.json, read from its decoder."""
    import xgrammar as xgr

    def kinds(node) -> list[str]:
        if not isinstance(node, dict):
            return []
        found = [node.get("type", "")]
        for child in node.get("decoders", []) or node.get("pretokenizers", []) or []:
            found += kinds(child)
        return found

    decoder_kinds = kinds(tokenizer_json.get("decoder"))
    if "ByteLevel" in decoder_kinds:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in decoder_kinds or tokenizer_json.get("model", {}).get("byte_fallback"):
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW
