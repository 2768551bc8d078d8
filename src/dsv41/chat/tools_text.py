"""Tool-related text of the V4.1 prompt: the `## Tools` section, the Response Format section, namespaces and
the DSML rendering of an assistant's tool calls (ENCODING.md §2, "System block" and "Tool calls").

The renderers return `Pieces`: the fixed text as template, everything taken from the request (tool schemas,
the response format, call names, parameter names and values) as content."""

import json

from .errors import EncodingError
from .pieces import Pieces
from .tokens import CALLS_CLOSE, CALLS_OPEN, DSML, INVOKE_CLOSE

TOOLS_PREAMBLE = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    f'"<{DSML} calls>" block like the following:\n\n'
    f"<{DSML} calls>\n"
    f'<{DSML} invoke name="$TOOL_NAME">\n'
    f'<{DSML} parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML} parameter>\n'
    "...\n"
    f"</{DSML} invoke>\n"
    f'<{DSML} invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML} invoke>\n"
    f"</{DSML} calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_EPILOGUE = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)
RESPONSE_FORMAT_HEADER = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)
SECTION_JOINER = "\n\n"


def dumps(value) -> str:
    """JSON exactly as the reference writes it: non-ASCII kept, default separators."""
    return json.dumps(value, ensure_ascii=False)


def _namespace_parts(namespace) -> tuple[str | None, str | None]:
    """A namespace given as a string or as {"name", "description"} -> (name, description)."""
    if namespace is None or namespace == "":
        return None, None
    if isinstance(namespace, dict):
        return namespace.get("name") or None, namespace.get("description") or None
    if isinstance(namespace, str):
        return namespace, None
    raise EncodingError(f"tool namespace must be a string or an object, got {type(namespace).__name__}")


def split_qualified_name(name: str) -> tuple[str | None, str]:
    """'ns::tool' -> ('ns', 'tool'); 'tool' -> (None, 'tool'); a second '::' is refused."""
    if not isinstance(name, str):
        raise EncodingError(f"tool name must be a string, got {type(name).__name__}")
    if "::" not in name:
        return None, name
    namespace, bare = name.split("::", 1)
    if "::" in bare:
        raise EncodingError(f"Tool name must not contain '::': {bare}")
    return namespace, bare


def qualify(name: str, *namespaces) -> tuple[str, str | None]:
    """Fold the namespaces given beside a tool/call (and inside its name) into 'ns::name'.

    Returns (qualified name, namespace description or None). Namespaces that disagree are refused.
    """
    from_name, bare = split_qualified_name(name)
    chosen, description = None, None
    for given in namespaces:
        ns_name, ns_description = _namespace_parts(given)
        if ns_name is None:
            continue
        if chosen is not None and ns_name != chosen:
            raise EncodingError(f"Conflicting tool namespaces: {chosen} != {ns_name}")
        chosen = ns_name
        description = description or ns_description
    if chosen is not None and from_name is not None and chosen != from_name:
        raise EncodingError(f"Conflicting tool namespaces: {chosen} != {from_name}")
    namespace = chosen or from_name
    return (f"{namespace}::{bare}" if namespace else bare), description


def tool_schema_line(tool: dict) -> str:
    """One line of the Available Tool Schemas list: the `function` object only, namespace folded in."""
    if not isinstance(tool, dict):
        raise EncodingError(f"each tool must be an object, got {type(tool).__name__}")
    function = tool.get("function", tool)
    if not isinstance(function, dict) or "name" not in function:
        raise EncodingError("each tool needs function.name")
    qualified, ns_description = qualify(function["name"], tool.get("namespace"), function.get("namespace"))
    schema = {k: v for k, v in function.items() if k != "namespace"}
    schema["name"] = qualified
    if ns_description:
        description = schema.get("description")
        schema["description"] = f"{ns_description}\n{description}" if description else ns_description
    return dumps(schema)


def tools_section(tools: list) -> Pieces:
    out = Pieces().t(TOOLS_PREAMBLE)
    for i, tool in enumerate(tools):
        out.t("\n" if i else "").c(tool_schema_line(tool))
    return out.t(TOOLS_EPILOGUE)


def response_format_section(response_format) -> Pieces:
    return Pieces().t(RESPONSE_FORMAT_HEADER).c(dumps(response_format))


def system_text(content: Pieces, tools, response_format) -> Pieces:
    """System content followed by the optional tools and response-format sections."""
    out = Pieces().add(content)
    if tools:
        out.t(SECTION_JOINER).add(tools_section(tools))
    if response_format:
        out.t(SECTION_JOINER).add(response_format_section(response_format))
    return out


def call_arguments(raw) -> dict:
    """The parameters of a call: a dict, a JSON object string, or a double-encoded one.

    Anything that does not end up as an object becomes one parameter named `arguments` holding `raw`.
    """
    value = raw
    for _ in range(2):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except ValueError:
            break
    return value if isinstance(value, dict) else {"arguments": raw}


def render_parameter(name: str, value) -> Pieces:
    out = Pieces().t(f'<{DSML} parameter name="').c(name)
    if isinstance(value, str):
        return out.t('" string="true">').c(value).t(f"</{DSML} parameter>")
    return out.t('" string="false">').c(dumps(value)).t(f"</{DSML} parameter>")


def render_invoke(call: dict) -> Pieces:
    if not isinstance(call, dict):
        raise EncodingError(f"each tool call must be an object, got {type(call).__name__}")
    function = call.get("function", call)
    if not isinstance(function, dict) or "name" not in function:
        raise EncodingError("each tool call needs function.name")
    name, _ = qualify(function["name"], call.get("namespace"), function.get("namespace"))
    out = Pieces().t(f'<{DSML} invoke name="').c(name).t('">\n')
    for i, (key, value) in enumerate(call_arguments(function.get("arguments")).items()):
        out.t("\n" if i else "").add(render_parameter(key, value))
    # A call without arguments still gets its (empty) parameter line.
    return out.t(f"\n{INVOKE_CLOSE}")


def render_calls(calls: list) -> Pieces:
    out = Pieces().t(f"\n\n{CALLS_OPEN}\n")
    for i, call in enumerate(calls):
        out.t("\n" if i else "").add(render_invoke(call))
    return out.t(f"\n{CALLS_CLOSE}")
