"""The model folder's tokenizer: encode/decode and the V4.1 special tokens, looked up by their text.

Special-token ids are never hard-coded: the release, the tiny model and the test fixtures number them
differently, so every id is read from `tokenizer.json` (and `tokenizer_config.json` where it names the
BOS/EOS/pad tokens). `encode` adds nothing: V4.1 prompts carry their own BOS in the text.

Text from a client must not become control tokens (a user message spelling `<｜Assistant｜>` would forge a
turn): `encode_pieces` takes a rendered prompt as template/content pieces (dsv41.chat.pieces) and recognises
added tokens in template text only; `encode_literal` takes all of its text as plain text. Both tokenize in
`encode_batch`, which releases the GIL, so a long prompt does not stall the server's event loop. Turning a long
result into Python ints does hold the GIL (`Encoding.ids`, and freeing the Encoding): the server hands texts of
`long_text_chars` or more to `long_text_encoder` (dsv41.server.tokenize_process, a child process) instead.
"""

from __future__ import annotations

import bisect
import codecs
import json
import re
import threading
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders

from dsv41.errors import TokenizerError

BOS_TEXT = "<｜begin▁of▁sentence｜>"
EOS_TEXT = "<｜end▁of▁sentence｜>"
PAD_TEXT = "<｜▁pad▁｜>"

# Short names for the V4.1 special tokens (MODEL.md §12.1, ENCODING.md). Their ids come from the tokenizer.
SPECIAL_TOKENS: dict[str, str] = {
    "bos": BOS_TEXT,
    "eos": EOS_TEXT,
    "pad": PAD_TEXT,
    "system": "<｜System｜>",
    "user": "<｜User｜>",
    "assistant": "<｜Assistant｜>",
    "eot": "<|EOT|>",
    "think": "<think>",
    "end_think": "</think>",
    "dsml": "｜DSML｜",
    "latest_reminder": "<｜latest_reminder｜>",
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
    "image": "<｜deepseek_image｜>",
}

# Every model folder must have these; the chat tokens are looked up on use (the oracle fixture lacks them).
REQUIRED_SPECIAL = ("bos", "eos", "pad")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the V4.1 special-token lookups."""

    def __init__(self, backend: BackendTokenizer, special_texts: dict[str, str] | None = None, source: str = "?"):
        self.backend = backend
        self.source = source
        texts = dict(SPECIAL_TOKENS)
        texts.update(special_texts or {})
        self._special_texts = texts
        # computed once: every streamed request builds an IncrementalDecoder from these
        self.added_tokens = backend.get_added_tokens_decoder()
        self.byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        contents = sorted({tok.content for tok in self.added_tokens.values() if tok.content}, key=len, reverse=True)
        # any added token's spelling (longest first, so a match is the leftmost-longest one, as the tokenizer's)
        self._control = re.compile("|".join(map(re.escape, contents))) if contents else None
        self._literal: BackendTokenizer | None = None
        self._literal_lock = threading.Lock()
        # set by the server (dsv41.server.tokenize_process.attach): f(text, content spans) -> ids, or None to
        # tokenize here after all; used for texts of at least long_text_chars characters
        self.long_text_encoder = None
        self.long_text_chars = 1 << 16
        for name in REQUIRED_SPECIAL:
            self.special(name)  # fails early, naming the missing token

    @classmethod
    def from_dir(cls, folder: str | Path) -> "Tokenizer":
        """Load `folder/tokenizer.json`; `tokenizer_config.json` (optional) may rename BOS/EOS/pad."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"tokenizer file not found: {path}")
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust error text is useful but not the whole story
            raise TokenizerError(f"cannot read {path}: {exc}") from None
        return cls(backend, _special_texts_from_config(folder / "tokenizer_config.json"), source=str(path))

    # --- text <-> ids -------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their ids, nothing is added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_pieces(self, pieces) -> list[int]:
        """Ids of a rendered prompt given as `(text, is_content)` pieces.

        The whole text is tokenized at once, so the ids equal `encode(text)` unless content spells an added
        token. Only then is each stretch between two template control tokens that holds such a spelling
        tokenized again as plain text: the template's control tokens stay, the content's become text."""
        text, content, at = [], [], 0
        for piece, is_content in pieces:
            if is_content:
                if content and content[-1][1] == at:
                    content[-1] = (content[-1][0], at + len(piece))
                else:
                    content.append((at, at + len(piece)))
            text.append(piece)
            at += len(piece)
        return self._encode_guarded("".join(text), content)

    def encode_literal(self, text: str) -> list[int]:
        """Ids of `text` with no control token: an added token's spelling is tokenized as plain text."""
        return self._encode_guarded(text, [(0, len(text))])

    def _encode_guarded(self, text: str, content: list[tuple[int, int]]) -> list[int]:
        if self.long_text_encoder is not None and len(text) >= self.long_text_chars:
            ids = self.long_text_encoder(text, content)
            if ids is not None:
                return ids
        return self.encode_guarded_here(text, content)

    def encode_guarded_here(self, text: str, content: list[tuple[int, int]]) -> list[int]:
        """Ids of `text` whose `content` spans (start, end) are plain text, in this process."""
        encoding = self.backend.encode_batch([text], add_special_tokens=False)[0]
        ids = encoding.ids
        if self._control is None or not any(_overlaps(content, m.start(), m.end())
                                             for m in self._control.finditer(text)):
            return ids
        # control tokens: the template's (kept, and where the text is split) and the content's (forged)
        marks = [(i, *encoding.token_to_chars(i)) for i, token in enumerate(ids) if token in self.added_tokens]
        kept = [(i, start, end) for i, start, end in marks if not _overlaps(content, start, end)]
        out, prev_index, prev_end = [], -1, 0
        for index, start, end in [*kept, (len(ids), len(text), len(text))]:
            stretch = ids[prev_index + 1:index]
            if any(t in self.added_tokens for t in stretch):  # a forged control token: the stretch is text
                stretch = self._literal_ids(text[prev_end:start])
            out += stretch
            if index < len(ids):
                out.append(ids[index])
            prev_index, prev_end = index, end
        return out

    def _literal_ids(self, text: str) -> list[int]:
        if not text:
            return []
        with self._literal_lock:
            if self._literal is None:
                config = json.loads(self.backend.to_str())
                config["added_tokens"] = []  # the model's vocabulary alone: no spelling is a control token
                self._literal = BackendTokenizer.from_str(json.dumps(config))
        return self._literal.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if len(ids) > 4096:  # decode holds the GIL throughout (~0.5 ms per 1K ids), decode_batch releases it
            return self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int) -> str:
        """Text of one token (U+FFFD where the token is only part of a UTF-8 character)."""
        return self.backend.decode([int(token_id)], skip_special_tokens=False)

    def token_to_id(self, text: str) -> int | None:
        return self.backend.token_to_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    # --- special tokens -----------------------------------------------------------------------------------------
    def special(self, name: str) -> int:
        """Id of a special token by short name (`"user"`, see SPECIAL_TOKENS) or by its text (`"<｜User｜>"`)."""
        text = self._special_texts.get(name, name)
        token_id = self.backend.token_to_id(text)
        if token_id is None:
            raise TokenizerError(f"{self.source} has no special token {text!r} ({name})")
        return token_id

    def has_special(self, name: str) -> bool:
        return self.backend.token_to_id(self._special_texts.get(name, name)) is not None

    @property
    def bos_id(self) -> int:
        return self.special("bos")

    @property
    def eos_id(self) -> int:
        return self.special("eos")

    @property
    def pad_id(self) -> int:
        # What the tokenizer calls pad. Engram uses the config's `engram_pad_token_id` instead (they may differ).
        return self.special("pad")

    def special_ids(self) -> set[int]:
        """Ids of all added tokens flagged special (what `skip_special_tokens` drops)."""
        return {i for i, tok in self.added_tokens.items() if tok.special}

    def incremental_decoder(self, skip_special_tokens: bool = False) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)


