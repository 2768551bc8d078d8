"""Grammars for constrained decoding, compiled by xgrammar over the model's own vocabulary.

`Grammars` owns one `xgrammar.GrammarCompiler` per served model. Its `TokenizerInfo` is the vocabulary of
tokenizer.json as xgrammar decodes it (the vocab type read from the tokenizer's decoder), at the model's padded
width so the bitmask matches the logits, with the control tokens made unreachable as text (markers.py): no
grammar ever allows `<｜User｜>`, a place-holder or any other added token inside JSON, a regex, a choice or a
tool argument; the markup tokens (`</think>`, `｜DSML｜`) only where the grammar writes them, EOS only where it
may end. Compiled grammars are handed to the engine per request.

Output shapes the server asks for:
- JSON (a schema, or any object) — after `</think>` when the prompt ends in `<think>` (thinking mode);
- DSML tool calls for `tool_choice` required / named — dsml_grammar.py (the encoder's exact layout).
A schema xgrammar cannot compile, or compiles without enforcing (schema_check.py), raises `GrammarError`, which
the server answers with 400; so does a grammar that provably admits no output at all (a regex whose
character class matches nothing, a string pattern no text can match): `_refuse_empty` walks the token masks
from the start and refuses when every path dead-ends before the grammar can end (bounded; a grammar with many
paths is not explored to the end, and is accepted).
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

from dsv41.errors import DSV41Error
from dsv41.chat.tokens import THINK_END, THINK_START
from dsv41.structured.markers import NO_TEXT, grammar_vocab, reasoning_then
from dsv41.structured.schema_check import SchemaRefused, enforceable, string_patterns

# runs of whitespace are capped so a random or confused model cannot pad JSON forever
MAX_WHITESPACE = 4
# the emptiness probe: at most this many tokens tried, this deep, for this long
PROBE_NODES, PROBE_DEPTH, PROBE_S = 256, 48, 0.25
PATTERN_PROBES = 16  # `pattern` keywords of one schema probed alone


class GrammarError(DSV41Error):
    """A schema or tool definition cannot be turned into an enforceable grammar."""


class Grammars:
    def __init__(self, tokenizer_json_path: str | Path, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self._xgr = xgr
        decoded, self.markup = grammar_vocab(tokenizer_json_path, vocab_size, list(stop_token_ids))
        self.tokenizer_info = xgr.TokenizerInfo(decoded, xgr.VocabType.RAW, vocab_size=vocab_size,
                                                stop_token_ids=list(stop_token_ids), add_prefix_space=False)
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2, cache_limit_bytes=256 << 20)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ public builders
    def json(self, schema: dict | None, *, thinking: bool) -> Any:
        """JSON output; `schema=None` means any JSON object (response_format json_object)."""
        fmt = self._xgr.structural_tag
        body = fmt.JSONSchemaFormat(
            json_schema=schema if schema is not None else {"type": "object"},
            max_whitespace_cnt=MAX_WHITESPACE,
        )
        return self._body(body, thinking, what="response_format schema")

    def regex(self, pattern: str, *, thinking: bool) -> Any:
        body = self._xgr.structural_tag.RegexFormat(pattern=pattern)
        return self._body(body, thinking, what="regex")

    def choice(self, options: list[str], *, thinking: bool) -> Any:
        fmt = self._xgr.structural_tag
        body = fmt.OrFormat(elements=[fmt.ConstStringFormat(value=o) for o in options])
        return self._body(body, thinking, what="choice")

    def ebnf(self, grammar: str, *, thinking: bool) -> Any:
        """vLLM's `structured_outputs.grammar`: an EBNF grammar (xgrammar's dialect, GBNF-like; root rule `root`)."""
        body = self._xgr.structural_tag.GrammarFormat(grammar=grammar)
        return self._body(body, thinking, what="grammar")

    def structural_tag(self, tag: Any, *, thinking: bool) -> Any:
        """vLLM's `structural_tag`: xgrammar's format tree `{"type": "structural_tag", "format": {...}}`, or the
        older `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}` (free text, and a JSON document
        between `begin` and `end` after a trigger). Formats that name token ids (token, exclude_token,
        any_tokens, token_dispatch, token_triggered_tags) are refused: they could write control tokens. Free text
        never holds the markup tokens (`NO_TEXT`), as in every grammar here; JSON schemas inside pass the same
        check as a response_format schema."""
        fmt = self._xgr.structural_tag
        if isinstance(tag, str):
            try:
                tag = json.loads(tag)
            except ValueError:
                raise GrammarError("structural_tag is not valid JSON") from None
        if not isinstance(tag, dict):
            raise GrammarError("structural_tag must be an object")
        if "format" in tag:
            tree = tag["format"]
        elif "structures" in tag:
            tree = _legacy_structural_tag(tag)
        else:
            raise GrammarError('structural_tag needs "format" (xgrammar\'s format tree) or "structures" and '
                               '"triggers"')
        tree = self._client_tree(tree, "structural_tag.format")
        try:
            body = fmt.StructuralTag.model_validate({"type": "structural_tag", "format": tree}).format
        except Exception as exc:
            raise GrammarError(f"structural_tag cannot be enforced: {_reason(exc)}") from None
        return self._body(body, thinking, what="structural_tag")

    def _client_tree(self, node: Any, where: str) -> Any:
        if isinstance(node, list):
            return [self._client_tree(v, f"{where}[{i}]") for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        kind = node.get("type")
        if kind in TOKEN_FORMATS:
            raise GrammarError(f"{where}: the format {kind!r} names token ids, which a client may not choose "
                               "(control tokens); spell the text instead")
        out = {}
        for key, value in node.items():
            if kind in ("json_schema", "qwen_xml_parameter") and key == "json_schema":
                out[key] = self.check_schema(value, f"{where}.json_schema")
            else:
                out[key] = self._client_tree(value, f"{where}.{key}")
        if kind in FREE_TEXT_FORMATS:
            excludes = out.get("excludes", [])
            if not isinstance(excludes, list):
                raise GrammarError(f"{where}.excludes must be a list of strings")
            out["excludes"] = list(excludes) + [x for x in (NO_TEXT, THINK_START, THINK_END) if x not in excludes]
        return out

    def tool_calls(self, tools: list[dict], tool_choice: Any, *, parallel: bool, thinking: bool) -> Any:
        """DSML tool calls in the encoder's exact layout: tool_choice "required" or a named function. Every
        enforced tool's parameters pass the same schema check as a response_format schema."""
        from dsv41.structured.dsml_grammar import dsml_tool_call_tag

        checked = []
        for i, tool in enumerate(tools):
            function = dict(tool["function"])
            parameters = function.get("parameters")
            if parameters is not None:
                where = f"tools[{i}].function.parameters"
                if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
                    raise GrammarError(f'{where} must be an object schema (type "object")')
                function["parameters"] = self.check_schema(parameters, where)
            checked.append({**tool, "function": function})
        try:
            tags = [dsml_tool_call_tag(checked, tool_choice, parallel=parallel, thinking=t, markup=self.markup)
                    for t in ([False, True] if thinking else [False])]
        except Exception as exc:
            raise GrammarError(f"tools cannot be enforced: {_reason(exc)}") from None
        compiled = self._compile(tags[0], what="tools")
        self._refuse_empty(compiled, "tools")
        return self._compile(tags[-1], what="tools") if thinking else compiled

    def check_schema(self, schema: Any, what: str) -> Any:
        """The schema to compile, or GrammarError naming `what` if the grammar cannot enforce it (keywords
        xgrammar ignores, see schema_check.py; or one it refuses to compile)."""
        try:
            schema = enforceable(schema, what)
        except SchemaRefused as exc:
            raise GrammarError(str(exc)) from None
        try:
            with self._lock:
                compiled = self.compiler.compile_json_schema(json.dumps(schema), max_whitespace_cnt=MAX_WHITESPACE)
        except Exception as exc:
            raise GrammarError(f"{what} cannot be enforced: {_reason(exc)}") from None
        # a pattern that matches nothing, found alone: deep inside a schema the bounded probe below misses it
        # (distinct patterns, at most PATTERN_PROBES of them: each probe is bounded by PROBE_S)
        probed: dict[str, str] = {}
        for place, pattern in string_patterns(schema, what):
            if pattern not in probed and len(probed) < PATTERN_PROBES:
                probed[pattern] = place
        for pattern, place in probed.items():
            compiled_pattern = self._compile(self._xgr.structural_tag.StructuralTag(
                format=self._xgr.structural_tag.RegexFormat(pattern=pattern)), what=place)
            self._refuse_empty(compiled_pattern, place, f"{place} {pattern!r} matches no string")
        self._refuse_empty(compiled, what)
        return schema

    # ------------------------------------------------------------------ helpers
    def _after_reasoning(self, body, thinking: bool):
        fmt = self._xgr.structural_tag
        if not thinking:
            return fmt.StructuralTag(format=body)
        return fmt.StructuralTag(format=reasoning_then(fmt, body, self.markup))

    def _body(self, body, thinking: bool, what: str):
        """Compile `body` (after the reasoning when thinking), refusing a grammar that admits no output."""
        fmt = self._xgr.structural_tag
        plain = self._compile(fmt.StructuralTag(format=body), what=what)
        self._refuse_empty(plain, what)
        return self._compile(self._after_reasoning(body, True), what=what) if thinking else plain

    def _refuse_empty(self, compiled, what: str, message: str | None = None) -> None:
        """GrammarError if, walking the token masks from the start, every path dead-ends before the grammar
        may end. Bounded (PROBE_*): when the walk runs out first, the grammar is accepted."""
        import numpy as np

        xgr = self._xgr
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        budget = {"nodes": PROBE_NODES, "until": time.monotonic() + PROBE_S}

        def allowed() -> list[int]:
            matcher.fill_next_token_bitmask(bitmask, 0)
            bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[: self.vocab_size]
            return np.flatnonzero(bits).tolist()

        def walk(depth: int) -> str:  # "ends" | "empty" | "unknown"
            ids = allowed()
            if self.stop_token_ids.intersection(ids) or matcher.is_terminated():
                return "ends"
            if not ids:
                return "empty"
            if depth >= PROBE_DEPTH or len(ids) > budget["nodes"] or time.monotonic() > budget["until"]:
                return "unknown"
            budget["nodes"] -= len(ids)
            for token in ids:
                if not matcher.accept_token(token):
                    continue
                outcome = walk(depth + 1)
                matcher.rollback(1)
                if outcome != "empty":
                    return outcome
            return "empty"

        if walk(0) == "empty":
            raise GrammarError(message or f"{what} cannot be enforced: no output can satisfy it")

    def _compile(self, tag, what: str):
        try:
            with self._lock:
                return self.compiler.compile_structural_tag(tag)
        except Exception as exc:
            raise GrammarError(f"{what} cannot be enforced: {_reason(exc, ebnf=what == 'grammar')}") from None


