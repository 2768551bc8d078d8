"""OpenAI chat request -> encoder arguments, checked against the official encoder's prompts where possible."""

import copy
import json
from pathlib import Path

import pytest

from dsv41.chat import RequestError
from dsv41.chat.request_mapping import build_chat_prompt

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "encoding"
CASES = {c["name"]: c for c in json.loads((FIXTURES / "encode_cases.json").read_text(encoding="utf-8"))}
USER_ONLY = [{"role": "user", "content": "q"}]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def effort_line(n):
    return f"Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)"


def test_request_with_tools_renders_like_official_fixture_1():
    case = CASES["official_fixture_1"]
    result = build_chat_prompt({"model": "x", "messages": copy.deepcopy(case["messages"]), "tools": case["tools"]})
    assert result.thinking_mode == "thinking" and result.reasoning_effort == 75
    assert result.prompt == case["prompt"]


def test_reasoning_field_is_accepted_like_reasoning_content():
    case = CASES["official_fixture_1"]
    messages = copy.deepcopy(case["messages"])
    for m in messages:
        if "reasoning_content" in m:
            m["reasoning"] = m.pop("reasoning_content")
    assert build_chat_prompt({"messages": messages, "tools": case["tools"]}).prompt == case["prompt"]


def test_tools_without_a_system_message_insert_an_empty_one():
    case = CASES["thinking_tools_empty_system"]  # the official prompt for [system "", user] + tools
    messages = [m for m in copy.deepcopy(case["messages"]) if m["role"] != "system"]
    result = build_chat_prompt({"messages": messages, "tools": case["tools"]})
    assert result.messages[0]["role"] == "system" and result.messages[0]["content"] == ""
    assert result.prompt == case["prompt"]


def test_response_format_and_tools_render_like_the_official_case():
    case = CASES["chat_tools_and_response_format"]
    messages = copy.deepcopy(case["messages"])
    response_format = messages[0].pop("response_format")
    result = build_chat_prompt({"messages": messages, "tools": case["tools"], "response_format": response_format,
                                "chat_template_kwargs": {"enable_thinking": False}})
    assert result.prompt == case["prompt"]
    assert result.response_format == response_format


def test_json_object_response_format_without_system_message():
    result = build_chat_prompt({"messages": USER_ONLY, "response_format": {"type": "json_object"},
                                "reasoning_effort": "none"})
    assert result.prompt == ("<｜begin▁of▁sentence｜><｜System｜>\n\n## Response Format:\n\nYou MUST strictly adhere "
                             'to the following schema to reply:\n{"type": "json_object"}<｜User｜>q<｜Assistant｜></think>')


def test_text_response_format_adds_nothing():
    plain = build_chat_prompt({"messages": USER_ONLY})
    assert build_chat_prompt({"messages": USER_ONLY, "response_format": {"type": "text"}}).prompt == plain.prompt


def test_guided_json_gets_the_openai_envelope():
    schema = {"type": "object"}
    result = build_chat_prompt({"messages": USER_ONLY, "guided_json": schema})
    assert result.response_format == {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}


def test_thinking_is_on_by_default_with_effort_75():
    result = build_chat_prompt({"messages": USER_ONLY})
    assert result.prompt == CASES["thinking_default_effort_no_system"]["prompt"].replace("Hello", "q")


@pytest.mark.parametrize("effort,number", [("low", 50), ("medium", 75), ("high", 75), ("xhigh", 100),
                                           ("max", 100), (1, 1), (33, 33), (100, 100), ("HIGH", 75)])
def test_effort_words_map_to_numbers(effort, number):
    result = build_chat_prompt({"messages": USER_ONLY, "reasoning_effort": effort})
    assert result.thinking_mode == "thinking" and result.reasoning_effort == number
    assert effort_line(number) + "\n\n<｜User｜>q<｜Assistant｜><think>" in result.prompt


@pytest.mark.parametrize("effort", ["none", "minimal"])
def test_none_and_minimal_turn_thinking_off(effort):
    result = build_chat_prompt({"messages": USER_ONLY, "reasoning_effort": effort})
    assert result.thinking_mode == "chat"
    assert result.prompt == "<｜begin▁of▁sentence｜><｜User｜>q<｜Assistant｜></think>"


def test_kwargs_effort_wins_over_top_level():
    result = build_chat_prompt({"messages": USER_ONLY, "reasoning_effort": "none",
                                "chat_template_kwargs": {"reasoning_effort": "low"}})
    assert result.thinking_mode == "thinking" and effort_line(50) in result.prompt


@pytest.mark.parametrize("bad", ["extreme", "50", 50.0, True, 0, 101, [], {}])
@pytest.mark.parametrize("where", ["top", "kwargs"])
def test_bad_effort_is_a_request_error_naming_the_param(bad, where):
    request = {"messages": USER_ONLY}
    if where == "top":
        request["reasoning_effort"] = bad
        param = "reasoning_effort"
    else:
        request["chat_template_kwargs"] = {"reasoning_effort": bad}
        param = "chat_template_kwargs.reasoning_effort"
    with pytest.raises(RequestError) as info:
        build_chat_prompt(request)
    assert info.value.param == param and param in str(info.value)


