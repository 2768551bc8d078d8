"""Training the tiny model (dsv41.tiny.train): corpus, transcripts, a CPU smoke run through the CLI, three steps
that learn, and the export read back by the real loader computing the trainer's logits."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from dsv41.chat.encoding import encode_messages
from dsv41.chat.parser import parse_completion
from dsv41.cli import main
from dsv41.eval.tools import TOOLS as EVAL_TOOLS, Scenario, scenarios
from dsv41.errors import DSV41Error
from dsv41.model.loader import load_model
from dsv41.tiny.train.corpus import build_corpus, fact_table, generate_chats, is_heldout
from dsv41.tiny.train.export import checkpoint_bytes
from dsv41.tiny.train.trainer import Run, TrainSettings, lr_at

SMALL = dict(code_bytes=150_000, n_chats=300)


# ---------------------------------------------------------------------------------------------------- corpus
def test_corpus_is_a_function_of_its_seed_with_disjoint_splits():
    a, b, other = build_corpus(3, **SMALL), build_corpus(3, **SMALL), build_corpus(4, **SMALL)
    assert a.digest == b.digest
    assert other.digest != a.digest
    assert a.code == other.code  # the stdlib part does not depend on the seed, the generated part does
    for split in ("train", "heldout"):
        assert all(is_heldout(f"file:{rel}") == (split == "heldout") for rel in a.files[split])
        assert all(is_heldout(c.key) == (split == "heldout") for c in a.chats[split])
    assert a.chats["heldout"] and a.code["train"] and a.docs["train"] and a.facts["train"]
    train_keys = {c.key for c in a.chats["train"]}
    assert not train_keys & {c.key for c in a.chats["heldout"]}
    assert sum(len(t) for t in a.code["train"] + a.code["heldout"]) <= SMALL["code_bytes"]


def test_generated_answers_are_right():
    countries = fact_table(0)
    by_name = {c.name: c for c in countries}
    chats = generate_chats(0, 400, countries)
    assert {c.kind for c in chats} == {"arithmetic", "lookup", "tool", "chain", "json"}
    world = Scenario("world", "", [], [], "")  # `dsv41 eval tools`' tool world: the chains' results are its results
    eval_prompts = {sc.prompt for steps in range(1, 6) for sc in scenarios(steps, seed=0)}
    assert {c.mode for c in chats} == {"thinking", "chat"}
    for chat in chats:
        if chat.kind == "arithmetic":
            _, op, a, b = chat.key.split(":")
            want = {"+": int(a) + int(b), "-": int(a) - int(b), "×": int(a) * int(b)}[op]
            assert chat.answer.split("= ")[-1] == str(want), chat.key
            if chat.mode == "thinking":
                assert chat.messages[-1]["reasoning_content"].endswith(f"= {want}.")
        elif chat.kind == "json":
            record = json.loads(chat.answer)
            assert record == by_name[record["country"]].record()
        elif chat.kind == "chain":
            assert next(m for m in chat.messages if m["role"] == "user")["content"] not in eval_prompts
            offered = {t["function"]["name"] for t in chat.messages[0]["tools"]}
            assert all(EVAL_TOOLS[name] in chat.messages[0]["tools"] for name in offered)
            calls = [(m["tool_calls"][0]["function"], json.loads(r["content"]))
                     for m, r in zip(chat.messages, chat.messages[1:]) if m.get("tool_calls")]
            for function, result in calls:
                if function["name"] in ("add", "multiply", "celsius_to_fahrenheit"):
                    assert world.call(function["name"], json.loads(function["arguments"])) == result
            assert str(list(calls[-1][1].values())[-1]) in chat.answer  # the answer holds the last result


def test_transcripts_parse_back_to_their_messages():
    """Every assistant turn the encoder renders parses back (chat/parser.py) to its reasoning, content and calls."""
    chats = generate_chats(1, 160, fact_table(1))
    checked = 0
    for chat in chats:
        for i, message in enumerate(chat.messages):
            if message["role"] != "assistant":
                continue
            prompt = encode_messages(chat.messages[:i], chat.mode)
            full = encode_messages(chat.messages[:i + 1], chat.mode)
            assert full.startswith(prompt)
            parsed = parse_completion(full[len(prompt):], chat.mode)
            assert parsed["content"] == message["content"]
            assert parsed["reasoning_content"] == (message["reasoning_content"] if chat.mode == "thinking" else "")
            want = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                    for c in message.get("tool_calls", [])]
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                    for c in parsed["tool_calls"]] == want
            checked += 1
    assert checked > 160


# ---------------------------------------------------------------------------------------------------- a run
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One smoke run through the CLI: skeleton, small corpus, one step on the CPU, checkpoint, export."""
    out = tmp_path_factory.mktemp("tiny-run")
    assert main(["train-tiny", "--out", str(out), "--steps", "1", "--tiny-batch"]) == 0
    return out


