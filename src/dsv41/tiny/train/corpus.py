"""The training corpus of the trained tiny model, built offline on any machine from a seed.

Three sources:
- `code`: Python's standard library source (`sysconfig.get_paths()["stdlib"]`, *.py, sorted by relative path,
  site-packages and the codec tables left out, files over 256 KB skipped, the total capped at `code_bytes`);
- `docs`: the documentation text in that source: module, class and function docstrings (as `name` + text),
  plus the reference manual's topic texts (`pydoc_data/topics.py`);
- `facts`: the generated atlas of made-up countries, one short entry a country;
- `chat`: generated conversations rendered with the project's V4.1 encoder (chat/encoding.py), each a list
  of OpenAI-style messages: arithmetic with column-wise reasoning, questions about a generated fact table,
  DSML tool calls (weather, fact lookup, calculator) and their results, multi-step tool chains in the tool world of
  `dsv41 eval tools`, JSON answers; in thinking and chat mode.

Held-out splits: a Python file is held out when the SHA-256 of its relative path says so (about 1 in 32; its
docstrings go with it); a generated question is held out by a hash of what it asks (operation and operands, or
country and field), so a held-out question never appears in training, in any phrasing. The fact table itself is
training text (`facts`): a held-out lookup question asks about a fact the model has read but was never asked.

The stdlib differs between Python versions, so the corpus (and the weights) depend on the interpreter:
`Corpus.digest` names the exact text, and the trainer records it with the Python version.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from dsv41.chat.encoding import encode_pieces

SPLITS = ("train", "heldout")
SOURCES = ("code", "docs", "facts", "chat")
DEFAULT_CODE_BYTES = 16_000_000
DEFAULT_CHATS = 40_000
MAX_FILE_BYTES = 256_000
_SKIPPED_DIRS = ("site-packages", "encodings")
HELDOUT_ONE_IN = 32


def _hash_int(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def is_heldout(key: str) -> bool:
    """The split rule of both files and questions: a stable hash of what identifies them."""
    return _hash_int(key) % HELDOUT_ONE_IN == 0


# --------------------------------------------------------------------------------------------------- stdlib
@dataclass
class PyFile:
    rel: str
    text: str


def stdlib_files(code_bytes: int = DEFAULT_CODE_BYTES, root: str | Path | None = None) -> list[PyFile]:
    """The stdlib's *.py files in sorted order, stdlib proper before its `test` package, each while the total stays
    within `code_bytes`."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    paths = [p for p in root.rglob("*.py") if p.is_file()]
    rels = sorted((p.relative_to(root).as_posix(), p) for p in paths)
    rels = [(r, p) for r, p in rels if not r.startswith(_SKIPPED_DIRS)]
    ordered = [rp for rp in rels if not rp[0].startswith("test/")] + [rp for rp in rels if rp[0].startswith("test/")]
    out, total = [], 0
    for rel, path in ordered:
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue  # empty package markers teach nothing and make degenerate held-out streams
        if total + len(text) > code_bytes:
            continue
        out.append(PyFile(rel, text))
        total += len(text)
    return out


def docstrings(file: PyFile) -> list[str]:
    """`module.name` + docstring for the module and every class and function with one (files that do not parse
    have none)."""
    try:
        tree = ast.parse(file.text)
    except (SyntaxError, ValueError):
        return []
    module = file.rel[:-3].replace("/", ".")
    out = []
    doc = ast.get_docstring(tree)
    if doc:
        out.append(f"{module}\n\n{doc}\n")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            if doc:
                out.append(f"{module}.{node.name}\n\n{doc}\n")
    return out


def topic_texts(root: str | Path | None = None) -> list[str]:
    """The reference manual's topics shipped with pydoc (`pydoc_data/topics.py`), one text per topic."""
    path = Path(root or sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
    if not path.is_file():
        return []
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        topics = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == "topics" for t in node.targets))
    except (SyntaxError, ValueError, StopIteration):
        return []
    return [f"{name}\n\n{text}" for name, text in sorted(topics.items()) if isinstance(text, str)]


# --------------------------------------------------------------------------------------------------- facts
_SYLLABLES = ("ka", "lo", "mi", "ra", "ven", "tor", "sel", "du", "bri", "nor", "esk", "ya", "fen", "ol", "zar",
              "tem", "qui", "lis", "gor", "pa", "sun", "vel", "ath", "mon")
