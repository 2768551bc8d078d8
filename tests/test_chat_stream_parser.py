"""The streaming parser: same answers as the one-shot (official) parser under any split of the text, markers
held back until decided, OpenAI-shaped tool-call events, schema typing and the server's fallbacks."""

import copy
import json
import random
import re
from pathlib import Path

import pytest

from dsv41.chat import encode_messages, parse_completion
from dsv41.chat.stream_parser import (ContentDelta, Finished, ReasoningDelta, StreamParser, ToolCallArgumentsDelta,
                                      ToolCallEnd, ToolCallStart, parse_output)

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "encoding"
PARSE_CASES = json.loads((FIXTURES / "parse_cases.json").read_text(encoding="utf-8"))
ENCODE_CASES = json.loads((FIXTURES / "encode_cases.json").read_text(encoding="utf-8"))
OK_CASES = [c for c in PARSE_CASES if c["parsed"] is not None]
EOS = "<｜end▁of▁sentence｜>"


def mode(case):
    return "thinking" if case["thinking"] else "chat"


def random_pieces(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def run(pieces, thinking_mode, tools=None, **kwargs):
    """Feed the pieces; return (events, result) and check the event stream's own consistency."""
    truncated = kwargs.pop("truncated", False)
    parser = StreamParser(thinking_mode, tools, **kwargs)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish(truncated=truncated)
    assert isinstance(events[-1], Finished) and not any(isinstance(e, Finished) for e in events[:-1])
    result = events[-1].result
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == result.content
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == result.reasoning_content
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [s.index for s in starts] == list(range(len(result.tool_calls))) == [e.index for e in ends]
    for start, end, call in zip(starts, ends, result.tool_calls):
        fragments = [e for e in events if isinstance(e, ToolCallArgumentsDelta) and e.index == start.index]
        assert events.index(start) < min((events.index(f) for f in fragments), default=len(events))
        assert "".join(f.fragment for f in fragments) == end.arguments == call["function"]["arguments"]
        assert call["id"] == start.id and call["function"]["name"] == start.name
    return events, result


def official_view(result):
    calls = [{k: v for k, v in call.items() if k != "id"} for call in result.tool_calls]
    return {"role": "assistant", "content": result.content, "reasoning_content": result.reasoning_content,
            "tool_calls": calls}


@pytest.mark.parametrize("case", OK_CASES, ids=lambda c: c["name"])
def test_any_split_gives_the_official_parse(case):
    text, rng = case["completion"], random.Random(case["name"])
    splits = [[text], list(text)] + [random_pieces(text, rng) for _ in range(60)]
    for pieces in splits:
        _, result = run(pieces, mode(case))
        assert official_view(result) == case["parsed"] == parse_completion(text, mode(case))


@pytest.mark.parametrize("case", [c for c in PARSE_CASES if c["parsed"] is None], ids=lambda c: c["name"])
def test_refused_completions_never_raise_and_split_invariantly(case):
    text, rng = case["completion"], random.Random(case["name"])
    _, whole = run([text], mode(case))
    for pieces in [list(text)] + [random_pieces(text, rng) for _ in range(20)]:
        _, result = run(pieces, mode(case))
        assert official_view(result) == official_view(whole)


def test_finish_reason_hints():
    assert parse_output("Hi" + EOS, "chat").finish_reason == "stop"
    assert parse_output("Hi", "chat").finish_reason == "length"
    assert parse_output("still thinking", "thinking").finish_reason == "length"
    calls = '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
    assert parse_output(calls, "chat").finish_reason == "tool_calls"
    assert parse_output(calls + EOS, "chat").finish_reason == "tool_calls"
    assert parse_output(calls[:-5], "chat").finish_reason == "length"


def test_markers_are_held_back_until_decided():
    parser = StreamParser("thinking")
    assert parser.feed("Let me think</thi") == [ReasoningDelta("Let me think")]
    assert parser.feed("nk>Answer\n") == [ContentDelta("Answer")]
    assert parser.feed("\n") == []
    assert parser.feed("<｜DSML｜ x") == [ContentDelta("\n\n<｜DSML｜ x")]
    assert parser.feed("<｜end▁of") == []
    assert parser.feed("▁sentence｜>ignored") == []
    assert parser.finish()[-1].result.content == "Answer\n\n<｜DSML｜ x"


def test_special_tokens_never_leak_in_char_by_char_deltas():
    text = "r</think>ok\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n" \
           "<｜DSML｜ parameter name=\"a\" string=\"true\">v</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n" \
           "</｜DSML｜ calls>" + EOS
    events, _ = run(list(text), "thinking")
    for event in events:
        piece = getattr(event, "text", None) or getattr(event, "fragment", "")
        assert "｜" not in piece and "</" not in piece, event


def test_string_values_stream_before_the_parameter_closes():
    parser = StreamParser("chat", None, new_call_id=lambda: "call_fixed")
    head = '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="write">\n<｜DSML｜ parameter name="text" string="true">'
    events = parser.feed(head + 'line "one"\nline two</｜DSML｜ para')
    assert events == [ToolCallStart(0, "call_fixed", "write", None),
                      ToolCallArgumentsDelta(0, '{"text": "line \\"one\\"\\nline two')]


def test_call_ids_are_openai_shaped_and_unique():
    text = '\n\n<｜DSML｜ calls>\n' + '<｜DSML｜ invoke name="f">\n\n</｜DSML｜ invoke>\n' * 3 + '</｜DSML｜ calls>'
    ids = [c["id"] for c in parse_output(text, "chat").tool_calls]
    assert len(set(ids)) == 3 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"},
    "tags": {"type": "array", "items": {"type": "string"}}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    "code": {"type": "string"}}}}}


