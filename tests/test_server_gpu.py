"""`dsv41 serve --device cuda` on the built-in tiny model: the real server process, warmed up on the GPU, answering
the official `openai` client (chat streaming, forced tool calls, json_schema). Every device mismatch on the serve
path (a one-token prompt at position 0, empty compressed caches, Engram tables read from host memory) shows here.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

pytestmark = pytest.mark.gpu

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["paris", "rome", "oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}]
NO_THINKING = {"reasoning_effort": "none"}
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    from server_harness import ServerProcess

    server = ServerProcess(tmp_path_factory.mktemp("gpu-server"), "--device", "cuda")
    yield server
    assert server.terminate() == 0, server.output()[-4000:]


def test_gpu_server_reports_the_cuda_device_and_warmed_up(gpu_server):
    health = gpu_server.health()
    assert health.status_code == 200, health.text
    assert "Traceback" not in gpu_server.output(), gpu_server.output()[-4000:]


def test_gpu_chat_streaming_matches_the_whole_reply(gpu_server):
    client = gpu_server.client()
    from server_harness import SERVED_NAME

    args = dict(model=SERVED_NAME, messages=ASK, max_tokens=24, temperature=0, seed=3, extra_body=NO_THINKING)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens > 0


def test_gpu_forced_tool_call_is_valid(gpu_server):
    from server_harness import SERVED_NAME

    resp = gpu_server.client().chat.completions.create(
        model=SERVED_NAME, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=300, seed=0, extra_body=NO_THINKING)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_gpu_json_schema_reply_is_valid(gpu_server):
    from server_harness import SERVED_NAME

    resp = gpu_server.client().chat.completions.create(
        model=SERVED_NAME, messages=ASK, max_tokens=300, seed=1, extra_body=NO_THINKING,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}})
    assert resp.choices[0].finish_reason == "stop", resp.choices[0]
    jsonschema.validate(json.loads(resp.choices[0].message.content), WEATHER)