COLORS = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple")
FIELDS = ("capital", "language", "population", "flag")


@dataclass(frozen=True)
class Country:
    name: str
    capital: str
    language: str
    population: int  # thousands
    flag: str

    def value(self, field_name: str) -> str:
        if field_name == "population":
            return f"{self.population} thousand"
        return str(getattr(self, field_name))

    def record(self) -> dict:
        return {"country": self.name, "capital": self.capital, "language": self.language,
                "population": self.population * 1000, "flag": self.flag}


def _word(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(n)).capitalize()


def fact_table(seed: int, n: int = 96) -> list[Country]:
    """A table of made-up countries (no fact a model could know from elsewhere), unique names, from `seed`."""
    rng = random.Random(f"facts-{seed}")
    seen: set[str] = set()
    countries = []
    while len(countries) < n:
        name, capital, language = _word(rng, 3), _word(rng, 2), _word(rng, 2) + "ish"
        if {name, capital, language} & seen or len({name, capital, language}) < 3:
            continue
        seen |= {name, capital, language}
        countries.append(Country(name, capital, language, rng.randint(5, 999), rng.choice(COLORS)))
    return countries


def fact_texts(countries: list[Country]) -> list[str]:
    """The atlas as text: one short entry a country (the only place a held-out lookup's answer appears)."""
    return [f"{c.name}. The capital of {c.name} is {c.capital}. People in {c.name} speak {c.language}. The "
            f"population of {c.name} is {c.population} thousand. The flag of {c.name} is {c.flag}.\n"
            for c in countries]


# --------------------------------------------------------------------------------------------------- chats
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "lookup_fact", "description": "One fact about a country from the atlas.",
        "parameters": {"type": "object", "properties": {
            "country": {"type": "string"}, "field": {"type": "string", "enum": list(FIELDS)}},
            "required": ["country", "field"]}}},
    {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
]
SKIES = ("sunny", "cloudy", "rainy", "windy", "foggy", "snowy")
SYSTEM_PROMPTS = ("", "You are a helpful assistant.", "You are a concise assistant. Answer briefly.")


@dataclass
class Chat:
    """One generated conversation: what it asks (`key`, which decides its split) and the encoder's messages."""

    kind: str  # arithmetic | lookup | tool | chain | json
    key: str
    messages: list
    mode: str  # thinking | chat
    answer: str  # the final answer's content (what an exact-match evaluation compares)

    @property
    def split(self) -> str:
        return "heldout" if is_heldout(self.key) else "train"

    def pieces(self):
        return encode_pieces(self.messages, self.mode)


def _digits_sum(a: int, b: int) -> list[str]:
    """Column addition from the right, one short sentence a column."""
    steps, carry, i = [], 0, 0
    da, db = str(a)[::-1], str(b)[::-1]
    while i < max(len(da), len(db)) or carry:
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        steps.append(f"{x} + {y}" + (f" + {carry}" if carry else "") + f" = {s}, write {s % 10}"
                     + (", carry 1." if s >= 10 else "."))
        carry, i = s // 10, i + 1
    return steps


def _digits_diff(a: int, b: int) -> list[str]:
    steps, borrow, i = [], 0, 0
    da, db = str(a)[::-1], str(b)[::-1]
    while i < len(da):
        x = int(da[i]) - borrow
        y = int(db[i]) if i < len(db) else 0
        borrow = 1 if x < y else 0
        steps.append(f"{x + 10 * borrow} - {y} = {x + 10 * borrow - y}" + (", borrow 1." if borrow else "."))
        i += 1
    return steps


def _digits_product(a: int, b: int) -> list[str]:
    """a one-digit times b: column by column with the carry."""
    steps, carry = [], 0
    for d in str(b)[::-1]:
        p = a * int(d) + carry
        steps.append(f"{a} × {d}" + (f" + {carry}" if carry else "") + f" = {p}, write {p % 10}"
                     + (f", carry {p // 10}." if p >= 10 else "."))
        carry = p // 10
    if carry:
        steps.append(f"Write the carry {carry}.")
    return steps


def _ask(rng: random.Random, templates: tuple[str, ...], **values) -> str:
    return rng.choice(templates).format(**values)


