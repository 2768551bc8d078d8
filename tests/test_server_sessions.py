"""Sessions seen from the API (issue 34): a later turn resumes from a session entry, and the server reports it —
`usage.prompt_tokens_details.cached_tokens` (chat, completions, streamed and not), `/v1/responses`'
`input_tokens_details.cached_tokens`, Anthropic's `cache_read_input_tokens`, vLLM's prefix-cache counters,
`/health`'s `batching.sessions` and `cached_tokens_total`, the request log.

Two real servers on the tiny model: one with sessions (the default) and one with `--sessions off`. A resumed
second turn equals the fresh one token for token and logprob for logprob, at T = 0 and seeded T = 0.7. The
`cached_tokens` a reply reports is checked against the engine's rule (engine/sessions.py): the longest entry
that is a strict prefix of the prompt, where entries are every earlier prompt's mark (all but its last token) and
every earlier turn's end (prompt + reply ids, the last sampled token not absorbed). The per-turn fraction reused is
printed (`pytest -s`); docs/SERVER.md "Sessions" quotes it, and where the next turn's prompt stops agreeing
with the ids generated so far.
"""

from __future__ import annotations

import json

import anthropic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_harness import API_KEY, SERVED_NAME, ServerProcess, model_dir

MIN_TOKENS = 16  # the default --session-min-tokens


class Recorder:
    """A server and the session entries its requests made (ids), so a reply's cached_tokens can be predicted."""

    def __init__(self, proc: ServerProcess, sessions: bool):
        self.proc, self.client, self.sessions = proc, proc.client(), sessions
        self.entries: list[list[int]] = []
        self.cached_seen = 0  # the sum of every reported cached_tokens (the server's totals must equal it)

    def expected(self, prompt: list[int]) -> int:
        """The engine's rule: the longest entry that is a strict prefix of the prompt (0: none)."""
        fits = [len(e) for e in self.entries if len(e) < len(prompt) and prompt[:len(e)] == e]
        return max(fits, default=0)

    def finished(self, reply: dict) -> None:
        """Note a finished turn: `reply["expected"]` is what it should have resumed (the entries made before it),
        then its own entries are added."""
        prompt, generated = reply["prompt"], reply["ids"]
        reply["expected"] = self.expected(prompt) if self.sessions else 0
        self.cached_seen += reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        if not self.sessions:
            return
        mark = len(prompt) - 1  # engine/sessions.py prompt_mark: just before the prompt's last token
        if mark >= MIN_TOKENS:
            self.entries.append(prompt[:mark])
        end = prompt + generated[:-1]  # the turn's end: the last sampled token is not absorbed
        if len(end) >= MIN_TOKENS:
            self.entries.append(end)

    def health(self) -> dict:
        return self.proc.wait_idle()

    def scrape(self) -> dict:
        with self.proc.http() as http:
            r = http.get("/metrics")
        assert r.status_code == 200
        return {f.name: f for f in text_string_to_metric_families(r.text)}


@pytest.fixture(scope="module")
def on(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("sessions-on"))
    yield Recorder(proc, sessions=True)
    proc.terminate()


@pytest.fixture(scope="module")
def off(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("sessions-off"), "--sessions", "off")
    yield Recorder(proc, sessions=False)
    proc.terminate()


@pytest.fixture(scope="module")
def tokenizer():
    from dsv41.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir())


def _chat(rec: Recorder, messages: list[dict], *, stream: bool = False, **kw) -> dict:
    """One chat turn with its ids and logprobs: {prompt, ids, logprobs (token, logprob, top), usage, message}."""
    body = dict(model=SERVED_NAME, messages=messages, logprobs=True, top_logprobs=3,
                extra_body={"return_token_ids": True, **kw.pop("extra_body", {})}, **kw)
    if not stream:
        reply = rec.client.chat.completions.create(**body).model_dump()
        choice = reply["choices"][0]
        out = {"prompt": reply["prompt_token_ids"], "ids": choice["token_ids"], "usage": reply["usage"],
               "logprobs": [(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
                            for e in (choice["logprobs"] or {}).get("content") or []],
               "message": choice["message"], "id": reply["id"], "finish": choice["finish_reason"]}
    else:
        out = {"prompt": None, "ids": [], "logprobs": [], "usage": None, "message": {"content": "", "reasoning_content": ""}}
        for chunk in rec.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **body):
            d = chunk.model_dump()
            out["id"] = d["id"]
            out["prompt"] = out["prompt"] or d.get("prompt_token_ids")
            if d.get("usage"):
                out["usage"] = d["usage"]
            for choice in d["choices"]:
                out["ids"] += choice.get("token_ids") or []
                for e in (choice["logprobs"] or {}).get("content") or []:
                    out["logprobs"].append((e["token"], e["logprob"],
                                            [(t["token"], t["logprob"]) for t in e["top_logprobs"]]))
                for key in ("content", "reasoning_content"):
                    out["message"][key] += choice["delta"].get(key) or ""
        assert out["usage"] is not None, "no final usage chunk"
    rec.finished(out)
    return out


