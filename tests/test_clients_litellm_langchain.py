"""LiteLLM's deepseek provider and LangChain's ChatOpenAI against the real server (issue 33), with no internet.

LiteLLM (`litellm.completion(model="deepseek/<served name>", api_base=...)`): what it puts on the wire for the
thinking controls is read from its own pre-call hook, and the reply must land where its users read it
(`reasoning_content` / `content`) with the same text the official `openai` client gets for the same fields;
streaming (its chunk builder included) equals the whole reply; a tool call, whole, streamed and answered.
LangChain (`ChatOpenAI(base_url=...)`): invoke, stream, `bind_tools` and `with_structured_output` (JSON schema).

Offline: LiteLLM reads its bundled model cost map (LITELLM_LOCAL_MODEL_COST_MAP) and its bundled tiktoken files;
every connection these clients open is checked to go to loopback (`no_internet`), so a library that fetched
something at run time would fail here rather than hang on CI.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from dsv41.chat.tokens import THINK_END, THINK_START
from server_harness import API_KEY, SERVED_NAME, client, server  # noqa: F401 (pytest fixtures)

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before litellm is imported: no fetch at import
litellm = pytest.importorskip("litellm", reason="litellm is in the test extra (requirements/dev.lock)")
langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is in the test extra")
from litellm.integrations.custom_logger import CustomLogger  # noqa: E402

HI = [{"role": "user", "content": "Hi"}]
ASK = [{"role": "user", "content": "What time is it in Paris?"}]
ZONE = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": ZONE}}]
LOOPBACK = ("127.0.0.1", "::1", "localhost")
# the clients' own deprecation noise (litellm's pydantic use), not ours
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")]


@pytest.fixture(scope="module", autouse=True)
def no_internet():
    """Connections go to loopback or nowhere: anything else is recorded and refused (asserted empty at the end)."""
    refused = []
    connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def check(host) -> None:
        if host is not None and host not in LOOPBACK:
            refused.append(host)
            raise OSError(101, f"no internet in this test (refused {host})")

    def connect_loopback(sock, address):
        check(address[0] if isinstance(address, tuple) else None)
        return connect(sock, address)

    def resolve_loopback(host, *args, **kwargs):
        check(host.decode() if isinstance(host, bytes) else host)
        return getaddrinfo(host, *args, **kwargs)

    socket.socket.connect, socket.getaddrinfo = connect_loopback, resolve_loopback
    try:
        yield refused
    finally:
        socket.socket.connect, socket.getaddrinfo = connect, getaddrinfo
    assert not refused, f"a client tried the network: {refused}"


class WireCapture(CustomLogger):
    """LiteLLM's pre-call hook: the JSON body it is about to send."""

    def __init__(self):
        super().__init__()
        self.bodies: list[dict] = []

    def log_pre_api_call(self, model, messages, kwargs):
        self.bodies.append(kwargs.get("additional_args", {}).get("complete_input_dict") or {})


@pytest.fixture(scope="module")
def wire():
    capture = WireCapture()
    saved = litellm.callbacks
    litellm.callbacks = [capture]
    yield capture
    litellm.callbacks = saved


@pytest.fixture(scope="module")
def complete(server):  # noqa: F811
    def call(**kwargs):
        return litellm.completion(model=f"deepseek/{SERVED_NAME}", api_base=f"{server.url}/v1", api_key=API_KEY,
                                  num_retries=0, timeout=120, **kwargs)
    return call


