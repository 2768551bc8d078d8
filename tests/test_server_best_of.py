"""n > 1 and best_of through the real server and the official client: the n choices are one engine group (the
prompt prefilled once, its full pages held once), choice i == a single request with seed + i token for token,
the pool is empty after siblings that finish apart and after a disconnect, and best_of returns the choices of
highest cumulative logprob among best_of sequences (vLLM's semantics)."""

from __future__ import annotations

import openai
import pytest

from server_harness import SERVED_NAME, ServerProcess, client, server  # noqa: F401 (pytest fixtures)

PROMPT = "the cat sat on the mat and the cat sat on the mat and the cat"
LONG = [(i * 53 + 17) % 400 + 5 for i in range(300)]  # 300 ids: one full page of 256 shared at the fork


def complete(client, **kw):
    body = dict(model=SERVED_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0)
    body.update(kw)
    return client.completions.create(**body)


def tokens(choice) -> tuple:
    return tuple(choice.logprobs.tokens), tuple(choice.logprobs.token_logprobs)


def batching(server) -> dict:
    return server.health().json()["batching"]


def pool_idle(server) -> bool:
    """No live sequence holds a slot or a page: every page still in use is a session entry's (issue 34)."""
    b = server.wait_idle()["batching"]
    return b["slots_busy"] == 0 and b["pages_used"] == (b["sessions"] or {}).get("pages", 0)


def test_n_three_equals_three_single_requests_token_for_token(client):
    many = complete(client, n=3, seed=70, logprobs=0)
    singles = [complete(client, seed=70 + i, logprobs=0) for i in range(3)]
    assert [tokens(c) for c in many.choices] == [tokens(s.choices[0]) for s in singles]
    assert [c.text for c in many.choices] == [s.choices[0].text for s in singles]
    assert len({c.text for c in many.choices}) > 1  # the seeds do differ
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


@pytest.fixture(scope="module")
def entryless(tmp_path_factory):
    """A server keeping no session entry: on the shared one, an entry the request's own takes evict (the other
    tests' entries fill its RAM budget, how many depends on timing) gives pages back while the group is counted."""
    proc = ServerProcess(tmp_path_factory.mktemp("no-sessions"), "--sessions", "off")
    yield proc
    proc.terminate()


def _pages_while_streaming(server, client, n: int, prompt: list[int]) -> int:
    """The pages the request takes while all its sequences decode."""
    server.wait_idle()
    held = batching(server)["pages_used"]
    stream = complete(client, prompt=prompt, n=n, seed=3, max_tokens=40, stream=True,
                      extra_body={"ignore_eos": True})
    seen = set()
    for chunk in stream:
        seen |= {c.index for c in chunk.choices}
        if len(seen) == n:  # every sibling is decoding: the whole group is admitted
            break
    pages = batching(server)["pages_used"] - held
    stream.close()
    server.wait_idle()
    return pages


def test_a_group_holds_the_prompt_pages_once_and_a_disconnect_frees_everything(entryless):
    server, client = entryless, entryless.client()
    server.wait_idle()
    before = batching(server)
    assert before["page_tokens"] == 256 and before["sessions"] is None
    single = _pages_while_streaming(server, client, 1, [8] + LONG[1:])
    group = _pages_while_streaming(server, client, 3, [7] + LONG[1:])
    assert single == 2 and group == 2 + 2 * 1 < 3 * single  # 340 positions: the first page shared by all three
    early = complete(client, prompt=LONG, n=3, seed=4, max_tokens=40, stream=True)
    early.close()  # gone at once: the group queued or its leader prefilling
    assert pool_idle(server)
    after = batching(server)
    assert after["forks_total"] >= before.get("forks_total", 0) + 2


def test_siblings_finishing_at_different_times_free_everything(server, client):
    stops = list(range(5, 260))  # frequent ids: the siblings stop after different numbers of tokens
    many = complete(client, prompt=LONG[:40], n=3, seed=11, max_tokens=16, logprobs=0,
                    extra_body={"stop_token_ids": stops})
    assert len({len(c.logprobs.tokens) for c in many.choices}) > 1
    singles = [complete(client, prompt=LONG[:40], seed=11 + i, max_tokens=16, logprobs=0,
                        extra_body={"stop_token_ids": stops}) for i in range(3)]
    assert [tokens(c) for c in many.choices] == [tokens(s.choices[0]) for s in singles]
    assert pool_idle(server)


def test_best_of_returns_the_highest_cumulative_logprob_choices(server, client):
    singles = [complete(client, seed=90 + i, logprobs=0).choices[0] for i in range(3)]
    totals = [sum(c.logprobs.token_logprobs) for c in singles]
    order = sorted(range(3), key=lambda i: (-totals[i], i))
    assert len(set(totals)) == 3
    best = complete(client, seed=90, best_of=3)
    assert len(best.choices) == 1 and best.choices[0].index == 0 and best.seed == 90
    assert best.choices[0].text == singles[order[0]].text and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == len(singles[order[0]].logprobs.tokens)
    two = complete(client, seed=90, n=2, logprobs=0, best_of=3)
    assert [tokens(c) for c in two.choices] == [tokens(singles[i]) for i in order[:2]]
    assert pool_idle(server)


@pytest.mark.parametrize("body", [
    {"best_of": 1, "n": 2}, {"best_of": 17}, {"best_of": "3"}, {"best_of": True}, {"best_of": 0},
    {"best_of": 2, "stream": True}, {"best_of": 16, "prompt": [PROMPT] * 5},
])
def test_best_of_out_of_bounds_is_400_with_an_openai_error(client, body):
    body = dict(body)
    kw = {k: body.pop(k) for k in ("n", "stream", "prompt") if k in body}
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, extra_body=body, **kw)
    assert info.value.body["param"] == "best_of" and info.value.body["type"] == "invalid_request_error"
