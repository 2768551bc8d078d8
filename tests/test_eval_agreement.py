"""`dsv41 eval agreement` on the tiny model (issue 36): a reference written from the model itself agrees 100% with
KL exactly 0; a perturbed reference (top-1 and top-2 swapped at known positions) agrees at exactly the positions
left alone, with KL > 0; the coarse KL equals the full KL when the reference lists every token; the reference
file's format errors name the line and field; the server's `prompt_logprobs` (--url) agree with the engine's."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dsv41.errors import DSV41Error
from dsv41.eval import agreement
from dsv41.eval.backend import EngineBackend, ServerBackend
from dsv41.eval.cli import eval_args
from dsv41.tiny.model import default_model_dir
from dsv41.tokenizer import Tokenizer

from server_harness import server  # noqa: F401  (the session's shared server)

TOKENS = 80  # longer than the list and dialogue texts: they repeat, and 'first copy' is a part of the ids


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(default_model_dir())


@pytest.fixture(scope="module")
def backend(tokenizer):
    torch.set_num_threads(1)
    b = EngineBackend(eval_args(["--device", "cpu", "--cpu-threads", "1"]), default_model_dir(), tokenizer,
                      log=lambda line: None)
    yield b
    b.close()


@pytest.fixture(scope="module")
def reference(backend, tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("agreement") / "ref.jsonl"
    prompts = agreement.reference_prompts(tokenizer, None, TOKENS)
    summary = agreement.write_reference(backend, prompts, str(path))
    assert summary == {"file": str(path), "prompts": 4, "positions": 4 * (TOKENS - 1), "top": 20}
    return path


def test_self_agreement_is_exact(backend, reference, tokenizer):
    ref = agreement.read_reference(str(reference), tokenizer.vocab_size)
    result = agreement.evaluate(backend, ref)
    assert result["errors"] == []
    assert result["positions"] == 4 * (TOKENS - 1) and result["top1_agree"] == result["positions"]
    assert result["top1"] == 1.0 and result["top1_first_copy"] == 1.0
    assert result["mean_kl"] == 0.0 and result["max_kl"] == 0.0 and result["kl_bounded_positions"] == 0
    rows = {r["name"]: r for r in map(json.loads, reference.read_text().splitlines())}
    assert list(rows) == ["code", "prose", "list", "dialogue"]
    assert rows["code"]["first_copy"] == TOKENS and 1 < rows["list"]["first_copy"] < TOKENS
    for row in rows.values():
        assert row["prompt_logprobs"][0] is None and len(row["ids"]) == len(row["prompt_logprobs"]) == TOKENS
        assert all(len(entry) == 20 for entry in row["prompt_logprobs"][1:])


def test_perturbed_reference_moves_both_metrics(backend, reference, tmp_path):
    rows = [json.loads(line) for line in reference.read_text().splitlines()]
    swapped = 0
    for row in rows:
        for i, entry in enumerate(row["prompt_logprobs"]):
            if entry is None or i % 3:
                continue
            (a, la), (b, lb) = sorted(entry.items(), key=lambda kv: -kv[1])[:2]
            entry[a], entry[b] = lb, la  # the reference now prefers the model's second choice
            swapped += 1
    path = tmp_path / "perturbed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = agreement.evaluate(backend, agreement.read_reference(str(path)))
    positions = 4 * (TOKENS - 1)
    assert result["top1_agree"] == positions - swapped
    assert result["top1"] == pytest.approx(1 - swapped / positions) and result["top1"] < 1
    assert result["mean_kl"] > 0 and result["max_kl"] > 0
    assert result["kl_bounded_positions"] == 0  # the same ids: the model knows every one of them


def test_server_prompt_logprobs_agree_with_the_engine(server, reference):  # noqa: F811
    b = ServerBackend(server.url, server.api_key)
    result = agreement.evaluate(b, agreement.read_reference(str(reference)))
    assert result["errors"] == [] and result["positions"] == 4 * (TOKENS - 1)
    assert result["top1"] == 1.0 and result["mean_kl"] == 0.0


def test_coarse_kl_is_the_full_kl_when_the_reference_lists_everything():
    p = torch.log_softmax(torch.tensor([2.0, 1.0, 0.5, -1.0]), -1).tolist()
    q = torch.log_softmax(torch.tensor([1.0, 1.5, 0.0, -0.5]), -1).tolist()
    full = sum(math.exp(a) * (a - b) for a, b in zip(p, q))
    kl, bounded = agreement.coarse_kl(dict(enumerate(p)), dict(enumerate(q)), top=4)
    assert kl == pytest.approx(full, rel=1e-9) and not bounded
    # the reference's top 2 only: a lower bound of the full KL; a reference id outside the model's list is bounded
    part, _ = agreement.coarse_kl({0: p[0], 1: p[1]}, dict(enumerate(q)), top=4)
    assert 0 < part <= full
    _, bounded = agreement.coarse_kl({0: p[0], 3: p[3]}, {0: q[0], 1: q[1]}, top=2)
    assert bounded


def test_vllm_prompt_logprobs_are_read(tmp_path):
    path = tmp_path / "vllm.jsonl"
    row = {"ids": [1, 5, 7], "prompt_logprobs": [None, {"5": {"logprob": -0.1, "rank": 1, "decoded_token": "a"},
                                                        "9": {"logprob": -2.5, "rank": 2, "decoded_token": "b"}},
                                                  {"7": {"logprob": -0.3, "rank": 1, "decoded_token": "c"}}]}
    path.write_text(json.dumps(row) + "\n")
    [prompt] = agreement.read_reference(str(path))
    assert prompt["logprobs"] == [None, {5: -0.1, 9: -2.5}, {7: -0.3}] and prompt["first_copy"] is None


@pytest.mark.parametrize("line, message", [
    ('{"ids": [1], "prompt_logprobs": [null]}', "line 2: field 'ids' must be a list of at least 2 token ids"),
    ('{"ids": [1, 2], "prompt_logprobs": [null]}', "line 2: field 'prompt_logprobs' must be a list as long as"),
    ('{"ids": [1, 2], "prompt_logprobs": [null, {"x": 1}]}', "line 2: prompt_logprobs[1] must map token ids"),
    ('{"ids": [1, 9999], "prompt_logprobs": [null, {"1": -1}]}', "line 2: id 9999 is beyond the model's vocabulary"),
    ("[1, 2]", "line 2 is not an object"),
    ("{", "line 2 is not JSON"),
])
def test_malformed_reference_names_line_and_field(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"ids": [1, 2], "prompt_logprobs": [null, {"2": -0.5}]}\n' + line + "\n")
    with pytest.raises(DSV41Error) as err:
        agreement.read_reference(str(path), vocab_size=512)
    assert message in str(err.value) and str(path) in str(err.value)


def test_a_prompt_beyond_the_context_is_reported_not_fatal(backend, reference, tmp_path):
    first = reference.read_text().splitlines()[0]
    n = backend.max_model_len
    long = {"name": "long", "ids": [1] * n, "prompt_logprobs": [None] + [{"1": -0.1}] * (n - 1)}
    path = tmp_path / "long.jsonl"
    path.write_text(first + "\n" + json.dumps(long) + "\n")
    result = agreement.evaluate(backend, agreement.read_reference(str(path)))
    assert result["positions"] == TOKENS - 1 and result["top1"] == 1.0
    assert result["errors"] == [{"prompt": "long", "error": f"a prompt of {n} tokens leaves no room for a reply "
                                                            f"within --max-model-len {n}"}]
