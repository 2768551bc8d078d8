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
    assert len(PARSE_CASES) == 23


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