def arithmetic_chat(rng: random.Random, mode: str) -> Chat:
    op = rng.choice("+-×")
    if op == "+":
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        result, steps = a + b, _digits_sum(a, b)
    elif op == "-":
        a, b = sorted((rng.randint(0, 999), rng.randint(0, 999)), reverse=True)
        result, steps = a - b, _digits_diff(a, b)
    else:
        a, b = rng.randint(2, 9), rng.randint(2, 999)
        result, steps = a * b, _digits_product(a, b)
    expr = f"{a} {op} {b}"
    question = _ask(rng, ("What is {e}?", "Compute {e}.", "{e} = ?", "How much is {e}?"), e=expr)
    reasoning = f"{expr}: " + " ".join(steps) + f" So {expr} = {result}."
    answer = str(result) if rng.random() < 0.5 else f"{expr} = {result}"
    return _single_turn(rng, "arithmetic", f"arith:{op}:{a}:{b}", question, reasoning, answer, mode)


def lookup_chat(rng: random.Random, mode: str, countries: list[Country]) -> Chat:
    c, f = rng.choice(countries), rng.choice(FIELDS)
    question = {
        "capital": ("What is the capital of {n}?", "Which city is the capital of {n}?"),
        "language": ("What language do people speak in {n}?", "Which language is spoken in {n}?"),
        "population": ("What is the population of {n}?", "How many people live in {n}?"),
        "flag": ("What color is the flag of {n}?", "Which color is {n}'s flag?"),
    }[f]
    value = c.value(f)
    reasoning = f"The atlas says the {f} of {c.name} is {value}."
    return _single_turn(rng, "lookup", f"fact:{c.name}:{f}", _ask(rng, question, n=c.name), reasoning, value, mode)


def json_chat(rng: random.Random, mode: str, countries: list[Country]) -> Chat:
    c = rng.choice(countries)
    question = _ask(rng, ("Give the facts about {n} as JSON.", "Return a JSON object describing {n}.",
                          "{n} as a JSON record, please."), n=c.name)
    reasoning = f"A JSON object with the country, its capital {c.capital}, language, population and flag."
    return _single_turn(rng, "json", f"json:{c.name}", question, reasoning, json.dumps(c.record()), mode)


def _system(rng: random.Random, tools: list | None = None) -> list:
    text = rng.choice(SYSTEM_PROMPTS)
    if not text and not tools:
        return []
    message = {"role": "system", "content": text}
    if tools:
        message["tools"] = tools
    return [message]


def _single_turn(rng, kind, key, question, reasoning, answer, mode) -> Chat:
    messages = _system(rng) + [{"role": "user", "content": question},
                               {"role": "assistant", "content": answer,
                                "reasoning_content": reasoning if mode == "thinking" else ""}]
    return Chat(kind, key, messages, mode, answer)


def tool_chat(rng: random.Random, mode: str, countries: list[Country]) -> Chat:
    think = mode == "thinking"
    which = rng.choice(("get_weather", "lookup_fact", "calculate"))
    c = rng.choice(countries)
    if which == "get_weather":
        args = {"city": c.capital}
        question = _ask(rng, ("What is the weather in {x}?", "Is it sunny in {x} right now?",
                              "How warm is it in {x}?"), x=c.capital)
        t, sky = rng.randint(-10, 35), rng.choice(SKIES)
        result = json.dumps({"city": c.capital, "temperature": t, "sky": sky})
        answer = f"It is {t} degrees and {sky} in {c.capital}."
        key = f"tool:weather:{c.capital}:{question[:12]}"
        why = f"The user asks about the weather in {c.capital}. I need the get_weather tool."
    elif which == "lookup_fact":
        f = rng.choice(FIELDS)
        args = {"country": c.name, "field": f}
        question = _ask(rng, ("Look up the {f} of {n}.", "Use the atlas: what is the {f} of {n}?"), f=f, n=c.name)
        result = json.dumps({"country": c.name, "field": f, "value": c.value(f)})
        answer = f"The {f} of {c.name} is {c.value(f)}."
        key = f"tool:fact:{c.name}:{f}"
        why = f"I should look up the {f} of {c.name} with lookup_fact."
    else:
        a, b = rng.randint(100, 9999), rng.randint(2, 99)
        op = rng.choice("+-*")
        expr = f"{a} {op} {b}"
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        args = {"expression": expr}
        question = _ask(rng, ("Use the calculator for {e}.", "Calculate {e} exactly.", "What is {e}? Use a tool."),
                        e=expr)
        result = json.dumps({"expression": expr, "value": value})
        answer = f"{expr} = {value}."
        key = f"tool:calc:{expr}"
        why = f"The user wants {expr} computed exactly. I will call calculate."
    call_id = f"call_{rng.randrange(16**6):06x}"
    call = {"id": call_id, "type": "function", "function": {"name": which, "arguments": json.dumps(args)}}
    messages = _system(rng, TOOLS) + [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "reasoning_content": why if think else "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
        {"role": "assistant", "content": answer,
         "reasoning_content": f"The tool answered {result}." if think else ""},
    ]
    if not messages[0].get("tools"):  # _system always keeps the tools; this guards the invariant
        raise AssertionError("tool chat without tools")
    return Chat("tool", key, messages, mode, answer)


