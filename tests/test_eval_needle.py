"""`dsv41 eval needle` on the tiny model (issue 36): two short context lengths at two depths run through the
engine; every prompt fits its length and is filled close to it, holds its needle once at its depth and asks for
it; a cell is found exactly when the reply's first number is the value."""

from __future__ import annotations

import pytest
import torch

from dsv41.eval import needle
from dsv41.eval.backend import EngineBackend
from dsv41.eval.cli import eval_args
from dsv41.tiny.model import default_model_dir
from dsv41.tokenizer import Tokenizer

LENGTHS, DEPTHS = [128, 256], [0.2, 0.8]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(default_model_dir())


@pytest.fixture(scope="module")
def result(tokenizer):
    torch.set_num_threads(1)
    backend = EngineBackend(eval_args(["--device", "cpu", "--cpu-threads", "1"]), default_model_dir(), tokenizer,
                            log=lambda line: None)
    try:
        yield needle.evaluate(backend, tokenizer, LENGTHS, DEPTHS, seed=3, max_tokens=8)
    finally:
        backend.close()


def test_runs_and_scores_exactly(result):
    assert result["cells"] == 4 and [(r["length"], r["depth"]) for r in result["results"]] == [
        (128, 0.2), (128, 0.8), (256, 0.2), (256, 0.8)]
    assert all("error" not in r for r in result["results"])
    for r in result["results"]:
        assert r["found"] == (needle.first_number(r["reply"]) == r["value"])
    assert result["found"] == sum(r["found"] for r in result["results"])
    assert result["by_length"] == {str(n): {"cells": 2, "found": sum(r["found"] for r in result["results"]
                                                                     if r["length"] == n)} for n in LENGTHS}
    assert len({r["value"] for r in result["results"]}) == 4  # no value shared between cells


@pytest.mark.parametrize("length, depth", [(128, 0.2), (256, 0.8), (2000, 0.5)])
def test_prompt_fits_and_holds_the_needle_at_its_depth(tokenizer, length, depth):
    ids = needle.needle_prompt(tokenizer, length, depth, "amber falcon", "123456", seed=1)
    longest_sentence = max(len(tokenizer.encode_literal(" " + s)) for s in needle.FILLER)
    assert length - 2 * longest_sentence <= len(ids) <= length
    text = tokenizer.decode(ids)
    needle_at = text.index("The secret number of the amber falcon is 123456.")
    assert text.count("123456") == 1 and "What is the secret number of the amber falcon?" in text
    start = text.index("<｜User｜>") + len("<｜User｜>")  # the haystack: the user turn up to the question
    end = text.index("\n\nWhat is the secret")
    # whole sentences: the needle sits within a sentence (and its own length) of its depth
    slack = max(map(len, needle.FILLER)) + len("The secret number of the amber falcon is 123456.")
    assert abs((needle_at - start) - depth * (end - start)) <= slack


def test_first_number():
    assert needle.first_number("The number is 123,456.") == "123456"
    assert needle.first_number("none") is None and needle.first_number(" 42 and 7") == "42"
