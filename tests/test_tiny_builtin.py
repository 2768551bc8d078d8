"""The built-in model (issue 36): the trained tiny DeepSeek-V4.1 shipped in src/dsv41/tiny/trained/ is small enough
for git, the default of every command, and does what docs/TINY_MODEL.md says, measured on what it never trained on
(held-out questions and stdlib files, `corpus.is_heldout`). Each threshold is the shipped weights' figure on the CPU
(docs/TINY_MODEL.md "Measured") with margin, and far above what the random model scores (about 0 on each)."""

from __future__ import annotations

import argparse
import json

import jsonschema
import pytest
import torch

from dsv41.eval.backend import EngineBackend, Query
from dsv41.eval.cli import eval_args
from dsv41.eval.prompts import user_ids
from dsv41.tiny.builtin import TRAINED_DIR, builtin_model_dir
from dsv41.tiny.train.corpus import fact_table, generate_chats, is_heldout, stdlib_files
from dsv41.tiny.train.layout import TRAINED_OVERRIDES
from dsv41.tokenizer import Tokenizer

from server_harness import SERVED_NAME, ServerProcess

MAX_BYTES = 20_000_000  # what git carries comfortably (issue 36: <= 20 MB)
# measured on the shipped weights (CPU, reference forward; docs/TINY_MODEL.md "Measured"): atlas 6/16 right and
# 15/16 well formed (a blind guess gets under 1: only a flag, 1 in 8 colours, can be guessed), source top-1 0.643,
# DSpark 1.84 tokens a round (the issue asks > 1.5)
LOOKUPS, MIN_LOOKUPS_RIGHT, MIN_LOOKUPS_FORMATTED = 16, 4, 14
CODE_FILES, CODE_TOKENS, MIN_CODE_TOP1 = 2, 512, 0.45
DRAFT_FILES, DRAFT_TOKENS, MIN_TOKENS_PER_ROUND = 4, 64, 1.5


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(builtin_model_dir())


@pytest.fixture(scope="module")
def backend(tokenizer):
    """The engine `dsv41 serve` runs, on the shipped model, DSpark drafting at its full depth (a flat step cost:
    the depth a GPU picks; the CPU's measured costs would pick a shallower one that depends on the machine)."""
    torch.set_num_threads(1)
    args = eval_args(["--device", "cpu", "--cpu-threads", "1", "--draft-dspark", "on", "--draft-cost", "1:0.01"])
    b = EngineBackend(args, builtin_model_dir(), tokenizer, log=lambda line: None)
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="module")
def heldout_files():
    files = [f for f in stdlib_files() if is_heldout(f"file:{f.rel}")]
    assert len(files) >= max(CODE_FILES, DRAFT_FILES), "too few held-out stdlib files on this Python"
    return files


def heldout_chats(kind: str) -> list:
    return [c for c in generate_chats(0, 8000, fact_table(0)) if c.split == "heldout" and c.kind == kind]