# The tool world of `dsv41 eval tools` (eval/tools.py): its tool schemas, prompts and result objects, with other
# keys, numbers and cities drawn here, so the model learns the procedure (call, read the result, call again with
# it, answer); the harness's own instances (its default seed, 1-5 steps) are never generated.
CHAIN_WORDS = ("apple", "river", "stone", "cloud", "maple", "ember", "harbor", "quartz", "willow", "falcon", "cedar",
               "comet", "delta", "frost", "glade", "heron")


def _eval_prompts() -> set[str]:
    from dsv41.eval.tools import scenarios
    return {s.prompt for steps in range(1, 6) for s in scenarios(steps, seed=0)}


def chain_chat(rng: random.Random, mode: str, countries: list[Country], avoid: set[str] = frozenset()) -> Chat:
    """A multi-step tool chain: a key chain, arithmetic one operation a call, or a temperature conversion (drawn
    again while its prompt is one of `avoid`)."""
    while True:
        chat = _chain_chat(rng, mode, countries)
        if chat.messages[_first_user(chat.messages)]["content"] not in avoid:
            return chat


def _first_user(messages: list) -> int:
    return next(i for i, m in enumerate(messages) if m["role"] == "user")


def _chain_chat(rng: random.Random, mode: str, countries: list[Country]) -> Chat:
    from dsv41.eval.tools import TOOLS
    kind = rng.choice(("key-chain", "arithmetic", "temperature"))
    steps: list[tuple[str, dict, dict, str]] = []  # (tool, arguments, result, why)
    if kind == "key-chain":
        names = [f"{rng.choice(CHAIN_WORDS)}-{rng.randrange(100, 1000)}" for _ in range(rng.randint(1, 4))]
        value = str(rng.randrange(10000, 100000))
        for i, k in enumerate(names):
            result = {"next_key": names[i + 1]} if i + 1 < len(names) else {"value": value}
            steps.append(("lookup", {"key": k}, result, f"Look up the key {k}."))
        prompt = (f"Find the value stored under the key chain that starts at key '{names[0]}'. Call lookup with a "
                  "key; a result with next_key names the key to look up next; keep going until a result has a "
                  "value, then reply with that value.")
        tools, answer, final, key = ["lookup"], value, f"The value is {value}.", f"chain:keys:{names[0]}"
    elif kind == "arithmetic":
        a, b, c, d = (rng.randint(1, 20) for _ in range(4))
        steps = [("add", {"a": a, "b": b}, {"result": a + b}, f"First {a} + {b}."),
                 ("multiply", {"a": a + b, "b": c}, {"result": (a + b) * c}, f"Then {a + b} * {c}."),
                 ("add", {"a": (a + b) * c, "b": d}, {"result": (a + b) * c + d}, f"Then {(a + b) * c} + {d}.")]
        prompt = (f"Using only the tools, one operation per call, compute ({a} + {b}) * {c} + {d} and reply with "
                  "the result.")
        answer = str((a + b) * c + d)
        tools, final, key = ["add", "multiply"], f"({a} + {b}) * {c} + {d} = {answer}", f"chain:arith:{a}:{b}:{c}:{d}"
    else:
        city, celsius = rng.choice(countries).capital, rng.randint(-15, 40)
        fahrenheit = round(celsius * 9 / 5 + 32, 1)
        fahrenheit = int(fahrenheit) if fahrenheit == int(fahrenheit) else fahrenheit
        steps = [("get_temperature", {"city": city}, {"city": city, "celsius": celsius},
                  f"Get the temperature in {city}."),
                 ("celsius_to_fahrenheit", {"celsius": celsius}, {"fahrenheit": fahrenheit},
                  f"Convert {celsius} degrees Celsius.")]
        prompt = f"What is the temperature in {city} right now, in degrees Fahrenheit? Use the tools."
        tools, answer = ["get_temperature", "celsius_to_fahrenheit"], str(fahrenheit)
        final, key = f"It is {fahrenheit} degrees Fahrenheit in {city}.", f"chain:temp:{city}:{celsius}"
    think = mode == "thinking"
    messages = _system(rng, [TOOLS[t] for t in tools]) + [{"role": "user", "content": prompt}]
    for i, (tool, args, result, why) in enumerate(steps):
        call_id = f"call_{rng.randrange(16**6):06x}"
        messages += [{"role": "assistant", "content": "", "reasoning_content": why if think else "",
                      "tool_calls": [{"id": call_id, "type": "function",
                                      "function": {"name": tool, "arguments": json.dumps(args)}}]},
                     {"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)}]
    messages.append({"role": "assistant", "content": final,
                     "reasoning_content": f"The last result gives {answer}." if think else ""})
    return Chat("chain", key, messages, mode, final)


CHAT_KINDS = (("arithmetic", 0.3), ("lookup", 0.2), ("tool", 0.2), ("chain", 0.2), ("json", 0.1))


def generate_chats(seed: int, n: int, countries: list[Country]) -> list[Chat]:
    """`n` conversations from `seed`: the kind by CHAT_KINDS' weights, thinking mode two times in three."""
    rng = random.Random(f"chats-{seed}")
    kinds, weights = zip(*CHAT_KINDS)
    avoid = _eval_prompts()
    out = []
    for _ in range(n):
        kind = rng.choices(kinds, weights)[0]
        mode = "thinking" if rng.random() < 2 / 3 else "chat"
        if kind == "arithmetic":
            out.append(arithmetic_chat(rng, mode))
        elif kind == "lookup":
            out.append(lookup_chat(rng, mode, countries))
        elif kind == "tool":
            out.append(tool_chat(rng, mode, countries))
        elif kind == "chain":
            out.append(chain_chat(rng, mode, countries, avoid))
        else:
            out.append(json_chat(rng, mode, countries))
    return out


# --------------------------------------------------------------------------------------------------- corpus
@dataclass
class Corpus:
    """Documents per source and split; `texts` are plain text, `chats` rendered with the encoder."""

    seed: int
    code: dict[str, list[str]] = field(default_factory=lambda: {s: [] for s in SPLITS})
    docs: dict[str, list[str]] = field(default_factory=lambda: {s: [] for s in SPLITS})
    chats: dict[str, list[Chat]] = field(default_factory=lambda: {s: [] for s in SPLITS})
    files: dict[str, list[str]] = field(default_factory=lambda: {s: [] for s in SPLITS})
    facts: dict[str, list[str]] = field(default_factory=lambda: {s: [] for s in SPLITS})
    countries: list[Country] = field(default_factory=list)

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for split in SPLITS:
            for text in self.code[split] + self.docs[split] + self.facts[split]:
                h.update(hashlib.sha256(text.encode()).digest())
            for chat in self.chats[split]:
                h.update(hashlib.sha256(chat.pieces().text.encode()).digest())
        return h.hexdigest()

    def summary(self) -> dict:
        return {
            "seed": self.seed, "digest": self.digest, "python": sys.version.split()[0],
            **{f"{src}_{split}": len(getattr(self, src)[split]) for src in ("code", "docs", "chats")
               for split in SPLITS},
            **{f"{src}_{split}_chars": sum(len(t) for t in getattr(self, src)[split]) for src in ("code", "docs")
               for split in SPLITS},
        }


def build_corpus(seed: int = 0, code_bytes: int = DEFAULT_CODE_BYTES, n_chats: int = DEFAULT_CHATS,
                 stdlib_root: str | Path | None = None) -> Corpus:
    corpus = Corpus(seed)
    for f in stdlib_files(code_bytes, stdlib_root):
        split = "heldout" if is_heldout(f"file:{f.rel}") else "train"
        corpus.files[split].append(f.rel)
        corpus.code[split].append(f.text)
        corpus.docs[split].extend(docstrings(f))
    corpus.docs["train"].extend(topic_texts(stdlib_root))
    corpus.countries = fact_table(seed)
    corpus.facts["train"] = fact_texts(corpus.countries)
    for chat in generate_chats(seed, n_chats, corpus.countries):
        corpus.chats[chat.split].append(chat)
    return corpus
