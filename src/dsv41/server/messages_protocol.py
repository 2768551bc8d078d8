"""Anthropic Messages API requests -> the OpenAI chat body `dsv41.chat.build_chat_prompt` takes; its errors.

A Messages request is rewritten field by field into the chat request the V4.1 encoder already renders (one
encoder, one set of rules): `system` -> a system message; content blocks -> text parts; assistant `thinking`
blocks -> `reasoning_content`; `tool_use` -> `tool_calls` (input dumped as JSON); user `tool_result` blocks ->
`tool` messages (before the user's own text, in order); `tools` (name, description, input_schema) -> functions;
`tool_choice` auto / any / tool / none -> auto / required / named / none (`disable_parallel_tool_use` ->
`parallel_tool_calls: false`); the `thinking` object (absent: disabled, Anthropic's default) and
`output_config.effort` go to the chat path's one precedence rule (`chat.request_mapping.resolve_thinking`),
`budget_tokens` checked as Anthropic does (`thinking_budget`) and enforced by the engine (`ReasoningBudget`);
`output_config.format` (json_schema) becomes the chat body's `response_format`. Images, documents and server tools
are refused (400), and so is what Anthropic refuses (empty content or stop sequences, a tool_result without its
tool_use, a non-boolean is_error, a non-string description).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from .errors import APIError, bad_request
from .protocol import MAX_STOP_STRINGS, Number, _Request

# Anthropic's minimum for thinking.budget_tokens; the same for every model served, the tiny test model included
MIN_BUDGET_TOKENS = 1024

# status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               413: "request_too_large", 415: "invalid_request_error", 421: "invalid_request_error",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def anthropic_error(exc: APIError) -> dict:
    return error_body(exc.status, exc.message)


class MessagesRequest(_Request):
    model_config = ConfigDict(extra="allow")  # unknown fields kept in model_extra: logged once, then ignored

    model: StrictStr | None = None
    messages: list[Any]
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    system: StrictStr | list[Any] | None = None
    stop_sequences: Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: StrictBool = False
    temperature: Annotated[Number, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # effort (low/medium/high/max) and format (json_schema)
    metadata: dict[str, Any] | None = None
    skip_special_tokens: StrictBool = True  # vLLM's, as on the OpenAI routes (server/reply_text.py)

    @model_validator(mode="after")
    def _stop_sequences(self):
        if any(not stop.strip() for stop in self.stop_sequences or []):
            raise ValueError("each stop sequence must contain non-whitespace")
        return self


class CountTokensRequest(MessagesRequest):
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None


def _text_of(blocks, where: str) -> str:
    """A string, or a list of text blocks, as one string (system prompts, tool results)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad_request(f"{where} must be a string or a list of content blocks", param=where)
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise bad_request(f"{where}[{j}]: only text blocks are supported here (got {kind!r})",
                              param=f"{where}[{j}]")
        texts.append(block["text"])
    return "\n\n".join(texts)


def _empty_message(where: str):
    return bad_request(f"{where}: all messages must have non-empty content except for the optional final "
                       "assistant message", param=where)


def _text_block(block: dict, at: str) -> str:
    if not block["text"]:
        raise bad_request(f"{at}: text content blocks must be non-empty", param=f"{at}.text")
    return block["text"]


def _user(content, where: str, calls: set[str]) -> list[dict]:
    """`calls`: the tool_use ids of the assistant message just before; a tool_result must answer one of them."""
    if isinstance(content, str):
        if not content:
            raise _empty_message(where)
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a non-empty list of content blocks", param=where)
    if not content:
        raise _empty_message(where)
    out, parts = [], []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": _text_block(block, at)})
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"{at}.tool_use_id must be a string", param=f"{at}.tool_use_id")
            if block["tool_use_id"] not in calls:
                raise bad_request(f"{at}: unexpected `tool_use_id` found in `tool_result` blocks: "
                                  f"{block['tool_use_id']}. Each `tool_result` block must have a corresponding "
                                  "`tool_use` block in the previous message.", param=f"{at}.tool_use_id")
            if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
                raise bad_request(f"{at}.is_error: Input should be a valid boolean", param=f"{at}.is_error")
            text = _text_of(block.get("content", ""), f"{at}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif kind in ("image", "document"):
            raise bad_request(f"{kind} blocks are not supported: this server runs the text model only", param=at)
        else:
            raise bad_request(f"{at}: unsupported user content block type {kind!r}", param=at)
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _assistant(content, where: str, final: bool) -> dict:
    """`final`: the last message (a prefill), the one assistant message that may be empty."""
    if isinstance(content, str):
        if not content and not final:
            raise _empty_message(where)
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks", param=where)
    if not content and not final:
        raise _empty_message(where)
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(_text_block(block, at))
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad_request(f"{at} needs a string id and name", param=at)
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise bad_request(f"{at}.input must be an object", param=f"{at}.input")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}})
        else:
            raise bad_request(f"{at}: unsupported assistant content block type {kind!r}", param=at)
    out = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    return out