# ------------------------------------------------------------------------------------------------ the folder
def test_shipped_folder_is_small_and_says_how_it_was_made():
    files = [p for p in TRAINED_DIR.iterdir() if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= MAX_BYTES
    index = json.loads((TRAINED_DIR / "model.safetensors.index.json").read_text())
    assert {p.name for p in files} >= set(index["weight_map"].values()) | {"config.json", "tokenizer.json"}
    config = json.loads((TRAINED_DIR / "config.json").read_text())
    text = config.get("text_config", config)
    assert {k: text[k] for k in TRAINED_OVERRIDES} == TRAINED_OVERRIDES
    assert config["quantization_config"]["quant_method"] == "fp8"
    training = json.loads((TRAINED_DIR / "training.json").read_text())
    assert training["steps"] == training["settings"]["steps"] > 0 and training["tokens_seen"] > 0
    assert training["corpus"]["seed"] == 0 and len(training["corpus"]["digest"]) == 64


def test_commands_default_to_the_shipped_model():
    from dsv41.cli import _model_dir
    from dsv41.server.cli import _model_folder

    assert _model_dir(None) == builtin_model_dir() == TRAINED_DIR
    assert _model_folder(argparse.Namespace(model=None)) == TRAINED_DIR


# ---------------------------------------------------------------------------------------- what it can do
def test_answers_held_out_atlas_questions(backend, tokenizer):
    """Atlas questions it never saw asked (the fact was in its reading), thinking on as in two thirds of its
    training chats: the reply closes its reasoning and ends on the fact, exactly."""
    chats = heldout_chats("lookup")[:LOOKUPS]
    answers = backend.run([Query(user_ids(tokenizer, c.messages[-2]["content"], thinking=True), max_tokens=96,
                                 draft=0) for c in chats])
    assert all(a.error is None for a in answers)
    right = [a.text.split("</think>")[-1].strip() == c.answer for c, a in zip(chats, answers)]
    formatted = [a.finish_reason == "stop" and a.text.count("</think>") == 1 for a in answers]
    print(f"held-out atlas questions: {sum(right)}/{len(chats)} right, {sum(formatted)} well formed")
    assert sum(formatted) >= MIN_LOOKUPS_FORMATTED, [a.text for a in answers]
    assert sum(right) >= MIN_LOOKUPS_RIGHT, [(c.answer, a.text) for c, a in zip(chats, answers)]


def test_predicts_held_out_python_source(backend, tokenizer, heldout_files):
    """Top-1 next-token accuracy, teacher-forced, on the first tokens of stdlib files held out of training."""
    hits = total = 0
    for f in heldout_files[:CODE_FILES]:
        ids = [tokenizer.bos_id] + tokenizer.encode_literal(f.text)[:CODE_TOKENS - 1]
        answer, = backend.run([Query(ids, max_tokens=1, prompt_logprobs=1, draft=0)])
        assert answer.error is None, answer.error
        for i, top in enumerate(answer.prompt_logprobs[1:], 1):
            hits += max(top, key=top.get) == ids[i]  # `top` holds the top-1 and the prompt's own token
            total += 1
    print(f"held-out Python source: top-1 {hits / total:.3f} over {total} tokens")
    assert hits / total >= MIN_CODE_TOP1, hits / total


def test_dspark_drafts_are_accepted_on_code(backend, tokenizer, heldout_files):
    """Greedy continuations of held-out stdlib source with DSpark drafting: tokens per decode round."""
    queries = [Query([tokenizer.bos_id] + tokenizer.encode_literal(f.text)[:256], max_tokens=DRAFT_TOKENS, draft=5)
               for f in heldout_files[:DRAFT_FILES]]
    answers = backend.run(queries)
    assert all(a.error is None and a.completion_tokens == DRAFT_TOKENS for a in answers)
    rounds = sum(a.completion_tokens / a.tokens_per_round for a in answers)
    print(f"DSpark on held-out code: {sum(a.completion_tokens for a in answers) / rounds:.3f} tokens a round")
    assert sum(a.completion_tokens for a in answers) / rounds > MIN_TOKENS_PER_ROUND, \
        [a.tokens_per_round for a in answers]


def test_makes_a_well_formed_tool_call_through_the_server(tmp_path_factory):
    """A held-out tool question through the real server and the official client, `tool_choice: "auto"` (no
    grammar forces a call): the model itself calls the right tool with arguments its schema accepts."""
    chat = next(c for c in heldout_chats("tool") if c.mode == "chat")
    system, question = chat.messages[0], chat.messages[1]
    expected = chat.messages[2]["tool_calls"][0]["function"]
    server = ServerProcess(tmp_path_factory.mktemp("builtin-serve"), model=builtin_model_dir())
    try:
        reply = server.client().chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "system", "content": system["content"]}, question],
            tools=system["tools"], tool_choice="auto", temperature=0, max_tokens=200,
            extra_body={"chat_template_kwargs": {"thinking": False}})
    finally:
        server.terminate()
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
    call = choice.message.tool_calls[0].function
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in system["tools"]}
    assert call.name == expected["name"], (call.name, call.arguments)
    jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_make_run_prints_the_answer(capsys):
    """`make run`'s command (README: what to expect): a fact of the atlas it was asked about in training, reasoned
    and answered in the chat format, through `generate --chat --think` on the built-in model."""
    from dsv41.cli import main

    assert main(["generate", "--chat", "--think", "--prompt", "What is the capital of Olvello?", "--max-tokens", "64",
                 "--cpu-threads", "1"]) == 0
    out = capsys.readouterr().out
    reasoning, _, answer = out.strip().partition("</think>")
    assert answer == "Brifen" and "Olvello" in reasoning and "<｜" not in out, out