# --------------------------------------------------------------------------------------------------- LiteLLM
@pytest.mark.parametrize("controls,wire_fields,thinking", [
    ({}, {}, True),  # nothing sent: our default (thinking, effort high)
    ({"reasoning_effort": "none"}, {"thinking": {"type": "disabled"}}, False),
    ({"reasoning_effort": "low"}, {"thinking": {"type": "enabled"}, "reasoning_effort": "low"}, True),
    ({"reasoning_effort": "max"}, {"thinking": {"type": "enabled"}, "reasoning_effort": "max"}, True),
    ({"thinking": {"type": "disabled"}}, {"thinking": {"type": "disabled"}}, False),
    ({"thinking": {"type": "enabled", "budget_tokens": 64}}, {"thinking": {"type": "enabled"}}, True),
])
def test_litellm_thinking_controls(complete, wire, client, controls, wire_fields, thinking):  # noqa: F811
    wire.bodies.clear()
    reply = complete(messages=HI, max_tokens=10, seed=3, **controls)
    sent = wire.bodies[-1]
    assert {k: sent[k] for k in ("thinking", "reasoning_effort") if k in sent} == wire_fields, sent
    message = reply.choices[0].message
    # the official client with the same fields on the wire: the same reply, field for field
    official = client.chat.completions.create(model=SERVED_NAME, messages=HI, max_tokens=10, seed=3,
                                              extra_body=wire_fields).choices[0].message
    official_reasoning = getattr(official, "reasoning_content", None)
    assert message.content == official.content
    assert getattr(message, "reasoning_content", None) == official_reasoning
    if thinking:
        assert isinstance(message.reasoning_content, str) and message.reasoning_content, message
    else:
        assert getattr(message, "reasoning_content", None) is None and isinstance(message.content, str)
    for text in (message.content or "", getattr(message, "reasoning_content", None) or ""):
        assert THINK_START not in text and THINK_END not in text


def _reasoning_counts(client, **kwargs) -> tuple[list[int], object]:  # noqa: F811
    """Per choice, the tokens before the answer, `</think>` included, read off the official client's logprobs."""
    reply = client.chat.completions.create(model=SERVED_NAME, messages=HI, logprobs=True, **kwargs)
    tokens = [[t.token for t in choice.logprobs.content] for choice in reply.choices]
    return [t.index(THINK_END) + 1 if THINK_END in t else len(t) for t in tokens], reply.usage


def test_litellm_and_langchain_read_the_reasoning_token_count(complete, chat_model, client):  # noqa: F811
    """DeepSeek's API (and OpenAI's) report `usage.completion_tokens_details.reasoning_tokens`; without it
    LiteLLM's chunk builder estimated the count with tiktoken (9 for 12 reasoning tokens) and LangChain had none."""
    budget = {"thinking_token_budget": 3}  # </think> after 3 tokens, then content
    (expected,), _ = _reasoning_counts(client, max_tokens=10, seed=3, extra_body=budget)
    assert expected == 4
    whole = complete(messages=HI, max_tokens=10, seed=3, extra_body=budget)
    assert whole.usage.completion_tokens_details.reasoning_tokens == expected
    streamed = litellm.stream_chunk_builder(list(complete(messages=HI, max_tokens=10, seed=3, extra_body=budget,
                                                          stream=True, stream_options={"include_usage": True})))
    assert streamed.usage.completion_tokens_details.reasoning_tokens == expected
    assert complete(messages=HI, max_tokens=10, seed=3, reasoning_effort="none") \
        .usage.completion_tokens_details.reasoning_tokens == 0
    lc = chat_model(max_tokens=10, seed=3, extra_body=budget).invoke("Hi")
    assert lc.usage_metadata["output_token_details"]["reasoning"] == expected
    # n > 1: the choices' counts summed, as the completion tokens are
    counts, both = _reasoning_counts(client, max_tokens=10, seed=3, n=2, extra_body=budget)
    assert both.completion_tokens_details.reasoning_tokens == sum(counts)


def test_litellm_refuses_an_effort_we_do_not_know(complete):
    """LiteLLM forwards "ultra" (DeepSeek's list has it; ours does not): a 400 naming the field, through
    LiteLLM's own error class."""
    with pytest.raises(litellm.BadRequestError, match="reasoning_effort"):
        complete(messages=HI, max_tokens=4, reasoning_effort="ultra")


