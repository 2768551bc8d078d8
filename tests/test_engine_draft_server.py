"""Drafting through a real `dsv41 serve` (tiny model, CPU) with the official OpenAI client: a request with
`draft: false` and one that drafts (DSpark + lookup, the server's default here) give the same reply — text, token
logprobs and top logprobs — and the drafts show in /health, /metrics (vLLM's spec-decode names, per drafter) and
the request log (tokens per round)."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_harness import ServerProcess


@pytest.fixture(scope="module")
def drafting_server(tmp_path_factory):
    # a flat step cost (what a GPU's verify window costs, nearly): the depth is the cap, so drafts do run
    server = ServerProcess(tmp_path_factory.mktemp("draft"), "--draft-dspark", "on", "--draft-lookup", "on",
                           "--draft-cost", "1:0.01", "--max-model-len", "512")
    yield server
    server.terminate()


def _completion(client, draft):
    extra = {} if draft is None else {"draft": draft}
    return client.completions.create(model="dsv41-tiny", prompt="the cat sat on the mat. the cat sat on the",
                                     max_tokens=16, temperature=0.7, seed=4, logprobs=2, extra_body=extra)


def _chat(client, draft):
    extra = {} if draft is None else {"draft": draft}
    return client.chat.completions.create(model="dsv41-tiny", messages=[{"role": "user", "content": "count: 1 2 3"}],
                                          max_tokens=12, temperature=0.0, logprobs=True, top_logprobs=3,
                                          extra_body=extra)


def test_draft_false_and_the_default_give_the_same_reply(drafting_server):
    client = drafting_server.client()
    off, on = _completion(client, False), _completion(client, None)
    assert off.choices[0].text == on.choices[0].text and off.choices[0].text
    assert off.choices[0].logprobs.model_dump() == on.choices[0].logprobs.model_dump()
    off, on, capped = _chat(client, False), _chat(client, None), _chat(client, 2)
    assert off.choices[0].message.content == on.choices[0].message.content == capped.choices[0].message.content
    assert off.choices[0].logprobs.model_dump() == on.choices[0].logprobs.model_dump() \
        == capped.choices[0].logprobs.model_dump()
    with drafting_server.http() as http:
        bad = http.post("/v1/completions", json={"model": "dsv41-tiny", "prompt": "x", "max_tokens": 2, "draft": 9})
        assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("draft")

    drafting_server.wait_idle()
    batching = drafting_server.health().json()["batching"]["drafting"]
    assert batching["drafters"] == ["dspark", "lookup"] and batching["depth"] == 5
    drafted = batching["dspark"]["num_draft_tokens"] + batching["lookup"]["num_draft_tokens"]
    assert drafted > 0
    with drafting_server.http() as http:
        families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    samples = {(s.name, s.labels.get("drafter"), s.labels.get("position")): s.value
               for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                            "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")
               for s in families[name].samples if s.labels.get("model_name") == "dsv41-tiny"}
    tokens = sum(v for (n, _, _), v in samples.items() if n == "vllm:spec_decode_num_draft_tokens_total")
    assert tokens == drafted
    assert samples["vllm:spec_decode_num_drafts_total", "dspark", None] == batching["dspark"]["num_drafts"]
    accepted = sum(v for (n, _, p), v in samples.items() if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert accepted == samples["vllm:spec_decode_num_accepted_tokens_total", "dspark", None] \
        + samples["vllm:spec_decode_num_accepted_tokens_total", "lookup", None]

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [json.loads(line) for line in drafting_server.request_log.read_text().splitlines()]
        if len(lines) >= 5:
            break
        time.sleep(0.05)
    rounds = [line.get("tokens_per_round") for line in lines if line.get("status") == 200]
    assert len(rounds) == 5 and all(r is not None and r >= 1.0 for r in rounds)
