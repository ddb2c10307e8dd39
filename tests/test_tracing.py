"""One trace id across both sides of a request/reply and of a JetStream publish -> consume."""

from __future__ import annotations

import asyncio

from opentelemetry.trace import SpanKind

from rose.contracts import GenerateReply, GenerateRequest, RolloutTask
from rose.contracts.registry import GENERATE, ROLLOUT_TASK
from rose.shared.bus import Bus, Delivery


async def test_request_reply_spans_share_one_trace(bus_config, spans):
    spans.clear()

    async def handle(msg: GenerateRequest, d: Delivery) -> GenerateReply:
        return GenerateReply(request_id=msg.request_id, executor_id="ex-tr", status="ok")

    async with Bus(bus_config, service="executor", instance="ex-tr") as server, Bus(bus_config, service="w", instance="w") as client:
        await server.serve(GENERATE, handle, executor_id="ex-tr")
        await client.request(GENERATE, GenerateRequest(request_id="r", trajectory_id="t", turn_index=0, prompt_token_ids=[1]), executor_id="ex-tr")
    finished = {s.kind: s for s in spans.get_finished_spans()}
    client_span, server_span = finished[SpanKind.CLIENT], finished[SpanKind.SERVER]
    assert client_span.context.trace_id == server_span.context.trace_id
    assert server_span.parent is not None and server_span.parent.span_id == client_span.context.span_id
    for s in (client_span, server_span):
        assert s.attributes["messaging.system"] == "nats"
        assert s.attributes["messaging.destination.name"] == "rose.executor.ex-tr.generate"
    assert client_span.attributes["messaging.operation.type"] == "send"
    assert server_span.attributes["messaging.operation.type"] == "process"


async def test_jetstream_publish_consume_spans_share_one_trace(bus_config, bus, task_queue, spans):
    spans.clear()
    done = asyncio.Event()

    async def handle(task: RolloutTask, d: Delivery) -> None:
        done.set()

    async with Bus(bus_config, service="trainer", instance="tr") as pub, Bus(bus_config, service="rollout_worker", instance="w-tr") as sub:
        await sub.consume(ROLLOUT_TASK, handle, durable="trace_test")
        await pub.publish(ROLLOUT_TASK, RolloutTask(task_id="trace-1", env="arith", prompt="1+1"))
        await asyncio.wait_for(done.wait(), 10)
    await bus.js.delete_consumer("ROSE_TASKS", "trace_test")
    finished = {s.kind: s for s in spans.get_finished_spans()}
    producer, consumer = finished[SpanKind.PRODUCER], finished[SpanKind.CONSUMER]
    assert producer.context.trace_id == consumer.context.trace_id
    assert consumer.attributes["messaging.destination.name"] == "rose.rollout.tasks"


async def _heartbeat_once(bus) -> tuple[dict[str, str], list[str]]:
    import time as _time

    from rose.contracts.registry import HEARTBEAT
    from rose.contracts.service import Heartbeat

    heard: asyncio.Queue = asyncio.Queue()

    async def on_beat(beat, d: Delivery) -> None:
        heard.put_nowait(dict(d.headers))

    await bus.subscribe(HEARTBEAT, on_beat, service="tracing_probe")
    now = _time.time()
    beat = Heartbeat(
        service="tracing_probe",
        instance="tp-1",
        version="0",
        host="h",
        pid=1,
        started_at=now,
        sent_at=now,
        interval_s=1.0,
        state="ready",
        load={},
        endpoints={},
        labels={},
    )
    await bus.publish(HEARTBEAT, beat, service="tracing_probe", instance="tp-1")
    return await asyncio.wait_for(heard.get(), 10)


async def test_periodic_messages_are_not_traced_unless_asked(bus, spans, monkeypatch):
    """A heartbeat starts no trace (no span on either side, no context in its headers); ROSE_TRACE_PERIODIC=1 traces it."""
    monkeypatch.delenv("ROSE_TRACE_PERIODIC", raising=False)
    spans.clear()
    headers = await _heartbeat_once(bus)
    assert "traceparent" not in headers
    assert not [s.name for s in spans.get_finished_spans() if "heartbeat" in s.name]
    monkeypatch.setenv("ROSE_TRACE_PERIODIC", "1")
    headers = await _heartbeat_once(bus)
    assert "traceparent" in headers
    traced = {s.kind for s in spans.get_finished_spans() if s.name.endswith("rose.svc.heartbeat.{service}.{instance}")}
    assert traced == {SpanKind.PRODUCER, SpanKind.CONSUMER}
