"""The grammar a request's structured-output fields ask for (response_format, vLLM's structured_outputs and
guided_*): one compiled grammar or None, a 400 naming the field for what cannot be enforced."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from dsv41.structured.grammar import GrammarError

from .context import ServerContext
from .errors import bad_request

if TYPE_CHECKING:
    from .protocol import SamplingFields


def structured_grammar(ctx: ServerContext, fields: "SamplingFields", *, thinking: bool):
    """The compiled grammar for response_format / structured_outputs / guided_*, or None. 400 if unenforceable."""
    grammars = ctx.grammars
    try:
        rf = fields.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                return grammars.json(None, thinking=thinking)
            if kind == "json_schema":
                envelope = rf.get("json_schema")
                if not isinstance(envelope, dict):
                    raise bad_request("response_format.json_schema must be an object",
                                      param="response_format.json_schema")
                schema = envelope.get("schema", {})
                schema = grammars.check_schema(schema, "response_format.json_schema.schema")
                return grammars.json(schema, thinking=thinking)
            if kind == "structural_tag":
                return grammars.structural_tag(rf, thinking=thinking)
            if kind in (None, "text"):
                if kind is None:
                    raise bad_request("response_format.type is required", param="response_format.type")
                return None
            raise bad_request(f"response_format.type {kind!r} is not supported (text, json_object, json_schema, "
                              "structural_tag)", param="response_format.type")
        so = fields.structured_outputs or {}
        # vLLM's other options (whitespace_pattern, disable_any_whitespace, ...): refused, never dropped; there is
        # no fallback backend, so disable_fallback holds as asked
        unknown = sorted(set(so) - set(STRUCTURED_OUTPUTS) - {"json_object", "disable_fallback"})
        if unknown:
            raise bad_request(f"structured_outputs.{unknown[0]} is not supported",
                              param=f"structured_outputs.{unknown[0]}")
        chosen = [k for k in STRUCTURED_OUTPUTS if so.get(k) is not None]
        if len(chosen) > 1:
            raise bad_request(f"structured_outputs takes only one of {', '.join(STRUCTURED_OUTPUTS)}",
                              param="structured_outputs")
        if so.get("json_object"):
            if chosen:
                raise bad_request(f"structured_outputs.json_object cannot be combined with {chosen[0]}",
                                  param="structured_outputs")
            return grammars.json(None, thinking=thinking)
        json_schema = so.get("json") if "json" in chosen else fields.guided_json
        if json_schema is not None:
            if isinstance(json_schema, str):
                try:
                    json_schema = json.loads(json_schema)
                except ValueError:
                    raise bad_request("the JSON schema is not valid JSON", param="guided_json") from None
            json_schema = grammars.check_schema(json_schema, "structured_outputs.json")
            return grammars.json(json_schema, thinking=thinking)
        regex = so.get("regex") if "regex" in chosen else fields.guided_regex
        choice = so.get("choice") if "choice" in chosen else fields.guided_choice
        if choice is not None:
            if not isinstance(choice, list) or not choice or not all(isinstance(c, str) for c in choice):
                raise bad_request("choice must be a non-empty list of strings", param="structured_outputs.choice")
            return grammars.choice(choice, thinking=thinking)
        if regex is not None:
            if not isinstance(regex, str):
                raise bad_request("regex must be a string", param="structured_outputs.regex")
            return grammars.regex(regex, thinking=thinking)
        if "grammar" in chosen:
            if not isinstance(so["grammar"], str):
                raise bad_request("structured_outputs.grammar must be a string (EBNF)",
                                  param="structured_outputs.grammar")
            return grammars.ebnf(so["grammar"], thinking=thinking)
        if "structural_tag" in chosen:
            return grammars.structural_tag(so["structural_tag"], thinking=thinking)
        return None
    except GrammarError as exc:
        raise bad_request(str(exc), param=_grammar_param(fields)) from None


STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "structural_tag")  # vLLM's, one per request


def _grammar_param(fields) -> str:
    if fields.response_format is not None:
        return "response_format"
    if fields.structured_outputs is not None:
        return "structured_outputs"
    for name in ("guided_json", "guided_regex", "guided_choice"):
        if getattr(fields, name, None) is not None:
            return name
    return "guided_json"