def _complete(rec: Recorder, prompt: list[int], *, stream: bool = False, **kw) -> dict:
    """One /v1/completions call on token ids: {prompt, ids, logprobs, usage}."""
    body = dict(model=SERVED_NAME, prompt=prompt, logprobs=3, extra_body={"return_token_ids": True, "ignore_eos": True},
                **kw)
    out = {"prompt": prompt, "ids": [], "logprobs": [], "usage": None}
    replies = rec.client.completions.create(stream=True, stream_options={"include_usage": True}, **body) \
        if stream else [rec.client.completions.create(**body)]
    for reply in replies:
        d = reply.model_dump()
        out["id"] = d["id"]
        if d.get("usage"):
            out["usage"] = d["usage"]
        for choice in d["choices"]:
            out["ids"] += choice.get("token_ids") or []
            lp = choice["logprobs"]
            if lp:
                out["logprobs"] += list(zip(lp["tokens"], lp["token_logprobs"],
                                            [sorted(t.items()) for t in lp["top_logprobs"]]))
    assert out["usage"] is not None, "no usage"
    rec.finished(out)
    return out


def _history(messages: list[dict], reply: dict, follow_up: str) -> list[dict]:
    message = reply["message"]
    assistant = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("reasoning_content"):
        assistant["reasoning_content"] = message["reasoning_content"]  # the encoder drops it (drop_thinking)
    return messages + [assistant, {"role": "user", "content": follow_up}]


def _agreement(generated: list[int], prompt: list[int]) -> int:
    k = 0
    while k < min(len(generated), len(prompt)) and generated[k] == prompt[k]:
        k += 1
    return k