@pytest.mark.parametrize("controls", [{"reasoning_effort": "none"}, {"reasoning_effort": "high"}])
def test_litellm_streaming_equals_the_whole_reply(complete, controls):
    kwargs = dict(messages=HI, max_tokens=14, seed=8, **controls)
    reply = complete(**kwargs)
    whole = reply.choices[0]
    chunks = list(complete(stream=True, stream_options={"include_usage": True}, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert content == (whole.message.content or "")
    assert reasoning == (getattr(whole.message, "reasoning_content", None) or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.finish_reason]
    rebuilt = litellm.stream_chunk_builder(chunks)
    assert (rebuilt.choices[0].message.content or "") == content
    assert rebuilt.usage.completion_tokens == reply.usage.completion_tokens > 0


def test_litellm_async_stream(server, complete):  # noqa: F811
    """`acompletion` goes through LiteLLM's own aiohttp transport, not httpx: the same SSE stream, read by it."""
    import asyncio

    kwargs = dict(model=f"deepseek/{SERVED_NAME}", api_base=f"{server.url}/v1", api_key=API_KEY, messages=HI,
                  max_tokens=10, seed=8, reasoning_effort="none")

    async def stream():
        return [chunk async for chunk in await litellm.acompletion(stream=True, **kwargs)]

    chunks = asyncio.run(stream())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == complete(**{k: v for k, v in kwargs.items() if k not in ("model", "api_base", "api_key")}) \
        .choices[0].message.content


def test_litellm_tool_call_whole_streamed_and_answered(complete):
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  reasoning_effort="none", max_tokens=200, seed=0)
    whole = complete(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_time" and call.id
    jsonschema.validate(json.loads(call.function.arguments), ZONE)
    rebuilt = litellm.stream_chunk_builder(list(complete(stream=True, **kwargs))).choices[0]
    assert rebuilt.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in rebuilt.message.tool_calls] == \
        [(call.function.name, call.function.arguments)]
    # the result goes back, thinking on: LiteLLM fills the assistant turn's reasoning_content (" ") as DeepSeek's
    # API demands; the server takes the turn and answers
    history = ASK + [whole.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"time": "12:00"}'}]
    answer = complete(messages=history, tools=TOOLS, max_tokens=8, seed=0,
                      thinking={"type": "enabled"}).choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls"), answer


# --------------------------------------------------------------------------------------------------- LangChain
@pytest.fixture(scope="module")
def chat_model(server):  # noqa: F811
    def make(**kwargs):
        return langchain_openai.ChatOpenAI(model=SERVED_NAME, base_url=f"{server.url}/v1", api_key=API_KEY,
                                           max_retries=0, timeout=120, **kwargs)
    return make


def _merged(chunks):
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    return merged


def test_langchain_invoke_and_stream(chat_model):
    llm = chat_model(max_tokens=12, seed=3, reasoning_effort="none", stream_usage=True)
    whole = llm.invoke("Hi")
    assert isinstance(whole.content, str) and whole.response_metadata["finish_reason"] == "length"
    assert whole.usage_metadata["output_tokens"] == 12
    streamed = _merged(list(llm.stream("Hi")))
    assert streamed.content == whole.content
    assert streamed.usage_metadata["output_tokens"] == 12
    assert streamed.usage_metadata["input_tokens"] == whole.usage_metadata["input_tokens"]
    # thinking on (the default): ChatOpenAI keeps only `content`, which holds no reasoning and no markup
    thinking = chat_model(max_tokens=12, seed=3).invoke("Hi")
    assert THINK_START not in thinking.content and THINK_END not in thinking.content


class GetTime(BaseModel):
    """Current time in a zone"""

    zone: Literal["utc", "cet"] = Field(description="time zone")


def test_langchain_bind_tools(chat_model):
    llm = chat_model(max_tokens=200, seed=0, reasoning_effort="none").bind_tools(
        [GetTime], tool_choice="required", parallel_tool_calls=False)
    whole = llm.invoke("What time is it in Paris?")
    assert whole.response_metadata["finish_reason"] == "tool_calls" and not whole.invalid_tool_calls
    (call,) = whole.tool_calls
    assert call["name"] == "GetTime" and call["args"]["zone"] in ("utc", "cet")
    streamed = _merged(list(llm.stream("What time is it in Paris?")))
    assert not streamed.invalid_tool_calls
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]


class Answer(BaseModel):
    n: int
    word: Literal["a", "b"]


def test_langchain_structured_output_json_schema(chat_model):
    llm = chat_model(max_tokens=80, seed=0, reasoning_effort="none")
    out = llm.with_structured_output(Answer, method="json_schema", include_raw=True).invoke("A number and a word")
    assert out["parsing_error"] is None and isinstance(out["parsed"], Answer), out
    assert out["raw"].response_metadata["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["raw"].content), Answer.model_json_schema())