def call_text(name, params):
    body = "\n".join(f'<｜DSML｜ parameter name="{k}" string="{s}">{v}</｜DSML｜ parameter>' for k, s, v in params)
    return f'<｜DSML｜ invoke name="{name}">\n{body}\n</｜DSML｜ invoke>'


def block(*invokes):
    return "\n\n<｜DSML｜ calls>\n" + "\n".join(invokes) + "\n</｜DSML｜ calls>" + EOS


@pytest.mark.parametrize("params,arguments", [
    ([("city", "true", "Paris"), ("days", "false", "3")], '{"city": "Paris", "days": 3}'),
    ([("days", "true", "3")], '{"days": 3}'),                              # string="true" coerced to the schema
    ([("days", "true", "three")], '{"days": "three"}'),                    # not coercible: stays the text
    ([("days", "false", "abc")], '{"days": "abc"}'),                       # invalid JSON never reaches the client
    ([("code", "false", "42")], '{"code": "42"}'),                         # string-only property
    ([("opts", "false", '{"a": [1, 2]}')], '{"opts": {"a": [1, 2]}}'),
    ([("tags", "true", '["x", "y"]')], '{"tags": ["x", "y"]}'),
    ([("note", "false", "null")], '{"note": null}'),
    ([("note", "true", "null")], '{"note": "null"}'),                      # string allowed: stays a string
    ([("extra", "false", "NaN")], '{"extra": "NaN"}'),                     # not JSON
    ([("extra", "true", 'q"s')], '{"extra": "q\\"s"}'),
    ([], "{}"),
])
def test_arguments_are_typed_by_the_schema(params, arguments):
    result = parse_output(block(call_text("get_weather", params)), "chat", [WEATHER])
    [call] = result.tool_calls
    assert call["function"] == {"name": "get_weather", "arguments": arguments}
    json.loads(call["function"]["arguments"])


def test_undeclared_tool_stays_content():
    text = "Sure." + block(call_text("launch_rockets", [("n", "false", "3")]))
    result = parse_output(text, "chat", [WEATHER])
    assert result.tool_calls == [] and result.content == text[:-len(EOS)] and result.finish_reason == "stop"
    # with no tools declared at all, the same holds
    assert parse_output(text, "chat", []).content == text[:-len(EOS)]


