"""Metrics through the OpenTelemetry SDK: a Prometheus endpoint per service, OTLP when configured.

    setup_metrics("scheduler", "scheduler-1")          # once per process (ServiceRuntime does it)
    leases = meter().create_counter(metric_name("scheduler.leases"), unit="{lease}")
    server = await MetricsServer.start("127.0.0.1", 0)  # GET {server.url} -> Prometheus text

Names follow the OpenTelemetry conventions (dotted, namespaced `rose.` by `metric_name`, a UCUM
unit, seconds for durations, `By` for bytes); the Prometheus exporter turns `executor.ttft`
with unit `s` into `rose_executor_ttft_seconds` and adds `_total` to counters. Instruments may be created before
`setup_metrics` runs (the API proxies them to the provider installed later), so a service can
build its instruments in a constructor. With `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`) set, the same instruments are also pushed over OTLP/HTTP
every `OTEL_METRIC_EXPORT_INTERVAL` ms (default 15000), unless `OTEL_METRICS_EXPORTER=none`.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING

from opentelemetry import metrics
from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.exposition import choose_encoder

from rose import __version__

if TYPE_CHECKING:  # aiohttp is imported where a server is made: every process that only counts (a `rose health` probe) skips it
    from aiohttp import web

log = logging.getLogger("rose.metrics")

METER_NAME = "rose"
NAMESPACE = "rose"  # of every instrument: `rose_` in Prometheus
DEFAULT_OTLP_INTERVAL_MS = 15000
# Histogram boundaries in seconds: serving latencies (ms to tens of s) and reclaim/apply times.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_provider: MeterProvider | None = None
_meter: Meter | None = None


def otlp_metrics_configured() -> bool:
    """An OTLP endpoint is set and `OTEL_METRICS_EXPORTER` (standard; default `otlp`) does not leave OTLP out.

    `OTEL_METRICS_EXPORTER=none` keeps a service's metrics on its Prometheus endpoint only
    (e.g. where Prometheus scrapes it directly while its traces still go over OTLP).
    """
    exporters = {e.strip() for e in os.environ.get("OTEL_METRICS_EXPORTER", "otlp").split(",")}
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    return bool(endpoint) and "otlp" in exporters


def setup_metrics(service: str, instance: str) -> MeterProvider:
    """Install this process's meter provider (the first call wins, as for tracing).

    The Prometheus reader feeds prometheus_client's default registry, which the service's
    metrics endpoint serves (with the client's process and Python collectors beside it).
    """
    global _provider, _meter
    if _provider is not None:
        return _provider
    from opentelemetry.exporter.prometheus import PrometheusMetricReader

    readers: list[MetricReader] = [PrometheusMetricReader()]
    if otlp_metrics_configured():
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        interval = int(os.environ.get("OTEL_METRIC_EXPORT_INTERVAL") or DEFAULT_OTLP_INTERVAL_MS)
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(), export_interval_millis=interval))
    resource = Resource.create({"service.name": f"rose-{service.replace('_', '-')}", "service.instance.id": instance, "service.version": __version__})
    _provider = MeterProvider(metric_readers=readers, resource=resource)
    metrics.set_meter_provider(_provider)
    _meter = _provider.get_meter(METER_NAME, __version__)
    return _provider


def metric_name(name: str) -> str:
    """`rose.<name>`: the namespaced instrument name (kept apart from bus subjects, which also start with `rose.`)."""
    return f"{NAMESPACE}.{name}"


def meter() -> Meter:
    """The ROSE meter (a proxy until `setup_metrics` installs the provider)."""
    return _meter if _meter is not None else metrics.get_meter(METER_NAME, __version__)


def flush(timeout_ms: int = 2000) -> None:
    """Push what OTLP has not sent yet (at shutdown); the Prometheus side is pulled, nothing to do."""
    if _provider is not None and otlp_metrics_configured():
        try:
            _provider.force_flush(timeout_ms)
        except Exception as exc:  # the collector may be gone at shutdown
            log.debug("metrics flush: %r", exc)


def exposition() -> bytes:
    """The Prometheus text of this process's metrics."""
    return generate_latest(REGISTRY)


async def metrics_handler(request: web.Request) -> web.Response:
    """aiohttp handler for GET /metrics (also mounted on the executor's own HTTP API).

    The format follows the scraper's Accept header (Prometheus text 0.0.4 by default,
    OpenMetrics when asked), as prometheus_client's own server does.
    """
    from aiohttp import web

    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return web.Response(body=encoder(REGISTRY), headers={"Content-Type": content_type})


class MetricsServer:
    """A small aiohttp server: GET /metrics -> Prometheus text. Port 0 picks a free port."""

    def __init__(self, runner: web.AppRunner, url: str) -> None:
        self._runner = runner
        self.url = url

    @classmethod
    async def start(cls, host: str, port: int, public_host: str = "") -> MetricsServer:
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/metrics", metrics_handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise OSError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc} (set runtime.metrics_port, 0 for a free port, -1 for none)"
            ) from exc
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        shown = public_host or (socket.gethostname() if host in ("0.0.0.0", "::", "") else host)
        return cls(runner, f"http://{shown}:{bound}/metrics")

    async def stop(self) -> None:
        await self._runner.cleanup()
