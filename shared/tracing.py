"""OpenTelemetry for the bus: W3C trace context in NATS headers, messaging semantic conventions.

There is no official NATS instrumentation for Python, so this follows the standard pattern:
`propagate.inject` into the headers on publish/request, `propagate.extract` on receive, with
`messaging.system="nats"`, `messaging.destination.name` and `messaging.operation.type`.
Spans are exported over OTLP/HTTP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, nowhere otherwise
(context still propagates, so a downstream service that does export keeps the trace whole).

A trace begins where the work is created: every `Bus` calls `ensure_tracing` when it connects,
so a framework's own process (a plain `Bus`, no tracer set up) records a producer span for each
task and weight publish when an endpoint is configured; a framework that installed its own SDK
`TracerProvider` keeps it (its spans are the parents), and a publish inside its current span
continues that span's trace.

Periodic messages (heartbeats, telemetry snapshots, headroom) are not traced: a root trace per
heartbeat would bury the traces an operator looks for. `ROSE_TRACE_PERIODIC=1` turns them on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased
from opentelemetry.trace import Span, SpanKind, Tracer

from rose import __version__

TRACER_NAME = "rose"

_OPERATION_KIND = {
    "send": SpanKind.PRODUCER,
    "request": SpanKind.CLIENT,
    "process": SpanKind.CONSUMER,
    "reply": SpanKind.SERVER,
}
_OPERATION_TYPE = {"send": "send", "request": "send", "process": "process", "reply": "process"}


_provider: TracerProvider | None = None
_tracer: Tracer | None = None
_recording = True  # until setup_tracing says otherwise (a bare API provider records nothing anyway)
TRACEPARENT = "traceparent"
TRACE_PERIODIC_ENV = "ROSE_TRACE_PERIODIC"
# Channels (registry names) published on a timer, not by work: untraced unless TRACE_PERIODIC_ENV is set.
PERIODIC_CHANNELS = frozenset({"service.heartbeat", "executor.metrics", "slo.headroom"})


def trace_periodic() -> bool:
    """Whether periodic messages get spans (`ROSE_TRACE_PERIODIC` = 1/true/yes)."""
    return os.environ.get(TRACE_PERIODIC_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def traced(channel_name: str) -> bool:
    """Whether messages of this channel are traced (periodic ones only when asked for)."""
    return channel_name not in PERIODIC_CHANNELS or trace_periodic()


def exporting_configured() -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup_tracing(service: str, instance: str, *, extra_processors: list[SpanProcessor] | None = None) -> TracerProvider:
    """Install this process's tracer provider (the first call wins; later calls add processors).

    Spans are recorded only when something receives them (an OTLP endpoint, or processors
    given here); otherwise the sampler drops new root spans, which keeps the bus helpers
    cheap, while a sampled parent arriving in headers is still honoured and passed on.
    `OTEL_TRACES_SAMPLER`, when set, overrides this choice.
    """
    global _provider, _tracer, _recording
    if _provider is None:
        existing = trace.get_tracer_provider()
        if isinstance(existing, TracerProvider):  # the process (a framework) set up its own SDK: join it
            _provider, _recording = existing, True
    if _provider is None:
        resource = Resource.create(
            {"service.name": f"rose-{service.replace('_', '-')}", "service.instance.id": instance, "service.version": __version__}
        )
        recording = exporting_configured() or bool(extra_processors) or bool(os.environ.get("OTEL_TRACES_SAMPLER"))
        _recording = recording
        sampler = None if os.environ.get("OTEL_TRACES_SAMPLER") else ParentBased(ALWAYS_ON if recording else ALWAYS_OFF)
        _provider = TracerProvider(resource=resource, sampler=sampler)
        if exporting_configured():
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(_provider)
    for processor in extra_processors or []:
        _provider.add_span_processor(processor)
    _tracer = _provider.get_tracer(TRACER_NAME, __version__)
    return _provider


def ensure_tracing(service: str, instance: str) -> None:
    """Set up tracing for a process that has not (a framework's own `Bus`); a no-op once it is set up."""
    if _provider is None:
        setup_tracing(service, instance)


def tracer() -> Tracer:
    """The cached tracer (looking one up per message costs ~15 us)."""
    global _tracer
    if _tracer is None:
        _tracer = trace.get_tracer(TRACER_NAME, __version__)
    return _tracer


def _attributes(operation: str, subject: str, template: str) -> dict[str, str]:
    return {
        "messaging.system": "nats",
        "messaging.destination.name": subject,
        "messaging.destination.template": template,
        "messaging.operation.type": _OPERATION_TYPE[operation],
        "messaging.operation.name": operation,
    }


@contextmanager
def outgoing_span(operation: str, subject: str, template: str, headers: dict[str, str], *, periodic: bool = False) -> Iterator[Span]:
    """A producer/client span; its context is written into `headers` for the receiver.

    It continues the caller's current span, or starts the trace here. With nothing recording
    and no trace in progress there is nothing to propagate: skip the span (it would be dropped
    by the sampler anyway) and save ~40 us per message. A `periodic` message is not traced.
    """
    if periodic or (not _recording and not trace.get_current_span().get_span_context().is_valid):
        yield trace.INVALID_SPAN
        return
    with tracer().start_as_current_span(
        f"{operation} {template}",
        kind=_OPERATION_KIND[operation],
        attributes=_attributes(operation, subject, template),
    ) as span:
        propagate.inject(headers)
        yield span


@contextmanager
def incoming_span(operation: str, subject: str, template: str, headers: dict[str, str] | None, *, periodic: bool = False) -> Iterator[Span]:
    """A consumer/server span that continues the trace found in the message headers.

    A `periodic` message without trace context starts no trace (its sender did not trace it).
    """
    if (not _recording or periodic) and not (headers and TRACEPARENT in headers):
        yield trace.INVALID_SPAN
        return
    parent = propagate.extract(headers or {})
    token = otel_context.attach(parent)
    try:
        with tracer().start_as_current_span(
            f"{operation} {template}",
            kind=_OPERATION_KIND[operation],
            attributes=_attributes(operation, subject, template),
        ) as span:
            yield span
    finally:
        otel_context.detach(token)
