"""Prometheus metrics: our own `dsv41_*` names and the vLLM names dashboards already know.

Each app owns a private CollectorRegistry, so several servers in one process (tests) never collide. No
`_created` series (vLLM exports none either). The engine's own figures (KV pool pages, rows per round, rounds)
come from `EngineStats.detail` at scrape time (`EngineCollector` here for vLLM's names, compose/build.py's for
`dsv41_engine_*`); an engine without them (serial) leaves them out.

As vLLM (v1) exports them: every `vllm:*` series carries the labels `model_name` and `engine` (the engine core's
index; dsv41 has one, "0"); `vllm:request_success_total` counts every finished request by the engine's finish
reason, `stop`, `length`, `abort` (the client left) or `error` — an API-level `tool_calls` is the engine's `stop`,
as vLLM's parser-level tool calls are. The prefix-cache counters are the engine's session figures (prompt tokens
looked up, and those resumed from a session entry of either tier: engine/sessions.py), read at scrape time like
the pool's, so nothing is counted twice; zero without sessions (--sessions off, the serial engine), present from
the first scrape.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

disable_created_metrics()  # process-wide: no `*_created` series next to counters and histograms

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
ENGINE_INDEX = "0"  # vLLM's `engine` label: the engine core's index (dsv41 runs one)
VLLM_LABELS = ["model_name", "engine"]
# API finish reasons -> the engine's, as vLLM's request_success counts them (Anthropic's names for /v1/messages)
ENGINE_FINISH = {"tool_calls": "stop", "function_call": "stop", "end_turn": "stop", "stop_sequence": "stop",
                 "tool_use": "stop", "max_tokens": "length", "cancelled": "abort"}


def engine_finish_reason(reason: str) -> str:
    return ENGINE_FINISH.get(reason, reason)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        self.started = time.monotonic()
        self.requests = Counter("dsv41_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("dsv41_request_errors", "Requests answered with an error (4xx/5xx or in-stream)",
                              ["endpoint", "status"], registry=r)
        self.disconnects = Counter("dsv41_client_disconnects", "Requests cancelled because the client left",
                                   registry=r)
        self.prompt_tokens = Counter("dsv41_prompt_tokens", "Prompt tokens (prefilled or resumed from a session "
                                     "entry)", registry=r)
        self.cached_tokens = Counter("dsv41_cached_tokens", "Prompt tokens resumed from a session entry instead of "
                                     "prefilled (usage.prompt_tokens_details.cached_tokens)", registry=r)
        self.generation_tokens = Counter("dsv41_generation_tokens", "Tokens generated", registry=r)
        self.inflight = Gauge("dsv41_requests_inflight", "Requests being handled now", registry=r)
        self.latency = Histogram("dsv41_request_latency_seconds", "Request latency, arrival to last byte",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("dsv41_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.uptime = Gauge("dsv41_uptime_seconds", "Seconds since the server started", registry=r)
        self.uptime.set_function(lambda: time.monotonic() - self.started)
        # vLLM-compatible names (labels model_name and engine, as vLLM exports them)
        labels = VLLM_LABELS
        self.v_running = Gauge("vllm:num_requests_running", "Requests running in the engine", labels, registry=r)
        self.v_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for the engine", labels, registry=r)
        self.v_prompt = Counter("vllm:prompt_tokens", "Prefill tokens processed", labels, registry=r)
        self.v_generation = Counter("vllm:generation_tokens", "Generation tokens processed", labels, registry=r)
        self.v_success = Counter("vllm:request_success", "Finished requests, by the engine's finish reason (stop, "
                                 "length, abort, error)", labels + ["finished_reason"], registry=r)
        # dsv41's own count of what did not finish: abort (client left) or error (also in request_success)
        self.unfinished = Counter("dsv41_requests_unfinished", "Generations that did not finish: abort (client "
                                  "left) or error", ["reason"], registry=r)
        self.v_decode = Histogram("vllm:request_decode_time_seconds", "First token to the end of the request",
                                  labels, buckets=LATENCY_BUCKETS, registry=r)
        self.v_inference = Histogram("vllm:request_inference_time_seconds", "Prefill and decode of a request: "
                                     "handed to the engine to its last token (dsv41 counts a wait in the engine's "
                                     "queue in it; vLLM starts at the first schedule)", labels,
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.v_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels,
                                buckets=LATENCY_BUCKETS, registry=r)
        self.v_e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", labels,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.v_tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token", labels,
                                buckets=TPOT_BUCKETS, registry=r)
        self.v_request_tpot = Histogram("vllm:request_time_per_output_token_seconds", "Per request: decode time "
                                        "over its output tokens after the first", labels, buckets=TPOT_BUCKETS,
                                        registry=r)
        self.v_prompt_hist = Histogram("vllm:request_prompt_tokens", "Prompt length per request", labels,
                                       buckets=(16, 64, 256, 1024, 4096, 16384, 65536, 262144), registry=r)
        self.v_generation_hist = Histogram("vllm:request_generation_tokens", "Generated tokens per request",
                                           labels, buckets=(16, 64, 256, 1024, 4096, 16384, 65536), registry=r)
        self.v_params_n = Histogram("vllm:request_params_n", "The n of each finished request", labels,
                                    buckets=(1, 2, 5, 10, 20), registry=r)
        self.v_params_max_tokens = Histogram("vllm:request_params_max_tokens", "The max_tokens of each finished "
                                             "request", labels, buckets=(1, 16, 64, 256, 1024, 4096, 16384, 65536,
                                                                         262144), registry=r)
        for family in (self.v_running, self.v_waiting, self.v_prompt, self.v_generation):
            family.labels(model_name, ENGINE_INDEX)  # present (at zero) from the first scrape, as vLLM's are
        for reason in ("stop", "length", "abort", "error"):
            self.v_success.labels(model_name, ENGINE_INDEX, reason)

        self.engine = EngineCollector(model_name)
        r.register(self.engine)

    def engine_gauges(self, running: int, waiting: int, detail: dict | None = None) -> None:
        self.v_running.labels(self.model_name, ENGINE_INDEX).set(running)
        self.v_waiting.labels(self.model_name, ENGINE_INDEX).set(waiting)
        self.engine.detail = dict(detail or {})

    def finished_generation(self, *, prompt_tokens: int, completion_tokens: int, ttft_s: float | None,
                            e2e_s: float, finish_reason: str, max_tokens: int | None = None, n: int = 1,
                            cached_tokens: int = 0) -> None:
        """One generation ended: `finish_reason` as the API sent it (stop, length, tool_calls, ...), or abort / error
        when it did not finish."""
        m = (self.model_name, ENGINE_INDEX)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.v_prompt.labels(*m).inc(prompt_tokens)
        self.v_generation.labels(*m).inc(completion_tokens)
        self.v_prompt_hist.labels(*m).observe(prompt_tokens)
        self.v_generation_hist.labels(*m).observe(completion_tokens)
        reason = engine_finish_reason(finish_reason)
        if reason in ("abort", "error"):
            self.unfinished.labels(reason).inc()
        self.v_success.labels(*m, reason).inc()
        self.v_params_n.labels(*m).observe(n)
        if max_tokens is not None:
            self.v_params_max_tokens.labels(*m).observe(max_tokens)
        self.v_e2e.labels(*m).observe(e2e_s)
        self.v_inference.labels(*m).observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            self.v_ttft.labels(*m).observe(ttft_s)
            self.v_decode.labels(*m).observe(e2e_s - ttft_s)
            if completion_tokens > 1:
                per_token = (e2e_s - ttft_s) / (completion_tokens - 1)
                self.v_tpot.labels(*m).observe(per_token)
                self.v_request_tpot.labels(*m).observe(per_token)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector:
    """The batched engine's figures under vLLM's names (`EngineStats.detail` as of the last `engine_gauges`);
    the same figures under dsv41's own names (`dsv41_engine_*`: slots, pages, queue, rounds, rows per round)
    come from compose/build.py's collector."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.detail: dict = {}

    def describe(self):
        return []  # figures appear only once an engine reported them

    def collect(self):
        d, m = self.detail, [self.model_name, ENGINE_INDEX]
        yield from self._prefix_cache(d.get("sessions") or {}, m)
        if "pages_total" not in d:
            return
        used, total = d["pages_used"], d["pages_total"]
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV pool usage, 0 to 1 (1 = every page in use)",
                                  labels=VLLM_LABELS)
        usage.add_metric(m, used / total if total else 0.0)
        yield usage
        # the engine never preempts (a running request never waits for memory: block_manager.py)
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Preemptions (always 0: dsv41 never preempts)",
                                          labels=VLLM_LABELS)
        preemptions.add_metric(m, 0)
        yield preemptions
        yield self._rows_per_round(d, m)
        seconds = d.get("seconds")
        if seconds:
            for key, name, text in (("queue", "request_queue_time_seconds", "Arrival in the engine to first scheduled"),
                                    ("prefill", "request_prefill_time_seconds", "First scheduled to the prompt in"),
                                    ("inter_token", "inter_token_latency_seconds", "Between two output tokens")):
                yield self._timing(f"vllm:{name}", text, seconds["bounds"], seconds[key], m)
        yield from self._spec_decode(d.get("drafting") or {}, m)

    @staticmethod
    def _prefix_cache(sessions: dict, m: list[str]):
        """vLLM's prefix-cache counters (tokens) from the engine's sessions: every prompt looked up at admission,
        and the tokens resumed from a session entry, RAM or NVMe tier (a group's siblings and prompt-logprob requests
        are not looked up); per tier under dsv41's name. Zero without sessions."""
        ram, nvme = sessions.get("hit_tokens", 0), sessions.get("disk_hit_tokens", 0)
        queries = CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the session entries",
                                      labels=VLLM_LABELS)
        queries.add_metric(m, sessions.get("query_tokens", 0))
        yield queries
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens resumed from a session entry (RAM or "
                                   "NVMe tier)", labels=VLLM_LABELS)
        hits.add_metric(m, ram + nvme)
        yield hits
        tiers = CounterMetricFamily("dsv41_session_hit_tokens", "Prompt tokens resumed from a session entry, by "
                                    "tier (ram, nvme)", labels=["tier"])
        tiers.add_metric(["ram"], ram)
        tiers.add_metric(["nvme"], nvme)
        yield tiers

    @staticmethod
    def _spec_decode(drafting: dict, m: list[str]):
        """vLLM's speculative-decoding counters, one series per drafter (engine/drafting.py: dspark, lookup)."""
        drafters = [k for k, v in drafting.items() if isinstance(v, dict)]
        for name, text in (("num_drafts", "Rounds that verified drafts"), ("num_draft_tokens", "Draft tokens verified"),
                           ("num_accepted_tokens", "Draft tokens accepted")):
            family = CounterMetricFamily(f"vllm:spec_decode_{name}", text, labels=VLLM_LABELS + ["drafter"])
            for drafter in drafters:
                family.add_metric(m + [drafter], drafting[drafter][name])
            yield family
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each "
                                     "position of the window", labels=VLLM_LABELS + ["drafter", "position"])
        for drafter in drafters:
            for pos, count in enumerate(drafting[drafter]["num_accepted_tokens_per_pos"]):
                family.add_metric(m + [drafter, str(pos)], count)
        yield family

    @staticmethod
    def _timing(name: str, text: str, bounds: list, figures: dict, m: list[str]) -> HistogramMetricFamily:
        """An engine TimeHistogram (counts per bound, the last above all) as a cumulative histogram."""
        buckets, seen = [], 0
        for bound, count in zip(bounds, figures["counts"]):
            seen += count
            buckets.append((str(float(bound)), seen))
        buckets.append(("+Inf", sum(figures["counts"])))
        family = HistogramMetricFamily(name, text, labels=VLLM_LABELS)
        family.add_metric(m, buckets, sum_value=figures["sum"])
        return family

    @staticmethod
    def _rows_per_round(d: dict, m: list[str]) -> HistogramMetricFamily:
        """vLLM's iteration_tokens_total: tokens (rows) per engine round. The engine counts rounds in buckets
        1, 2, 4, ..., 4096, the last one also holding bigger rounds, so it is exported as +Inf."""
        counts = sorted((int(k), v) for k, v in d.get("rows_per_round", {}).items())
        bounds = [1 << i for i in range(12)]  # 1 .. 2048; above that: +Inf
        buckets, seen = [], 0
        for bound in bounds:
            seen = sum(v for k, v in counts if k <= bound)
            buckets.append((str(float(bound)), seen))
        buckets.append(("+Inf", sum(v for _, v in counts)))
        family = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens (prefill and decode rows) per "
                                       "engine round", labels=VLLM_LABELS)
        family.add_metric(m, buckets, sum_value=d["prefill_tokens_total"] + d["decode_tokens_total"])
        return family
