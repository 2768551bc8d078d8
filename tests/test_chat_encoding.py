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
    assert len(ENCODE_CASES) == 53


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
