"""Tokenizer (dsv41.tokenizer) against the oracle fixture's tokenizer, and the tiny tokenizer builder."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models

from dsv41.errors import TokenizerError
from dsv41.tiny.tokenizer import ADDED_TOKENS, build_tiny_tokenizer
from dsv41.tokenizer import SPECIAL_TOKENS, Tokenizer

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
ORACLE = SHARED / "fixtures" / "oracle-tiny-a"

MIXED_TEXT = (
    "<｜begin▁of▁sentence｜><｜System｜>Be brief.<｜User｜>Café façade, naïve coöperation — 12345 + 6.75 = ?\n"
    "```python\ndef f(x):\n    return {\"k\": x ** 2}  # tab\there\n```\n日本語のテキスト, 한국어, emoji 😀👍🏽!"
    "<｜Assistant｜><think>Sum it.</think>12351.75<｜end▁of▁sentence｜>"
)


@pytest.fixture(scope="module")
def oracle():
    return Tokenizer.from_dir(ORACLE)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_tok")
    build_tiny_tokenizer(out)
    return out


# --- the oracle fixture's tokenizer ------------------------------------------------------------------------------


def test_special_ids_agree_with_fixture_config(oracle):
    config = json.loads((ORACLE / "config.json").read_text())
    text = config["text_config"]
    assert oracle.bos_id == text["bos_token_id"]
    assert oracle.eos_id == text["eos_token_id"]
    assert oracle.pad_id == text["engram_pad_token_id"]
    assert oracle.special("image") == config["image_token_id"]
    assert oracle.special("<｜deepseek_image｜>") == config["image_token_id"]
    assert len(oracle) == text["vocab_size"] == oracle.vocab_size


def test_encode_matches_fixture_prompt(oracle):
    inputs = json.loads((ORACLE / "inputs.json").read_text())
    ids = inputs["input_ids"][0]
    assert oracle.encode(inputs["decoded_text"]) == ids
    assert oracle.decode(ids) == inputs["decoded_text"]
    assert oracle.decode(ids, skip_special_tokens=True) == inputs["decoded_text"].removeprefix(SPECIAL_TOKENS["bos"])


def test_encode_adds_no_bos(oracle):
    ids = oracle.encode("The note said the same thing")
    assert oracle.bos_id not in ids and oracle.eos_id not in ids
    assert oracle.encode("") == []


def test_token_lookups(oracle):
    token = oracle.id_to_token(262)
    assert oracle.token_to_id(token) == 262
    assert oracle.token_to_id("no such token") is None
    assert oracle.decode_token(oracle.bos_id) == SPECIAL_TOKENS["bos"]


def test_missing_chat_token_is_a_clear_error(oracle):
    assert not oracle.has_special("user")
    with pytest.raises(TokenizerError, match="<｜User｜>"):
        oracle.special("user")


def test_missing_file_names_it(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_missing_required_special_token_names_it(tmp_path):
    raw = RawTokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    raw.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TokenizerError, match="begin▁of▁sentence"):
        Tokenizer.from_dir(tmp_path)


def test_tokenizer_config_names_the_pad_token(tmp_path):
    shutil.copy(ORACLE / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": {"content": "<｜end▁of▁sentence｜>"}}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.pad_id == tok.eos_id
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<nope>"}))
    with pytest.raises(TokenizerError, match="<nope>"):
        Tokenizer.from_dir(tmp_path)


# --- incremental decoding ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["oracle", "tiny"])
def test_incremental_decoder_streams_whole_characters(which, oracle, tiny_dir):
    tok = oracle if which == "oracle" else Tokenizer.from_dir(tiny_dir)
    text = MIXED_TEXT if which == "tiny" else "<｜begin▁of▁sentence｜>Café 😀 日本 € done"
    ids = tok.encode(text)
    decoder = tok.incremental_decoder()
    pieces = [decoder.feed(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    # the emoji needs several byte tokens: some feeds must have held bytes back
    assert sum(1 for p in pieces if p == "") > 0


def test_incremental_decoder_holds_back_a_split_character(oracle):
    ids = oracle.encode("€")  # three UTF-8 bytes
    assert len(ids) > 1, "the fixture tokenizer has no merge for '€'; the test needs it split"
    decoder = oracle.incremental_decoder()
    assert [decoder.feed(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.feed(ids[-1]) == "€"
    # an unfinished character comes out as U+FFFD at the end, like a full decode shows it
    decoder.feed(ids[0])
    assert decoder.flush() == oracle.decode(ids[:1]) == "\ufffd"


def test_incremental_decoder_token_bytes_match_backend_decode(oracle):
    decoder = oracle.incremental_decoder()
    for token_id in range(len(oracle)):
        assert decoder.token_bytes(token_id).decode("utf-8", errors="replace") == oracle.decode_token(token_id)


def test_incremental_decoder_skips_special_tokens(oracle):
    ids = oracle.encode("<｜begin▁of▁sentence｜>Hi<｜end▁of▁sentence｜>")
    decoder = oracle.incremental_decoder(skip_special_tokens=True)
    assert "".join(decoder.feed(i) for i in ids) + decoder.flush() == "Hi"


# --- the tiny tokenizer ------------------------------------------------------------------------------------------


def test_tiny_tokenizer_layout(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    assert len(tok) == 512
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    ids = [tok.special(name) for name in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    assert all(0 <= i < 512 for i in ids)
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["add_bos_token"] is False
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        SPECIAL_TOKENS["bos"], SPECIAL_TOKENS["eos"], SPECIAL_TOKENS["pad"])
    # every added V4.1 token is one token when it appears in text, special or not
    for text, _special in ADDED_TOKENS:
        assert tok.encode(f"a{text}b")[1:-1] == [tok.token_to_id(text)]
    # the chat parser must still see </think> and ｜DSML｜ after skip_special_tokens
    ids = tok.encode("<｜User｜>x</think>y｜DSML｜")
    assert tok.decode(ids, skip_special_tokens=True) == "x</think>y｜DSML｜"


def test_tiny_tokenizer_round_trip(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    ids = tok.encode(MIXED_TEXT)
    assert tok.decode(ids) == MIXED_TEXT
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    # the BPE learned something from the corpus: common words are single tokens
    assert len(tok.encode(" the")) == 1
    assert len(ids) < len(MIXED_TEXT.encode("utf-8"))


def test_tiny_tokenizer_splits_digits_in_threes(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    pieces = [tok.decode_token(i) for i in tok.encode("1234567")]
    assert "".join(pieces) == "1234567"
    assert all(len(p) <= 3 for p in pieces)
    # no token crosses the 3-digit boundary: the pieces regroup into 123|456|7
    boundaries, pos = set(), 0
    for p in pieces:
        pos += len(p)
        boundaries.add(pos)
    assert {3, 6, 7} <= boundaries


def test_tiny_tokenizer_is_byte_identical_across_builds(tiny_dir, tmp_path):
    again = tmp_path / "again"
    build_tiny_tokenizer(again)
    # and in a fresh process (Rust hash maps are seeded per process)
    other = tmp_path / "other"
    subprocess.run([sys.executable, "-c", f"from dsv41.tiny.tokenizer import build_tiny_tokenizer as b; b({str(other)!r})"],
                   check=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        reference = (tiny_dir / name).read_bytes()
        assert (again / name).read_bytes() == reference
        assert (other / name).read_bytes() == reference


def test_tiny_tokenizer_rejects_impossible_sizes(tmp_path):
    with pytest.raises(TokenizerError, match="exceed"):
        build_tiny_tokenizer(tmp_path, vocab_size=400, bpe_size=448)
    with pytest.raises(TokenizerError, match="only supports"):
        build_tiny_tokenizer(tmp_path, vocab_size=100000, bpe_size=90000)


def test_unreadable_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    shutil.copy(ORACLE / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("[")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)


def test_incremental_decoder_without_byte_level_decoder(tmp_path):
    # a tokenizer whose decoder is not byte-level takes the re-decode path
    raw = RawTokenizer(models.WordLevel(vocab={"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1,
                                               "<｜▁pad▁｜>": 2, "ab": 3, "c": 4}, unk_token="c"))
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    assert not tok.byte_level
    decoder = tok.incremental_decoder()
    assert decoder.feed([3, 4]) == tok.decode([3, 4])
    assert decoder.flush() == ""
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.incremental_decoder().token_bytes(99)
