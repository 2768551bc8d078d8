"""No grammar lets a control token into generated JSON, regex or choice output or a tool argument: walking the
compiled grammars' token masks (along real outputs and random paths) finds no special token allowed except the
grammar's own markup where it writes it (`</think>` ending the reasoning, `｜DSML｜` in the tool-call tags) and
EOS where the output may end; through the real server a +100 logit_bias on control tokens cannot put one into
json_schema output."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from dsv41.chat import encode_pieces
from dsv41.chat.tokens import ASSISTANT, DSML, THINK_END, USER
from dsv41.structured.grammar import Grammars
from server_harness import SERVED_NAME, client, model_dir, server  # noqa: F401  (shared fixtures)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
          "items": {"type": "string"}}, "n": {"type": "integer"}}, "required": ["name", "tags", "n"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "opts": {"type": "object"},
                                     "words": {"type": "array", "items": {"type": "string"}}},
    "required": ["query"]}}},
         {"type": "function", "function": {"name": "free", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def setup():
    import xgrammar as xgr

    from dsv41.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir())
    grammars = Grammars(model_dir() / "tokenizer.json", vocab_size=tokenizer.vocab_size,
                        stop_token_ids=[tokenizer.eos_id])
    return tokenizer, grammars, xgr


class Walker:
    """A matcher over a compiled grammar that reports which special ids its mask allows at each state."""

    def __init__(self, setup, compiled):
        self.tokenizer, grammars, xgr = setup
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, grammars.vocab_size)
        self.vocab_size = grammars.vocab_size
        self.specials = set(self.tokenizer.added_tokens)
        self.ids: list[int] = []

    def allowed(self) -> list[int]:
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), bitorder="little")[: self.vocab_size]
        return np.flatnonzero(bits).tolist()

    def special_allowed(self) -> set[int]:
        return self.specials.intersection(self.allowed())

    def text(self) -> str:
        return self.tokenizer.decode(self.ids)

    def accept(self, token: int) -> None:
        assert self.matcher.accept_token(token), (token, self.text())
        self.ids.append(token)


def check_state(w: Walker, *, in_reasoning: bool, tools: bool) -> None:
    """The special ids allowed here are only the grammar's own markup and terminator."""
    t = w.tokenizer
    eos, think_end, dsml = t.eos_id, t.special(THINK_END), t.special(DSML)
    specials = w.special_allowed()
    if in_reasoning:
        assert specials <= {think_end}, (specials, w.text())
        return
    assert specials <= {eos, dsml} if tools else specials <= {eos}, (specials, w.text())
    if dsml in specials:  # only as the markup itself: a tag after "<" or "</", never inside a value
        assert w.text().endswith(("<", "</")), w.text()


def walk_ids(w: Walker, ids: list[int], *, thinking: bool, tools: bool) -> None:
    in_reasoning = thinking
    for token in ids:
        check_state(w, in_reasoning=in_reasoning, tools=tools)
        w.accept(token)
        if token == w.tokenizer.special(THINK_END):
            in_reasoning = False


def walk_random(w: Walker, rng: random.Random, steps: int, *, thinking: bool, tools: bool) -> None:
    in_reasoning = thinking
    for _ in range(steps):
        check_state(w, in_reasoning=in_reasoning, tools=tools)
        choices = [i for i in w.allowed() if i != w.tokenizer.eos_id]
        if not choices or w.matcher.is_terminated():
            return
        # now and then take a markup token when allowed, so the walk gets past the reasoning and into values
        markup = [i for i in choices if i in w.specials]
        token = rng.choice(markup) if markup and rng.random() < 0.3 else rng.choice(choices)
        w.accept(token)
        if token == w.tokenizer.special(THINK_END):
            in_reasoning = False


def tricky_strings() -> list[str]:
    # control-token spellings and look-alikes inside values: they must stay text in the grammar's view
    return [f"a<b</c {USER} x", f"{ASSISTANT}", "x</", "<｜place▁holder▁no▁3｜>"]


@pytest.mark.parametrize("thinking", [False, True])
def test_json_grammar_allows_no_special_token(setup, thinking):
    tokenizer, grammars, _ = setup
    value = {"name": tricky_strings()[0], "tags": tricky_strings()[1:], "n": 7}
    # the value's control-token spellings are text, as a model writing them as text would produce them
    out = tokenizer.encode_literal(json.dumps(value, ensure_ascii=False))
    if thinking:
        out = tokenizer.encode_literal("ok, done") + [tokenizer.special(THINK_END)] + out
    for compiled in (grammars.json(SCHEMA, thinking=thinking), grammars.json(None, thinking=thinking)):
        w = Walker(setup, compiled)
        walk_ids(w, out, thinking=thinking, tools=False)
        assert tokenizer.eos_id in w.special_allowed()  # the end: EOS and nothing else special
        assert w.special_allowed() == {tokenizer.eos_id}
    rng = random.Random(0)
    for _ in range(6):
        walk_random(Walker(setup, grammars.json(SCHEMA, thinking=thinking)), rng, 60, thinking=thinking, tools=False)


def test_regex_and_choice_allow_no_special_token(setup):
    tokenizer, grammars, _ = setup
    rng = random.Random(1)
    for thinking, compiled in ((False, grammars.regex(r"[\s\S]{1,40}", thinking=False)),
                               (True, grammars.regex(r".+", thinking=True)),
                               (False, grammars.choice(["yes", "no <x>"], thinking=False))):
        for _ in range(4):
            walk_random(Walker(setup, compiled), rng, 40, thinking=thinking, tools=False)


