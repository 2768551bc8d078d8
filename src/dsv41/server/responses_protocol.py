"""OpenAI Responses API requests (`POST /v1/responses`) -> the chat body `build_chat_prompt` takes.

A Responses request is validated here and rewritten field by field into the chat completions request the V4.1
encoder already renders (one encoder, one set of rules, one grammar path):
- `instructions` -> a system message first; `input` (a string, or a list of items) -> messages
  (`responses_input.Conversation`: message, reasoning, function_call and function_call_output items);
- function `tools` -> chat functions; `tool_choice` none / auto / required / {type: function, name} /
  {type: allowed_tools} -> the chat equivalents; `reasoning.effort` -> `reasoning_effort` (chat's words: none
  and minimal turn thinking off); `text.format` (json_schema / json_object) -> `response_format`;
  `max_output_tokens` -> `max_completion_tokens`.
What cannot be served is refused with a 400 naming the field: `previous_response_id` and `conversation` (no
session store yet), `background: true`, `item_reference`, built-in tools (web_search, file_search, ...) and
their items, images and files, `truncation: auto`, and any field OpenAI's API does not define.
`include: ["message.output_text.logprobs"]` (and `top_logprobs`) -> chat's `logprobs` / `top_logprobs`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from ..chat import effort_to_mode
from ..chat.errors import RequestError
from .errors import bad_request
from .protocol import Number, _Request
from .responses_input import Conversation

MAX_METADATA = 16  # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512
SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
INCLUDABLE = {"file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs"}
# fields OpenAI defines that need what this server does not have; refused when set (not null)
UNSERVED = {
    "previous_response_id": "previous_response_id is not supported: this server keeps no responses (no session "
                            "store yet); send the whole conversation in input",
    "conversation": "conversation is not supported: this server keeps no conversations; send them in input",
    "prompt": "prompt (stored prompt templates) is not supported; send instructions and input",
    "context_management": "context_management is not supported",
    "prompt_cache_options": "prompt_cache_options is not supported",
    "background_options": "background_options is not supported (no background mode)",
    "moderation": "moderation is not supported",
    "image": "image is not supported: this server runs the text model only",
    "access_programs": "access_programs is not supported",
}


class ReasoningConfig(_Request):
    model_config = ConfigDict(extra="forbid")

    effort: StrictStr | StrictInt | None = None  # chat's words, or DeepSeek's 1-100
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # OpenAI's deprecated spelling


class TextConfig(_Request):
    model_config = ConfigDict(extra="forbid")

    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Request):
    model_config = ConfigDict(extra="allow")  # unknown names: refused below with OpenAI's wording

    model: StrictStr | None = None
    input: StrictStr | list[Any]
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    tools: list[Any] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[StrictStr, Field(max_length=512)]],
                        Field(max_length=MAX_METADATA)] | None = None
    store: StrictBool | None = None
    stream: StrictBool = False
    background: StrictBool | None = None
    include: list[StrictStr] | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # accepted, no effect: identifiers, caching and routing hints
    user: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    max_tool_calls: Annotated[StrictInt, Field(ge=1)] | None = None  # counts built-in tool calls: there are none
    stream_options: dict[str, StrictBool] | None = None

    @model_validator(mode="before")
    @classmethod
    def _shapes(cls, data):
        """The errors pydantic would word with our class names or its union members, in our words."""
        if isinstance(data, dict):
            if "input" in data and not isinstance(data["input"], (str, list)):
                raise bad_request("input must be a string or a list of input items", param="input")
            for name in ("reasoning", "text"):
                if data.get(name) is not None and not isinstance(data[name], dict):
                    raise bad_request(f"{name} must be an object", param=name)
        return data

    @model_validator(mode="after")
    def _served(self):
        extra = sorted(set(self.model_extra or {}) - set(UNSERVED))
        if extra:
            shown = ", ".join(repr(name[:64]) for name in extra[:5]) + (" ..." if len(extra) > 5 else "")
            raise bad_request(f"Unrecognized request argument supplied: {shown}", param=extra[0][:64])
        for name, message in UNSERVED.items():
            if (self.model_extra or {}).get(name) is not None:
                raise bad_request(message, param=name)
        if self.background:
            raise bad_request("background mode is not supported: send background false (or leave it out)",
                              param="background")
        if self.truncation == "auto":
            raise bad_request('truncation "auto" is not supported: the server never drops input (a conversation '
                              'past the context is a 400); send "disabled"', param="truncation")
        for i, name in enumerate(self.include or []):
            if name not in INCLUDABLE:
                raise bad_request(f"include[{i}]: {name[:80]!r} is not an includable field", param=f"include[{i}]")
        if self.effort is not None:
            try:
                effort_to_mode(self.effort, "reasoning.effort")
            except RequestError as exc:
                raise bad_request(str(exc), param=exc.param) from None
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if isinstance(self.input, str) and not self.input:
            raise bad_request("input must not be empty", param="input")
        if isinstance(self.input, list) and not self.input:
            raise bad_request("input must not be an empty list", param="input")
        return self

    @property
    def logprobs(self) -> bool:
        """Whether the output text carries its tokens' logprobs (`top_logprobs` alternatives each)."""
        return "message.output_text.logprobs" in (self.include or []) or bool(self.top_logprobs)

    @property
    def effort(self) -> str | int | None:
        return self.reasoning.effort if self.reasoning is not None else None


