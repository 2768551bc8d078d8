"""Engram compressed token map (dsv41.engram.token_map, MODEL.md §9.1): against the oracle fixture and the
normaliser chain restated by hand."""

import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models

from dsv41.engram.token_map import build_compressed_token_map
from dsv41.tokenizer import Tokenizer
from engram_harness import ORACLE, cfg, fixture_hashes  # noqa: F401 (pytest fixtures)


def test_fixture_token_map(fixture_hashes, cfg):
    token_map, size = build_compressed_token_map(Tokenizer.from_dir(ORACLE))
    assert size == cfg.engram_compressed_vocab_size == 271
    assert torch.equal(token_map, fixture_hashes["token_map"])


def test_compressed_map_normaliser_rules():
    # byte-level spellings: Ġ = space, Ċ = newline, ĉ = tab, Ã© = "é" (two bytes), a lone Ã = a partial byte
    vocab = ["<s>", "ĠThe", "the", "THE", "Ġ", "ĠĠ", "Ċ", "ĉĠ", "cafÃ©", "cafe", "ĠCAFE", "Ã", "©", "Ã©", "e",
             "Ġx", "x"]
    raw = RawTokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[]))
    raw.decoder = decoders.ByteLevel()
    token_map, size = build_compressed_token_map(raw)
    expected_groups = [
        ["<s>"], ["ĠThe", "the", "THE"],  # case and leading space fold
        ["Ġ", "ĠĠ", "Ċ", "ĉĠ"],  # any whitespace run is the one-space key, kept by the sentinel
        ["cafÃ©", "cafe", "ĠCAFE"],  # accents stripped
        ["Ã"], ["©"],  # partial UTF-8: keyed by the raw token string, so they stay apart
        ["Ã©", "e"], ["Ġx", "x"],
    ]
    assert size == len(expected_groups)
    for new_id, group in enumerate(expected_groups):  # ids in order of first appearance
        assert [int(token_map[vocab.index(t)]) for t in group] == [new_id] * len(group)
