"""OpenAI chat request (a plain dict, as parsed from JSON) -> the V4.1 encoder's arguments and prompt text.

Rules (issue 5, RECIPE.md §1.2, fixtures README "OpenAI request -> encoder arguments"):
- thinking is on by default; `chat_template_kwargs.enable_thinking` / `.thinking` (bool), then the `thinking`
  object (DeepSeek's `{"type": "enabled" | "disabled"}`, Anthropic's adaptive) set it explicitly and win over an
  effort word that implies a mode (`resolve_thinking`: the one precedence rule);
- `reasoning_effort` at top level or in `chat_template_kwargs` (kwargs win): none/minimal -> thinking off,
  low -> 50, medium/high -> 75, xhigh/max -> 100, an int 1..100 as is; anything else is a RequestError;
- request `tools` and `response_format` go onto a system message at index 0 (an empty one is inserted when the
  conversation does not start with one); `tool_choice: "none"` offers no tools at all;
- assistant history accepts `reasoning_content` or `reasoning`; `tool_calls[].function.arguments` is a JSON
  string (a dict works too); `developer` messages are system messages;
- `continue_final_message: true` continues the final assistant message (the encoder's `wo_eos`);
- `add_generation_prompt` (vLLM's, default true): false leaves a final user / tool / system turn without its
  generation header (`<｜Assistant｜>` + think token), so the reply continues the prompt text as plain content;
  true together with `continue_final_message: true` is refused, as in vLLM.
Only the fields above reach the encoder: encoder-internal keys a client might send (`task`, `wo_eos`,
message-level `tools`) are not passed through.
"""

import json
from dataclasses import dataclass, field

from .encoding import encode_pieces
from .errors import EncodingError, RequestError
from .stream_parser import StreamParser
from .tools_text import qualify

EFFORT_WORDS = {"low": 50, "medium": 75, "high": 75, "xhigh": 100, "max": 100}
EFFORT_OFF_WORDS = ("none", "minimal")
ROLES = ("system", "developer", "user", "assistant", "tool")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")


@dataclass
class ChatPrompt:
    """Everything the server needs from a chat request to run and parse it."""

    messages: list                       # encoder-ready conversation (system message with tools/format first)
    thinking_mode: str                   # "thinking" or "chat"
    reasoning_effort: int                # the effort number given to the encoder (shown only when thinking)
    prompt: str                          # encode_messages(...) of the above
    pieces: list = field(default_factory=list)  # the same text as template/content pieces (for the tokenizer)
    tools: list = field(default_factory=list)   # tools offered to the model ([] when none or tool_choice none)
    tool_choice: str | dict = "auto"     # "none" | "auto" | "required" | {"type": "function", "function": {...}}
    response_format: dict | None = None  # the json_schema / json_object object, None for text
    parallel_tool_calls: bool = True
    continue_final_message: bool = False  # the prompt ends inside the last assistant's answer (after </think>)
    add_generation_prompt: bool = True    # False: no generation header after a final user/tool/system turn

    @property
    def reply_in_reasoning(self) -> bool:
        """Whether the reply starts inside reasoning (the prompt opened `<think>` for it)."""
        return self.thinking_mode == "thinking" and not self.continue_final_message and self.add_generation_prompt

    def new_parser(self, **kwargs) -> StreamParser:
        """The output parser for this request (undeclared tool names stay content, values typed by schema; a call
        is reported once its invoke closes, so one cut by max_tokens is never shown: `hold_calls`)."""
        # A continued answer is past </think> already, and a prompt without a generation header is continued as
        # text, so the generated text starts as content.
        mode = self.thinking_mode if self.reply_in_reasoning else "chat"
        kwargs.setdefault("hold_calls", True)
        return StreamParser(mode, self.tools, parallel_tool_calls=self.parallel_tool_calls, **kwargs)


