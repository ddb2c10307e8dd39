"""Bad input on the bus: each refusal is answered, dead-lettered with its reason, and the service keeps answering."""

from __future__ import annotations

import msgspec
import pytest

from rose.contracts import DeadLetter, GenerateReply, GenerateRequest
from rose.contracts.registry import DEAD_LETTER, GENERATE
from rose.shared.bus import Bus, Delivery, RemoteError


async def _echo(msg: GenerateRequest, d: Delivery) -> GenerateReply:
    return GenerateReply(request_id=msg.request_id, executor_id="ex-dlq", status="ok")


GOOD = {"request_id": "r1", "trajectory_id": "t1", "turn_index": 0, "prompt_token_ids": [5, 6]}

BAD_INPUTS = [
    pytest.param(b"\x00\xffgarbage", "decode", "not valid json", id="garbage-bytes"),
    pytest.param(
        msgspec.json.encode({**GOOD, "schema_version": 2}), "schema_version", "schema_version 2 is not supported", id="wrong-schema-version"
    ),
    pytest.param(
        msgspec.json.encode({k: v for k, v in GOOD.items() if k != "prompt_token_ids"}),
        "validation",
        "missing required field `prompt_token_ids`",
        id="missing-field",
    ),
    pytest.param(msgspec.json.encode({**GOOD, "sampling": {"temperature": -1}}), "validation", "$.sampling.temperature", id="out-of-range"),
    pytest.param(msgspec.json.encode({**GOOD, "prompt_token_ids": list(range(300_000))}), "oversized", "exceeds the limit", id="oversized"),
]


@pytest.mark.parametrize("payload,kind,reason", BAD_INPUTS)
async def test_bad_request_is_refused_dead_lettered_and_service_keeps_answering(bus_config, bus, payload, kind, reason):
    async with Bus(bus_config, service="dlqsvc", instance="ex-dlq") as server:
        await server.serve(GENERATE, _echo, executor_id="ex-dlq")
        reply = await bus.nc.request(GENERATE.subject(executor_id="ex-dlq"), payload, timeout=5)
        assert reply.headers["Nats-Service-Error-Code"] == "400"
        assert reason in reply.headers["Nats-Service-Error"]

        last = await bus.js.get_last_msg("ROSE_DLQ", DEAD_LETTER.pattern(service="dlqsvc"))
        letter = msgspec.json.decode(last.data, type=DeadLetter)
        assert letter.kind == kind and reason in letter.reason
        assert letter.subject == GENERATE.subject(executor_id="ex-dlq")
        assert letter.payload == payload[: len(letter.payload)] and len(letter.payload) > 0

        ok = await bus.request(GENERATE, GenerateRequest(**GOOD), executor_id="ex-dlq")
        assert ok.status == "ok"


async def test_typed_request_raises_remote_error_with_reason(bus_config, bus):
    async with Bus(bus_config, service="dlqsvc2", instance="ex-dlq2") as server:
        await server.serve(GENERATE, _echo, executor_id="ex-dlq2")
        bad = GenerateRequest(**{**GOOD, "prompt_token_ids": []})  # msgspec validates on decode: the server must check
        with pytest.raises(RemoteError) as err:
            await bus.request(GENERATE, bad, executor_id="ex-dlq2")
        assert err.value.code == "400" and "prompt_token_ids" in err.value.description
