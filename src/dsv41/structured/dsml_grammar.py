"""A grammar for V4.1 DSML tool calls exactly as the official encoder writes them (ENCODING.md §2):

    \\n\\n<｜DSML｜ calls>\\n
    <｜DSML｜ invoke name="f">\\n
    <｜DSML｜ parameter name="k" string="true">raw text</｜DSML｜ parameter>\\n
    <｜DSML｜ parameter name="n" string="false">JSON</｜DSML｜ parameter>\\n
    </｜DSML｜ invoke>\\n
    </｜DSML｜ calls>

xgrammar's built-in `deepseek_v4_1` tag allows free whitespace between the tags, which a weak (or random) model
fills and the strict parser then refuses; this one allows only the canonical separators. Parameters follow the
tool's schema in declared order (required ones mandatory, others optional); a string-typed property is raw text
(`string="true"`: its enum, pattern or maxLength enforced), any other type is JSON under its sub-schema
(`string="false"`). In thinking mode the reasoning (free text up to `</think>`) comes first.

The `｜DSML｜` and `</think>` in that markup are the tokens themselves, asked for by id (markers.py); no
argument value, raw or JSON, can hold them or any other control token.
"""

from __future__ import annotations

from typing import Any

from dsv41.chat.tokens import CALLS_CLOSE, CALLS_OPEN, DSML
from dsv41.chat.tool_schema import schema_types
from dsv41.structured.markers import NO_TEXT, literal, reasoning_then

PARAM_END = f"</{DSML} parameter>\n"
JSON_WHITESPACE = 1  # at most one whitespace character in a row inside JSON values


def _formats():
    import xgrammar as xgr

    return xgr.structural_tag


def _value(fmt, schema: Any, root: dict) -> tuple[list, list]:
    """(string="true" value formats, string="false" value formats) allowed for one property."""
    types = schema_types(schema)
    raw, typed = [], []
    if types is None or "string" in types:
        raw.append(_raw_string(fmt, schema if isinstance(schema, dict) else {}))
    if types is None or types - {"string"}:
        sub = dict(schema) if isinstance(schema, dict) else {}
        for key in ("$defs", "definitions"):  # keep $refs into the root schema resolvable
            if key in root and key not in sub:
                sub[key] = root[key]
        typed.append(fmt.JSONSchemaFormat(json_schema=sub or True, max_whitespace_cnt=JSON_WHITESPACE))
    return raw, typed


def _raw_string(fmt, schema: dict):
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return fmt.OrFormat(elements=[fmt.ConstStringFormat(value=v) for v in enum]) if len(enum) > 1 \
            else fmt.ConstStringFormat(value=enum[0])
    if isinstance(schema.get("const"), str):
        return fmt.ConstStringFormat(value=schema["const"])
    if isinstance(schema.get("pattern"), str):
        return fmt.RegexFormat(pattern=schema["pattern"])
    max_chars = schema.get("maxLength")
    return fmt.AnyTextFormat(excludes=[PARAM_END.rstrip("\n"), NO_TEXT],
                             max_chars=max_chars if isinstance(max_chars, int) and max_chars >= 0 else None)


def _param(fmt, lit, name: str, schema: Any, root: dict):
    raw, typed = _value(fmt, schema, root)
    tags = [fmt.SequenceFormat(elements=[lit(f'<{DSML} parameter name="{name}" string="true">'), v, lit(PARAM_END)])
            for v in raw]
    tags += [fmt.SequenceFormat(elements=[lit(f'<{DSML} parameter name="{name}" string="false">'), v,
                                          lit(PARAM_END)]) for v in typed]
    return tags[0] if len(tags) == 1 else fmt.OrFormat(elements=tags)


def _invoke(fmt, lit, name: str, parameters: Any):
    head = lit(f'<{DSML} invoke name="{name}">\n')
    tail = lit(f"</{DSML} invoke>\n")
    schema = parameters if isinstance(parameters, dict) else {}
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = set(schema.get("required") or [])
    if not properties:
        if schema.get("additionalProperties") is False or parameters is None:
            return fmt.SequenceFormat(elements=[head, fmt.ConstStringFormat(value="\n"), tail])
        # free-form object: any parameter names, raw or JSON values (or none at all: the blank line)
        any_param = fmt.OrFormat(elements=[
            fmt.SequenceFormat(elements=[
                lit(f'<{DSML} parameter name="'),
                fmt.RegexFormat(pattern=r'[A-Za-z_][A-Za-z0-9_.\-]{0,63}'),
                fmt.ConstStringFormat(value=f'" string="{flag}">'), content, lit(PARAM_END)])
            for flag, content in (("true", fmt.AnyTextFormat(excludes=[PARAM_END.rstrip("\n"), NO_TEXT])),
                                  ("false", fmt.JSONSchemaFormat(json_schema=True,
                                                                 max_whitespace_cnt=JSON_WHITESPACE)))])
        body = fmt.OrFormat(elements=[fmt.ConstStringFormat(value="\n"), fmt.PlusFormat(content=any_param)])
        return fmt.SequenceFormat(elements=[head, body, tail])
    parts = [head]
    for key, prop in properties.items():
        param = _param(fmt, lit, key, prop, schema)
        parts.append(param if key in required else fmt.OptionalFormat(content=param))
    if not required:
        # every parameter optional: the encoder writes a blank line when none is given
        parts = [head, fmt.OrFormat(elements=[fmt.ConstStringFormat(value="\n"),
                                              fmt.SequenceFormat(elements=parts[1:])])]
    parts.append(tail)
    return fmt.SequenceFormat(elements=parts)


def dsml_tool_call_tag(tools: list[dict], tool_choice: Any, *, parallel: bool, thinking: bool,
                       markup: dict[str, int] | None = None):
    """Structural tag for tool_choice "required" or {"type": "function", "function": {"name": ...}}; `markup`:
    the ids of the markup tokens (`Grammars.markup`; without it the markup is plain text)."""
    fmt = _formats()
    markup = markup or {}

    def lit(text: str):
        return literal(fmt, text, markup)

    if isinstance(tool_choice, dict):
        wanted = tool_choice.get("function", {}).get("name")
        chosen = [t for t in tools if t["function"]["name"] == wanted]
        if not chosen:
            raise ValueError(f"tool_choice names an unknown tool {wanted!r}")
        parallel = False
    else:
        chosen = list(tools)
    invokes = [_invoke(fmt, lit, _dsml_name(t), t["function"].get("parameters")) for t in chosen]
    one_call = invokes[0] if len(invokes) == 1 else fmt.OrFormat(elements=invokes)
    elements = [lit("\n\n" + CALLS_OPEN + "\n"), one_call]
    if parallel:
        elements.append(fmt.StarFormat(content=one_call))
    elements.append(lit(CALLS_CLOSE))
    calls = fmt.SequenceFormat(elements=elements)
    if not thinking:
        return fmt.StructuralTag(format=calls)
    return fmt.StructuralTag(format=reasoning_then(fmt, calls, markup))


def _dsml_name(tool: dict) -> str:
    from dsv41.chat.request_mapping import tool_qualified_name

    return tool_qualified_name(tool)
