"""The gateway's metrics and its request spans.

Counters, exported at 0 from the start for each label a dashboard queries: episodes ended per status,
turns sampled, turns answered again from their record (retries, replays after a restart), segment
breaks, HTTP errors per status; a histogram of the time a turn spends in the gateway outside the turn
runner (its own added latency). Each agent request is a server span `POST /episodes/{episode_id}/v1/...`
that continues the agent's `traceparent`, so an agent's own trace holds the turn's route and generate
spans (shared/turns) and the executor's.
"""

from __future__ import annotations

from typing import Any, get_args

from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from rose.contracts.rollout import TrajectoryStatus
from rose.shared.metrics import meter, metric_name
from rose.shared.tracing import tracer

STATUSES = get_args(TrajectoryStatus)
OWN_TIME_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class GatewayMetrics:
    def __init__(self) -> None:
        m = meter()
        self.episodes = m.create_counter(metric_name("gateway.episodes"), unit="{episode}", description="Agents' episodes ended, per status.")
        self.turns = m.create_counter(metric_name("gateway.turns"), unit="{turn}", description="Turns sampled for agents.")
        self.replayed = m.create_counter(
            metric_name("gateway.replayed_turns"), unit="{turn}", description="Requests answered again from a turn's record (a retry, a replay)."
        )
        self.breaks = m.create_counter(
            metric_name("gateway.segment_breaks"), unit="{break}", description="Turns that do not extend the turn before them (with a reason)."
        )
        self.http_errors = m.create_counter(metric_name("gateway.http_errors"), unit="{request}", description="4xx and 5xx answers, per status.")
        self.own_time = m.create_histogram(
            metric_name("gateway.turn_own_time"),
            unit="s",
            description="A turn's time in the gateway outside the turn runner: HTTP, planning, parsing, its checkpoint.",
            explicit_bucket_boundaries_advisory=OWN_TIME_BUCKETS_S,
        )
        for status in STATUSES:
            self.episodes.add(0, {"status": status})
        for counter in (self.turns, self.replayed, self.breaks):
            counter.add(0)
        for code in (400, 401, 403, 404, 408, 413, 503):
            self.http_errors.add(0, {"status": str(code)})


@web.middleware
async def traced(request: web.Request, handler: Any) -> web.StreamResponse:
    """A server span per agent request (HTTP semantic conventions), continuing the caller's trace."""
    if request.method != "POST":
        return await handler(request)
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else request.path
    attributes = {"http.request.method": request.method, "http.route": route, "rose.episode_id": request.match_info.get("episode_id", "")}
    with tracer().start_as_current_span(
        f"{request.method} {route}", context=propagate.extract(request.headers), kind=SpanKind.SERVER, attributes=attributes
    ) as span:
        response = await handler(request)
        span.set_attribute("http.response.status_code", response.status)
        if response.status >= 500:
            span.set_status(trace.StatusCode.ERROR)
        return response