@pytest.mark.parametrize("key", ["enable_thinking", "thinking"])
def test_thinking_switches_set_the_mode(key):
    off = build_chat_prompt({"messages": USER_ONLY, "chat_template_kwargs": {key: False}})
    on = build_chat_prompt({"messages": USER_ONLY, "reasoning_effort": "none", "chat_template_kwargs": {key: True}})
    assert off.thinking_mode == "chat" and on.thinking_mode == "thinking"


@pytest.mark.parametrize("kwargs,param", [
    ("yes", "chat_template_kwargs"),
    ({"enable_thinking": "false"}, "chat_template_kwargs.enable_thinking"),
    ({"thinking": 1}, "chat_template_kwargs.thinking"),
    ({"enable_thinking": True, "thinking": False}, "chat_template_kwargs.enable_thinking"),
])
def test_bad_thinking_switches(kwargs, param):
    with pytest.raises(RequestError) as info:
        build_chat_prompt({"messages": USER_ONLY, "chat_template_kwargs": kwargs})
    assert info.value.param == param


def test_tool_messages_and_string_arguments_render_like_the_official_loop():
    case = CASES["thinking_tool_loop_parallel_out_of_order"]
    messages = copy.deepcopy(case["messages"])
    result = build_chat_prompt({"messages": messages, "tools": case["tools"], "reasoning_effort": "high"})
    assert result.prompt == case["prompt"]


def test_tool_choice_none_offers_no_tools():
    result = build_chat_prompt({"messages": USER_ONLY, "tools": [WEATHER_TOOL], "tool_choice": "none"})
    assert "## Tools" not in result.prompt and result.tools == []


def test_named_tool_choice_must_name_a_declared_tool():
    ok = build_chat_prompt({"messages": USER_ONLY, "tools": [WEATHER_TOOL],
                            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert ok.tool_choice["function"]["name"] == "get_weather"
    with pytest.raises(RequestError) as info:
        build_chat_prompt({"messages": USER_ONLY, "tools": [WEATHER_TOOL],
                           "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert info.value.param == "tool_choice"


@pytest.mark.parametrize("request_body,param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                   "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]},
     "messages[1].tool_calls[0].function.name"),
    ({"messages": USER_ONLY, "tools": {"f": 1}}, "tools"),
    ({"messages": USER_ONLY, "tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"messages": USER_ONLY, "tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools[1].function.name"),
    ({"messages": USER_ONLY, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER_ONLY, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": USER_ONLY, "response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": USER_ONLY, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"messages": USER_ONLY, "guided_json": "{not json"}, "guided_json"),
    ({"messages": USER_ONLY, "continue_final_message": True}, "continue_final_message"),
    ({"messages": USER_ONLY, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"messages": USER_ONLY, "continue_final_message": 1}, "continue_final_message"),
])
def test_malformed_requests_name_the_field(request_body, param):
    with pytest.raises(RequestError) as info:
        build_chat_prompt(request_body)
    assert info.value.param == param


def test_developer_message_is_a_system_message():
    result = build_chat_prompt({"messages": [{"role": "developer", "content": "Be terse."}, {"role": "user",
                                "content": "Hi"}], "reasoning_effort": "none"})
    assert result.prompt == CASES["chat_system_user"]["prompt"].replace("You are terse.", "Be terse.")


def test_continue_final_message_is_a_prefill():
    case = CASES["thinking_prefill_wo_eos"]
    messages = copy.deepcopy(case["messages"])
    del messages[-1]["wo_eos"]
    assert build_chat_prompt({"messages": messages, "continue_final_message": True}).prompt == case["prompt"]


def test_encoder_internal_keys_from_clients_are_not_passed_through():
    messages = [{"role": "user", "content": "q", "task": "query", "tools": [WEATHER_TOOL]}]
    assert build_chat_prompt({"messages": messages}).prompt == build_chat_prompt({"messages": USER_ONLY}).prompt


def test_new_parser_follows_the_request():
    text = ('\n\n<｜DSML｜ calls>\n' + '<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" '
            'string="true">Oslo</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n' * 2 + '</｜DSML｜ calls><｜end▁of▁sentence｜>')
    for body, calls in (({"tools": [WEATHER_TOOL]}, 2), ({"tools": [WEATHER_TOOL], "parallel_tool_calls": False}, 1),
                        ({"tools": [WEATHER_TOOL], "tool_choice": "none"}, 0), ({}, 0)):
        chat = build_chat_prompt({"messages": USER_ONLY, "reasoning_effort": "none", **body})
        parser = chat.new_parser()
        parser.feed(text)
        parser.finish()
        assert len(parser.result.tool_calls) == calls
        assert (parser.result.content == "") == (calls > 0)


def test_continued_answer_is_parsed_as_content():
    chat = build_chat_prompt({"messages": [{"role": "user", "content": "q"},
                                           {"role": "assistant", "content": "Sure,", "reasoning_content": "r"}],
                              "continue_final_message": True})
    assert chat.thinking_mode == "thinking" and chat.prompt.endswith("<think>r</think>Sure,")
    parser = chat.new_parser()
    parser.feed(" here it is.<｜end▁of▁sentence｜>")
    parser.finish()
    assert (parser.result.content, parser.result.reasoning_content) == (" here it is.", "")
