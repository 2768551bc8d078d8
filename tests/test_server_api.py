"""The OpenAI-compatible API against a real hypercorn server on loopback, driven by the official `openai` client."""

import json

import httpx
import openai
import pytest

from dsv41.chat import build_chat_prompt
from server_harness import ALIAS, SERVED_NAME, client, server, tokenizer  # noqa: F401 (pytest fixtures)

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


def extra(obj, name):
    return (obj.model_extra or {}).get(name)


def test_models_health_and_auth(server, client):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [SERVED_NAME, ALIAS]
    assert all(extra(m, "max_model_len") > 0 for m in models.data)
    health = server.health()
    assert health.status_code == 200
    body = health.json()
    assert body["ok"] is True and body["status"] == "ready" and body["uptime_s"] > 0
    for key in ("inflight", "requests_total", "errors_total", "prompt_tokens_total", "completion_tokens_total"):
        assert isinstance(body[key], int)
    # wrong and missing keys
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.models.list()
    assert err.value.status_code == 401 and err.value.body["type"] == "authentication_error"
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}).status_code == 401
    # a key that shares a prefix with the real one is still wrong
    near = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {server.api_key[:-1]}"})
    assert near.status_code == 401


def test_version_endpoint_needs_no_key(server):
    import importlib.metadata

    reply = httpx.get(f"{server.url}/version")
    assert reply.status_code == 200 and reply.json() == {"version": importlib.metadata.version("dsv41")}


def test_chat_non_stream_thinking_default(client):
    resp = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=12, seed=1)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length")
    reasoning = extra(choice.message, "reasoning_content")
    assert reasoning == extra(choice.message, "reasoning")
    # thinking is on by default: the prompt ends in <think>, so output starts as reasoning
    assert reasoning
    assert resp.usage.completion_tokens == 12 or choice.finish_reason == "stop"
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    # resumed from a session entry when an earlier test sent this prompt (never all of it: the last prompt token is
    # always computed, so the first token is sampled from fresh logits); tests/test_server_sessions.py tests it
    assert 0 <= resp.usage.prompt_tokens_details.cached_tokens < resp.usage.prompt_tokens


def test_chat_thinking_off_puts_everything_in_content(client):
    for body in ({"reasoning_effort": "none"}, {"chat_template_kwargs": {"thinking": False}},
                 {"chat_template_kwargs": {"enable_thinking": False}}):
        resp = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=8, seed=3,
                                              extra_body=body)
        message = resp.choices[0].message
        assert extra(message, "reasoning_content") is None and extra(message, "reasoning") is None
        assert message.content


def test_effort_changes_the_rendered_prompt(server, tokenizer):
    """reasoning_effort words map to the encoder's numbers; /tokenize renders exactly what chat renders."""
    http = server.http()
    for effort, expected in (("low", 50), ("medium", 75), ("high", 75), ("xhigh", 100), ("max", 100), (33, 33)):
        body = {"messages": MESSAGES, "reasoning_effort": effort}
        tokens = http.post("/tokenize", json=body).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
        assert f"Reasoning Effort: {expected}" in text
        local = build_chat_prompt(body)
        assert tokens == tokenizer.encode(local.prompt)
    # chat_template_kwargs win over the top-level field
    body = {"messages": MESSAGES, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "max"}}
    text = http.post("/detokenize", json={"tokens": http.post("/tokenize", json=body).json()["tokens"]}).json()
    assert "Reasoning Effort: 100" in text["prompt"]


