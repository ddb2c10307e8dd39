"""The shared metrics module: the runtime's Prometheus endpoint (advertised, optional, clear errors),
its configuration, and OTLP/HTTP metric export to a real HTTP server."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import aiohttp
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from rose.contracts.registry import SERVICE_REGISTRY
from rose.services.scheduler.config import SchedulerConfig
from rose.shared.config import ConfigError, RuntimeConfig, load_config
from rose.shared.metrics import MetricsServer, meter, metric_name
from rose.shared.service import ServiceRuntime
from rose.testing.otlp_receiver import otlp_receiver
from rose.testing.polling import until


async def test_runtime_serves_and_advertises_its_metrics_endpoint(bus_config, bus):
    # created before the runtime installs the provider (as services do in constructors): the API proxies it
    counter = meter().create_counter(metric_name("test.runtime_probe"), unit="{probe}", description="A probe of the runtime's endpoint.")
    async with ServiceRuntime("scheduler", bus=bus_config, runtime=RuntimeConfig(instance="metrics-probe", heartbeat_interval_s=0.2)) as rt:
        counter.add(3, {"case": "advertised"})
        rt.ready()
        url = rt.endpoints["metrics"]
        beat = await until(lambda: bus.kv_get(SERVICE_REGISTRY, service="scheduler", instance="metrics-probe"), 10, "the runtime's heartbeat")
        assert beat.endpoints["metrics"] == url
        async with aiohttp.ClientSession() as http, http.get(url) as r:
            text = await r.text()
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert 'rose_test_runtime_probe_total{case="advertised"' in text
        assert "# HELP rose_test_runtime_probe_total A probe of the runtime's endpoint." in text
    async with aiohttp.ClientSession() as http:  # closed with the runtime
        with pytest.raises(aiohttp.ClientConnectionError):
            async with http.get(url) as r:
                pass


async def test_metrics_endpoint_can_be_turned_off(bus_config):
    async with ServiceRuntime("scheduler", bus=bus_config, runtime=RuntimeConfig(instance="metrics-off", metrics_port=-1)) as rt:
        assert rt.metrics_server is None and "metrics" not in rt.endpoints


async def test_a_taken_port_is_a_clear_error():
    first = await MetricsServer.start("127.0.0.1", 0)
    port = int(first.url.rsplit(":", 1)[1].split("/")[0])
    try:
        with pytest.raises(OSError, match=r"cannot serve metrics on 127\.0\.0\.1:\d+.*runtime\.metrics_port"):
            await MetricsServer.start("127.0.0.1", port)
    finally:
        await first.stop()


async def test_public_host_is_what_is_advertised():
    server = await MetricsServer.start("127.0.0.1", 0, public_host="executor-1.rose")
    try:
        assert server.url.startswith("http://executor-1.rose:") and server.url.endswith("/metrics")
    finally:
        await server.stop()


def test_otlp_metrics_follow_the_standard_variables(monkeypatch):
    from rose.shared.metrics import otlp_metrics_configured

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_METRICS_EXPORTER", raising=False)
    assert not otlp_metrics_configured()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert otlp_metrics_configured()
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    assert not otlp_metrics_configured()


def test_bad_metrics_port_names_the_field_and_its_source():
    with pytest.raises(ConfigError, match=r"runtime\.metrics_port.*ROSE_RUNTIME__METRICS_PORT"):
        load_config(SchedulerConfig, env={"ROSE_RUNTIME__METRICS_PORT": "70000"})
    assert (
        load_config(SchedulerConfig, env={"ROSE_RUNTIME__METRICS_PORT": "9464", "ROSE_RUNTIME__METRICS_HOST": "0.0.0.0"}).runtime.metrics_port == 9464
    )


OTLP_SCRIPT = textwrap.dedent(
    """
    from rose.shared.metrics import flush, meter, setup_metrics
    setup_metrics("otlp_probe", "probe-1")
    meter().create_counter("rose.test.otlp_probe", unit="{probe}").add(5, {"case": "otlp"})
    meter().create_histogram("rose.test.otlp_latency", unit="s").record(0.25)
    flush()
    """
)


async def test_metrics_are_exported_over_otlp_http_when_configured():
    async with otlp_receiver("/v1/metrics", ExportMetricsServiceRequest) as (endpoint, received):
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_METRIC_EXPORT_INTERVAL": "60000"}
        proc = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", OTLP_SCRIPT], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
    points = {
        metric.name: (resource.resource, metric)
        for message in received
        for resource in message.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }
    assert {"rose.test.otlp_probe", "rose.test.otlp_latency"} <= set(points)
    resource, counter = points["rose.test.otlp_probe"]
    assert counter.sum.data_points[0].as_int == 5 and counter.unit == "{probe}"
    assert points["rose.test.otlp_latency"][1].unit == "s"
    services = {a.value.string_value for a in resource.attributes if a.key == "service.name"}
    assert services == {"rose-otlp-probe"}