def build_chat_prompt(request: dict) -> ChatPrompt:
    """Map an OpenAI chat request to encoder arguments and render the prompt; RequestError names the field."""
    if not isinstance(request, dict):
        raise RequestError("request body must be a JSON object", param=None)
    kwargs = request.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    thinking, effort = resolve_thinking(request, kwargs)
    tools = _tools(request.get("tools"))
    tool_choice = _tool_choice(request.get("tool_choice"), tools)
    offered = [] if tool_choice == "none" else tools
    response_format = _response_format(request)
    parallel, continuing, generation_prompt = (_optional_bool(request, key) for key in (
        "parallel_tool_calls", "continue_final_message", "add_generation_prompt"))
    if continuing and generation_prompt:
        raise RequestError("continue_final_message and add_generation_prompt cannot both be true",
                           param="add_generation_prompt")
    messages = [_message(m, i) for i, m in enumerate(_message_list(request.get("messages")))]
    if continuing:
        if messages[-1]["role"] != "assistant":
            raise RequestError("continue_final_message needs a final assistant message",
                               param="continue_final_message")
        messages[-1]["wo_eos"] = True
    if offered or response_format:
        if messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": ""})
        if offered:
            messages[0]["tools"] = offered
        if response_format:
            messages[0]["response_format"] = response_format
    mode = "thinking" if thinking else "chat"
    try:
        pieces = encode_pieces(messages, mode, reasoning_effort=effort,
                               add_generation_prompt=generation_prompt is not False)
    except EncodingError as error:
        raise RequestError(str(error), param="messages") from error
    return ChatPrompt(messages=messages, thinking_mode=mode, reasoning_effort=effort, prompt=pieces.text,
                      pieces=pieces,
                      tools=offered, tool_choice=tool_choice, response_format=response_format,
                      parallel_tool_calls=parallel is not False,
                      continue_final_message=bool(continuing),
                      add_generation_prompt=generation_prompt is not False)


def _optional_bool(request: dict, key: str) -> bool | None:
    value = request.get(key)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{key} must be a boolean", param=key)
    return value


def resolve_thinking(request: dict, kwargs: dict) -> tuple[bool, int]:
    """(thinking on?, effort number): THE precedence rule of every endpoint (docs/SERVER.md "Thinking controls").

    Whether the reply reasons, the first of these that is given decides:
      1. `chat_template_kwargs.enable_thinking` / `.thinking` (booleans; they must agree);
      2. the `thinking` object (DeepSeek's API and Anthropic's): type enabled / adaptive -> on, disabled -> off;
      3. the effort: none / minimal -> off, any other effort -> on;
      4. the default: on.
    How much (the effort number the prompt shows when thinking): `chat_template_kwargs.reasoning_effort`, else
    `reasoning_effort` (Anthropic's `output_config.effort` arrives here), else high (75)."""
    if "reasoning_effort" in kwargs and kwargs["reasoning_effort"] is not None:
        raw, param = kwargs["reasoning_effort"], "chat_template_kwargs.reasoning_effort"
    else:
        raw, param = request.get("reasoning_effort"), "reasoning_effort"
    thinking, effort = effort_to_mode(raw, param)
    switches = {key: kwargs[key] for key in ("enable_thinking", "thinking") if kwargs.get(key) is not None}
    for key, value in switches.items():
        if not isinstance(value, bool):
            raise RequestError(f"chat_template_kwargs.{key} must be a boolean", param=f"chat_template_kwargs.{key}")
    if len(set(switches.values())) > 1:
        raise RequestError("chat_template_kwargs.enable_thinking and .thinking disagree",
                           param="chat_template_kwargs.enable_thinking")
    switch = thinking_switch(request.get("thinking"))
    if switches:
        thinking = next(iter(switches.values()))
    elif switch is not None:
        thinking = switch
    return thinking, effort


THINKING_TYPES = {"enabled": True, "adaptive": True, "disabled": False}


