"""Typing DSML parameter values by the request's tool schemas (issue 5: "arguments typed by the tool's JSON
schema"; `string="false"` values are JSON).

The official parser splices `string="false"` text into `arguments` unchecked. A server that knows the tools
instead guarantees valid JSON arguments that follow the schema where the model's text allows it.
"""

import json

from .tools_text import qualify


def schema_types(schema) -> set[str] | None:
    """The JSON types a property schema admits, or None when it does not constrain the type."""
    if not isinstance(schema, dict):
        return None
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or []:
            branch_types = schema_types(branch)
            if branch_types is None:
                return None
            types |= branch_types
    if not types and isinstance(schema.get("enum"), list):
        types = {"string" if isinstance(v, str) else "other" for v in schema["enum"]}
    return types or None


class ToolSpec:
    """One declared tool as the parser needs it: the name to report and each property's schema."""

    def __init__(self, tool: dict):
        function = tool.get("function", tool)
        self.qualified_name = qualify(function["name"], tool.get("namespace"), function.get("namespace"))[0]
        self.name = function["name"]
        namespace = tool.get("namespace") or function.get("namespace")
        self.namespace = namespace.get("name") if isinstance(namespace, dict) else namespace
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        self.properties = properties if isinstance(properties, dict) else {}

    def streams_as_string(self, key: str, is_string: bool) -> bool:
        """A string="true" value that will stay a JSON string, so its text can be streamed as it arrives."""
        if not is_string:
            return False
        types = schema_types(self.properties.get(key))
        return types is None or "string" in types

    def value_json(self, key: str, raw: str, is_string: bool) -> str:
        """The JSON text of one parameter value, typed by the property's schema."""
        types = schema_types(self.properties.get(key))
        if is_string and (types is None or "string" in types):
            return json.dumps(raw, ensure_ascii=False)
        try:
            value = json.loads(raw, parse_constant=_reject_constant)
        except ValueError:
            return json.dumps(raw, ensure_ascii=False)
        if types == {"string"} and not isinstance(value, str):
            return json.dumps(raw, ensure_ascii=False)
        return json.dumps(value, ensure_ascii=False) if is_string else raw.strip()


def _reject_constant(name: str):
    # NaN / Infinity are accepted by Python's json but are not JSON; keep such text as a string instead.
    raise ValueError(name)


def tool_specs(tools) -> dict[str, ToolSpec] | None:
    """qualified DSML name -> ToolSpec; None (no tools argument) means "accept every name, untyped"."""
    if tools is None:
        return None
    specs = [ToolSpec(t) for t in tools]
    by_name = {spec.qualified_name: spec for spec in specs}
    # A tool declared with a separate namespace may also be called by its bare name (grammars built from the
    # OpenAI tool list write that one) as long as the bare name is unambiguous.
    for spec in specs:
        if spec.name not in by_name and sum(other.name == spec.name for other in specs) == 1:
            by_name[spec.name] = spec
    return by_name
