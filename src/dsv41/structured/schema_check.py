"""Which JSON schemas the grammar can enforce, and the schema handed to xgrammar.

xgrammar compiles many schemas it does not enforce: it ignores `not`, `if`/`then`/`else`, `allOf` and the
`dependent*` keywords (any JSON passes), never writes a `required` property that `properties` does not define,
reads `contains` and `uniqueItems` as "an empty array", writes an `enum` value of the wrong `type`, and takes an
empty `anyOf` as the empty string. A reply produced under such a grammar breaks the schema the client sent, so
`enforceable` refuses them (GrammarError -> 400 naming the keyword and where it is). Pure annotations (`title`,
`description`, `format`, ...) and unknown keywords are ignored, as JSON Schema says. An `allOf` of one subschema
(pydantic v1's `{"allOf": [{"$ref": ...}], "description": ...}`) is replaced by that subschema.

The same check runs for `response_format` / `structured_outputs` / `guided_json` and for the parameters of
every tool a `tool_choice` of "required" or a named function enforces.
"""

from __future__ import annotations

from typing import Any

# keywords xgrammar ignores or gets wrong: refused wherever they appear
UNENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains",
              "minContains", "maxContains", "unevaluatedItems", "$dynamicRef", "$recursiveRef")
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "$anchor",
                         "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding", "format",
                         "nullable", "strict", "name"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("additionalProperties", "additionalItems", "propertyNames", "unevaluatedProperties")


class SchemaRefused(ValueError):
    """A schema the grammar cannot enforce; the message names the keyword and its place."""


def enforceable(schema: Any, where: str) -> Any:
    """`schema` as xgrammar should get it, or SchemaRefused. `where` names the request field."""
    if isinstance(schema, bool):
        if schema is False:
            raise SchemaRefused(f"{where} is false: no value can satisfy it")
        return schema
    if not isinstance(schema, dict):
        raise SchemaRefused(f"{where} must be a JSON object")
    return _node(schema, where)


def _node(schema: Any, where: str) -> Any:
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        raise SchemaRefused(f"{where} must be a schema object or a boolean")
    for key in UNENFORCED:
        if key in schema:
            raise SchemaRefused(f"{where}: the keyword {key!r} cannot be enforced by the grammar")
    if schema.get("uniqueItems") is True:
        raise SchemaRefused(f"{where}: the keyword 'uniqueItems' cannot be enforced by the grammar")
    if "unevaluatedProperties" in schema and schema["unevaluatedProperties"] is not False:
        raise SchemaRefused(f"{where}: 'unevaluatedProperties' other than false cannot be enforced by the grammar")
    if "allOf" in schema:
        return _node(_single_all_of(schema, where), where)
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if key in schema:
            value = schema[key]
            if not isinstance(value, dict):
                raise SchemaRefused(f"{where}.{key} must be an object")
            out[key] = {name: _node(sub, f"{where}.{key}.{name}") for name, sub in value.items()}
    for key in _SCHEMA_LISTS:
        if key in schema:
            value = schema[key]
            if not isinstance(value, list) or (key != "prefixItems" and not value):
                raise SchemaRefused(f"{where}.{key} must be a non-empty list of schemas")
            out[key] = [_node(sub, f"{where}.{key}[{i}]") for i, sub in enumerate(value)]
    for key in _SCHEMA_VALUES:
        if isinstance(schema.get(key), dict):
            out[key] = _node(schema[key], f"{where}.{key}")
    if "items" in schema:
        items = schema["items"]
        out["items"] = ([_node(sub, f"{where}.items[{i}]") for i, sub in enumerate(items)]
                        if isinstance(items, list) else _node(items, f"{where}.items"))
    _required(schema, where)
    _values_match_type(schema, where)
    _counts(schema, where)
    return out


COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
MAX_COUNT = 2**31 - 1  # xgrammar's repetition bound


def _counts(schema: dict, where: str) -> None:
    for key in COUNTS:
        if key in schema:
            value = schema[key]
            if type(value) is not int or not 0 <= value <= MAX_COUNT:
                raise SchemaRefused(f"{where}.{key} must be an integer from 0 to {MAX_COUNT}, got {_short(value)}")


_DATA = frozenset({"enum", "const", "default", "examples"})  # values, not schemas: no pattern keyword inside


def string_patterns(schema: Any, where: str) -> list[tuple[str, str]]:
    """(place, regex) of every `pattern` keyword in `schema`, for the emptiness probe of each alone."""
    found: list[tuple[str, str]] = []
    if isinstance(schema, dict):
        if isinstance(schema.get("pattern"), str):
            found.append((f"{where}.pattern", schema["pattern"]))
        for key, value in schema.items():
            if key not in _DATA:
                found += string_patterns(value, f"{where}.{key}")
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            found += string_patterns(value, f"{where}[{i}]")
    return found


def _single_all_of(schema: dict, where: str) -> Any:
    parts = schema["allOf"]
    siblings = [k for k in schema if k != "allOf" and k not in ANNOTATIONS]
    if not isinstance(parts, list) or len(parts) != 1 or siblings:
        raise SchemaRefused(f"{where}: 'allOf' is enforced only with a single subschema and no other "
                            "constraints beside it")
    part = parts[0]
    if isinstance(part, dict) and "$ref" not in part:
        annotations = {k: v for k, v in schema.items() if k in ANNOTATIONS and k not in part}
        return {**part, **annotations}
    return part


def _required(schema: dict, where: str) -> None:
    required = schema.get("required")
    if required is None:
        return
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise SchemaRefused(f"{where}.required must be a list of property names")
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    missing = [r for r in required if r not in properties]
    if missing:
        raise SchemaRefused(f"{where}.required names {missing[0]!r}, which {where}.properties does not define "
                            "(the grammar writes only defined properties)")


_JSON_TYPES = {"null", "boolean", "integer", "number", "string", "array", "object"}


def _type_of(value) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


def _values_match_type(schema: dict, where: str) -> None:
    declared = schema.get("type")
    if declared is None:
        return
    types = {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else None
    if not types or not all(isinstance(t, str) for t in types):
        raise SchemaRefused(f"{where}.type must be a type name or a non-empty list of them")
    unknown = sorted(t for t in types if t not in _JSON_TYPES)
    if unknown:
        raise SchemaRefused(f"{where}.type {unknown[0]!r} is not a JSON type")
    values = list(schema["enum"]) if isinstance(schema.get("enum"), list) else []
    if "const" in schema:
        values.append(schema["const"])
    for value in values:
        if not _type_of(value) & types:
            raise SchemaRefused(f"{where}: the value {_short(value)} does not have the declared type "
                                f"{'/'.join(sorted(types))}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