def thinking_switch(value) -> bool | None:
    """The `thinking` object's switch (DeepSeek: enabled / disabled; Anthropic also adaptive), None when absent.
    Its other keys (Anthropic's budget_tokens, display) are the caller's business."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in THINKING_TYPES:
        raise RequestError('thinking must be an object {"type": "enabled" | "disabled" | "adaptive"}',
                           param="thinking.type" if isinstance(value, dict) else "thinking")
    return THINKING_TYPES[value["type"]]


def effort_to_mode(raw, param: str = "reasoning_effort") -> tuple[bool, int]:
    """An OpenAI effort value -> (thinking on?, encoder effort number); None means the defaults."""
    if raw is None:
        return True, EFFORT_WORDS["high"]
    if isinstance(raw, str):
        word = raw.strip().lower()
        if word in EFFORT_OFF_WORDS:
            return False, EFFORT_WORDS["high"]
        if word in EFFORT_WORDS:
            return True, EFFORT_WORDS[word]
    elif type(raw) is int and 1 <= raw <= 100:
        return True, raw
    raise RequestError(
        f"{param} must be one of none, minimal, low, medium, high, xhigh, max or an integer 1-100, got {raw!r}",
        param=param)


def _message_list(messages) -> list:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    return messages


def _content(value, where: str, *, required: bool):
    if value is None:
        if required:
            raise RequestError(f"{where} must not be null", param=where)
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for j, part in enumerate(value):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise RequestError(f"{where}[{j}] must be an object with a type", param=f"{where}[{j}]")
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise RequestError(f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
        return value
    raise RequestError(f"{where} must be a string or a list of content parts", param=where)


def _message(message, index: int) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object", param=where)
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
    if role in ("system", "developer"):
        return {"role": "system", "content": _content(message.get("content"), f"{where}.content", required=False)}
    if role == "user":
        return {"role": "user", "content": _content(message.get("content"), f"{where}.content", required=True)}
    if role == "tool":
        out = {"role": "tool", "content": _content(message.get("content"), f"{where}.content", required=False)}
        if message.get("tool_call_id") is not None:
            out["tool_call_id"] = message["tool_call_id"]
        return out
    out = {"role": "assistant", "content": _content(message.get("content"), f"{where}.content", required=False)}
    reasoning = message.get("reasoning_content")
    if reasoning is None:
        reasoning = message.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise RequestError(f"{where}.reasoning_content must be a string", param=f"{where}.reasoning_content")
        out["reasoning_content"] = reasoning
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [_history_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
    return out


def _history_call(call, where: str) -> dict:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise RequestError(f"{where} must be an object with a function", param=where)
    function = call["function"]
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise RequestError(f"{where}.function.name must be a non-empty string", param=f"{where}.function.name")
    arguments = function.get("arguments", "{}")
    if arguments is None:
        arguments = "{}"
    if not isinstance(arguments, (str, dict)):
        raise RequestError(f"{where}.function.arguments must be a JSON string", param=f"{where}.function.arguments")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if call.get("id") is not None:
        out["id"] = call["id"]
    for holder, target in ((call, out), (function, out["function"])):
        if holder.get("namespace") is not None:
            target["namespace"] = holder["namespace"]
    return out


def _tools(tools) -> list:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("tools must be a list", param="tools")
    seen = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise RequestError(f'{where} must be an object of type "function"', param=where)
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"{where}.function.name must be a non-empty string", param=f"{where}.function.name")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise RequestError(f"{where}.function.parameters must be an object", param=f"{where}.function.parameters")
        name = tool_qualified_name(tool, where)
        if name in seen:
            raise RequestError(f"{where}: duplicate tool name {name!r}", param=f"{where}.function.name")
        seen.add(name)
    return tools


def tool_qualified_name(tool: dict, where: str = "tools") -> str:
    """The name a tool is called by in DSML ('ns::name' when it has a namespace)."""
    function = tool["function"]
    try:
        return qualify(function["name"], tool.get("namespace"), function.get("namespace"))[0]
    except EncodingError as error:
        raise RequestError(f"{where}: {error}", param=where) from error


def _tool_choice(choice, tools: list):
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise RequestError('tool_choice "required" needs tools', param="tool_choice")
        return choice
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in {t["function"]["name"] for t in tools} | {tool_qualified_name(t) for t in tools}:
            raise RequestError(f"tool_choice names an unknown tool {name!r}", param="tool_choice")
        return choice
    raise RequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                       '"function": {"name": ...}}', param="tool_choice")


def _response_format(request: dict) -> dict | None:
    """The object rendered as the Response Format section (OpenAI's envelope, dumped as given)."""
    response_format = request.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or response_format.get("type") not in RESPONSE_FORMAT_TYPES:
            raise RequestError('response_format.type must be "text", "json_object", "json_schema" or "structural_tag"',
                               param="response_format")
        if response_format["type"] in ("text", "structural_tag"):  # a structural tag is enforced, not described
            return None
        if response_format["type"] == "json_schema" and not isinstance(response_format.get("json_schema"), dict):
            raise RequestError("response_format.json_schema must be an object", param="response_format.json_schema")
        return response_format
    # vLLM's spellings carry a bare schema; give it OpenAI's envelope so the prompt reads the same.
    structured = request.get("structured_outputs")
    if isinstance(structured, dict) and structured.get("json") is not None:
        return _schema_envelope(structured["json"], "structured_outputs.json")
    if request.get("guided_json") is not None:
        return _schema_envelope(request["guided_json"], "guided_json")
    return None


def _schema_envelope(schema, param: str) -> dict:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise RequestError(f"{param} is not valid JSON: {error}", param=param) from error
    if not isinstance(schema, dict):
        raise RequestError(f"{param} must be a JSON schema object", param=param)
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
