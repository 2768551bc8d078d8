"""The V4.1 encoder against the official encoder's outputs (shared/fixtures/encoding/encode_cases.json)."""

import copy
import json
from pathlib import Path

import pytest

from dsv41.chat import EncodingError, encode_messages
from dsv41.chat import tokens

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "encoding"
ENCODE_CASES = json.loads((FIXTURES / "encode_cases.json").read_text(encoding="utf-8"))


def replay(case):
    """The README's replay rule: request-level tools go onto messages[0]."""
    messages = copy.deepcopy(case["messages"])
    if case["tools"] is not None:
        messages[0]["tools"] = case["tools"]
    return encode_messages(messages, **copy.deepcopy(case["kwargs"]))


def test_fixture_file_has_all_cases():
    assert len(ENCODE_CASES) >= 53  # more cases may be added beside the shipped ones


@pytest.mark.parametrize("case", [c for c in ENCODE_CASES if c["prompt"] is not None], ids=lambda c: c["name"])
def test_encoder_matches_official_output(case):
    assert replay(case) == case["prompt"]


@pytest.mark.parametrize("case", [c for c in ENCODE_CASES if c["prompt"] is None], ids=lambda c: c["name"])
def test_encoder_refuses_where_official_raised(case):
    with pytest.raises(EncodingError) as info:
        replay(case)
    assert isinstance(info.value, ValueError)
    assert str(info.value) == case["error"]["message"]


def test_special_token_constants_are_in_the_official_output():
    text = "".join(c["prompt"] for c in ENCODE_CASES if c["prompt"])
    for token in (tokens.BOS, tokens.EOS, tokens.SYSTEM, tokens.USER, tokens.ASSISTANT, tokens.THINK_START,
                  tokens.THINK_END, tokens.DSML, tokens.LATEST_REMINDER, tokens.IMAGE,
                  tokens.TASK_TOKENS["action"], tokens.TASK_TOKENS["query"], tokens.TASK_TOKENS["title"]):
        assert token in text, token


@pytest.mark.parametrize("effort", ["medium", "minimal", "xhigh", "50", 50.0, True, 0, 101, -1, "HIGH"])
@pytest.mark.parametrize("mode", ["chat", "thinking"])
def test_effort_outside_the_official_table_is_refused(effort, mode):
    # ENCODING.md §2: only low/high/max or an int 1..100, validated in chat mode too.
    with pytest.raises(EncodingError, match="Invalid reasoning effort"):
        encode_messages([{"role": "user", "content": "q"}], mode, reasoning_effort=effort)


def test_null_user_content_is_refused_with_the_message_index():
    with pytest.raises(EncodingError, match="message 1 .*user"):
        encode_messages([{"role": "system", "content": "s"}, {"role": "user", "content": None}], "chat")


def test_developer_role_is_refused_in_chat_mode():
    # The official encoder has no developer role; only thinking mode's drop_thinking silently removes it.
    with pytest.raises(EncodingError, match="developer"):
        encode_messages([{"role": "developer", "content": "d"}, {"role": "user", "content": "q"}], "chat")


def test_nested_namespace_in_a_call_name_is_refused():
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "a::b::c", "arguments": "{}"}}]}]
    with pytest.raises(EncodingError, match="must not contain '::'"):
        encode_messages(messages, "chat")


def test_typed_image_placeholder_in_user_text_is_refused():
    with pytest.raises(EncodingError, match="image placeholder"):
        encode_messages([{"role": "user", "content": f"look {tokens.IMAGE}"}], "chat")


def test_tools_on_any_message_keep_earlier_reasoning():
    # Documented rule: a non-empty tools list anywhere (even on a user message, where it is not rendered)
    # switches drop_thinking off; the rendered user text stays the same.
    history = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
               {"role": "user", "content": "q2"}]
    dropped = encode_messages(copy.deepcopy(history), "thinking")
    with_tools = copy.deepcopy(history)
    with_tools[0]["tools"] = [{"type": "function", "function": {"name": "f"}}]
    kept = encode_messages(with_tools, "thinking")
    assert "r1" not in dropped and f"{tokens.ASSISTANT}{tokens.THINK_START}r1{tokens.THINK_END}a1" in kept
    assert "## Tools" not in kept