def _overlaps(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether [start, end) meets one of the sorted, disjoint `spans`."""
    i = bisect.bisect_right(spans, (start, float("inf"))) - 1
    for j in (i, i + 1):
        if 0 <= j < len(spans) and spans[j][0] < end and start < spans[j][1]:
            return True
    return False


def _special_texts_from_config(path: Path) -> dict[str, str]:
    """BOS/EOS/pad texts named by tokenizer_config.json (a string or an AddedToken dict), if any."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from None
    texts = {}
    for name in ("bos", "eos", "pad"):
        value = config.get(f"{name}_token")
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise TokenizerError(f"{path}: field {name}_token must be a string, got {value!r}")
        texts[name] = value
    return texts


@lru_cache(maxsize=1)
def byte_level_char_to_byte() -> dict[str, int]:
    """The byte-level BPE alphabet: each of the 256 bytes is shown as one printable character.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, soft hyphen) are shifted to
    U+0100 and up in byte order. Inverting it turns a token string back into its raw bytes.
    """
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[chr(byte)] = byte
        else:
            mapping[chr(256 + shifted)] = byte
            shifted += 1
    return mapping


class IncrementalDecoder:
    """Streaming detokenizer: feed token ids, get only text made of complete UTF-8 characters.

    A character split over several byte tokens is held back until its last byte arrives. For byte-level BPE
    (the V4.1 tokenizer) each token is turned into its raw bytes and run through Python's incremental UTF-8
    decoder; invalid bytes become U+FFFD exactly as a whole-sequence `decode` would show them. Other decoders
    fall back to re-decoding the pending ids and holding back text that ends in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._added = tokenizer.added_tokens
        self._byte_level = tokenizer.byte_level
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending: list[int] = []  # fallback path only
        self._char_to_byte = byte_level_char_to_byte()

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token of a byte-level tokenizer (added tokens: their UTF-8 text)."""
        added = self._added.get(token_id)
        if added is not None:
            return added.content.encode("utf-8")
        token = self.tokenizer.id_to_token(token_id)
        if token is None:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary of {self.tokenizer.source}")
        # A character outside the byte alphabet (not expected in a byte-level vocab) stands for itself.
        return b"".join(
            bytes([self._char_to_byte[c]]) if c in self._char_to_byte else c.encode("utf-8") for c in token
        )

    def feed(self, token_ids) -> str:
        """Text completed by these tokens (may be empty)."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        ids = [int(i) for i in token_ids]
        if self.skip_special_tokens:
            ids = [i for i in ids if not (i in self._added and self._added[i].special)]
        if self._byte_level:
            return self._utf8.decode(b"".join(self.token_bytes(i) for i in ids))
        self._pending.extend(ids)
        text = self.tokenizer.decode(self._pending, skip_special_tokens=self.skip_special_tokens)
        if text.endswith("\ufffd"):
            return ""
        self._pending.clear()
        return text

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character comes out as U+FFFD)."""
        if self._byte_level:
            return self._utf8.decode(b"", final=True)
        text = self.tokenizer.decode(self._pending, skip_special_tokens=self.skip_special_tokens)
        self._pending.clear()
        return text
