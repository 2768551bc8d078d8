"""Tool calls and structured output, enforced by xgrammar: the tiny model is random, so every valid call or JSON
document it produces here is the grammar's doing. Thinking is switched off (a random model would rarely close
its reasoning within the token budget); the grammar then starts right after the prompt's `</think>`."""

import json

import jsonschema

from server_harness import SERVED_NAME, client, server  # noqa: F401 (pytest fixtures)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["paris", "rome", "oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
NO_THINKING = {"reasoning_effort": "none"}
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]


def _check_calls(calls, allowed=("get_weather", "get_time")):
    assert calls, "expected at least one tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required_always_calls(client):
    # seeds 0 and 1 as the two choices of one request (choice i draws with seed + i: the single request's draw,
    # test_server_params.py), the prompt prefilled once
    resp = client.chat.completions.create(model=SERVED_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=400, seed=0, n=2,
                                          extra_body=NO_THINKING)
    assert len(resp.choices) == 2
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls)
    # parallel calls allowed: the random model may keep adding calls until max_tokens; the first is complete
    resp = client.chat.completions.create(model=SERVED_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                          max_tokens=400, seed=0, extra_body=NO_THINKING)
    assert resp.choices[0].finish_reason in ("tool_calls", "length")
    _check_calls(resp.choices[0].message.tool_calls[:1])


def test_named_tool_choice_and_no_parallel_calls(client):
    resp = client.chat.completions.create(  # seeds 0 and 1, as the two choices
        model=SERVED_NAME, messages=ASK, tools=TOOLS, max_tokens=400, seed=0, n=2, extra_body=NO_THINKING,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    assert len(resp.choices) == 2
    for choice in resp.choices:
        calls = choice.message.tool_calls
        assert len(calls) == 1
        _check_calls(calls, allowed=("get_time",))


def test_streamed_tool_call_shape(client):
    stream = client.chat.completions.create(model=SERVED_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=400, seed=2, stream=True,
                                            extra_body=NO_THINKING)
    calls, finish = {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                # the first fragment of a call carries its id and complete name
                assert delta.id.startswith("call_") and delta.function.name in SCHEMAS
                calls[delta.index] = {"name": delta.function.name, "arguments": delta.function.arguments or ""}
            else:
                assert delta.id is None and not delta.function.name
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls" and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_tool_choice_auto_is_well_formed(client):
    resp = client.chat.completions.create(model=SERVED_NAME, messages=ASK, tools=TOOLS, max_tokens=20,
                                          seed=0, n=3, extra_body=NO_THINKING)  # seeds 0, 1 and 2, as the choices
    assert len(resp.choices) == 3
    for choice in resp.choices:
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                json.loads(call.function.arguments)


def test_two_turn_tool_exchange(server, client):
    first = client.chat.completions.create(model=SERVED_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=400, seed=4, extra_body=NO_THINKING)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": first.choices[0].message.content,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = client.chat.completions.create(model=SERVED_NAME, messages=history, tools=TOOLS, max_tokens=8,
                                            seed=4, extra_body=NO_THINKING)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the second prompt carries the call and its result, and extends the first prompt (tools keep history)
    with server.http() as http:
        text = http.post("/detokenize", json={"tokens": http.post("/tokenize", json={
            "messages": history, "tools": TOOLS, **NO_THINKING}).json()["tokens"]}).json()["prompt"]
        first_prompt = http.post("/detokenize", json={"tokens": http.post("/tokenize", json={
            "messages": ASK, "tools": TOOLS, **NO_THINKING}).json()["tokens"]}).json()["prompt"]
    assert "<tool_result>sunny, 21 C</tool_result>" in text
    assert f'invoke name="{call.function.name}"' in text
    assert text.startswith(first_prompt)


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["paris", "rome"]},
                   "rank": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["city", "rank", "tags"],
    "additionalProperties": False,
}


def test_response_format_json_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    resp = client.chat.completions.create(model=SERVED_NAME, messages=ASK, response_format=fmt, max_tokens=200,
                                          seed=0, n=2, extra_body=NO_THINKING)  # seeds 0 and 1, as the choices
    assert len(resp.choices) == 2
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), CITY)
    stream = client.chat.completions.create(model=SERVED_NAME, messages=ASK, response_format=fmt, max_tokens=200,
                                            seed=5, stream=True, extra_body=NO_THINKING)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), CITY)


def test_vllm_structured_output_spellings(client):
    for body in ({"structured_outputs": {"json": CITY}}, {"guided_json": CITY}):
        resp = client.chat.completions.create(model=SERVED_NAME, messages=ASK, max_tokens=200, seed=1,
                                              extra_body={**NO_THINKING, **body})
        jsonschema.validate(json.loads(resp.choices[0].message.content), CITY)
    resp = client.chat.completions.create(model=SERVED_NAME, messages=ASK, max_tokens=50, seed=1,
                                          extra_body={**NO_THINKING, "structured_outputs": {"choice": ["yes", "no"]}})
    assert resp.choices[0].message.content in ("yes", "no")
    comp = client.completions.create(model=SERVED_NAME, prompt="Answer:", max_tokens=50, seed=2,
                                     extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}})
    assert len(comp.choices[0].text) == 6 and comp.choices[0].text[3] == "-"


def test_json_object_starts_an_object(client):
    resp = client.chat.completions.create(model=SERVED_NAME, messages=ASK, max_tokens=6, seed=3,
                                          response_format={"type": "json_object"}, extra_body=NO_THINKING)
    # a random model rarely finishes a free-form object in 6 tokens, but what it wrote is an object's start
    assert resp.choices[0].message.content.lstrip().startswith("{")
