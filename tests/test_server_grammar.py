"""The grammars accept exactly what the official encoder writes: every tool call the V4.1 encoder renders (and
JSON after `</think>`) is accepted token by token by the compiled grammar and ends it; near misses are refused."""

import json

import pytest

from dsv41.chat import encode_messages
from dsv41.structured.grammar import GrammarError, Grammars
from server_harness import model_dir

NESTED = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"},
                       "filter": NESTED, "tags": {"type": "array", "items": {"type": "string"}},
                       "mode": {"type": "string", "enum": ["fast", "deep"]}},
        "required": ["query"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "free", "parameters": {"type": "object"}}},
]
CALLS = [
    [("search", {"query": "lighthouse keepers", "limit": 3, "exact": True, "filter": {"k": 2}, "tags": ["a", "b"],
                 "mode": "deep"})],
    [("search", {"query": "x"})],
    [("now", {})],
    [("free", {"anything": "goes", "n": [1, 2]})],
    [("search", {"query": "q", "mode": "fast"}), ("now", {})],
]


@pytest.fixture(scope="module")
def setup():
    from dsv41.tokenizer import Tokenizer

    folder = model_dir()
    tokenizer = Tokenizer.from_dir(folder)
    return tokenizer, Grammars(folder / "tokenizer.json", vocab_size=tokenizer.vocab_size,
                               stop_token_ids=[tokenizer.eos_id])


def accepts(tokenizer, compiled, text: str) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    for token in tokenizer.encode(text):
        if not matcher.accept_token(token):
            return False
    return matcher.is_terminated()


def rendered(calls, thinking: bool) -> str:
    message = {"role": "assistant", "content": "", "reasoning_content": "let me look" if thinking else "",
               "tool_calls": [{"type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                              for n, a in calls]}
    return encode_messages([message], "thinking" if thinking else "chat", context=[{"role": "user", "content": "q"}])


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("calls", CALLS, ids=["all-types", "required-only", "no-args", "free-form", "two-calls"])
def test_required_grammar_accepts_the_encoders_calls(setup, calls, thinking):
    tokenizer, grammars = setup
    text = rendered(calls, thinking)
    parallel = grammars.tool_calls(TOOLS, "required", parallel=True, thinking=thinking)
    assert accepts(tokenizer, parallel, text), text
    single = grammars.tool_calls(TOOLS, "required", parallel=False, thinking=thinking)
    assert accepts(tokenizer, single, text) == (len(calls) == 1)
    named = grammars.tool_calls(TOOLS, {"type": "function", "function": {"name": calls[0][0]}}, parallel=True,
                                thinking=thinking)
    assert accepts(tokenizer, named, text) == (len(calls) == 1)


def test_required_grammar_refuses_near_misses(setup):
    tokenizer, grammars = setup
    grammar = grammars.tool_calls(TOOLS, "required", parallel=True, thinking=False)
    good = rendered([("search", {"query": "x", "limit": 2})], thinking=False)
    assert accepts(tokenizer, grammar, good)
    for bad in (good.replace('string="false">2', 'string="false">two'),          # not an integer
                good.replace("</｜DSML｜ parameter>\n<", "</｜DSML｜ parameter>\n\n<"),  # extra blank line
                good.replace('name="search"', 'name="unknown"'),                 # undeclared tool
                good.replace('name="query" string="true">x</｜DSML｜ parameter>\n', ""),  # required arg missing
                "plain text" + good):                                            # text before the calls
        assert not accepts(tokenizer, grammar, bad), bad


def test_json_after_think_and_bad_schemas(setup):
    tokenizer, grammars = setup
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["city", "n"], "additionalProperties": False}
    eos = tokenizer.decode([tokenizer.eos_id])
    thinking = grammars.json(schema, thinking=True)
    assert accepts(tokenizer, thinking, 'hmm, Paris</think>{"city": "Paris", "n": 3}' + eos)
    assert not accepts(tokenizer, thinking, '{"city": "Paris", "n": 3}' + eos)  # the reasoning must close first
    chat = grammars.json(schema, thinking=False)
    assert accepts(tokenizer, chat, '{"city": "Paris", "n": 3}' + eos)
    assert not accepts(tokenizer, chat, '{"city": "Paris", "n": "3"}' + eos)
    assert not accepts(tokenizer, chat, '{"city": "Paris", "n": 3, "x": 1}' + eos)
    for bad in ({"type": "object", "properties": {"a": {"type": "strin"}}}, {"$ref": "#/$defs/none"}, "not a schema"):
        with pytest.raises(GrammarError):
            grammars.check_schema(bad, "response_format.json_schema.schema")
