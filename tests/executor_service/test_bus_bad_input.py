"""Bad input on the bus against the real executor: oversized, truncated, wrong-version and random messages.

Each is answered at once with a 400 that says what to fix and kept in the dead-letter stream
with its kind, its reason and its bytes; the executor keeps answering good requests. (The
fourth kind the issue names, unauthorised, is a weight manifest without a trusted signature:
tests/executor_service/test_weights_follow.py and tests/weights/test_signing.py.)
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rose.contracts import DeadLetter, GenerateRequest
from rose.contracts.registry import DEAD_LETTER, GENERATE

GOOD = {"request_id": "bad-in-1", "trajectory_id": "t1", "turn_index": 0, "prompt_token_ids": [5, 6, 7]}
VALID = msgspec.json.encode(GOOD)
CASES = [
    pytest.param(msgspec.json.encode({**GOOD, "prompt_token_ids": list(range(300_000))}), "oversized", "exceeds the limit", id="oversized"),
    pytest.param(VALID[: len(VALID) // 2], "decode", "not valid json", id="truncated"),
    pytest.param(msgspec.json.encode({**GOOD, "schema_version": 2}), "schema_version", "schema_version 2 is not supported", id="wrong-version"),
]
RANDOM_EXAMPLES = 25


async def _send(bus, executor_id: str, payload: bytes):
    reply = await bus.nc.request(GENERATE.subject(executor_id=executor_id), payload, timeout=10)
    return reply.headers or {}


async def _last_letter(bus) -> DeadLetter:
    last = await bus.js.get_last_msg("ROSE_DLQ", DEAD_LETTER.pattern(service="executor"))
    return msgspec.json.decode(last.data, type=DeadLetter)


@pytest.mark.parametrize("payload,kind,needle", CASES)
async def test_each_bad_message_is_answered_and_dead_lettered(bus, executor, payload, kind, needle):
    ex, _ = executor
    headers = await _send(bus, ex, payload)
    assert headers.get("Nats-Service-Error-Code") == "400" and needle in headers.get("Nats-Service-Error", "")
    letter = await _last_letter(bus)
    assert (letter.instance, letter.kind) == (ex, kind) and needle in letter.reason
    assert letter.subject == GENERATE.subject(executor_id=ex) and letter.payload == payload[: len(letter.payload)]
    reply = await bus.request(GENERATE, GenerateRequest(**GOOD), executor_id=ex, timeout=30)
    assert reply.status in ("ok", "rejected")  # answered (rejected without a lease): still serving the bus


async def test_random_bytes_are_always_a_400_and_a_dead_letter(bus, executor, request):
    ex, _ = executor
    seen = []

    @settings(max_examples=RANDOM_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.binary(min_size=1, max_size=64))
    def collect(data):
        seen.append(data)

    collect()  # hypothesis draws the payloads; the bus calls below are async
    before = (await bus.js.stream_info("ROSE_DLQ")).state.messages
    for data in seen:
        headers = await _send(bus, ex, data)
        code = headers.get("Nats-Service-Error-Code")
        if code is None:  # bytes that happen to be a valid request are answered normally
            continue
        assert code == "400" and headers.get("Nats-Service-Error"), (data, headers)
    after = (await bus.js.stream_info("ROSE_DLQ")).state.messages
    assert after - before == sum(1 for d in seen if not _valid(d))
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():  # shown also without -s
        print(
            f"\nbus bad input: {len(CASES)} named cases + {len(seen)} random payloads to the executor's generate endpoint; each answered 400 and "
            "dead-lettered"
        )


def _valid(data: bytes) -> bool:
    try:
        msgspec.json.decode(data, type=GenerateRequest)
        return True
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
