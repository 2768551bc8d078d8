"""Tool-call chains through the real server and the official `openai` client (RECIPE.md §4.2: multi-step chains,
thinking off and on).

A chain is one conversation: the user asks for something only the offered tools can give, step by step; the model
must call a tool (`tool_choice: "auto"`: the model decides, no grammar forces it), get the result as a `tool`
message, and go on, until it answers in text. The harness runs every call the model makes against a small
deterministic tool world (a key chain of `--tool-steps` lookups, arithmetic, a temperature conversion), so a chain
that goes astray still gets real results and its later steps are judged as they come.

Per chain: each call is *well formed* when its name is an offered tool and its arguments parse as a JSON object
with every required parameter of the schema's type; a *step* is matched when the call is the expected next call
(name and arguments); the chain is *completed* when every expected call came in order and the final answer holds
the expected result. A server error (4xx/5xx, timeout) ends that chain and is reported with it, never the run.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DSV41Error


def _fn(name: str, description: str, **params: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in params.items()},
                       "required": list(params)}}}


TOOLS = {
    "lookup": _fn("lookup", "Look up a key in the key store. Returns either the next key or the final value.",
                  key="string"),
    "add": _fn("add", "Add two numbers.", a="number", b="number"),
    "multiply": _fn("multiply", "Multiply two numbers.", a="number", b="number"),
    "get_temperature": _fn("get_temperature", "Current temperature of a city in degrees Celsius.", city="string"),
    "celsius_to_fahrenheit": _fn("celsius_to_fahrenheit", "Convert degrees Celsius to Fahrenheit.",
                                 celsius="number"),
}
TEMPERATURES = {"lisbon": 20, "oslo": -5, "cairo": 35}
WORDS = ("apple", "river", "stone", "cloud", "maple", "ember", "harbor", "quartz", "willow", "falcon")


@dataclass
class Scenario:
    name: str
    prompt: str
    tools: list[str]
    expected: list[tuple[str, dict]]  # the calls in order
    answer: str  # the final reply must contain this
    keys: dict = field(default_factory=dict)  # lookup's store

    def call(self, name: str, args: dict):
        """The tool world: what a call returns (an error object for a bad one, as a real tool would)."""
        try:
            if name == "lookup":
                return self.keys.get(str(args["key"]), {"error": f"no key {args['key']!r}"})
            if name == "add":
                return {"result": _num(args["a"]) + _num(args["b"])}
            if name == "multiply":
                return {"result": _num(args["a"]) * _num(args["b"])}
            if name == "get_temperature":
                city = str(args["city"]).strip().lower()
                return {"city": args["city"], "celsius": TEMPERATURES[city]} if city in TEMPERATURES else \
                    {"error": f"unknown city {args['city']!r}"}
            if name == "celsius_to_fahrenheit":
                return {"fahrenheit": round(_num(args["celsius"]) * 9 / 5 + 32, 1)}
        except (KeyError, TypeError, ValueError) as exc:
            return {"error": f"bad arguments: {exc}"}
        return {"error": f"no tool {name!r}"}


def _num(value) -> float:
    if isinstance(value, bool):
        raise TypeError("a boolean is not a number")
    number = float(value)
    return int(number) if number == int(number) else number


SCENARIOS = ("key-chain", "arithmetic", "temperature")


def scenarios(steps: int, seed: int = 0) -> list[Scenario]:
    rng = random.Random(seed)
    names = [f"{rng.choice(WORDS)}-{rng.randrange(100, 1000)}" for _ in range(steps)]
    value = str(rng.randrange(10000, 100000))
    keys = {k: {"next_key": names[i + 1]} for i, k in enumerate(names[:-1])}
    keys[names[-1]] = {"value": value}
    return [
        Scenario("key-chain", f"Find the value stored under the key chain that starts at key '{names[0]}'. Call "
                 "lookup with a key; a result with next_key names the key to look up next; keep going until a "
                 "result has a value, then reply with that value.", ["lookup"],
                 [("lookup", {"key": k}) for k in names], value, keys),
        Scenario("arithmetic", "Using only the tools, one operation per call, compute (3 + 4) * 5 + 6 and reply "
                 "with the result.", ["add", "multiply"],
                 [("add", {"a": 3, "b": 4}), ("multiply", {"a": 7, "b": 5}), ("add", {"a": 35, "b": 6})], "41"),
        Scenario("temperature", "What is the temperature in Lisbon right now, in degrees Fahrenheit? Use the "
                 "tools.", ["get_temperature", "celsius_to_fahrenheit"],
                 [("get_temperature", {"city": "Lisbon"}), ("celsius_to_fahrenheit", {"celsius": 20})], "68"),
    ]


# ------------------------------------------------------------------------------------------------ judging
TYPES = {"string": str, "number": (int, float), "integer": int, "boolean": bool, "object": dict, "array": list}


def well_formed(name: str, arguments: str, offered: list[str]) -> tuple[bool, dict | None, str]:
    """(well formed?, the parsed arguments, why not)."""
    if name not in offered:
        return False, None, f"tool {name!r} was not offered"
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        return False, None, f"arguments are not JSON ({exc.msg})"
    if not isinstance(args, dict):
        return False, None, "arguments are not a JSON object"
    params = TOOLS[name]["function"]["parameters"]
    for key in params["required"]:
        kind = params["properties"][key]["type"]
        if key not in args:
            return False, args, f"missing argument {key!r}"
        if not isinstance(args[key], TYPES[kind]) or (kind == "number" and isinstance(args[key], bool)):
            return False, args, f"argument {key!r} is not a {kind}"
    return True, args, ""


def matches(expected: tuple[str, dict], name: str, args: dict | None) -> bool:
    want_name, want = expected
    if name != want_name or args is None:
        return False

    def same(a, b) -> bool:
        if isinstance(b, (int, float)) and not isinstance(b, bool):
            try:
                return abs(_num(a) - b) < 1e-6
            except (TypeError, ValueError):
                return False
        return str(a).strip().lower() == str(b).strip().lower()

    if all(same(args.get(k), v) for k, v in want.items()):
        return True
    # add and multiply commute
    return name in ("add", "multiply") and same(args.get("a"), want["b"]) and same(args.get("b"), want["a"])


class Chain:
    """The judging of one chain, fed the model's calls and its final answer as they come."""

    def __init__(self, scenario: Scenario, thinking: bool):
        self.scenario = scenario
        self.step, self.in_order = 0, True
        self.out = {"scenario": scenario.name, "thinking": thinking, "turns": 0, "calls": 0, "well_formed": 0,
                    "steps": len(scenario.expected), "steps_matched": 0, "turns_without_call": 0,
                    "answered": False, "answer_correct": False, "completed": False, "problems": []}

    def take_call(self, name: str, arguments: str) -> dict:
        """Judge one call; what the tool returns (an error object for a malformed call)."""
        out, expected = self.out, self.scenario.expected
        out["calls"] += 1
        ok, args, why = well_formed(name, arguments, self.scenario.tools)
        out["well_formed"] += ok
        if not ok:
            out["problems"].append(why)
        if self.in_order and self.step < len(expected) and ok and matches(expected[self.step], name, args):
            self.step += 1
        else:
            self.in_order = False
        out["steps_matched"] = self.step
        return self.scenario.call(name, args) if ok else {"error": why}

    def take_answer(self, text: str) -> None:
        self.out["turns_without_call"] += 1
        self.out["answered"] = bool(text.strip())
        self.out["answer_correct"] = self.scenario.answer in text.replace(",", "")
        self.out["final"] = text[:300]

    def result(self) -> dict:
        self.out["completed"] = (self.in_order and self.step == len(self.scenario.expected)
                                 and self.out["answer_correct"])
        return self.out