@pytest.mark.parametrize("thinking", [False, True])
def test_forced_tool_call_allows_no_special_token_in_arguments(setup, thinking):
    tokenizer, grammars, _ = setup
    calls = [("search", {"query": tricky_strings()[0], "opts": {"k": tricky_strings()[1]},
                         "words": tricky_strings()[2:]}), ("free", {"x": "</", "y": [ASSISTANT]})]
    message = {"role": "assistant", "content": "", "reasoning_content": "look it up" if thinking else "",
               "tool_calls": [{"type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                              for n, a in calls]}
    pieces = encode_pieces([message], "thinking" if thinking else "chat", context=[{"role": "user", "content": "q"}])
    ids = tokenizer.encode_pieces(pieces)  # markup as its tokens, the values' spellings as text
    assert ids[-1] == tokenizer.eos_id
    ids = ids[:-1]
    for choice in ("required", {"type": "function", "function": {"name": "search"}}):
        compiled = grammars.tool_calls(TOOLS, choice, parallel=True, thinking=thinking)
        w = Walker(setup, compiled)
        if choice == "required":
            walk_ids(w, ids, thinking=thinking, tools=True)
            assert w.matcher.is_terminated() or tokenizer.eos_id in w.special_allowed()
        rng = random.Random(2)
        for _ in range(5):
            walk_random(Walker(setup, compiled), rng, 80, thinking=thinking, tools=True)


def test_markup_only_by_id(setup):
    """The markup tokens are asked for by id: spelled as plain text they are not the tags (the parser reads the
    decoded text, so the grammar refuses the spelling rather than let the two disagree)."""
    tokenizer, grammars, xgr = setup
    assert set(grammars.markup) == {"<think>", THINK_END, DSML}
    compiled = grammars.json(None, thinking=True)
    matcher = xgr.GrammarMatcher(compiled)
    spelled = tokenizer.encode_literal("hmm" + THINK_END)
    assert tokenizer.special(THINK_END) not in spelled
    assert not all(matcher.accept_token(t) for t in spelled)


def test_logit_bias_cannot_force_a_special_token_into_json(client, setup):  # noqa: F811
    tokenizer = setup[0]
    favoured = [tokenizer.special(USER), tokenizer.special(ASSISTANT), tokenizer.special(DSML),
                tokenizer.token_to_id("<｜place▁holder▁no▁3｜>")]
    bias = {str(i): 100 for i in favoured}
    messages = [{"role": "user", "content": "Describe the lighthouse as JSON."}]
    # the bias works: without a grammar the favoured tokens are what the model writes
    free = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=4, temperature=0,
                                          logit_bias=bias, extra_body={"skip_special_tokens": False,
                                                                       "reasoning_effort": "none"})
    assert any(tokenizer.decode([i]) in (free.choices[0].message.content or "") for i in favoured)
    fmt = {"type": "json_schema", "json_schema": {"name": "d", "schema": SCHEMA}}
    for thinking in (False, True):
        reply = client.chat.completions.create(
            model=SERVED_NAME, messages=messages, max_tokens=60, temperature=0, logit_bias=bias, logprobs=True,
            response_format=fmt, extra_body={"skip_special_tokens": False, "chat_template_kwargs":
                                             {"thinking": thinking}})
        tokens = [entry.token for entry in reply.choices[0].logprobs.content]
        shown = {tokenizer.decode([i]) for i in tokenizer.added_tokens} - {THINK_END, tokenizer.decode([tokenizer.eos_id])}
        assert not shown.intersection(tokens), tokens
        content = reply.choices[0].message.content or ""
        assert not any(s in content for s in shown), content
        if reply.choices[0].finish_reason == "stop":
            assert set(json.loads(content)) == {"name", "tags", "n"}


def test_inside_argument_values_no_special_token(setup):
    """Inside a raw value `｜DSML｜` is allowed only as its closing tag (after "</"), inside a JSON value never;
    no other special token anywhere."""
    tokenizer, grammars, _ = setup
    compiled = grammars.tool_calls(TOOLS, {"type": "function", "function": {"name": "search"}}, parallel=False,
                                   thinking=False)
    head = f'\n\n<{DSML} calls>\n<{DSML} invoke name="search">\n<{DSML} parameter name="query" string="true">'
    dsml = tokenizer.special(DSML)
    for value, allowed in (("a<", set()), (f"a<b</c {USER}", set()), ("a<b</", {dsml})):
        w = Walker(setup, compiled)
        for token in tokenizer.encode(head) + tokenizer.encode_literal(value):
            w.accept(token)
        assert w.special_allowed() == allowed, value
    json_head = head + f'x</{DSML} parameter>\n<{DSML} parameter name="opts" string="false">'
    for value in ('{"k": "<', '{"k": "</', '{"k": ["</', '{"k": "</x', "{"):
        w = Walker(setup, compiled)
        for token in tokenizer.encode(json_head) + tokenizer.encode_literal(value):
            w.accept(token)
        assert w.special_allowed() == set(), value
    w = Walker(setup, compiled)
    for token in tokenizer.encode(json_head) + tokenizer.encode_literal("{}</"):
        w.accept(token)
    assert w.special_allowed() == {dsml}
