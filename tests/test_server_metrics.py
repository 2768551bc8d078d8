"""/metrics as Prometheus parses it (vLLM's names, dsv41_* for the rest) and the CORS option, on real servers.

One server runs with --allowed-origins (CORS on); the shared `server` fixture runs without it (CORS off).
"""

from __future__ import annotations

import pytest

from server_harness import SERVED_NAME, ServerProcess, server  # noqa: F401  (the shared server fixture)

ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def cors_server(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("cors"), "--allowed-origins", ORIGIN)
    yield proc
    proc.terminate()


# ---------------------------------------------------------------------------- CORS
def test_cors_preflight_is_answered_before_auth(cors_server):
    with cors_server.http() as http:
        r = http.options("/v1/chat/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type", "Authorization": ""})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()


def test_cors_headers_on_answers_and_errors(cors_server):
    with cors_server.http() as http:
        ok = http.get("/v1/models", headers={"Origin": ORIGIN})
        denied = http.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer wrong"})
        foreign = http.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
    assert foreign.status_code == 200 and "access-control-allow-origin" not in foreign.headers


def test_cors_is_off_by_default(server):  # noqa: F811
    with server.http() as http:
        pre = http.options("/v1/chat/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
        r = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert pre.status_code == 405
    assert "access-control-allow-origin" not in r.headers and "access-control-allow-origin" not in pre.headers


# ---------------------------------------------------------------------------- /metrics
def _scrape(proc) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with proc.http() as http:
        r = http.get("/metrics")
    assert r.status_code == 200
    return {family.name: family for family in text_string_to_metric_families(r.text)}


def _value(families: dict, family: str, sample: str, default: float | None = None, **labels) -> float:
    found = [s.value for s in families[family].samples if s.name == sample and all(
        s.labels.get(k) == v for k, v in labels.items())]
    if not found and default is not None:
        return default
    assert found, f"no {sample} {labels} in {family}"
    return sum(found)


def test_metrics_vllm_names_and_engine_figures(cors_server):
    with cors_server.client() as client:
        client.chat.completions.create(model=SERVED_NAME, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    cors_server.wait_idle()
    families = _scrape(cors_server)
    names = set(families)
    # the parser drops the _total suffix of counters from the family name
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_preemptions", "vllm:iteration_tokens_total",
                 "vllm:request_decode_time_seconds", "vllm:request_success", "vllm:num_requests_running",
                 "vllm:time_to_first_token_seconds", "dsv41_engine_pages_used", "dsv41_engine_pages",
                 "dsv41_engine_rounds", "dsv41_requests_unfinished"):
        assert name in names, name
    assert not [s.name for f in families.values() for s in f.samples if s.name.endswith("_created")]
    usage = _value(families, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc")
    pages = _value(families, "dsv41_engine_pages", "dsv41_engine_pages")
    assert 0.0 <= usage <= 1.0 and usage == _value(families, "dsv41_engine_pages_used", "dsv41_engine_pages_used") / pages
    assert _value(families, "vllm:num_preemptions", "vllm:num_preemptions_total") == 0
    rounds = _value(families, "dsv41_engine_rounds", "dsv41_engine_rounds_total")
    assert rounds >= 1
    inf = _value(families, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_bucket", le="+Inf")
    assert inf == rounds
    tokens = _value(families, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_sum")
    assert tokens == _value(families, "dsv41_engine_prefill_tokens", "dsv41_engine_prefill_tokens_total") + \
        _value(families, "dsv41_engine_decode_tokens", "dsv41_engine_decode_tokens_total")
    assert _value(families, "vllm:request_success", "vllm:request_success_total") >= 1
    assert _value(families, "vllm:request_decode_time_seconds", "vllm:request_decode_time_seconds_count") >= 1
    # the engine's own timings: one queue and one prefill figure per request, a gap per token after the first
    generated = _value(families, "dsv41_engine_decode_tokens", "dsv41_engine_decode_tokens_total")
    queued = _value(families, "vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_count")
    prefilled = _value(families, "vllm:request_prefill_time_seconds", "vllm:request_prefill_time_seconds_count")
    gaps = _value(families, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count")
    assert queued >= prefilled >= 2  # the warm-up and the chat request
    assert 1 <= gaps <= generated + queued
    assert _value(families, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_bucket",
                  le="+Inf") == gaps


def test_metrics_count_aborts_apart_from_successes(cors_server):
    before = _scrape(cors_server)
    success = _value(before, "vllm:request_success", "vllm:request_success_total", default=0)
    with cors_server.http() as http:
        with http.stream("POST", "/v1/chat/completions", json={
                "model": SERVED_NAME, "max_tokens": 2000, "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as r:
            for _ in r.iter_lines():
                break  # leave after the first event: the request is aborted
    cors_server.wait_idle()
    after = _scrape(cors_server)
    # as vLLM: an abort is a finished request with finished_reason="abort", never a stop or length
    finished = {reason: _value(after, "vllm:request_success", "vllm:request_success_total", finished_reason=reason)
                for reason in ("stop", "length")}
    assert finished == {reason: _value(before, "vllm:request_success", "vllm:request_success_total", default=0,
                                       finished_reason=reason) for reason in ("stop", "length")}
    aborted = _value(after, "vllm:request_success", "vllm:request_success_total", finished_reason="abort")
    assert aborted >= 1 and sum(finished.values()) + aborted > success
    assert _value(after, "dsv41_requests_unfinished", "dsv41_requests_unfinished_total", reason="abort") >= 1


def test_engine_time_histogram_and_its_export():
    from prometheus_client import CollectorRegistry, generate_latest

    from dsv41.engine.llm_engine import TIME_BUCKETS, TimeHistogram
    from dsv41.server.metrics import EngineCollector

    h = TimeHistogram()
    for seconds in (0.0005, 0.003, 0.003, 1000.0):
        h.observe(seconds)
    assert h.counts[0] == 1 and h.counts[TIME_BUCKETS.index(0.005)] == 2 and h.counts[-1] == 1 and sum(h.counts) == 4
    collector = EngineCollector("m")
    # vLLM's labels: model_name and engine (the engine core's index)
    collector.detail = {"pages_used": 1, "pages_total": 4, "rows_per_round": {"1": 2}, "prefill_tokens_total": 1,
                        "decode_tokens_total": 1,
                        "seconds": {"bounds": list(TIME_BUCKETS), "queue": h.figures(), "prefill": h.figures(),
                                    "inter_token": TimeHistogram().figures()}}
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'vllm:request_queue_time_seconds_bucket{engine="0",le="0.005",model_name="m"} 3.0' in text
    assert 'vllm:request_queue_time_seconds_bucket{engine="0",le="80.0",model_name="m"} 3.0' in text
    assert 'vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0' in text
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25' in text
    assert 'vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="m"} 2.0' in text


# ---------------------------------------------------------------------------- vLLM's series and labels (issue 33)
def test_metrics_as_vllm_names_them(cors_server):
    """The engine label on every vllm: series, the request_params_* and per-request time series, the prefix-cache
    counters: scraped from a real server and read with prometheus_client's parser."""
    before = _scrape(cors_server)
    with cors_server.client() as client:
        reply = client.chat.completions.create(model=SERVED_NAME, max_tokens=3, n=2,
                                               messages=[{"role": "user", "content": "hi"}])
    cors_server.wait_idle()
    after = _scrape(cors_server)
    for family in after.values():
        if family.name.startswith("vllm:"):
            for sample in family.samples:
                assert sample.labels.get("model_name") == SERVED_NAME and sample.labels.get("engine") == "0", sample
    for reason in ("stop", "length", "abort", "error"):  # present from the start, as vLLM's
        _value(after, "vllm:request_success", "vllm:request_success_total", finished_reason=reason)

    def grew(family: str, sample: str, **labels) -> float:
        return _value(after, family, sample, **labels) - _value(before, family, sample, default=0, **labels)

    assert grew("vllm:request_params_n", "vllm:request_params_n_count") == 2  # both sequences of the n=2 request
    assert grew("vllm:request_params_n", "vllm:request_params_n_sum") == 4
    assert grew("vllm:request_params_max_tokens", "vllm:request_params_max_tokens_sum") == 6
    assert grew("vllm:request_params_max_tokens", "vllm:request_params_max_tokens_bucket", le="1.0") == 0
    assert grew("vllm:request_params_max_tokens", "vllm:request_params_max_tokens_bucket", le="16.0") == 2
    assert grew("vllm:request_inference_time_seconds", "vllm:request_inference_time_seconds_count") == 2
    assert grew("vllm:request_time_per_output_token_seconds",
                "vllm:request_time_per_output_token_seconds_count") >= 0  # a 1-token reply has no per-token time
    assert "vllm:request_time_per_output_token_seconds" in after
    # the prefix-cache counters are the engine's session figures (tokens); an n > 1 group's prompt is looked up once
    sessions = cors_server.wait_idle()["batching"]["sessions"]
    assert _value(after, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == sessions["query_tokens"]
    assert _value(after, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == sessions["hit_tokens"]
    assert grew("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == reply.usage.prompt_tokens


def test_finish_reasons_counted_as_the_engine_ends():
    """tool_calls (and /v1/messages' names) count as the engine's stop; abort and error are counted too."""
    from prometheus_client.parser import text_string_to_metric_families

    from dsv41.server.metrics import Metrics

    metrics = Metrics("m")
    for reason in ("stop", "tool_calls", "end_turn", "tool_use", "length", "max_tokens", "abort", "error", "error"):
        metrics.finished_generation(prompt_tokens=3, completion_tokens=4, ttft_s=0.1, e2e_s=0.4,
                                    finish_reason=reason, max_tokens=8)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    counted = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples
               if s.name == "vllm:request_success_total"}
    assert counted == {"stop": 4, "length": 2, "abort": 1, "error": 2}
    tpot = _value(families, "vllm:request_time_per_output_token_seconds",
                  "vllm:request_time_per_output_token_seconds_sum")
    assert abs(tpot - 9 * 0.1) < 1e-9  # (0.4 - 0.1) / (4 - 1) per request
