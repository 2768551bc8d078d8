"""Pieces of the DSML tool-call grammar shared by the one-shot and the streaming parser.

A block is:  <｜DSML｜ calls>\\n  (invoke \\n)*  </｜DSML｜ calls>
an invoke:   <｜DSML｜ invoke name="N">\\n  (param \\n)*  </｜DSML｜ invoke>   (a blank line allowed when no params)
a param:     <｜DSML｜ parameter name="K" string="true|false">VALUE</｜DSML｜ parameter>
Every tag is followed by exactly ">\\n" as written by the encoder; values are raw text.
"""

import json
import re

from .errors import ParseError

# What follows "<｜DSML｜ invoke" / "<｜DSML｜ parameter" up to the tag's closing ">".
INVOKE_ATTRS = re.compile(r'\s*name="([^"]*)"\s*>')
PARAM_ATTRS = re.compile(r'\s*name="([^"]*)"\s*string="(true|false)"\s*>')


def split_call_name(qualified: str) -> tuple[str, str | None]:
    """'ns::tool' -> ('tool', 'ns'); a nested name is refused like the reference does."""
    if "::" not in qualified:
        return qualified, None
    namespace, name = qualified.split("::", 1)
    if "::" in name:
        raise ParseError(f"Tool name must not contain '::': {name}")
    return name, namespace


def json_key(name: str) -> str:
    return json.dumps(name, ensure_ascii=False)


def official_value(value: str, is_string: bool) -> str:
    """The reference's value text: strings JSON-quoted, everything else spliced in unchecked."""
    return json.dumps(value, ensure_ascii=False) if is_string else value


def join_arguments(pairs: list[tuple[str, str]]) -> str:
    """Arguments text rebuilt the reference's way: {"k": v, ...} with ", " / ": " separators."""
    return "{" + ", ".join(f"{json_key(k)}: {v}" for k, v in pairs) + "}"


def tool_call_dict(qualified_name: str, arguments: str) -> dict:
    name, namespace = split_call_name(qualified_name)
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if namespace is not None:
        call["namespace"] = namespace
    return call

