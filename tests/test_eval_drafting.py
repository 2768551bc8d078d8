"""`dsv41 eval drafting` on the tiny model with lookup drafts (issue 36): tokens per round read from the engine
(FinishEvent.tokens_per_round) on a repetitive prompt and on code, at least 1, and consistent with the engine's
own lookup counters over the same request; the part refuses an engine that drafts with nothing."""

from __future__ import annotations

import pytest
import torch

from dsv41.errors import DSV41Error
from dsv41.eval import drafting
from dsv41.eval.backend import EngineBackend
from dsv41.eval.cli import eval_args
from dsv41.eval.prompts import WORKLOADS
from dsv41.tiny.model import default_model_dir
from dsv41.tokenizer import Tokenizer

WORK = {"repetitive": "1 2 3 4 " * 12 + "1 2 3", "code": WORKLOADS["code"]}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(default_model_dir())


@pytest.fixture(scope="module")
def backend(tokenizer):
    torch.set_num_threads(1)
    b = EngineBackend(eval_args(["--device", "cpu", "--cpu-threads", "1", "--draft-lookup", "on"]),
                      default_model_dir(), tokenizer, log=lambda line: None)
    yield b
    b.close()


def test_tokens_per_round_from_the_engine(backend, tokenizer):
    result = drafting.evaluate(backend, tokenizer, max_tokens=24, depth=5, workloads=WORK)
    assert result["drafters"] == ["lookup"] and result["depth"] == 5
    assert list(result["workloads"]) == ["repetitive", "code"]
    for w in result["workloads"].values():
        assert "error" not in w and 1 <= w["tokens"] <= 24 and w["tok_s"] > 0
        assert w["tokens_per_round"] >= 1.0
        lookup = w["drafters"]["lookup"]
        assert set(w["drafters"]) == {"lookup"}
        assert 0 <= lookup["num_accepted_tokens"] <= lookup["num_draft_tokens"] <= 5 * lookup["num_drafts"]
        # accepted drafts are what lifts a round above one token
        assert (w["tokens_per_round"] > 1.0) == (lookup["num_accepted_tokens"] > 0)


def test_refuses_an_engine_without_a_drafter(tokenizer):
    class NoDrafts:  # what drafting_figures reports for an engine built with drafting off
        def drafting_figures(self):
            return {"drafters": [], "depth": 5}

    with pytest.raises(DSV41Error, match="--draft-lookup on"):
        drafting.evaluate(NoDrafts(), tokenizer, max_tokens=4)
