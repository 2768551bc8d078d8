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
from dsv41.structured.markers import grammar_vocab, reasoning_then
from dsv41.structured.schema_check import SchemaRefused, enforceable

# runs of whitespace are capped so a random or confused model cannot pad JSON forever
MAX_WHITESPACE = 4
# the emptiness probe: at most this many tokens tried, this deep, for this long
PROBE_NODES, PROBE_DEPTH, PROBE_S = 256, 48, 0.25


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
            raise GrammarError(f"tools cannot be enforced: {_first_line(exc)}") from None
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
            raise GrammarError(f"{what} cannot be enforced: {_first_line(exc)}") from None
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

    def _refuse_empty(self, compiled, what: str) -> None:
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
            raise GrammarError(f"{what} cannot be enforced: no output can satisfy it")

    def _compile(self, tag, what: str):
        try:
            with self._lock:
                return self.compiler.compile_structural_tag(tag)
        except Exception as exc:
            raise GrammarError(f"{what} cannot be enforced: {_first_line(exc)}") from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    # xgrammar prefixes C++ errors with "[hh:mm:ss] /path/file.cc:NN: "; the rest is the useful part
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", line)[:300]