# Image-part spellings as rendered by DeepSeek's pre-release encoder (smg-project/smg,
# crates/tokenizer/tests/fixtures/deepseek_v41/render_fixtures.json: cases input_image_and_image_pil_spellings,
# empty_text_and_image_parts, image_only_part); image handling is the same in the release.
@pytest.mark.parametrize("parts,expected", [
    ([{"type": "input_image", "image_url": "https://example.com/a.png"}, {"type": "text", "text": "which is brighter?"},
      {"type": "image_pil"}],
     "<｜begin▁of▁sentence｜><｜User｜><｜deepseek_image｜>\n\nwhich is brighter?\n\n<｜deepseek_image｜>"
     "<｜Assistant｜></think>"),
    ([{"type": "text", "text": ""}, {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
      {"type": "text", "text": "describe"}],
     "<｜begin▁of▁sentence｜><｜User｜>\n\n<｜deepseek_image｜>\n\ndescribe<｜Assistant｜></think>"),
    ([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
     "<｜begin▁of▁sentence｜><｜User｜><｜deepseek_image｜><｜Assistant｜></think>"),
])
def test_image_part_spellings(parts, expected):
    assert encode_messages([{"role": "user", "content": parts}], "chat") == expected


def _tools_text_from_fixture_1(schema_lines):
    """The ## Tools section around `schema_lines`, cut out of official fixture 1's prompt (data, not our code)."""
    prompt = next(c for c in ENCODE_CASES if c["name"] == "official_fixture_1")["prompt"]
    head = prompt[prompt.index("\n\n## Tools"):prompt.index("### Available Tool Schemas\n\n") + 28]
    tail = prompt[prompt.index("\n\nYou MUST strictly follow"):prompt.index("<｜User｜>")]
    return head + "\n".join(schema_lines) + tail


def test_official_fixture_3_chat_mid_system_tools_after_reminder():
    # Upstream test_input_3 as recorded by smg-project/smg (render_fixtures.json, case hf_3); chat mode, so the
    # pre-release effort table it was rendered with does not show.
    search = {"type": "function", "function": {
        "name": "search", "description": "Web search. Split multiple queries with '||'.",
        "parameters": {"type": "object", "properties": {"queries": {"type": "string", "description": "query1||query2"}},
                       "required": ["queries"], "additionalProperties": False}}}
    open_ = {"type": "function", "function": {
        "name": "open", "description": "Batch open IDs (format 【{id}†...】) or URLs.",
        "parameters": {"type": "object", "properties": {"open_list": {"type": "array", "items": {
            "type": "object", "properties": {
                "id": {"description": "ID or URL", "anyOf": [{"type": "integer"}, {"type": "string"}], "default": -1},
                "loc": {"type": "integer", "description": "Start line", "default": -1},
                "num_lines": {"type": "integer", "description": "", "default": -1}},
            "additionalProperties": False}, "description": ""}},
            "required": ["open_list"], "additionalProperties": False}}}
    messages = [
        {"role": "system", "content": "该助手为DeepSeek，由深度求索公司创造。"},
        {"role": "latest_reminder", "content": "2026-02-21,星期六,广州,App,中文"},
        {"role": "system", "content": "CITATION FORMAT: 【{cursor_id}†L{start_line_id}(-L{end_line_id})?】",
         "tools": [search, open_]},
        {"role": "user", "content": "小柴胡冲剂和布洛芬能一起吃吗？"},
        {"role": "assistant", "content": "", "reasoning_content": "用户想知道小柴胡冲剂和布洛芬能否一起服用。",
         "tool_calls": [{"type": "function", "function": {
             "name": "search", "arguments": "{\"queries\": \"小柴胡冲剂 布洛芬 相互作用 一起吃\"}"}}]},
        {"role": "tool", "content": "[0]"},
        {"role": "assistant", "content": "请及时就医。", "reasoning_content": "现在开始组织回答。", "tool_calls": []},
    ]
    schema_lines = [
        '{"name": "search", "description": "Web search. Split multiple queries with \'||\'.", "parameters": {"type": '
        '"object", "properties": {"queries": {"type": "string", "description": "query1||query2"}}, "required": '
        '["queries"], "additionalProperties": false}}',
        '{"name": "open", "description": "Batch open IDs (format 【{id}†...】) or URLs.", "parameters": {"type": '
        '"object", "properties": {"open_list": {"type": "array", "items": {"type": "object", "properties": {"id": '
        '{"description": "ID or URL", "anyOf": [{"type": "integer"}, {"type": "string"}], "default": -1}, "loc": '
        '{"type": "integer", "description": "Start line", "default": -1}, "num_lines": {"type": "integer", '
        '"description": "", "default": -1}}, "additionalProperties": false}, "description": ""}}, "required": '
        '["open_list"], "additionalProperties": false}}',
    ]
    expected = (
        "<｜begin▁of▁sentence｜><｜System｜>该助手为DeepSeek，由深度求索公司创造。<｜latest_reminder｜>"
        "2026-02-21,星期六,广州,App,中文<｜System｜>CITATION FORMAT: 【{cursor_id}†L{start_line_id}(-L{end_line_id})?】"
        + _tools_text_from_fixture_1(schema_lines) +
        "<｜User｜>小柴胡冲剂和布洛芬能一起吃吗？<｜Assistant｜></think>\n\n<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="search">\n'
        '<｜DSML｜ parameter name="queries" string="true">小柴胡冲剂 布洛芬 相互作用 一起吃</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜><｜User｜><tool_result>[0]</tool_result>"
        "<｜Assistant｜></think>请及时就医。<｜end▁of▁sentence｜>")
    assert encode_messages(messages, "chat") == expected


def test_official_fixture_5_thinking_images_max_effort():
    # Upstream test_input_5 (smg-project/smg render_fixtures.json, case hf_5); "max" is 100 in both effort tables.
    messages = [
        {"role": "system", "content": "You are a helpful vision assistant."},
        {"role": "user", "content": [
            {"type": "text", "text": "请按“第一张、第二张”的顺序回答：第一张图"},
            {"type": "image_url", "image_url": {"url": "examples/images/carrots.jpeg"}},
            {"type": "text", "text": "和第二张图"},
            {"type": "image_url", "image_url": {"url": "examples/images/corn.jpeg"}},
            {"type": "text", "text": "中分别是什么食材？它们通常食用的部位分别是什么？"}]},
    ]
    assert encode_messages(messages, "thinking", reasoning_effort="max") == (
        "<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 100 (range 1-100, the higher the value, the more "
        "thorough the reasoning)\n\nYou are a helpful vision assistant.<｜User｜>请按“第一张、第二张”的顺序回答：第一张图"
        "\n\n<｜deepseek_image｜>\n\n和第二张图\n\n<｜deepseek_image｜>\n\n中分别是什么食材？它们通常食用的部位分别是什么？"
        "<｜Assistant｜><think>")


EFFORT_50 = "Reasoning Effort: 50 (range 1-100, the higher the value, the more thorough the reasoning)"
LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Look up", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
LOOKUP_LINE = ('{"name": "lookup", "description": "Look up", "parameters": {"type": "object", "properties": '
               '{"query": {"type": "string"}}, "required": ["query"]}}')
F_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
F_LINE = '{"name": "f", "parameters": {"type": "object"}}'


# More cases recorded by smg-project/smg (render_fixtures.json) from the pre-release encoder; its default effort
# was 50, so these pass 50 explicitly.
def test_unknown_result_id_sorts_first():
    calls = [{"id": f"call_{x}", "type": "function",
              "function": {"name": "lookup", "arguments": f"{{\"query\": \"{q}\"}}"}}
             for x, q in (("a", "first"), ("b", "second"))]
    messages = [{"role": "system", "content": "", "tools": [LOOKUP]}, {"role": "user", "content": "question"},
                {"role": "assistant", "reasoning_content": "reason", "content": "summary", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_b", "content": "second result"},
                {"role": "tool", "tool_call_id": "call_x", "content": "unknown result"},
                {"role": "tool", "tool_call_id": "call_a", "content": "first result"}]
    invoke = ('<｜DSML｜ invoke name="lookup">\n<｜DSML｜ parameter name="query" string="true">{}</｜DSML｜ parameter>\n'
              "</｜DSML｜ invoke>")
    assert encode_messages(messages, "thinking", reasoning_effort=50) == (
        f"<｜begin▁of▁sentence｜><｜System｜>{EFFORT_50}\n\n" + _tools_text_from_fixture_1([LOOKUP_LINE]) +
        "<｜User｜>question<｜Assistant｜><think>reason</think>summary\n\n<｜DSML｜ calls>\n"
        + invoke.format("first") + "\n" + invoke.format("second") + "\n</｜DSML｜ calls><｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>unknown result</tool_result>\n\n<tool_result>first result</tool_result>\n\n"
        "<tool_result>second result</tool_result><｜Assistant｜><think>")


@pytest.mark.parametrize("arguments,parameters", [
    ('"{\\"a\\": 1}"', '<｜DSML｜ parameter name="a" string="false">1</｜DSML｜ parameter>'),   # double-encoded
    ("[1, 2]", '<｜DSML｜ parameter name="arguments" string="true">[1, 2]</｜DSML｜ parameter>'),  # not an object
    ('{"n": 3, "ok": true, "obj": {"temp": "C"}, "s": "raw <x>"}',
     '<｜DSML｜ parameter name="n" string="false">3</｜DSML｜ parameter>\n'
     '<｜DSML｜ parameter name="ok" string="false">true</｜DSML｜ parameter>\n'
     '<｜DSML｜ parameter name="obj" string="false">{"temp": "C"}</｜DSML｜ parameter>\n'
     '<｜DSML｜ parameter name="s" string="true">raw <x></｜DSML｜ parameter>'),
])
def test_call_arguments_spellings(arguments, parameters):
    messages = [{"role": "system", "content": "", "tools": [F_TOOL]}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    assert encode_messages(messages, "thinking", reasoning_effort=50) == (
        f"<｜begin▁of▁sentence｜><｜System｜>{EFFORT_50}\n\n" + _tools_text_from_fixture_1([F_LINE]) +
        '<｜User｜>q<｜Assistant｜><think></think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n' + parameters +
        "\n</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜><｜User｜><tool_result>done</tool_result>"
        "<｜Assistant｜><think>")
