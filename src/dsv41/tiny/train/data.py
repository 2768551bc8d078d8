"""Token streams and batches: the corpus tokenized with the model's tokenizer, then sampled by (seed, step).

Each document becomes one run of ids: a chat is its encoder rendering (template control tokens kept, content
tokenized as plain text, `Tokenizer.encode_pieces` as the server does), a file or docstring `BOS + text + EOS`
with its text tokenized literally. A source's documents are concatenated into one stream.

A batch is a pure function of (seed, step): resuming at step k draws the batches a run that never stopped would
have drawn. A sample of T+1 ids starts at a document start (half the samples) or anywhere in its source's stream,
and runs on across document ends (wrapping at the stream's end). Its Engram row ids are hashed from its own ids as
one sequence from position 0, as inference hashes a prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .corpus import SPLITS, Corpus

SOURCE_WEIGHTS = {"chat": 0.45, "code": 0.35, "docs": 0.12, "facts": 0.08}


@dataclass
class Stream:
    ids: np.ndarray  # uint16 [n]
    starts: np.ndarray  # int64 document starts
    answers: np.ndarray | None = None  # chats: tokens of each one's final answer + EOS at its end (-1: unknown)

    def __len__(self) -> int:
        return int(self.ids.size)


def tokenize_corpus(corpus: Corpus, tok) -> dict[str, dict[str, Stream]]:
    """{split: {source: Stream}}; a split without documents of a source has no entry for it."""
    bos, eos = tok.bos_id, tok.eos_id
    out: dict[str, dict[str, Stream]] = {}
    for split in SPLITS:
        docs = {
            "code": [[bos, *tok.encode_literal(t), eos] for t in corpus.code[split]],
            "docs": [[bos, *tok.encode_literal(t), eos] for t in corpus.docs[split]],
            "facts": [[bos, *tok.encode_literal(t), eos] for t in corpus.facts[split]],
            "chat": [tok.encode_pieces(c.pieces()) for c in corpus.chats[split]],
        }
        out[split] = {src: _stream(d) for src, d in docs.items() if d}
        if "chat" in out[split]:
            out[split]["chat"].answers = np.array([_answer_tokens(tok, c.answer, d) for c, d in
                                                   zip(corpus.chats[split], docs["chat"])], dtype=np.int64)
    return out


def _answer_tokens(tok, answer: str, doc: list[int]) -> int:
    """How many tokens at the end of a chat's ids are its final answer and EOS (-1 if they are not exactly the
    answer's own tokens: then it is left out of the answer evaluation)."""
    tail = [*tok.encode_literal(answer), tok.eos_id]
    return len(tail) if doc[-len(tail):] == tail else -1


def _stream(docs: list[list[int]]) -> Stream:
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    ids = np.fromiter((i for d in docs for i in d), dtype=np.uint16, count=int(lengths.sum()))
    return Stream(ids, starts)


def save_streams(streams: dict[str, dict[str, Stream]], folder: str | Path, summary: dict) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split, by_source in streams.items():
        for src, s in by_source.items():
            arrays[f"{split}.{src}.ids"] = s.ids
            arrays[f"{split}.{src}.starts"] = s.starts
            if s.answers is not None:
                arrays[f"{split}.{src}.answers"] = s.answers
    np.savez_compressed(folder / "tokens.npz", **arrays)
    counts = {f"{split}.{src}": len(s) for split, by in streams.items() for src, s in by.items()}
    (folder / "corpus.json").write_text(json.dumps({**summary, "tokens": counts}, indent=2) + "\n")


def load_streams(folder: str | Path) -> dict[str, dict[str, Stream]]:
    out: dict[str, dict[str, Stream]] = {}
    with np.load(Path(folder) / "tokens.npz") as z:
        for key in z.files:
            split, src, what = key.split(".")
            if what == "ids":
                answers = z[f"{split}.{src}.answers"] if f"{split}.{src}.answers" in z.files else None
                out.setdefault(split, {})[src] = Stream(z[key], z[f"{split}.{src}.starts"], answers)
    return out