def _tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"{at}: only custom tools (name, input_schema) are supported, not {kind!r}", param=at)
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"{at}.name must be a non-empty string", param=f"{at}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request(f"{at}.input_schema must be an object", param=f"{at}.input_schema")
        function = {"name": tool["name"], "parameters": schema}
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"{at}.description: Input should be a valid string", param=f"{at}.description")
        if description is not None:
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict | None, body: dict) -> None:
    if choice is None:
        return
    kind = choice.get("type")
    if kind == "auto":
        body["tool_choice"] = "auto"
    elif kind == "any":
        body["tool_choice"] = "required"
    elif kind == "none":
        body["tool_choice"] = "none"
    elif kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice.name must be a string", param="tool_choice.name")
        body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise bad_request("tool_choice.type must be auto, any, tool or none", param="tool_choice.type")
    if choice.get("disable_parallel_tool_use") is True:
        body["parallel_tool_calls"] = False


EFFORTS = ("low", "medium", "high", "max")  # Anthropic's output_config.effort, the chat effort words of those names


def _output_config(config: dict | None, body: dict) -> None:
    """Anthropic's `output_config`: `effort` -> the chat body's reasoning_effort (the one precedence rule,
    chat.request_mapping.resolve_thinking); `format` {type: json_schema, schema} -> response_format (the schema
    in the prompt and enforced by the grammar, as on the chat route)."""
    if config is None:
        return
    effort = config.get("effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise bad_request(f"output_config.effort must be one of {', '.join(EFFORTS)}", param="output_config.effort")
        body["reasoning_effort"] = effort
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise bad_request('output_config.format must be {"type": "json_schema", "schema": {...}}',
                              param="output_config.format")
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    unknown = sorted(set(config) - {"effort", "format"})
    if unknown:
        raise bad_request(f"output_config.{unknown[0]}: Extra inputs are not permitted",
                          param=f"output_config.{unknown[0]}")


def thinking_budget(req: MessagesRequest) -> int | None:
    """The reasoning budget in tokens, or None (thinking off, or adaptive without a budget), checked as
    Anthropic's API does: `enabled` needs an integer `budget_tokens` >= 1024 and below `max_tokens`; `adaptive`
    takes none."""
    thinking = req.thinking or {}
    kind = thinking.get("type")
    if kind not in ("enabled", "adaptive"):
        return None
    budget = thinking.get("budget_tokens")
    if kind == "adaptive":
        if budget is not None:
            raise bad_request("thinking.adaptive.budget_tokens: Extra inputs are not permitted",
                              param="thinking.budget_tokens")
        return None
    if budget is None:
        raise bad_request("thinking.enabled.budget_tokens: Field required", param="thinking.budget_tokens")
    if type(budget) is not int:
        raise bad_request("thinking.enabled.budget_tokens: Input should be a valid integer",
                          param="thinking.budget_tokens")
    if budget < MIN_BUDGET_TOKENS:
        raise bad_request(f"thinking.enabled.budget_tokens: Input should be greater than or equal to "
                          f"{MIN_BUDGET_TOKENS}", param="thinking.budget_tokens")
    if req.max_tokens is not None and budget >= req.max_tokens:
        raise bad_request("`max_tokens` must be greater than `thinking.budget_tokens`", param="max_tokens")
    return budget


def chat_body(req: MessagesRequest) -> dict:
    """The OpenAI chat request the encoder renders for this Messages request."""
    messages = []
    if req.system is not None:
        messages.append({"role": "system", "content": _text_of(req.system, "system")})
    if not req.messages:
        raise bad_request("messages must be a non-empty list", param="messages")
    calls: set[str] = set()  # the tool_use ids of the previous (assistant) message
    for i, message in enumerate(req.messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user":
            messages += _user(message.get("content"), f"{where}.content", calls)
            calls = set()
        elif role == "assistant":
            messages.append(_assistant(message.get("content"), f"{where}.content", final=i == len(req.messages) - 1))
            calls = {call["id"] for call in messages[-1].get("tool_calls", [])}
        else:
            raise bad_request(f"{where}.role must be user or assistant, got {role!r}", param=f"{where}.role")
    # thinking: Anthropic's default is off; the object itself goes to the one precedence rule of the chat path
    body: dict = {"messages": messages, "thinking": req.thinking or {"type": "disabled"}}
    _output_config(req.output_config, body)
    thinking_budget(req)  # refused here when it is not one Anthropic accepts (count_tokens too)
    tools = _tools(req.tools)
    if tools:
        body["tools"] = tools
    _tool_choice(req.tool_choice, body)
    if messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        body["continue_final_message"] = True  # Anthropic's prefill: the reply continues the last turn
    return body
