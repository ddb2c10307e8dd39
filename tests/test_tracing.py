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


async def test_jetstream_publish_consume_spans_share_one_trace(bus_config, bus, spans):
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
