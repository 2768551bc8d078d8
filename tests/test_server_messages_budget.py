"""Anthropic's `thinking.budget_tokens`: checked as Anthropic's API does (>= 1024, below max_tokens) and enforced
by the engine's constraint (`ReasoningBudget`: once the reasoning has that many tokens, `</think>` is forced),
which follows the request's own tokens only (batched == alone == SerialEngine), with and without a grammar;
end to end with the official `anthropic` client."""

from __future__ import annotations

import asyncio
import time

import anthropic
import pytest

from dsv41.chat.tokens import THINK_END
from dsv41.engine import GenerationRequest, SamplingParams, TokenEvent
from dsv41.engine.constraint import GrammarConstraint, ReasoningBudget
from server_harness import API_KEY, SERVED_NAME, model_dir, server, tokenizer  # noqa: F401  (shared fixtures)

USER = [{"role": "user", "content": "Think about the lighthouse, then answer."}]


@pytest.fixture(scope="module")
def claude(server):  # noqa: F811
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=300)


def test_budget_constraint_alone():
    end, vocab = 7, 64
    c = GrammarConstraint(ReasoningBudget(3, end), vocab)
    for token in (1, 2, 3):
        assert c.mask() is None and c.forced(10) == []
        assert c.accept(token) is False
    only = c.mask()
    assert only is not None and len(only) == 4 * 2
    assert [i for i in range(vocab) if only[i // 8] >> (i % 8) & 1] == [end]
    assert c.forced(0) == [] and c.forced(10) == [end]
    assert c.mask() is None and c.forced(10) == []  # past the reasoning: free again
    import torch

    row = torch.randn(vocab)
    spent = GrammarConstraint(ReasoningBudget(1, end), vocab)
    assert spent.mask_row(row) is row
    spent.accept(2)
    masked = spent.mask_row(row)  # SerialEngine's path: every id but the end at -inf
    assert torch.isinf(masked).sum() == vocab - 1 and masked[end] == row[end]
    early = GrammarConstraint(ReasoningBudget(3, end), vocab)
    early.accept(5)
    early.accept(end)  # the model closed its reasoning itself: nothing is forced later
    for token in (1, 2, 3, 4):
        assert early.mask() is None
        early.accept(token)


def test_budget_then_grammar(tokenizer):  # noqa: F811
    """Over a thinking-mode JSON grammar: the budget closes the reasoning, the grammar takes over."""
    from dsv41.structured.grammar import Grammars

    grammars = Grammars(model_dir() / "tokenizer.json", vocab_size=tokenizer.vocab_size,
                        stop_token_ids=[tokenizer.eos_id])
    end = tokenizer.special(THINK_END)
    c = GrammarConstraint(ReasoningBudget(4, end, grammars.json(None, thinking=True)), tokenizer.vocab_size,
                          tokenizer.encode)
    for token in tokenizer.encode_literal("the keeper climbed")[:4]:
        assert c.forced(10) == []
        c.accept(token)
    assert c.forced(10) == [end]
    assert tokenizer.decode(c.forced(10)) == "{"  # the grammar's forced text follows at once


def _run(engine_kind: str, model, requests, tok):
    from dsv41.compose.build import build_engine, engine_defaults
    from dsv41.compose.serial import SerialEngine

    if engine_kind == "serial":
        async def main():
            engine = SerialEngine(model, max_model_len=512, encode_text=tok.encode)
            await engine.start()
            out = [[e async for e in engine.submit(r)] for r in requests]
            await engine.shutdown()
            return out
        return asyncio.run(main())
    engine = build_engine(engine_defaults(), model, max_model_len=512, encode_text=tok.encode, log=lambda line: None)
    events = [[] for _ in requests]
    for i, r in enumerate(requests):  # all at once: batched together
        engine.core.add(engine.make_sequence(r, events[i].append))
    while engine.core.step():
        pass
    return events


def test_budget_in_both_engines_batched_equals_alone(tokenizer):  # noqa: F811
    from dsv41.model.loader import load_model

    model = load_model(model_dir(), dspark=False)
    tok = tokenizer
    end = tok.special(THINK_END)
    prompt = [tok.bos_id] + tok.encode("<｜User｜>Think.<｜Assistant｜><think>")

    from dsv41.structured.grammar import Grammars

    json_grammar = Grammars(model_dir() / "tokenizer.json", vocab_size=model.cfg.vocab_size,
                            stop_token_ids=[tok.eos_id]).json(None, thinking=True)

    def requests():  # a fresh matcher per run; the last one: the budget over a JSON grammar
        return [GenerationRequest(prompt, 24, SamplingParams(temperature=t, seed=s), logprobs=0,
                                  grammar=ReasoningBudget(b, end, json_grammar if s == 4 else None),
                                  stop_token_ids=frozenset({tok.eos_id}))
                for b, t, s in ((3, 0.0, 1), (9, 0.8, 2), (1, 0.8, 3), (5, 0.8, 4))]

    serial = _run("serial", model, requests(), tok)
    batched = _run("batched", model, requests(), tok)
    alone = [_run("batched", model, [r], tok)[0] for r in requests()]
    assert serial == batched == alone
    cut = 0
    for events, budget in zip(serial, (3, 9, 1, 5)):
        ids = [e.token_id for e in events if isinstance(e, TokenEvent)]
        if end in ids:
            assert ids.index(end) <= budget
            cut += ids.index(end) == budget
        else:  # the reply ended (EOS) inside its budget
            assert len(ids) <= budget + 1 and ids[-1] == tok.eos_id
    assert cut == 4  # this prompt's reasoning runs past every budget: each one was cut exactly there
    ids = [e.token_id for e in serial[3] if isinstance(e, TokenEvent)]
    assert tok.decode(ids[6:7]) == "{"  # then the JSON grammar: its forced "{" right after </think>
    first = [e.token_id for e in serial[0] if isinstance(e, TokenEvent)]
    free = _run("serial", model, [GenerationRequest(prompt, 24, SamplingParams(temperature=0.0, seed=1), logprobs=0,
                                                    stop_token_ids=frozenset({tok.eos_id}))], tok)[0]
    free_ids = [e.token_id for e in free if isinstance(e, TokenEvent)]
    if end not in free_ids[:4]:  # the budget cut a reasoning that would have gone on: exactly 3 tokens of it
        assert first[:4] == free_ids[:3] + [end]


def test_anthropic_checks(server):  # noqa: F811
    cases = [({"type": "enabled", "budget_tokens": 1023}, 2000, "greater than or equal to 1024"),
             ({"type": "enabled", "budget_tokens": 1024}, 1024, "`max_tokens` must be greater"),
             ({"type": "enabled"}, 2000, "Field required"),
             ({"type": "enabled", "budget_tokens": "2000"}, 3000, "valid integer"),
             ({"type": "adaptive", "budget_tokens": 2000}, 3000, "Extra inputs")]
    with server.http() as http:
        for thinking, max_tokens, message in cases:
            r = http.post("/v1/messages", json={"model": SERVED_NAME, "max_tokens": max_tokens, "messages": USER,
                                                "thinking": thinking})
            assert r.status_code == 400, r.text
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
            assert message in r.json()["error"]["message"]
        r = http.post("/v1/messages/count_tokens", json={"model": SERVED_NAME, "messages": USER,
                                                         "thinking": {"type": "enabled", "budget_tokens": 1000}})
        assert r.status_code == 400 and "1024" in r.json()["error"]["message"]
        # an unknown field is accepted, ignored and logged once
        r = http.post("/v1/messages/count_tokens", json={"model": SERVED_NAME, "messages": USER,
                                                         "service_tier": "auto"})
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while "'service_tier' is accepted but not implemented" not in server.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "messages: the request field 'service_tier' is accepted but not implemented" in server.output()


def test_budget_end_to_end(claude, tokenizer):  # noqa: F811
    """A smoke test at the smallest budget Anthropic accepts (1024), streamed: the thinking block stays within it
    and the reply goes on with text (read up to the first text, then the stream is closed). The tiny model closes
    its reasoning by itself after ~150 tokens here, and a reasoning of 1,024 tokens costs ~50 s on this CPU, so
    the cut itself is tested above, at the engine, with small budgets."""
    budget = 1024
    thinking, text = [], []
    with claude.messages.stream(model=SERVED_NAME, max_tokens=budget + 200, messages=USER,
                                thinking={"type": "enabled", "budget_tokens": budget},
                                extra_body={"temperature": 0}) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                thinking.append(event.delta.thinking)
            elif event.type == "content_block_delta" and event.delta.type == "text_delta":
                text.append(event.delta.text)
                break
    assert thinking, "no thinking block"
    # the ids of the reasoning's text (control tokens the model wrote there count as one token each)
    assert len(tokenizer.encode("".join(thinking))) <= budget
    assert text, "no text after the thinking block"