def test_tokenize_matches_chat_prompt_tokens(server, client, tokenizer):
    http = server.http()
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    body = {"messages": MESSAGES, "tools": tools}
    tok = http.post("/tokenize", json=body).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0
    assert tok["tokens"] == tokenizer.encode(build_chat_prompt(body).prompt)
    assert tok["tokens"][0] == tokenizer.bos_id
    resp = client.chat.completions.create(model=SERVED_NAME, max_tokens=2, **body)
    assert resp.usage.prompt_tokens == tok["count"]
    plain = http.post("/tokenize", json={"prompt": "hello there"}).json()
    assert plain["tokens"] == [tokenizer.bos_id] + tokenizer.encode("hello there")
    bare = http.post("/tokenize", json={"prompt": "hello there", "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode("hello there")


def test_chat_stream_chunks_done_and_usage(server, client):
    stream = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=10, seed=5,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    reasoning = "".join(extra(c.choices[0].delta, "reasoning_content") or "" for c in chunks if c.choices)
    # the stream and the non-stream reply of the same request agree
    whole = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=10, seed=5)
    assert reasoning == extra(whole.choices[0].message, "reasoning_content")
    # the raw bytes end with the [DONE] sentinel
    with server.http() as http:
        raw = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_seeds_reproduce(client):
    def run(**kw):
        resp = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=16,
                                              temperature=1.0, extra_body={"reasoning_effort": "none"}, **kw)
        return resp.choices[0].message.content

    assert run(seed=7) == run(seed=7)
    assert run(seed=7) != run(seed=8)
    # without a seed, each request draws a fresh one and returns it in `seed`: sending it back reproduces the reply
    first = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=16, temperature=1.0,
                                           extra_body={"reasoning_effort": "none"})
    assert run() != run() or run() != run()
    assert run(seed=first.seed) == first.choices[0].message.content
    texts = {run(seed=s, top_p=0.9) for s in range(4)}
    assert len(texts) > 1


def test_completions_text_and_token_ids(client, tokenizer):
    prompt = "The lighthouse keeper"
    a = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=10, seed=11)
    assert a.object == "text_completion" and a.id.startswith("cmpl-")
    assert a.usage.prompt_tokens == 1 + len(tokenizer.encode(prompt))
    ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
    b = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=10, seed=11)
    assert b.choices[0].text == a.choices[0].text
    assert b.usage.prompt_tokens == len(ids)
    echo = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=4, seed=11, echo=True)
    assert echo.choices[0].text.startswith(prompt)
    streamed = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=10, seed=11, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == a.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(client, tokenizer):
    """Prompt token i is scored with the distribution after tokens < i: for the last prompt token that is the
    distribution a plain completion of the shorter prompt reports for its first token."""
    prefix = [tokenizer.bos_id] + tokenizer.encode("The lighthouse keeper")
    first = client.completions.create(model=SERVED_NAME, prompt=prefix, max_tokens=1, temperature=0, logprobs=3)
    after_prefix = first.choices[0].logprobs.top_logprobs[0]
    ids = prefix + tokenizer.encode(" walked")
    scored = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=2, temperature=0, logprobs=3,
                                       echo=True)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text.startswith(tokenizer.decode(ids))
    assert len(lp.tokens) == len(ids) + scored.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # (top_logprobs are keyed by token text: two ids that decode alike share one key)
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    at_prefix = lp.top_logprobs[len(prefix)]
    assert at_prefix.keys() == after_prefix.keys()
    assert all(at_prefix[k] == pytest.approx(after_prefix[k], abs=1e-4) for k in at_prefix)
    assert lp.text_offset == sorted(lp.text_offset)
    text_prompt = "The lighthouse keeper walked"  # the BOS the server adds is neither echoed nor scored
    echoed = client.completions.create(model=SERVED_NAME, prompt=text_prompt, max_tokens=1, logprobs=1, echo=True)
    text_lp = echoed.choices[0].logprobs
    n_prompt = len(tokenizer.encode(text_prompt))
    assert "".join(text_lp.tokens[:n_prompt]) == text_prompt and text_lp.token_logprobs[0] is not None
    streamed = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=2, temperature=0, logprobs=3,
                                         echo=True, stream=True)
    tokens = [t for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
              for t in chunk.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_ignore_eos_and_max_tokens(client):
    resp = client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=20, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 20 and resp.choices[0].finish_reason == "length"


def test_logprobs_chat_and_completions(client):
    resp = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3)
    entries = resp.choices[0].logprobs.content
    assert len(entries) == resp.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert isinstance(entry.bytes, list)
    streamed = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=3, stream=True)
    stream_entries = [e for c in streamed if c.choices and c.choices[0].logprobs
                      for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in stream_entries] == pytest.approx([e.logprob for e in entries])
    comp = client.completions.create(model=SERVED_NAME, prompt="The sea", max_tokens=5, logprobs=2, temperature=0)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    # greedy: the chosen token is the best (the legacy format keys by token text, so skip entries where two
    # alternatives decode to the same text and one hid the other)
    distinct = [(top, chosen) for top, chosen in zip(lp.top_logprobs, lp.token_logprobs) if len(top) == 2]
    assert all(max(top.values()) == pytest.approx(chosen) for top, chosen in distinct)