def chat_messages(req: ResponsesRequest) -> list[dict]:
    conversation = Conversation()
    if req.instructions:
        conversation.messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        conversation.messages.append({"role": "user", "content": req.input})
    else:
        for i, item in enumerate(req.input):
            conversation.add(item, i)
    if not conversation.messages:
        raise bad_request("input holds no message", param="input")
    return conversation.messages


# ------------------------------------------------------------------------------------------- tools, format
def chat_tools(tools: list | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            if isinstance(kind, str):
                raise bad_request(f"{where}: the built-in tool {kind[:60]!r} is not supported by this server "
                                  "(function tools only)", param=f"{where}.type")
            raise bad_request(f'{where} must be an object of type "function"', param=f"{where}.type")
        function = {"name": tool.get("name")}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        if tool.get("description") is not None and not isinstance(tool["description"], str):
            raise bad_request(f"{where}.description must be a string", param=f"{where}.description")
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice, tools: list[dict] | None):
    """(chat tool_choice, the tools offered): allowed_tools narrows the tools to the ones it lists."""
    if choice is None or isinstance(choice, str):
        if choice not in (None, "none", "auto", "required"):
            raise bad_request('tool_choice must be "none", "auto", "required" or an object', param="tool_choice")
        return choice, tools
    kind = choice.get("type")
    if kind == "function":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice.name must be a string", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}, tools
    if kind == "allowed_tools":
        mode, listed = choice.get("mode"), choice.get("tools")
        if mode not in ("auto", "required") or not isinstance(listed, list) or not listed:
            raise bad_request('tool_choice allowed_tools needs mode "auto" or "required" and a non-empty tools list',
                              param="tool_choice")
        names = set()
        for j, entry in enumerate(listed):
            if not isinstance(entry, dict) or entry.get("type") != "function" or not isinstance(entry.get("name"), str):
                raise bad_request(f"tool_choice.tools[{j}] must be a function tool with a name",
                                  param=f"tool_choice.tools[{j}]")
            names.add(entry["name"])
        kept = [t for t in tools or [] if t["function"]["name"] in names]
        missing = names - {t["function"]["name"] for t in kept}
        if missing:
            raise bad_request(f"tool_choice names a tool not in tools: {sorted(missing)[0][:60]!r}",
                              param="tool_choice.tools")
        return mode, kept
    raise bad_request(f"tool_choice of type {str(kind)[:60]!r} is not supported (function tools only)",
                      param="tool_choice.type")


def response_format(text: TextConfig | None) -> dict | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") != "json_schema":
        raise bad_request('text.format.type must be "text", "json_object" or "json_schema"', param="text.format.type")
    name = fmt.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise bad_request("text.format.name must be 1-64 letters, digits, _ or -", param="text.format.name")
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request("text.format.schema must be a JSON schema object", param="text.format.schema")
    envelope = {"name": name, "schema": fmt["schema"]}
    for key in ("strict", "description"):
        if fmt.get(key) is not None:
            envelope[key] = fmt[key]
    return {"type": "json_schema", "json_schema": envelope}


def chat_body(req: ResponsesRequest) -> dict:
    """The chat completions body this request is served as (never streamed itself: the handler streams)."""
    tools = chat_tools(req.tools)
    choice, tools = chat_tool_choice(req.tool_choice, tools)
    body: dict[str, Any] = {"messages": chat_messages(req)}
    optional = {"model": req.model, "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
                "top_p": req.top_p, "tools": tools or None, "tool_choice": choice if tools else None,
                "parallel_tool_calls": req.parallel_tool_calls, "reasoning_effort": req.effort,
                "response_format": response_format(req.text), "logprobs": req.logprobs or None,
                "top_logprobs": req.top_logprobs if req.logprobs else None}
    if choice not in (None, "none", "auto") and not tools:
        raise bad_request(f"tool_choice {choice if isinstance(choice, str) else 'function'!r} needs tools",
                          param="tool_choice")
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


# chat field names in errors -> the Responses request's own names
PARAMS = (("max_completion_tokens", "max_output_tokens"), ("response_format.json_schema.schema", "text.format.schema"),
          ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
          ("reasoning_effort", "reasoning.effort"), ("messages", "input"))


def responses_param(param: str | None) -> str | None:
    """A chat-side error's `param` as the Responses request names it."""
    if param is None:
        return None
    tool = re.match(r"^tools\[(\d+)\]\.function\.(.*)$", param)
    if tool:
        return f"tools[{tool.group(1)}].{tool.group(2)}"
    for chat, ours in PARAMS:
        if param == chat or param.startswith(chat + ".") or param.startswith(chat + "["):
            return ours + param[len(chat):] if chat != "messages" else "input"
    return param