def test_undeclared_tool_after_a_declared_one_ends_the_calls():
    second = call_text("nope", [])
    text = block(call_text("get_weather", [("city", "true", "Oslo")]), second)
    result = parse_output(text, "chat", [WEATHER])
    assert [c["function"]["name"] for c in result.tool_calls] == ["get_weather"]
    assert result.content == second + "\n</｜DSML｜ calls>"


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = block(call_text("get_weather", [("city", "true", "A")]), call_text("get_weather", [("city", "true", "B")]))
    events, result = run([text], "chat", [WEATHER], parallel_tool_calls=False)
    assert [json.loads(c["function"]["arguments"]) for c in result.tool_calls] == [{"city": "A"}]
    assert sum(isinstance(e, ToolCallStart) for e in events) == 1 and result.content == ""


def test_namespaced_tools_report_the_declared_name():
    tools = [{"type": "function", "function": {"name": "db::query", "parameters": {}}},
             {"type": "function", "namespace": "files", "function": {"name": "read"}}]
    text = block(call_text("db::query", [("sql", "true", "select 1")]), call_text("files::read", []))
    calls = parse_output(text, "chat", tools).tool_calls
    assert [(c["function"]["name"], c.get("namespace")) for c in calls] == [("db::query", None), ("read", "files")]


@pytest.mark.parametrize("cut", [-40, -60, -80, -100, -120])
def test_truncated_call_has_valid_json_arguments(cut):
    text = "r</think>" + block(call_text("get_weather", [("city", "true", "Paris, the city of light"),
                                                         ("days", "false", "12345")]))
    for tools in (None, [WEATHER]):
        _, result = run(list(text[:cut]), "thinking", tools)
        assert result.finish_reason == "length"
        for call in result.tool_calls:
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
        assert "｜" not in result.content


def test_typed_parse_is_split_invariant_and_valid_json():
    tools = [WEATHER] + [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {
        "precision": {"type": "number"}, "top_k": {"type": "integer"}}}}}
        for n in ("calculator", "web_search", "ping", "echo", "f")]
    rng = random.Random(7)
    for case in OK_CASES:
        text = case["completion"]
        _, whole = run([text], mode(case), tools)
        for call in whole.tool_calls:
            json.loads(call["function"]["arguments"])
        for _ in range(20):
            _, result = run(random_pieces(text, rng), mode(case), tools)
            assert official_view(result) == official_view(whole)


def _assistant_calls():
    for case in ENCODE_CASES:
        for message in case["messages"]:
            if case["prompt"] is not None and message.get("role") == "assistant" and message.get("tool_calls"):
                yield case, message


@pytest.mark.parametrize("case,message", list(_assistant_calls()), ids=lambda x: x["name"] if "name" in x else "")
def test_encoded_assistant_turns_stream_back_to_their_calls(case, message):
    # The encoder's own rendering of an assistant turn is what a well-behaved model emits.
    thinking_mode = case["kwargs"]["thinking_mode"]
    text = encode_messages([copy.deepcopy(message)], thinking_mode, context=[{"role": "user", "content": "q"}])
    _, result = run(random_pieces(text, random.Random(case["name"])), thinking_mode, None)
    assert result.content == (message.get("content") or "")
    assert [json.loads(c["function"]["arguments"]) for c in result.tool_calls] == [
        json.loads(c["function"]["arguments"]) for c in message["tool_calls"]]


# --- grammar-constrained output -----------------------------------------------------------------------------------
# The server enforces tool_choice required / named with xgrammar's `deepseek_v4_1` structural tag. A random walk
# through that grammar (a toy character vocabulary plus the DSML tag pieces) stands in for a random model: whatever
# the grammar lets through must come out as declared calls whose arguments validate against the tool schemas.

# No JSON strings inside string="false" values: xgrammar's DSML grammar lets a JSON string there contain the
# closing "</｜DSML｜ parameter>" (the official parser, and this one, end the value at it). A real model has no
# reason to write that, and with the real vocabulary it needs the special ｜DSML｜ token inside a JSON string.
GRAMMAR_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
        "opts": {"type": "object", "properties": {"metric": {"type": "boolean"}}, "additionalProperties": False}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {},
                                                                      "additionalProperties": False}}},
]
WALK_VOCAB = (["<think>", "</think>", EOS, "｜DSML｜", '<｜DSML｜ parameter name="', "</｜DSML｜ parameter>",
               '" string="true">', '" string="false">', '<｜DSML｜ invoke name="', "</｜DSML｜ invoke>\n",
               "</｜DSML｜ calls>", "<｜DSML｜ calls>\n", "\n\n", '">\n']
              + [chr(c) for c in range(32, 127)] + ["\n", "\t", "é", "中", "｜", "▁"])


