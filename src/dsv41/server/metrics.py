"""Prometheus metrics: our own `dsv41_*` names and the vLLM names dashboards already know.

Each app owns a private CollectorRegistry, so several servers in one process (tests) never collide.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


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
        self.prompt_tokens = Counter("dsv41_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("dsv41_generation_tokens", "Tokens generated", registry=r)
        self.inflight = Gauge("dsv41_requests_inflight", "Requests being handled now", registry=r)
        self.latency = Histogram("dsv41_request_latency_seconds", "Request latency, arrival to last byte",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("dsv41_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.uptime = Gauge("dsv41_uptime_seconds", "Seconds since the server started", registry=r)
        self.uptime.set_function(lambda: time.monotonic() - self.started)
        # vLLM-compatible names (label model_name, as vLLM exports them)
        labels = ["model_name"]
        self.v_running = Gauge("vllm:num_requests_running", "Requests running in the engine", labels, registry=r)
        self.v_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for the engine", labels, registry=r)
        self.v_prompt = Counter("vllm:prompt_tokens", "Prefill tokens processed", labels, registry=r)
        self.v_generation = Counter("vllm:generation_tokens", "Generation tokens processed", labels, registry=r)
        self.v_success = Counter("vllm:request_success", "Finished requests by finish reason",
                                 labels + ["finished_reason"], registry=r)
        self.v_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels,
                                buckets=LATENCY_BUCKETS, registry=r)
        self.v_e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", labels,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.v_tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token", labels,
                                buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                                registry=r)
        self.v_prompt_hist = Histogram("vllm:request_prompt_tokens", "Prompt length per request", labels,
                                       buckets=(16, 64, 256, 1024, 4096, 16384, 65536, 262144), registry=r)
        self.v_generation_hist = Histogram("vllm:request_generation_tokens", "Generated tokens per request",
                                           labels, buckets=(16, 64, 256, 1024, 4096, 16384, 65536), registry=r)

    def engine_gauges(self, running: int, waiting: int) -> None:
        self.v_running.labels(self.model_name).set(running)
        self.v_waiting.labels(self.model_name).set(waiting)

    def finished_generation(self, *, prompt_tokens: int, completion_tokens: int, ttft_s: float | None,
                            e2e_s: float, finish_reason: str) -> None:
        m = self.model_name
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.v_prompt.labels(m).inc(prompt_tokens)
        self.v_generation.labels(m).inc(completion_tokens)
        self.v_prompt_hist.labels(m).observe(prompt_tokens)
        self.v_generation_hist.labels(m).observe(completion_tokens)
        self.v_success.labels(m, finish_reason).inc()
        self.v_e2e.labels(m).observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            self.v_ttft.labels(m).observe(ttft_s)
            if completion_tokens > 1:
                self.v_tpot.labels(m).observe((e2e_s - ttft_s) / (completion_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