@pytest.fixture(scope="module")
def run(run_dir):
    r = Run(TrainSettings.smoke(str(run_dir)), log=lambda msg: None)
    r.prepare()
    r.build()
    return r


def test_smoke_run_writes_everything_a_later_call_needs(run_dir, run):
    for name in ("run.json", "state.pt", "log.jsonl", "corpus/tokens.npz", "skeleton/config.json",
                 "model/config.json", "model/training.json", "loss.svg"):
        assert (run_dir / name).is_file(), name
    logged = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert logged[0]["step"] == 1 and math.isfinite(logged[0]["total"])
    evaluation = next(row["eval"] for row in logged if "eval" in row)
    assert 0 <= evaluation["chat"]["answer_exact"] <= 1 and math.isfinite(evaluation["chat"]["loss"])
    assert (run.streams["heldout"]["chat"].answers > 0).all()  # every held-out answer located in its chat's ids
    assert checkpoint_bytes(run_dir / "model") <= 20_000_000
    assert run.step == 1  # resumed
    state = torch.load(run_dir / "state.pt", weights_only=True)
    assert all(torch.equal(v, run.net.state_dict()[k]) for k, v in state["model"].items())
    b1, a1 = run._batch(5)
    again = Run(TrainSettings.smoke(str(run_dir)), log=lambda m: None)
    again.prepare()
    b2, a2 = again._batch(5)
    assert torch.equal(b1.ids, b2.ids) and torch.equal(b1.engram, b2.engram) and torch.equal(a1, a2)


def test_a_continued_run_must_keep_its_settings(run_dir):
    with pytest.raises(DSV41Error, match="seq_len"):
        Run(TrainSettings.smoke(str(run_dir), seq_len=32), log=lambda m: None).prepare()
    with pytest.raises(DSV41Error, match="--steps 5"):
        Run(TrainSettings.smoke(str(run_dir), steps=5), log=lambda m: None).prepare()


def test_rendered_chats_tokenize_back_to_their_text(run):
    for chat in generate_chats(2, 20, fact_table(2)):
        pieces = chat.pieces()
        assert run.tok.decode(run.tok.encode_pieces(pieces)) == pieces.text


def test_three_steps_lower_the_loss_on_a_fixed_batch_with_finite_gradients_everywhere(run):
    batch, anchors = run._batch(0)
    with torch.no_grad():
        before = run.net.losses(batch.ids, batch.engram, anchors)
    trainable = {name: run.net.raw(name) for name in run.net.names() if run.net.raw(name).requires_grad}
    assert any(n.startswith("mtp.") for n in trainable) and any(".indexer." in n for n in trainable)
    with torch.no_grad():  # which routed experts the step's forward will use (the routing is deterministic)
        run.net.train()
        run.net.losses(batch.ids, batch.engram, anchors)
        loads, run.net.loads = run.net.loads, {}
    for step in range(3):
        losses, _ = run.train_step(batch, anchors, lr=2e-3)
        if step == 0:
            for name, p in trainable.items():
                assert p.grad is not None and torch.isfinite(p.grad).all(), name
                routed = re.match(r"(.*ffn\.)experts\.(\d+)\.", name)
                used = not routed or bool(loads[routed.group(1) + "gate.bias"][int(routed.group(2))] > 0)
                assert bool(p.grad.abs().sum() > 0) == used, name  # an expert no row chose gets no gradient
    with torch.no_grad():
        after = run.net.losses(batch.ids, batch.engram, anchors)
    assert after.lm < before.lm
    assert after.total < before.total