def grammar_walks(tool_choice, thinking, parallel, count, seed):
    xgr = pytest.importorskip("xgrammar", reason="xgrammar (optional 'serve' dependency) is not installed")
    torch = pytest.importorskip("torch", reason="torch is needed for xgrammar's token bitmask")
    info = xgr.TokenizerInfo(WALK_VOCAB, xgr.VocabType.RAW, stop_token_ids=[2])
    tag = xgr.get_model_structural_tag("deepseek_v4_1", tools=GRAMMAR_TOOLS, tool_choice=tool_choice,
                                       reasoning="enabled" if thinking else "disabled",
                                       parallel_tool_calls=parallel, max_whitespace_cnt=4)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_structural_tag(tag)
    shifts = torch.arange(32, dtype=torch.int32)
    rng, walks = random.Random(seed), []
    while len(walks) < count:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)
        out = []
        for _ in range(800):
            if matcher.is_terminated():
                walks.append("".join(out))
                break
            matcher.fill_next_token_bitmask(mask)
            bits = ((mask[0][:, None] >> shifts) & 1).flatten()[:len(WALK_VOCAB)]
            allowed = [i for i in torch.nonzero(bits).flatten().tolist() if i != 2]
            tags = [i for i in allowed if len(WALK_VOCAB[i]) > 1]
            token = rng.choice(tags if tags and rng.random() < 0.35 else allowed)
            assert matcher.accept_token(token)
            out.append(WALK_VOCAB[token])
    return walks


@pytest.mark.parametrize("tool_choice,thinking,parallel", [
    ("required", False, True), ("required", True, True), ("required", False, False), ("named", False, True)])
def test_grammar_constrained_calls_parse_to_valid_arguments(tool_choice, thinking, parallel):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (test dependency) is not installed")
    named = tool_choice == "named"
    choice = {"type": "function", "function": {"name": "get_weather"}} if named else tool_choice
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in GRAMMAR_TOOLS}
    walks = grammar_walks(choice, thinking, parallel, count=12, seed=f"{tool_choice}{thinking}{parallel}")
    rng = random.Random(1)
    for text in walks:
        _, result = run(random_pieces(text + EOS, rng), "thinking" if thinking else "chat", GRAMMAR_TOOLS,
                        parallel_tool_calls=parallel)
        assert result.content == "" and result.finish_reason == "tool_calls", text
        assert len(result.tool_calls) >= 1 and (parallel or len(result.tool_calls) == 1), text
        for call in result.tool_calls:
            assert not named or call["function"]["name"] == "get_weather"
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def test_call_cut_anywhere_is_never_reported_with_hold_calls():
    """A call cut by max_tokens (finish(truncated=True)) is dropped; with hold_calls nothing of it was streamed
    either, so the streamed events and the result agree at every cut (issue 33 item 4)."""
    whole = call_text("get_weather", [("city", "true", "Paris"), ("days", "false", "3")])
    text = "Sure." + block(whole)
    for cut in range(len(text)):
        events, result = run(list(text[:cut]), "chat", [WEATHER], truncated=True, hold_calls=True)
        streamed = [e for e in events if isinstance(e, (ToolCallStart, ToolCallArgumentsDelta))]
        complete = INVOKE_CLOSE_AT <= cut - len("Sure.\n\n<｜DSML｜ calls>\n")
        assert [c["function"]["arguments"] for c in result.tool_calls] == (['{"city": "Paris", "days": 3}']
                                                                           if complete else []), cut
        assert bool(streamed) == complete, cut
        assert result.content == "Sure."[:cut] and "｜" not in result.content


INVOKE_CLOSE_AT = len(call_text("get_weather", [("city", "true", "Paris"), ("days", "false", "3")]))


def test_stray_think_markers_are_never_text():
    _, result = run(list("a</think>b<think>c" + EOS), "chat", [])
    assert result.content == "abc"
    _, result = run(list("r<think>s</think>x</think>y" + EOS), "thinking", [])
    assert (result.reasoning_content, result.content) == ("rs", "xy")
