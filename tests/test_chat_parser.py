"""The one-shot completion parser against the official parser's outputs (parse_cases.json)."""

import json
from pathlib import Path

import pytest

from dsv41.chat import ParseError, encode_messages, parse_completion

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "encoding"
PARSE_CASES = json.loads((FIXTURES / "parse_cases.json").read_text(encoding="utf-8"))


def mode(case):
    return "thinking" if case["thinking"] else "chat"


def test_fixture_file_has_all_cases():
    assert len(PARSE_CASES) >= 23  # more cases may be added beside the shipped ones


@pytest.mark.parametrize("case", [c for c in PARSE_CASES if c["parsed"] is not None], ids=lambda c: c["name"])
def test_parser_matches_official_result(case):
    assert parse_completion(case["completion"], mode(case)) == case["parsed"]


@pytest.mark.parametrize("case", [c for c in PARSE_CASES if c["parsed"] is None], ids=lambda c: c["name"])
def test_parser_refuses_where_official_raised(case):
    with pytest.raises(ParseError):
        parse_completion(case["completion"], mode(case))


@pytest.mark.parametrize("case", [c for c in PARSE_CASES if c.get("reencodes_identically") is not None],
                         ids=lambda c: c["name"])
def test_parse_then_encode_round_trip(case):
    # The README's rule: encoding the parsed message after a one-user context gives the completion back
    # exactly when the spelling is canonical.
    parsed = parse_completion(case["completion"], mode(case))
    again = encode_messages([parsed], mode(case), context=[{"role": "user", "content": "q"}])
    assert (again == case["completion"]) == case["reencodes_identically"]


def test_namespaced_call_returns_bare_name_and_namespace():
    text = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="files::read">\n'
            '<｜DSML｜ parameter name="path" string="true">/x</｜DSML｜ parameter>\n'
            '</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>')
    [call] = parse_completion(text, "chat")["tool_calls"]
    assert call["namespace"] == "files" and call["function"] == {"name": "read", "arguments": '{"path": "/x"}'}


@pytest.mark.parametrize("text", [
    "a\n\n<｜DSML｜ calls>\n</｜DSML｜ calls>\n\n<｜DSML｜ calls>\n</｜DSML｜ calls><｜end▁of▁sentence｜>",
    "a\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ parameter name=\"k\">1</｜DSML｜ parameter>\n"
    "</｜DSML｜ invoke>\n</｜DSML｜ calls>",
    "a\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n</｜DSML｜ invoke>\n",
    "r\n\n<｜DSML｜ calls>\n</｜DSML｜ calls></think>x<｜end▁of▁sentence｜>",
])
def test_documented_refusals(text):
    # second block, missing string attribute, truncated block, calls before </think> (ENCODING.md §3)
    with pytest.raises(ParseError):
        parse_completion(text, "thinking" if "</think>" in text else "chat")


def test_empty_calls_block_parses_to_no_calls():
    parsed = parse_completion("a\n\n<｜DSML｜ calls>\n</｜DSML｜ calls><｜end▁of▁sentence｜>", "chat")
    assert parsed["content"] == "a" and parsed["tool_calls"] == []


def _random_text(rng, alphabet="ab c\n\"\\<>/{}é中😀\t"):
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))


def _random_value(rng, depth=0):
    kind = rng.choice(["str", "int", "float", "bool", "null", "list", "dict"] if depth < 2 else ["str", "int"])
    if kind == "str":
        return _random_text(rng)
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "float":
        return rng.choice([0.5, -1.25, 1e20, 3.0e-7])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


@pytest.mark.parametrize("seed", range(40))
def test_random_assistant_turns_round_trip(seed):
    # encode(message) as a completion -> parse -> the same message, and encoding the parse gives the same text
    import random
    rng = random.Random(seed)
    thinking_mode = rng.choice(["chat", "thinking"])
    calls = [{"type": "function", "function": {"name": rng.choice(["f", "get_x", "ns::tool"]), "arguments": json.dumps(
        {f"p{i}": _random_value(rng) for i in range(rng.randint(0, 4))}, ensure_ascii=False)}}
        for _ in range(rng.choice([0, 0, 1, 3]))]
    message = {"role": "assistant", "content": _random_text(rng),
               "reasoning_content": _random_text(rng) if thinking_mode == "thinking" else ""}
    if calls:
        message["tool_calls"] = calls
    text = encode_messages([message], thinking_mode, context=[{"role": "user", "content": "q"}])
    parsed = parse_completion(text, thinking_mode)
    assert parsed["content"] == message["content"] and parsed["reasoning_content"] == message["reasoning_content"]
    assert [json.loads(c["function"]["arguments"]) for c in parsed["tool_calls"]] == [
        json.loads(c["function"]["arguments"]) for c in calls]
    assert [c.get("namespace", "") + c["function"]["name"] for c in parsed["tool_calls"]] == [
        c["function"]["name"].replace("::", "") for c in calls]
    assert encode_messages([parsed], thinking_mode, context=[{"role": "user", "content": "q"}]) == text
