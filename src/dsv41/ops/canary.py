"""`dsv41 canary`: five end-to-end probes over the OpenAI HTTP API (RECIPE.md §3.5), non-zero exit on any failure.

1. greedy chat, thinking off: a deterministic answer (asked twice, same text); `full` also wants "paris";
2. thinking reply (effort low): reasoning returned; `full` also wants 42 in the answer;
3. forced tool call (`tool_choice: required`): finish_reason tool_calls, get_weather with a `city` from its enum;
   `full` also wants Paris;
4. JSON-schema reply: the content parses and matches `{"ok": boolean}`;
5. /tokenize of the probe-1 messages: `count == len(tokens)` and equal to probe 1's `usage.prompt_tokens`.

`--level structural` drops the knowledge checks (paris, 42, city Paris): a random-weight test model cannot know them, but
the server must still honour every structural guarantee. Deploy gates on `full` against the real model.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from dsv41.errors import ConfigError, DSV41Error
from dsv41.ops.health import Reply, base_url, health, request

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        # an enum keeps the forced call short and checkable even on a random-weight test model
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
                       "required": ["city"]},
    },
}
OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
THINKING_OFF = {"chat_template_kwargs": {"thinking": False}, "reasoning_effort": "none"}


class ProbeFailed(Exception):
    pass


@dataclass
class ProbeResult:
    name: str
    passed: bool
    detail: str


class Canary:
    def __init__(self, base: str, model: str, api_key: str | None = None, level: str = "full",
                 timeout: float = 300.0):
        if level not in ("full", "structural"):
            raise ConfigError(f"--level {level!r}: expected full or structural")
        self.base, self.model, self.api_key, self.level, self.timeout = base, model, api_key, level, timeout
        self.greedy_usage: int | None = None

    def post(self, path: str, payload: dict) -> Any:
        reply = request(self.base + path, payload, timeout=self.timeout, api_key=self.api_key)
        if not reply.ok:
            message = reply.error or _error_message(reply.body)
            raise ProbeFailed(f"POST {path} -> HTTP {reply.status or 'no reply'}: {message}")
        if not isinstance(reply.body, dict):
            raise ProbeFailed(f"POST {path}: response is not a JSON object")
        return reply.body

    def chat(self, messages: list, **extra) -> tuple[dict, dict]:
        body = self.post("/v1/chat/completions", {"model": self.model, "messages": messages, **extra})
        try:
            choice = body["choices"][0]
            return choice, body
        except (KeyError, IndexError, TypeError):
            raise ProbeFailed("response has no choices[0]") from None

    # ---------------------------------------------------------------- the five probes

    def greedy_chat(self) -> str:
        args = dict(temperature=0, max_tokens=16, **THINKING_OFF)
        first, body = self.chat(FRANCE, **args)
        second, _ = self.chat(FRANCE, **args)
        content = _message(first).get("content")
        if not isinstance(content, str):
            raise ProbeFailed(f"content is {type(content).__name__}, expected a string")
        if _message(second).get("content") != content:
            raise ProbeFailed(f"greedy replies differ: {content!r} vs {_message(second).get('content')!r}")
        self.greedy_usage = (body.get("usage") or {}).get("prompt_tokens")
        if self.level == "full" and "paris" not in content.lower():
            raise ProbeFailed(f"answer {content!r} does not contain 'paris'")
        return f"{content.strip()!r}, same twice"

    def thinking_reply(self) -> str:
        messages = [{"role": "user", "content": "What is 17 + 25? Reply with the number."}]
        # structural: a few tokens of reasoning are enough; full: room to reason and then answer
        max_tokens = 1024 if self.level == "full" else 32
        choice, _ = self.chat(messages, temperature=0, max_tokens=max_tokens, reasoning_effort="low")
        message = _message(choice)
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if not isinstance(reasoning, str) or not reasoning.strip():
            raise ProbeFailed("no reasoning_content/reasoning in a thinking reply")
        content = message.get("content") or ""
        if self.level == "full" and "42" not in content:
            raise ProbeFailed(f"answer {content!r} does not contain 42")
        return f"{len(reasoning)} chars of reasoning, answer {content.strip()[:40]!r}"

    def forced_tool_call(self) -> str:
        messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
        choice, _ = self.chat(messages, temperature=0, max_tokens=256, tools=[WEATHER_TOOL], tool_choice="required",
                              parallel_tool_calls=False, **THINKING_OFF)
        if choice.get("finish_reason") != "tool_calls":
            raise ProbeFailed(f"finish_reason {choice.get('finish_reason')!r}, expected 'tool_calls'")
        calls = _message(choice).get("tool_calls") or []
        if not calls:
            raise ProbeFailed("finish_reason tool_calls but message.tool_calls is empty")
        function = calls[0].get("function") or {}
        if function.get("name") != "get_weather":
            raise ProbeFailed(f"called {function.get('name')!r}, expected 'get_weather'")
        try:
            arguments = json.loads(function.get("arguments") or "")
        except ValueError:
            raise ProbeFailed(f"arguments are not JSON: {function.get('arguments')!r}") from None
        cities = WEATHER_TOOL["function"]["parameters"]["properties"]["city"]["enum"]
        if not isinstance(arguments, dict) or arguments.get("city") not in cities:
            raise ProbeFailed(f"arguments {arguments!r}: 'city' must be one of {cities}")
        if self.level == "full" and arguments["city"] != "Paris":
            raise ProbeFailed(f"asked about Paris, called get_weather for {arguments['city']!r}")
        return f"get_weather({json.dumps(arguments)})"

    def json_schema_reply(self) -> str:
        messages = [{"role": "user", "content": "Is water wet? Answer as JSON."}]
        response_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": OK_SCHEMA}}
        choice, _ = self.chat(messages, temperature=0, max_tokens=64, response_format=response_format,
                              **THINKING_OFF)
        content = _message(choice).get("content") or ""
        try:
            value = json.loads(content)
        except ValueError:
            raise ProbeFailed(f"content is not JSON: {content[:80]!r}") from None
        if not (isinstance(value, dict) and set(value) == {"ok"} and isinstance(value["ok"], bool)):
            raise ProbeFailed(f"{value!r} does not match {{\"ok\": boolean}}")
        return content.strip()

    def tokenize_consistency(self) -> str:
        body = self.post("/tokenize", {"model": self.model, "messages": FRANCE, **THINKING_OFF})
        tokens, count = body.get("tokens"), body.get("count")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) for t in tokens):
            raise ProbeFailed("tokens is not a non-empty list of ints")
        if count != len(tokens):
            raise ProbeFailed(f"count {count} != len(tokens) {len(tokens)}")
        if self.greedy_usage is not None and self.greedy_usage != count:
            raise ProbeFailed(f"/tokenize counts {count} tokens but the chat request used {self.greedy_usage}")
        return f"{count} tokens, first id {tokens[0]}"

    def probes(self) -> list[tuple[str, Callable[[], str]]]:
        return [("greedy-chat", self.greedy_chat), ("thinking-reply", self.thinking_reply),
                ("forced-tool-call", self.forced_tool_call), ("json-schema", self.json_schema_reply),
                ("tokenize", self.tokenize_consistency)]

    def run(self) -> list[ProbeResult]:
        results = []
        for name, probe in self.probes():
            try:
                results.append(ProbeResult(name, True, probe()))
            except ProbeFailed as exc:
                results.append(ProbeResult(name, False, str(exc)))
        return results


def _message(choice: dict) -> dict:
    message = choice.get("message")
    if not isinstance(message, dict):
        raise ProbeFailed("choices[0].message is missing")
    return message


def _error_message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body["error"]))
    return str(body)[:200]


def wait_healthy(base: str, wait_s: float, sleep: Callable[[float], None] = time.sleep) -> Reply:
    deadline = time.monotonic() + wait_s
    while True:
        reply = health(base)
        if reply.ok or time.monotonic() >= deadline:
            return reply
        sleep(2.0)


def resolve_model(base: str, api_key: str | None, env: Mapping[str, str]) -> str:
    if env.get("DSV41_SERVED_NAME", "").strip():
        return env["DSV41_SERVED_NAME"].strip()
    reply = request(base + "/v1/models", api_key=api_key)
    try:
        return reply.body["data"][0]["id"]
    except (TypeError, KeyError, IndexError):
        raise ConfigError(f"{base}/v1/models gave no model id (HTTP {reply.status}); pass --model") from None


def run_canary(env: Mapping[str, str], url: str | None = None, api_key_file: str | None = None,
               wait_s: float = 0.0, model: str | None = None, level: str = "full", out=print) -> int:
    base = (url or base_url(env)).rstrip("/")
    key_file = api_key_file or env.get("DSV41_API_KEY_FILE", "").strip()
    api_key = None
    if key_file:
        try:
            api_key = Path(key_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"api key file {key_file}: {exc.strerror}") from None
    reply = wait_healthy(base, wait_s)  # one look at /health when not waiting
    if wait_s > 0 and not reply.ok:
        out(f"canary: FAILED: {base}/health not ok after {wait_s:.0f} s "
            f"(HTTP {reply.status or 'no reply'} {reply.error})".rstrip())
        return 1
    if reply.status == 0:  # nothing listens there: one line naming the address, not five failed probes
        raise DSV41Error(f"cannot reach the server: {reply.error}")
    canary = Canary(base, model or resolve_model(base, api_key, env), api_key, level)
    results = canary.run()
    for r in results:
        out(f"{'PASS' if r.passed else 'FAIL'} {r.name}: {r.detail}")
    failed = [r.name for r in results if not r.passed]
    if failed:
        out(f"canary: FAILED: {len(failed)} of {len(results)} probes failed ({', '.join(failed)}) against {base}")
        return 1
    out(f"canary: ok, {len(results)} probes passed against {base} ({canary.level})")
    return 0
