"""SGLang's Prometheus metrics on the executor's /metrics, for the scrapers and dashboards written against SGLang.

A module of its own because the collectors are process-wide (one registry, every ``SGLangApi`` of the process
reports through them: an emulated group runs many executors in one process), while sglang_api.py answers the calls.
Names and default buckets follow SGLang's ``metrics/collector.py``.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Protocol

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from .protocol import GenerationResult


class GaugeSource(Protocol):
    """What the scheduler gauges read from an SGLang API at scrape time (``sglang_api.SGLangApi``)."""

    served_name: str

    def scheduler_state(self) -> dict[str, Any]: ...

    def gen_throughput(self) -> float: ...

    def cache_hit_rate(self) -> float: ...


_LABELS = ["model_name"]
TTFT = Histogram(
    "sglang:time_to_first_token_seconds",
    "Time to first token (SGLang-compatible /generate).",
    _LABELS,
    buckets=[0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400],
)
ITL = Histogram(
    "sglang:inter_token_latency_seconds",
    "Inter-token latency (SGLang-compatible /generate).",
    _LABELS,
    buckets=[
        0.002,
        0.004,
        0.006,
        0.008,
        0.010,
        0.015,
        0.020,
        0.025,
        0.030,
        0.035,
        0.040,
        0.060,
        0.080,
        0.100,
        0.200,
        0.400,
        0.600,
        0.800,
        1,
        2,
        4,
        6,
        8,
    ],
)
E2E = Histogram(
    "sglang:e2e_request_latency_seconds",
    "End-to-end request latency (SGLang-compatible /generate).",
    _LABELS,
    buckets=[0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400],
)
PROMPT_TOKENS = Counter("sglang:prompt_tokens", "Prompt tokens of finished /generate requests.", _LABELS)
GENERATION_TOKENS = Counter("sglang:generation_tokens", "Generated tokens of finished /generate requests.", _LABELS)
REQUESTS = Counter("sglang:num_requests", "Finished /generate requests.", _LABELS)
ABORTED = Counter("sglang:num_aborted_requests", "Aborted /generate requests.", _LABELS)
CACHED_TOKENS = Counter("sglang:cached_tokens", "Prompt tokens of finished /generate requests served from the prefix cache.", _LABELS)


class SchedulerGauges:
    """`sglang:num_running_reqs`, `num_queue_reqs`, `token_usage` read from the live engines at scrape time."""

    def __init__(self) -> None:
        self.apis: weakref.WeakSet[GaugeSource] = weakref.WeakSet()

    def collect(self):
        running = GaugeMetricFamily("sglang:num_running_reqs", "Running rollout requests (policy model).", labels=_LABELS)
        queued = GaugeMetricFamily("sglang:num_queue_reqs", "Queued rollout requests (policy model).", labels=_LABELS)
        usage = GaugeMetricFamily("sglang:token_usage", "Fraction of the rollout KV pool in use.", labels=_LABELS)
        used = GaugeMetricFamily("sglang:num_used_tokens", "Token slots of the rollout KV pool in use.", labels=_LABELS)
        throughput = GaugeMetricFamily("sglang:gen_throughput", "Rollout tokens generated per second since the previous scrape.", labels=_LABELS)
        hit_rate = GaugeMetricFamily("sglang:cache_hit_rate", "Cached / prompt tokens of finished /generate requests, since start.", labels=_LABELS)
        grammar = GaugeMetricFamily(
            "sglang:num_grammar_queue_reqs", "Requests waiting for a grammar (none: no constrained decoding).", labels=_LABELS
        )
        accept = GaugeMetricFamily("sglang:spec_accept_length", "Speculative decoding accept length (0: no speculative decoding).", labels=_LABELS)
        for api in list(self.apis):
            state = api.scheduler_state()
            name = [api.served_name]
            running.add_metric(name, state["num_running_reqs"])
            queued.add_metric(name, state["num_queue_reqs"])
            usage.add_metric(name, state["token_usage"])
            used.add_metric(name, state["num_used_tokens"])
            throughput.add_metric(name, api.gen_throughput())
            hit_rate.add_metric(name, api.cache_hit_rate())
            grammar.add_metric(name, 0)
            accept.add_metric(name, 0.0)
        yield from (running, queued, usage, used, throughput, hit_rate, grammar, accept)


GAUGES = SchedulerGauges()
REGISTRY.register(GAUGES)


def observe_finished(name: str, result: GenerationResult, prompt_tokens: int, started: float) -> None:
    """One finished /generate request in the counters and latency histograms (``started``: time.monotonic())."""
    REQUESTS.labels(name).inc()
    if result.finish_reason == "abort":
        ABORTED.labels(name).inc()
    PROMPT_TOKENS.labels(name).inc(prompt_tokens)
    CACHED_TOKENS.labels(name).inc(result.prefix_cached_tokens)
    GENERATION_TOKENS.labels(name).inc(len(result.token_ids))
    times = result.timings.token_times_ms
    if times:
        TTFT.labels(name).observe(times[0] / 1000.0)
        for a, b in zip(times, times[1:]):
            ITL.labels(name).observe((b - a) / 1000.0)
    E2E.labels(name).observe(time.monotonic() - started)
