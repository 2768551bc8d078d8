"""Multiple-choice accuracy on questions in MMLU's layout (RECIPE.md §4.2: MMLU-200, 0-shot, greedy, thinking off).

Input: a CSV file, or a folder of them, as the MMLU dataset ships (`data/test/<subject>_test.csv`): no header,
one question a row, `question,A,B,C,D,answer` with `answer` one of A-D. The subject is the file name without
`_test.csv` / `_dev.csv` / `_val.csv`. `--mmlu-limit N` keeps N questions spread evenly over all of them (in file
order), the recipe's MMLU-200 being such a subset.

How a question is asked (0-shot, no examples): the standard MMLU prompt ("The following is a multiple choice
question about <subject>." then the question, the four options as `A. ...` and "Answer:") as one user turn in the
V4.1 chat encoding with thinking off, and the model's answer is the first token of its reply restricted to the
four letter tokens (`allowed_token_ids`), greedy: the letter with the highest logprob. Why the chat encoding and
not a plain completion: the served model is a chat model and the recipe asks it through the chat API with
thinking off, where the reply starts right after the assistant's header (so the letter token is "A", not " A");
why logprobs and not free generation (the recipe's max_tokens 8, first A-D in the reply): every question gets
exactly one of the four answers, so the count is not blurred by replies that never name a letter, and one token a
question is the cheapest run there is.
"""

from __future__ import annotations

import csv
from pathlib import Path

from ..errors import DSV41Error
from .backend import Query
from .prompts import user_ids

LETTERS = ("A", "B", "C", "D")
SPLITS = ("_test", "_dev", "_val")


def read_questions(path: str, limit: int | None = None) -> list[dict]:
    """The questions of a CSV file or of every *.csv in a folder (sorted by name), each {"subject", "question",
    "choices", "answer"}; `limit` keeps that many spread evenly. A malformed row is an error naming it."""
    root = Path(path)
    files = sorted(root.glob("*.csv")) if root.is_dir() else [root]
    if not files:
        raise DSV41Error(f"--mmlu {root}: no .csv files in the folder")
    questions = []
    for file in files:
        subject = file.stem
        for split in SPLITS:
            subject = subject.removesuffix(split)
        try:
            with file.open(newline="", encoding="utf-8") as f:
                rows = list(csv.reader(f))
        except OSError as e:
            raise DSV41Error(f"--mmlu {file}: {e.strerror or e}") from None
        except (UnicodeDecodeError, csv.Error) as e:
            raise DSV41Error(f"--mmlu {file}: not a UTF-8 CSV file ({e})") from None
        for n, row in enumerate(rows, 1):
            if not row:
                continue
            if len(row) != 6:
                raise DSV41Error(f"--mmlu {file}: row {n} has {len(row)} fields, expected 6 "
                                 "(question,A,B,C,D,answer)")
            answer = row[5].strip().upper()
            if answer not in LETTERS:
                raise DSV41Error(f"--mmlu {file}: row {n}: answer {row[5]!r} is not one of A, B, C, D")
            questions.append({"subject": subject.replace("_", " "), "question": row[0], "choices": row[1:5],
                              "answer": answer})
    if not questions:
        raise DSV41Error(f"--mmlu {root}: no questions")
    if limit is not None and limit < len(questions):
        step = len(questions) / limit
        questions = [questions[int(i * step)] for i in range(limit)]
    return questions


def prompt_text(q: dict) -> str:
    options = "\n".join(f"{letter}. {choice}" for letter, choice in zip(LETTERS, q["choices"]))
    return (f"The following is a multiple choice question about {q['subject']}.\n\n{q['question']}\n{options}\n"
            f"Answer:")


def letter_ids(tokenizer) -> tuple[int, ...]:
    ids = []
    for letter in LETTERS:
        encoded = tokenizer.encode_literal(letter)
        if len(encoded) != 1:
            raise DSV41Error(f"mmlu: the letter {letter!r} is {len(encoded)} tokens in this tokenizer, not one")
        ids.append(encoded[0])
    return tuple(ids)


def evaluate(backend, tokenizer, questions: list[dict]) -> dict:
    allowed = letter_ids(tokenizer)
    queries = [Query(user_ids(tokenizer, prompt_text(q)), max_tokens=1, allowed_ids=allowed, draft=0)
               for q in questions]
    answers = backend.run(queries, "mmlu")
    correct, errors, subjects, picked, choices = 0, [], {}, {letter: 0 for letter in LETTERS}, []
    for i, (q, answer) in enumerate(zip(questions, answers)):
        choice = None if answer.error else answer.text.strip()[:1].upper()
        choices.append(choice)
        if answer.error:
            errors.append({"question": i, "error": answer.error})
            continue
        if choice in picked:
            picked[choice] += 1
        right = choice == q["answer"]
        correct += right
        s = subjects.setdefault(q["subject"], {"questions": 0, "correct": 0})
        s["questions"] += 1
        s["correct"] += right
    answered = len(questions) - len(errors)
    return {"questions": len(questions), "answered": answered, "correct": correct,
            "accuracy": correct / len(questions) if questions else None, "picked": picked,
            "prompt": "chat encoding, thinking off, 0-shot; answer = argmax over the letter tokens A-D",
            "subjects": subjects, "choices": choices, "errors": errors}