# ---------------------------------------------------------------------------- (a) resumed == fresh
@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.7, 1234)], ids=["greedy", "T0.7"])
def test_resumed_chat_turn_equals_fresh(on, off, temperature, seed):
    """Turn 2 of a thinking chat (the default): the reasoning of turn 1 is dropped from the history, so it resumes
    from turn 1's prompt mark. Streamed at T = 0.7 (the final usage chunk carries cached_tokens)."""
    first = [{"role": "system", "content": "You describe places in a few words."},
             {"role": "user", "content": f"Case {temperature}: describe a lighthouse at dusk, please."}]
    turns = {}
    for rec in (on, off):
        one = _chat(rec, first, max_tokens=10, temperature=temperature, seed=seed)
        two = _chat(rec, _history(first, one, "And the same lighthouse at dawn?"), max_tokens=10,
                    temperature=temperature, seed=seed, stream=temperature > 0)
        turns[rec] = (one, two)
    for k in (0, 1):
        a, b = turns[on][k], turns[off][k]
        assert a["prompt"] == b["prompt"]
        assert a["ids"] == b["ids"] and a["logprobs"] == b["logprobs"], f"turn {k + 1} differs"
        assert len(a["logprobs"]) == len(a["ids"]) == a["usage"]["completion_tokens"]
    resumed = turns[on][1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert turns[on][0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a new conversation
    assert resumed == turns[on][1]["expected"] > 0
    assert turns[off][1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # the request log has the same count
    logged = [json.loads(line) for line in on.proc.request_log.read_text().splitlines()]
    assert [r["cached_tokens"] for r in logged if r["id"] == turns[on][1]["id"]] == [resumed]


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.7, 99)], ids=["greedy", "T0.7"])
def test_resumed_completion_equals_fresh(on, off, temperature, seed):
    """Token ids: turn 2 = turn 1's prompt + its reply + more ids, resumed from turn 1's end (an entry that ends
    inside a page, past the prompt's own mark). Streamed at T = 0 (the final usage chunk)."""
    prompt = [(7 * i + 11 + int(temperature * 10)) % 400 + 20 for i in range(37)]
    turns = {}
    for rec in (on, off):
        one = _complete(rec, prompt, max_tokens=9, temperature=temperature, seed=seed)
        two = _complete(rec, prompt + one["ids"] + [31, 41, 59, 26, 53], max_tokens=9, temperature=temperature,
                        seed=seed, stream=temperature == 0)
        turns[rec] = (one, two)
    for k in (0, 1):
        a, b = turns[on][k], turns[off][k]
        assert a["ids"] == b["ids"] and a["logprobs"] == b["logprobs"], f"turn {k + 1} differs"
        assert len(a["logprobs"]) == len(a["ids"]) == 9
    resumed = turns[on][1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert resumed == len(prompt) + 9 - 1 == turns[on][1]["expected"]  # turn 1's end
    assert turns[off][1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_concurrent_turns_resuming_one_entry_equal_fresh(on, off):
    """Two follow-ups to one turn, sent together: both resume from the same entry (its pages shared, its snapshot
    restored into two slots) and each equals the fresh reply of the server without sessions."""
    from concurrent.futures import ThreadPoolExecutor

    prompt = [(13 * i + 5) % 400 + 20 for i in range(45)]
    replies = {}
    for rec in (on, off):
        one = _complete(rec, prompt, max_tokens=6, temperature=0)
        follow = [prompt + one["ids"] + tail for tail in ([101, 102, 103], [201, 202])]
        with ThreadPoolExecutor(2) as pool:
            replies[rec] = list(pool.map(lambda p: _complete(rec, p, max_tokens=6, temperature=0.7, seed=8), follow))
    for a, b in zip(replies[on], replies[off]):
        assert a["ids"] == b["ids"] and a["logprobs"] == b["logprobs"]
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) + 6 - 1
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_nvme_tier_after_a_restart_reports_the_resumed_tokens(off, tmp_path):
    """A conversation parked by the SIGTERM drain resumes on the restarted server from the NVMe tier: the reply is
    the fresh one, `cached_tokens` counts the loaded entry, and /health and /metrics put the hit in the nvme tier."""
    sessions = ("--session-dir", str(tmp_path / "parked"), "--session-disk-min-tokens", "16")
    prompt = [(11 * i + 3) % 400 + 20 for i in range(90)]  # a load must gain 64 tokens over RAM (disk_gain)
    before = ServerProcess(tmp_path / "before", *sessions)
    try:
        one = _complete(Recorder(before, sessions=True), prompt, max_tokens=6, temperature=0)
    finally:
        assert before.terminate() == 0  # the drain parks every RAM entry
    after = ServerProcess(tmp_path / "after", *sessions)
    try:
        rec = Recorder(after, sessions=True)
        follow = prompt + one["ids"] + [7, 8, 9]
        two = _complete(rec, follow, max_tokens=6, temperature=0.7, seed=3)
        health, families = rec.health(), rec.scrape()
    finally:
        after.terminate()
    fresh = _complete(off, follow, max_tokens=6, temperature=0.7, seed=3)
    assert two["ids"] == fresh["ids"] and two["logprobs"] == fresh["logprobs"]
    cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == len(prompt) + 6 - 1  # turn 1's end, parked and loaded
    figures = health["batching"]["sessions"]
    assert (figures["disk_hits"], figures["disk_hit_tokens"], figures["hit_tokens"]) == (1, cached, 0)
    assert health["cached_tokens_total"] == cached
    assert _value(families, "vllm:prefix_cache_hits") == cached
    tiers = {s.labels["tier"]: s.value for s in families["dsv41_session_hit_tokens"].samples}
    assert tiers == {"ram": 0, "nvme": cached}


# ---------------------------------------------------------------------------- (b) conversations
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
NO_THINKING = {"reasoning_effort": "none"}


def _report(kind: str, turn: int, prev: dict, reply: dict, tokenizer) -> None:
    usage, prompt = reply["usage"], reply["prompt"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    generated = prev["prompt"] + prev["ids"]
    agree = _agreement(generated, prompt)
    where = ""
    if agree < len(generated):
        where = (f"; ids diverge at {agree} (previous prompt {len(prev['prompt'])}): generated "
                 f"{tokenizer.decode(generated[agree:agree + 2])!r} vs re-encoded {tokenizer.decode(prompt[agree:agree + 2])!r}")
    print(f"\n{kind} turn {turn}: prompt {usage['prompt_tokens']}, cached {cached} "
          f"({cached / usage['prompt_tokens']:.0%}){where}")


def test_three_turn_thinking_chat_reuses_every_turn(on, tokenizer):
    """Thinking on (the default), no tools: the encoder drops the reasoning of earlier turns, rendering the answered
    turn as `<｜Assistant｜></think>answer` where the prompt ended in `<｜Assistant｜><think>`; the ids agree up
    to that last prompt token only, so each turn resumes from the previous prompt's mark, just before it."""
    think, end_think = tokenizer.special("<think>"), tokenizer.special("</think>")
    messages = [{"role": "system", "content": "You are a concise travel guide for northern Europe."},
                {"role": "user", "content": "Plan one day in Bergen for me."}]
    prev = None
    for turn in (1, 2, 3):
        reply = _chat(on, messages, max_tokens=12, temperature=0)
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        if prev is None:
            assert cached == 0
        else:
            _report("thinking chat", turn, prev, reply, tokenizer)
            n = len(prev["prompt"])
            assert prev["prompt"][-1] == think and reply["prompt"][n - 1] == end_think
            assert _agreement(prev["prompt"], reply["prompt"]) == n - 1
            assert cached == reply["expected"] == n - 1
        prev = reply
        messages = _history(messages, reply, f"Thanks. Now turn {turn + 1}: what about the evening?")


def test_three_turn_plain_chat_resumes_at_the_reply_end(on, tokenizer):
    """Thinking off, a reply that re-encodes as generated (a guided choice of plain words: the tiny model's free text
    is random bytes that do not survive decode and encode): each turn resumes from the previous turn's end."""
    options = ["Take the funicular up Mount Floyen.", "Walk along the old Bryggen wharf."]
    messages = [{"role": "system", "content": "You are a concise travel guide for western Norway."},
                {"role": "user", "content": "One thing to do in Bergen?"}]
    prev = None
    for turn in (1, 2, 3):
        reply = _chat(on, messages, max_tokens=30, temperature=0, extra_body={**NO_THINKING, "guided_choice": options})
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        if prev is not None:
            _report("plain chat", turn, prev, reply, tokenizer)
            end = len(prev["prompt"]) + len(prev["ids"]) - 1
            assert _agreement(prev["prompt"] + prev["ids"], reply["prompt"]) > end
            assert cached == reply["expected"] == end
        else:
            assert cached == 0
        prev = reply
        messages = _history(messages, reply, f"Good. And a second idea ({turn + 1})?")


def test_agent_loop_resumes_at_the_reply_end(on, tokenizer):
    """Tools declared (the encoder keeps the history as it was), a call forced each turn and its result resent:
    each turn's prompt extends the previous prompt and its reply, which resumes all but the reply's last token."""
    messages = [{"role": "user", "content": "Check the weather where I am going next week."}]
    prev = None
    for turn in (1, 2, 3):
        reply = _chat(on, messages, max_tokens=200, temperature=0, tools=[WEATHER], tool_choice="required",
                      parallel_tool_calls=False, extra_body=NO_THINKING)
        calls = reply["message"]["tool_calls"]
        assert calls and reply["finish"] == "tool_calls", "the grammar forces a call, ended by EOS"
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        if prev is not None:
            _report("agent loop", turn, prev, reply, tokenizer)
            end = len(prev["prompt"]) + len(prev["ids"]) - 1
            assert _agreement(prev["prompt"] + prev["ids"], reply["prompt"]) > end
            assert cached == reply["expected"] == end
        else:
            assert cached == 0
        prev = reply
        messages = messages + [
            {"role": "assistant", "content": reply["message"]["content"], "tool_calls": [
                {"id": c["id"], "type": "function", "function": c["function"]} for c in calls]},
            *[{"role": "tool", "tool_call_id": c["id"], "content": f"sunny, {18 + turn} C"} for c in calls]]


def test_agent_loop_with_thinking_restores_the_dropped_reasoning(on, tokenizer):
    """Thinking on and tools declared (drop_thinking off: earlier turns keep their reasoning), the client resending
    each reply WITHOUT its reasoning_content (as most agent clients do): the server's reasoning memory puts it
    back by tool-call id, so the prompt is the one a client sending the reasoning gets (an explicit empty
    reasoning is the client's word, kept). On a real model that prompt extends the previous prompt and reply to
    its end; the random tiny model's reasoning can hold bytes that are no text (U+FFFD on the way back), so here
    the reuse is reported, and asserted to reach past the previous prompt's mark."""
    messages = [{"role": "user", "content": "Check the weather where I am going next week."}]
    prev = None
    for turn in (1, 2):
        reply = _chat(on, messages, max_tokens=120, temperature=0, tools=[WEATHER], tool_choice="required",
                      parallel_tool_calls=False, extra_body={"thinking_token_budget": 12})
        calls, reasoning = reply["message"]["tool_calls"], reply["message"]["reasoning_content"]
        assert calls and reasoning, "the reply reasons, then calls"
        if prev is not None:
            _report("agent loop, thinking, reasoning dropped by the client", turn, prev, reply, tokenizer)
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prev["prompt"]) - 1
        prev = reply
        history = [{"role": "assistant", "content": reply["message"]["content"], "tool_calls": [
            {"id": c["id"], "type": "function", "function": c["function"]} for c in calls]},
            *[{"role": "tool", "tool_call_id": c["id"], "content": f"sunny, {18 + turn} C"} for c in calls]]

        def tokens(assistant_extra: dict) -> list[int]:
            body = {"model": SERVED_NAME, "tools": [WEATHER],
                    "messages": messages + [{**history[0], **assistant_extra}, *history[1:]]}
            return on.client.post("/tokenize", cast_to=object, body=body)["tokens"]

        restored, explicit, empty = tokens({}), tokens({"reasoning_content": reasoning}), \
            tokens({"reasoning_content": ""})
        assert restored == explicit and restored != empty
        messages = messages + history


# ---------------------------------------------------------------------------- (c) the Anthropic client
def test_anthropic_cache_read_input_tokens(on):
    claude = anthropic.Anthropic(base_url=on.proc.url, api_key=API_KEY, max_retries=0, timeout=120)
    system = "You are a terse assistant for a shipping company. Answer in one short sentence."
    messages = [{"role": "user", "content": "Where is my parcel 4711 now?"}]
    first = claude.messages.create(model=SERVED_NAME, max_tokens=6, system=system, messages=messages,
                                   extra_body={"temperature": 0})
    assert first.usage.cache_read_input_tokens == 0 and first.usage.cache_creation_input_tokens == 0
    messages = messages + [{"role": "assistant", "content": first.content or "..."},
                           {"role": "user", "content": "And parcel 4712?"}]
    counted = claude.messages.count_tokens(model=SERVED_NAME, system=system, messages=messages).input_tokens
    with claude.messages.stream(model=SERVED_NAME, max_tokens=6, system=system, messages=messages,
                                extra_body={"temperature": 0}) as stream:
        events = list(stream)
        second = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start").message.usage
    delta = next(e for e in events if e.type == "message_delta").usage
    usage = second.usage
    assert usage.cache_read_input_tokens > 0 and usage.cache_creation_input_tokens == 0
    # Anthropic's split: input_tokens are those prefilled; with the cache read they make up the whole prompt
    assert usage.input_tokens + usage.cache_read_input_tokens == counted
    assert (start.input_tokens, start.cache_read_input_tokens) == (usage.input_tokens, usage.cache_read_input_tokens)
    assert (delta.input_tokens, delta.cache_read_input_tokens, delta.output_tokens) == \
        (usage.input_tokens, usage.cache_read_input_tokens, usage.output_tokens)
    on.cached_seen += first.usage.cache_read_input_tokens + usage.cache_read_input_tokens


# ---------------------------------------------------------------------------- other routes
def test_responses_and_groups_report_cached_tokens(on):
    """/v1/responses reports input_tokens_details.cached_tokens; an n > 1 group counts its prompt once, with the
    first sibling's count (a group's sequences share the leader's prompt and do not resume: 0)."""
    text = "List three rivers of France and one fact about each of them, in order of length."
    first = on.client.responses.create(model=SERVED_NAME, input=text, max_output_tokens=4,
                                       reasoning={"effort": "none"})
    again = on.client.responses.create(model=SERVED_NAME, input=text, max_output_tokens=4,
                                       reasoning={"effort": "none"})
    assert first.usage.input_tokens_details.cached_tokens == 0
    cached = again.usage.input_tokens_details.cached_tokens
    assert cached == again.usage.input_tokens - 1  # the first one's prompt mark
    on.cached_seen += cached
    group = on.client.chat.completions.create(model=SERVED_NAME, n=2, max_tokens=2, seed=5,
                                              messages=[{"role": "user", "content": text}])
    assert group.usage.prompt_tokens_details.cached_tokens == 0


# ---------------------------------------------------------------------------- (d) /metrics and /health
def _value(families: dict, name: str) -> float:
    return sum(s.value for s in families[name].samples if s.name.endswith("_total") or s.name == name)


def test_metrics_and_health_count_the_hits(on, off):
    """After the turns above: vLLM's prefix-cache counters are the engine's session figures, the server's cached
    totals the sum of the replies' counts, and the KV usage counts the pages session entries hold."""
    health = on.health()
    sessions = health["batching"]["sessions"]
    families = on.scrape()
    assert sessions["hits"] > 0 and sessions["hit_tokens"] > 0 and sessions["evicted"] == 0
    assert _value(families, "vllm:prefix_cache_hits") == sessions["hit_tokens"]
    assert _value(families, "vllm:prefix_cache_queries") == sessions["query_tokens"] > sessions["hit_tokens"]
    assert health["cached_tokens_total"] == _value(families, "dsv41_cached_tokens") == on.cached_seen
    assert sessions["hit_tokens"] == on.cached_seen  # every resumed token was reported to a client
    assert sessions["entries"] > 0 and sessions["snapshot_bytes"] > 0
    # idle: every page in use is held by a session entry, and vLLM's KV usage counts them
    pool = health["batching"]
    assert pool["pages_used"] == sessions["pages"] > 0
    assert _value(families, "vllm:kv_cache_usage_perc") == pytest.approx(sessions["pages"] / pool["pages_total"])
    # without sessions: nothing looked up, nothing held
    health_off, families_off = off.health(), off.scrape()
    assert health_off["batching"]["sessions"] is None and health_off["cached_tokens_total"] == 0
    assert _value(families_off, "vllm:prefix_cache_queries") == _value(families_off, "vllm:prefix_cache_hits") == 0
    assert health_off["batching"]["pages_used"] == 0 and _value(families_off, "vllm:kv_cache_usage_perc") == 0


# ---------------------------------------------------------------------------- reading the figures from the server
def test_session_figures_read_while_the_engine_thread_changes_entries():
    """/health and /metrics read `LLMEngine.stats()` on the server's thread while the engine's thread makes, touches
    and evicts entries; the session figures (`pages_held`, `snapshot_bytes`: a walk over the entries) must not
    raise "OrderedDict mutated during iteration" there (a 500 on /health). Fails today: engine/sessions.py walks
    `index.entries` without a copy (the engine's `prefilling` figure copies its list for this reason)."""
    import sys
    import threading
    import time

    from dsv41.engine.sessions import SessionConfig, SessionIndex

    index = SessionIndex(SessionConfig(), page_tokens=256)
    for i in range(200):
        index.add([i, 1, 2] * 10, [i])
    done = threading.Event()

    def engine_thread():
        k = 1000
        while not done.is_set():
            entry = index.add([k, 5] * 10, [k % 50])
            index.touch(next(iter(index.entries.values())))
            index.remove(entry)
            k += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: what a loaded server does now and then
    worker = threading.Thread(target=engine_thread)
    worker.start()
    failure = None
    try:
        deadline = time.monotonic() + 0.5
        while failure is None and time.monotonic() < deadline:
            try:
                index.pages_held, index.snapshot_bytes
            except RuntimeError as exc:
                failure = exc
    finally:
        done.set()
        worker.join()
        sys.setswitchinterval(interval)
    assert failure is None, f"reading the session figures while entries change: {failure}"
