"""With OTEL_EXPORTER_OTLP_ENDPOINT set, a service exports its bus spans over OTLP/HTTP (to a real HTTP server here)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from rose.testing.otlp_receiver import otlp_receiver

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
            request = GenerateRequest(request_id="r", trajectory_id="t", turn_index=0, prompt_token_ids=[1])
            await client.request(GENERATE, request, executor_id="ex-otlp")
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


FRAMEWORK = textwrap.dedent(
    """
    import asyncio, sys
    from opentelemetry import trace
    from rose.contracts import RolloutTask
    from rose.contracts.registry import ROLLOUT_TASK
    from rose.shared.bus import Bus
    from rose.shared.config import BusConfig

    async def main():  # a framework plugged in as the README shows: a plain Bus, no tracing set up
        async with Bus(BusConfig(url=sys.argv[1]), service="trainer", instance="my-framework") as bus:
            await bus.publish(ROLLOUT_TASK, RolloutTask(task_id="fw-1", env="arithmetic", prompt="1+1"))
        trace.get_tracer_provider().shutdown()

    asyncio.run(main())
    """
)


async def test_a_framework_with_a_plain_bus_starts_the_trace_of_its_work(nats_server, bus, task_queue, spans):
    """No tracer set up in the framework's process: its Bus starts a producer span there (exported), and the
    worker side continues that trace instead of starting its own root."""
    import asyncio

    from rose.contracts.registry import ROLLOUT_TASK

    got: list[tuple[str, dict[str, str]]] = []
    done = asyncio.Event()

    async def take(task, delivery) -> None:
        got.append((task.task_id, delivery.headers))
        done.set()

    await bus.consume(ROLLOUT_TASK, take, durable="fw_trace_test")
    try:
        async with otlp_receiver("/v1/traces", ExportTraceServiceRequest) as (endpoint, received):
            env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
            proc = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-c", FRAMEWORK, nats_server.url], env=env, capture_output=True, text=True, timeout=60
            )
            assert proc.returncode == 0, proc.stderr
            await asyncio.wait_for(done.wait(), 10)
    finally:
        await bus.js.delete_consumer("ROSE_TASKS", "fw_trace_test")
    exported = [(resource, span) for m in received for resource in m.resource_spans for scope in resource.scope_spans for span in scope.spans]
    ((resource, producer),) = [(r, s) for r, s in exported if s.name == "send rose.rollout.tasks"]
    assert not producer.parent_span_id  # the trace begins where the work was created
    assert {a.value.string_value for a in resource.resource.attributes if a.key == "service.name"} == {"rose-trainer"}
    ((task_id, headers),) = got
    assert task_id == "fw-1" and headers["traceparent"].split("-")[1] == producer.trace_id.hex()
    consumer = [
        s for s in spans.get_finished_spans() if s.name == "process rose.rollout.tasks" and s.context.trace_id == int(producer.trace_id.hex(), 16)
    ]
    assert consumer and consumer[0].parent.span_id == int(producer.span_id.hex(), 16)