def _stop_candidate(text: str) -> str | None:
    """A 2-character piece of `text` that first occurs after position 2."""
    for i in range(2, len(text) - 2):
        piece = text[i:i + 2]
        if piece.strip() and text.find(piece) == i:
            return piece
    return None


def test_stop_strings_cut_the_answer(client):
    kw = dict(model=SERVED_NAME, prompt="The lighthouse", max_tokens=24, seed=21, temperature=1.0)
    full = client.completions.create(**kw).choices[0].text
    stop = _stop_candidate(full)
    assert stop is not None, f"no stop candidate in {full!r}"
    cut = client.completions.create(stop=[stop, "\u2603never"], **kw)
    assert cut.choices[0].text == full[:full.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kw))
    assert streamed == full[:full.find(stop)]
    # chat: the stop string applies to the answer (thinking off here)
    chat_kw = dict(model=SERVED_NAME, messages=MESSAGES, max_tokens=24, seed=4,
                   extra_body={"reasoning_effort": "none"})
    answer = client.chat.completions.create(**chat_kw).choices[0].message.content
    stop = _stop_candidate(answer)
    assert stop is not None, f"no stop candidate in {answer!r}"
    cut = client.chat.completions.create(stop=stop, **chat_kw)
    assert cut.choices[0].message.content == answer[:answer.find(stop)] or (
        cut.choices[0].message.content is None and answer.find(stop) == 0)
    assert cut.choices[0].finish_reason == "stop"


def test_metrics_and_request_log(server, client):
    resp = client.completions.create(model=SERVED_NAME, prompt="metrics", max_tokens=3)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("dsv41_requests_total", "dsv41_prompt_tokens_total", "dsv41_generation_tokens_total",
                 "dsv41_request_latency_seconds_bucket", "vllm:num_requests_running",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket"):
        assert name in text, name
    records = [json.loads(line) for line in server.request_log.read_text().splitlines()]
    last = [r for r in records if r["endpoint"] == "completions" and r["status"] == 200][-1]
    # unseeded at T=1 the reply may stop early: the log must say what the reply said
    assert last["completion_tokens"] == resp.usage.completion_tokens and 1 <= last["completion_tokens"] <= 3
    assert last["finish_reason"] == resp.choices[0].finish_reason
    with server.http() as http:
        assert http.post("/v1/completions", json={"prompt": "x", "n": 17}).status_code == 400
    refused = json.loads(server.request_log.read_text().splitlines()[-1])
    assert refused["status"] == 400 and "n must be between 1 and 16" in refused["error"]


def test_unknown_fields_are_ignored_and_logged_once_and_an_unknown_model_is_404(server, client):
    resp = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=2,
                                          extra_body={"frobnicate": {"x": 1}, "user_tag": "t"})
    assert resp.choices[0].finish_reason in ("stop", "length")
    client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=1, extra_body={"frobnicate": 2})
    warned = [line for line in server.lines if "accepted but not implemented" in line and "'frobnicate'" in line]
    assert len(warned) == 1, warned
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="some-other-name", messages=MESSAGES, max_tokens=2)
    assert "does not exist" in err.value.message and err.value.body["code"] == "model_not_found"
    alias = client.completions.create(model=ALIAS, prompt="x", max_tokens=1)
    assert alias.model == ALIAS


def test_history_reasoning_accepted_under_both_names(server):
    """`reasoning_content` and `reasoning` on an assistant turn render the same prompt (tools keep it)."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]

    def rendered(field):
        history = [{"role": "user", "content": "q1"},
                   {"role": "assistant", "content": "a1", field: "I pondered the lamp"},
                   {"role": "user", "content": "q2"}]
        with server.http() as http:
            tokens = http.post("/tokenize", json={"messages": history, "tools": tools}).json()["tokens"]
            return http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]

    assert rendered("reasoning") == rendered("reasoning_content")
    assert "<think>I pondered the lamp</think>a1" in rendered("reasoning")


def test_continue_final_message_replies_as_content(server, client):
    messages = MESSAGES + [{"role": "assistant", "content": "The colour is"}]
    resp = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=6, seed=2,
                                          extra_body={"continue_final_message": True})
    message = resp.choices[0].message
    assert extra(message, "reasoning_content") is None and message.content
    with server.http() as http:
        tokens = http.post("/tokenize", json={"messages": messages, "continue_final_message": True}).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text.endswith("The colour is")  # the prefill is continued, not closed with EOS