@dataclass
class Batch:
    ids: torch.Tensor  # int64 [B, T+1]
    engram: torch.Tensor | None  # int64 [B, T, n_layers, n_cols] row ids of ids[:, :T]
    sources: list[str]

    @property
    def inputs(self) -> torch.Tensor:
        return self.ids[:, :-1]

    @property
    def targets(self) -> torch.Tensor:
        return self.ids[:, 1:]

    def to(self, device) -> "Batch":
        return Batch(self.ids.to(device, non_blocking=True),
                     None if self.engram is None else self.engram.to(device, non_blocking=True), self.sources)


def sample(stream: Stream, rng: np.random.Generator, length: int) -> np.ndarray:
    start = int(rng.choice(stream.starts)) if rng.random() < 0.5 else int(rng.integers(len(stream)))
    idx = (start + np.arange(length)) % len(stream)
    return stream.ids[idx].astype(np.int64)


def make_batch(streams: dict[str, Stream], hasher, seed: int, step: int, batch: int, seq_len: int,
               weights: dict[str, float] | None = None) -> Batch:
    """The training batch of `step`: `batch` samples of seq_len+1 ids, sources drawn by `weights`."""
    weights = {k: v for k, v in (weights or SOURCE_WEIGHTS).items() if k in streams}
    names = sorted(weights)
    p = np.array([weights[n] for n in names], dtype=np.float64)
    rng = np.random.default_rng([seed, step])
    sources = [names[i] for i in rng.choice(len(names), size=batch, p=p / p.sum())]
    rows = np.stack([sample(streams[s], rng, seq_len + 1) for s in sources])
    return Batch(torch.from_numpy(rows), engram_rows(hasher, rows[:, :-1]), sources)


def engram_rows(hasher, rows: np.ndarray) -> torch.Tensor | None:
    if hasher is None:
        return None
    B, T = rows.shape
    flat = hasher.hash_many([(torch.from_numpy(r), None) for r in rows])
    return flat.view(B, T, *flat.shape[1:])


def eval_batches(streams: dict[str, Stream], hasher, seq_len: int, per_source: int, batch: int = 8
                 ) -> dict[str, list[Batch]]:
    """Fixed held-out batches per source: the first `per_source` documents' starts (seed-free)."""
    out = {}
    for src, stream in sorted(streams.items()):
        if len(stream) <= seq_len:
            continue  # too little held-out text of this source for one sequence
        starts = stream.starts[:per_source]
        rows = np.stack([stream.ids[(int(s) + np.arange(seq_len + 1)) % len(stream)].astype(np.int64)
                         for s in starts])
        out[src] = [Batch(torch.from_numpy(rows[i:i + batch]), engram_rows(hasher, rows[i:i + batch, :-1]),
                          [src] * len(rows[i:i + batch])) for i in range(0, len(rows), batch)]
    return out


def answer_batches(stream: Stream, hasher, seq_len: int, n_docs: int, batch: int = 8):
    """The first `n_docs` chats that fit in seq_len+1 ids with a known answer: (batches, spans) where span i is
    (row, first answer position, end) inside batch i // batch's ids (the rest of a row is the following text)."""
    ends = np.append(stream.starts[1:], len(stream))
    picked = [(int(s), int(e), int(a)) for s, e, a in zip(stream.starts, ends, stream.answers)
              if a > 0 and e - s <= seq_len + 1][:n_docs]
    rows = np.stack([stream.ids[(s + np.arange(seq_len + 1)) % len(stream)].astype(np.int64) for s, _, _ in picked]) \
        if picked else np.zeros((0, seq_len + 1), dtype=np.int64)
    batches = [Batch(torch.from_numpy(rows[i:i + batch]), engram_rows(hasher, rows[i:i + batch, :-1]), ["chat"])
               for i in range(0, len(rows), batch)]
    spans = [(e - s - a, e - s) for s, e, a in picked]
    return batches, spans
