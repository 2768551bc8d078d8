"""`dsv41 eval mmlu` on the tiny model (issue 36): a generated folder of questions in MMLU's CSV layout runs, the
counts are exact (per subject, per letter), each pick is the argmax of the reference forward's logits over the
four letter tokens of the same chat prompt, and malformed files are one-line errors naming the row."""

from __future__ import annotations

import csv

import pytest
import torch

from dsv41.errors import DSV41Error
from dsv41.eval import mmlu
from dsv41.eval.backend import EngineBackend
from dsv41.eval.cli import eval_args
from dsv41.eval.prompts import user_ids
from dsv41.tiny.model import default_model_dir
from dsv41.tokenizer import Tokenizer


def write_csv(path, rows) -> None:
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(rows)


@pytest.fixture(scope="module")
def questions_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("mmlu")
    write_csv(root / "arithmetic_test.csv", [
        [f"What is {a} + {b}?", str(a + b - 1), str(a + b), str(a + b + 1), str(a + b + 2), "B"]
        for a, b in ((2, 2), (3, 5), (7, 1), (4, 9))])
    write_csv(root / "world_capitals_test.csv", [
        ['Which city is the capital of "France"?', "Paris", "Rome", "Berlin", "Madrid", "A"],
        ["Which city is the capital of Japan?", "Seoul", "Beijing", "Tokyo", "Bangkok", "C"],
        ["Which city is the capital of Peru, a country\nin South America?", "Quito", "Bogota", "Santiago", "Lima",
         "D"]])
    return root


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(default_model_dir())


@pytest.fixture(scope="module")
def result(questions_dir, tokenizer):
    torch.set_num_threads(1)
    backend = EngineBackend(eval_args(["--device", "cpu", "--cpu-threads", "1"]), default_model_dir(), tokenizer,
                            log=lambda line: None)
    try:
        questions = mmlu.read_questions(str(questions_dir))
        yield questions, mmlu.evaluate(backend, tokenizer, questions), backend.engine.core.executor.runner
    finally:
        backend.close()


def test_counts_are_exact(result):
    questions, r, _ = result
    assert r["questions"] == r["answered"] == 7 and r["errors"] == []
    assert 0.0 <= r["accuracy"] <= 1.0 and r["accuracy"] == r["correct"] / 7
    assert set(r["subjects"]) == {"arithmetic", "world capitals"}
    assert r["subjects"]["arithmetic"]["questions"] == 4 and r["subjects"]["world capitals"]["questions"] == 3
    assert sum(s["correct"] for s in r["subjects"].values()) == r["correct"]
    assert sum(r["picked"].values()) == 7 and all(c in "ABCD" for c in r["choices"])
    assert r["correct"] == sum(c == q["answer"] for c, q in zip(r["choices"], questions))


def test_each_pick_is_the_argmax_over_the_letters(result, tokenizer):
    questions, r, runner = result
    model = runner.forward.model  # the reference model the engine's pool forward runs
    letters = mmlu.letter_ids(tokenizer)
    with torch.no_grad():
        for q, picked in zip(questions, r["choices"]):
            logits = model.forward(model.new_state(), torch.tensor(user_ids(tokenizer, mmlu.prompt_text(q))))[-1]
            assert picked == mmlu.LETTERS[int(logits[list(letters)].argmax())]


def test_prompt_is_the_standard_zero_shot_one():
    q = {"subject": "world capitals", "question": "Capital of Peru?", "choices": ["Quito", "Bogota", "Santiago",
                                                                                 "Lima"], "answer": "D"}
    assert mmlu.prompt_text(q) == ("The following is a multiple choice question about world capitals.\n\n"
                                   "Capital of Peru?\nA. Quito\nB. Bogota\nC. Santiago\nD. Lima\nAnswer:")


def test_limit_spreads_over_the_set(questions_dir):
    picked = mmlu.read_questions(str(questions_dir), limit=3)
    assert [q["subject"] for q in picked] == ["arithmetic", "arithmetic", "world capitals"]
    assert len(mmlu.read_questions(str(questions_dir / "arithmetic_test.csv"))) == 4


@pytest.mark.parametrize("rows, message", [
    ([["q", "a", "b", "c", "d"]], "row 1 has 5 fields, expected 6"),
    ([["q", "a", "b", "c", "d", "A"], ["q", "a", "b", "c", "d", "E"]], "row 2: answer 'E' is not one of"),
])
def test_malformed_rows_are_named(tmp_path, rows, message):
    path = tmp_path / "bad_test.csv"
    write_csv(path, rows)
    with pytest.raises(DSV41Error, match=message):
        mmlu.read_questions(str(path))
