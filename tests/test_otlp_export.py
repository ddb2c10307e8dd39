"""With OTEL_EXPORTER_OTLP_ENDPOINT set, a service exports its bus spans over OTLP/HTTP (to a real HTTP server here)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from otlp_receiver import otlp_receiver
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from opentelemetry import trace
    from rose.contracts import GenerateReply, GenerateRequest
    from rose.contracts.registry import GENERATE
    from rose.shared.bus import Bus
    from rose.shared.config import BusConfig
    from rose.shared.tracing import setup_tracing

    async def main():
        setup_tracing("otlp_probe", "probe-1")
        cfg = BusConfig(url=sys.argv[1])
        async with Bus(cfg, service="executor", instance="ex-otlp") as server, Bus(cfg, service="probe", instance="p") as client:
            async def echo(m, d):
                return GenerateReply(request_id=m.request_id, executor_id="ex-otlp", status="ok")
            await server.serve(GENERATE, echo, executor_id="ex-otlp")
            await client.request(GENERATE, GenerateRequest(request_id="r", trajectory_id="t", turn_index=0, prompt_token_ids=[1]), executor_id="ex-otlp")
        trace.get_tracer_provider().shutdown()  # flushes the batch exporter

    asyncio.run(main())
    """
)


async def test_spans_are_exported_over_otlp_http(nats_server, tmp_path):
    async with otlp_receiver("/v1/traces", ExportTraceServiceRequest) as (endpoint, received):
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
        proc = await _run(env, nats_server.url)
        assert proc.returncode == 0, proc.stderr
    spans = [
        (resource.resource, span)
        for message in received
        for resource in message.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    names = {span.name for _, span in spans}
    assert {"request rose.executor.{executor_id}.generate", "reply rose.executor.{executor_id}.generate"} <= names
    trace_ids = {span.trace_id for _, span in spans if "generate" in span.name}
    assert len(trace_ids) == 1
    services = {attr.value.string_value for resource, _ in spans for attr in resource.attributes if attr.key == "service.name"}
    assert services == {"rose-otlp-probe"}


async def _run(env: dict[str, str], url: str) -> subprocess.CompletedProcess[str]:
    import asyncio

    return await asyncio.to_thread(subprocess.run, [sys.executable, "-c", SCRIPT, url], env=env, capture_output=True, text=True, timeout=60)