def run_chain(client, model: str, scenario: Scenario, *, thinking: bool, max_tokens: int,
              tool_choice: str = "auto", extra_turns: int = 2) -> dict:
    """One chain: at most its expected calls + `extra_turns` turns. `tool_choice` "required" makes the server's
    grammar force a call every turn: a check of the harness and the server, not of the model."""
    import openai

    tools = [TOOLS[name] for name in scenario.tools]
    messages: list[dict] = [{"role": "user", "content": scenario.prompt}]
    chain = Chain(scenario, thinking)
    for _ in range(len(scenario.expected) + extra_turns):
        try:
            reply = client.chat.completions.create(
                model=model, messages=messages, tools=tools, tool_choice=tool_choice, max_tokens=max_tokens,
                temperature=0.0, extra_body={"chat_template_kwargs": {"thinking": thinking}})
        except openai.APIError as exc:
            chain.out["error"] = f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"
            break
        chain.out["turns"] += 1
        message = reply.choices[0].message
        calls = message.tool_calls or []
        if not calls:  # the model answered (or gave nothing usable): the chain ends here
            chain.take_answer(message.content or "")
            break
        history = {"role": "assistant", "content": message.content or "",
                   "tool_calls": [{"id": c.id, "type": "function",
                                   "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                  for c in calls]}
        reasoning = getattr(message, "reasoning_content", None)
        if reasoning:
            history["reasoning_content"] = reasoning  # V4.1 keeps a tool turn's reasoning in the history
        messages.append(history)
        for call in calls:
            result = chain.take_call(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    return chain.result()


def evaluate(url: str, api_key: str | None, *, steps: int = 3, modes=(False, True), max_tokens: int = 2048,
             seed: int = 0, tool_choice: str = "auto", only: list[str] | None = None,
             timeout_s: float = 600.0) -> dict:
    """Every scenario (or those named in `only`) in every thinking mode of `modes`, one chain each."""
    try:
        import openai
    except ImportError:
        raise DSV41Error("tools: needs the official openai client (pip install openai; it is in the test "
                         "extra)") from None
    from .backend import progress

    client = openai.OpenAI(base_url=url.rstrip("/") + ("" if url.rstrip("/").endswith("/v1") else "/v1"),
                           api_key=api_key or "none", max_retries=0, timeout=timeout_s)
    try:
        model = client.models.list().data[0].id
    except (openai.APIError, IndexError) as exc:
        raise DSV41Error(f"tools: {url}: cannot list the served model ({exc})") from None
    chains = []
    chosen = [s for s in scenarios(steps, seed) if only is None or s.name in only]
    plan = [(s, thinking) for thinking in modes for s in chosen]
    with progress(len(plan), "tools") as bar:
        for scenario, thinking in plan:
            chains.append(run_chain(client, model, scenario, thinking=thinking, max_tokens=max_tokens,
                                    tool_choice=tool_choice))
            bar.update(1)
    by_mode = {}
    for c in chains:
        m = by_mode.setdefault("on" if c["thinking"] else "off", {k: 0 for k in (
            "chains", "completed", "calls", "well_formed", "steps", "steps_matched", "errors")})
        m["chains"] += 1
        m["completed"] += c["completed"]
        m["errors"] += "error" in c
        for k in ("calls", "well_formed", "steps", "steps_matched"):
            m[k] += c[k]
    return {"server": url, "model": model, "steps": steps, "tool_choice": tool_choice,
            "scenarios": [s.name for s in chosen], "thinking": by_mode,
            "chains": chains}


# ------------------------------------------------------------------------------------------------ the server
class ServeProcess:
    """`dsv41 serve` as a subprocess on a free loopback port (the same command a deployment runs), stopped with
    SIGTERM (a drain) when done."""

    def __init__(self, argv: list[str], start_timeout_s: float = 900.0, log=None):
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        src = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")  # this checkout's package, as ours
        cmd = [sys.executable, "-m", "dsv41.server", "serve", "--host", "127.0.0.1", "--port", "0", *argv]
        self.log("dsv41 eval: starting " + " ".join(cmd[2:]))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.url: str | None = None
        seen = threading.Event()

        def pump() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                found = re.search(r"dsv41: serving .* on (http://\S+)", line)
                if found:
                    self.url = found.group(1)
                    seen.set()
            seen.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + start_timeout_s
        while not seen.wait(1.0) and time.monotonic() < deadline:
            pass
        if self.url is None:
            self.stop()
            tail = "".join(self.lines[-15:]).strip()
            why = "timed out" if self.proc.returncode is None else f"exit {self.proc.returncode}"
            raise DSV41Error(f"tools: the server did not start ({why}):\n{tail}")

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