# xgrammar's format types that name token ids, and those with free text (`excludes`)
TOKEN_FORMATS = frozenset({"token", "exclude_token", "any_tokens", "token_dispatch", "token_triggered_tags"})
FREE_TEXT_FORMATS = frozenset({"any_text", "triggered_tags", "dispatch"})
# xgrammar's field names -> the JSON schema keywords they come from (dsml_grammar.py)
_FIELD_NAMES = {"max_chars": "maxLength"}


def _legacy_structural_tag(tag: dict) -> dict:
    """vLLM's older structural_tag (`structures` + `triggers`) as xgrammar's format tree."""
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures or not all(isinstance(s, dict) for s in structures):
        raise GrammarError("structural_tag.structures must be a non-empty list of {begin, schema, end}")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise GrammarError("structural_tag.triggers must be a non-empty list of strings")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str) or "schema" not in s:
            raise GrammarError(f"structural_tag.structures[{i}] needs begin and end strings and a schema")
        tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                     "content": {"type": "json_schema", "json_schema": s["schema"]}})
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags}


def _reason(exc: Exception, ebnf: bool = False) -> str:
    """Why xgrammar (or its pydantic formats) refused, in words a client can act on: no source paths, no
    "Check failed: (...) is false", no pydantic banner, no EBNF positions for what the client wrote as a regex."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        error = exc.errors()[0]
        where = ".".join(_FIELD_NAMES.get(str(p), str(p)) for p in error.get("loc", ())
                         if str(p) not in ("str", "int", "float", "bool", "list", "dict"))
        return f"{where}: {error.get('msg', 'invalid value')}" if where else error.get("msg", "invalid value")
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    # xgrammar prefixes C++ errors with "[hh:mm:ss] /path/file.cc:NN: "; the rest is the useful part
    line = re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", line)
    line = re.sub(r"^Check failed: \(.*?\) is false:? ?", "", line)
    if not ebnf:  # a regex or schema is translated to EBNF first: its positions are not the client's
        line = re.sub(r"^EBNF parser error at line \d+, column \d+: ", "", line)
    return (line or "the grammar compiler refused it")[:300]