def test_export_loads_and_computes_the_trainers_logits(run, tmp_path):
    """load_model on the export == the trainer's forward: to fp32 rounding without the activation quantisers;
    with them (the default), a value near a rounding boundary may land on the other side in one of the two, so
    the same greedy tokens and a small relative error are asserted (measured: ~3e-3)."""
    folder = run.export(tmp_path / "model")
    chat = run.streams["heldout"]["chat"]
    ids = torch.from_numpy(chat.ids[:72].astype("int64"))
    rows = run.hasher.hash(ids)[None]
    torch.manual_seed(0)
    for fake_quant in (False, True):
        run.net.fake_quant = fake_quant
        try:
            mine = run.net.reference_logits(ids[None], rows)[0]
        finally:
            run.net.fake_quant = True
        model = load_model(folder, fake_quant=fake_quant)
        ref = model(model.new_state(), ids)
        rel = float((ref - mine).norm() / ref.norm())
        agree = float((ref.argmax(-1) == mine.argmax(-1)).float().mean())
        if not fake_quant:
            assert float((ref - mine).abs().max()) < 1e-4 * max(1.0, float(ref.abs().max()))
        else:
            assert rel < 2e-2 and agree >= 0.95, (rel, agree)


def test_export_drafts_like_the_trainers_dspark_block(run, tmp_path):
    """The reference drafter (model/dspark.py) on the export, fed the true tokens as its choices, gives the
    trainer's draft-block logits and confidences (activation quantisers off: exact math)."""
    folder = tmp_path / "model"
    run.export(folder)
    ids = torch.from_numpy(run.streams["heldout"]["chat"].ids[:40].astype("int64"))
    p, Bk = 30, run.cfg.dspark_block_size
    run.net.fake_quant = False
    try:
        with torch.no_grad():
            run.net.eval()
            _, taps = run.net.backbone(ids[None], run.hasher.hash(ids)[None])
            mx = run.net.main_x(taps).view(1, len(ids), -1)
            prev = ids[p + 1:p + 1 + Bk].view(1, 1, Bk)
            logits, conf = run.net.draft_block(ids[None], mx, torch.tensor([[p]]), prev)
    finally:
        run.net.fake_quant = True
    model = load_model(folder, fake_quant=False, dspark=True)
    state = model.new_state()
    model(state, ids[:p + 1])
    draft = model.dspark.draft(model, state, int(ids[p + 1]), choose=lambda row, i: int(ids[p + 2 + i]))
    assert float((draft.logits - logits[0, 0]).abs().max()) < 1e-3
    assert torch.allclose(draft.confidence, torch.sigmoid(conf[0, 0]), atol=1e-5)


def test_total_minutes_fixes_the_step_count_from_measured_steps(run, run_dir):
    """--total-minutes: after the timed warmup steps the count that fits is written to run.json and kept."""
    saved = (run_dir / "run.json").read_text()
    steps = run.s.steps
    try:
        run.s.steps, run.s.total_minutes, run.step = None, 1.0, 8
        assert run.s.warmup <= 3 and lr_at(run.s, 3) == run.s.lr  # no step count yet: the peak after warmup
        run._calibrate([9.0, 9.0, 0.5, 0.5, 0.5, 0.5, 0.5], minutes_used=0.1)
        assert run.s.steps == 8 + int((60 * 0.95 - 6) / 0.5)
        assert json.loads((run_dir / "run.json").read_text())["steps"] == run.s.steps
        again = Run(TrainSettings.smoke(str(run_dir)), log=lambda m: None)
        again._check_run_json()
        assert again.s.steps == run.s.steps
    finally:
        (run_dir / "run.json").write_text(saved)
        run.s.steps, run.s.total_minutes, run.step = steps, None, 1


def test_learning_rate_warms_up_then_decays_to_its_floor():
    s = TrainSettings(out="unused", steps=1000, warmup=100, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(s, 0) == pytest.approx(1e-5) and lr_at(s, 99) == pytest.approx(1e-3)
    assert lr_at(s, 100) == pytest.approx(1e-3)
    assert lr_at(s, 550) == pytest.approx(0.55e-3)
    assert lr_at(s, 1000) == pytest.approx(1e-4)
