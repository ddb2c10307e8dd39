"""The executor follows published policy versions: SDK -> weight_publisher -> executor swap; a bad version is refused."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import msgspec
import pytest
import torch

from rose.client import WeightsClient
from rose.contracts import DeadLetter, GenerateRequest, Lease, SamplingParams, WeightApplied, WeightFailed
from rose.contracts.registry import DEAD_LETTER, GENERATE, WEIGHT_APPLIED, WEIGHT_FAILED, WEIGHT_MANIFEST
from rose.shared.bus import Delivery
from rose.shared.models import load_model
from rose.testing.polling import put_lease, retrying

TIMEOUT_S = 60.0


@pytest.fixture
def publisher(nats_server, tmp_path, state_dir):
    env = {**os.environ, "NATS_URL": nats_server.url, "ROSE_RUNTIME__INSTANCE": "wp-exec-test", "ROSE_STATE_DIR": str(state_dir)}
    with open(tmp_path / "publisher.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rose.cli.main", "run", "weight_publisher"], env=env, stdout=log, stderr=subprocess.STDOUT)
    yield proc
    proc.terminate()
    proc.wait(20)


async def _publish(client: WeightsClient, state: dict[str, torch.Tensor], version: int) -> None:
    await retrying(lambda: client.publish(state, version), Exception, TIMEOUT_S, "publishing (the publisher still starting)")
    await client.published(version, timeout=TIMEOUT_S)


async def _next(queue: asyncio.Queue, version: int):
    while True:
        event = await asyncio.wait_for(queue.get(), TIMEOUT_S)
        if event.version == version:
            return event


async def test_executor_applies_published_versions_and_refuses_a_bad_one(bus, executor, publisher, models_dir):
    ex, _ = executor
    applied: asyncio.Queue = asyncio.Queue()
    failed: asyncio.Queue = asyncio.Queue()

    async def on_applied(e: WeightApplied, d: Delivery) -> None:
        await applied.put(e)

    async def on_failed(e: WeightFailed, d: Delivery) -> None:
        await failed.put(e)

    await bus.subscribe(WEIGHT_APPLIED, on_applied, executor_id=ex)
    await bus.subscribe(WEIGHT_FAILED, on_failed, executor_id=ex)

    # version 1: the executor's own policy in bf16 with a few weights nudged (bf16 applies exactly to fp32)
    state = {n: t.to(torch.bfloat16).clone() for n, t in load_model(models_dir / "policy").state_dict().items()}
    first = next(n for n in state if n.endswith("q_proj.weight"))
    state[first].view(-1)[:64] += 0.5
    async with WeightsClient(bus, "policy") as client:
        await _publish(client, state, 1)
        event = await _next(applied, 1)
        assert event.executor_id == ex and event.pause_ms >= 0

        now = time.time()
        lease = Lease(
            lease_id="wl-1",
            executor_id=ex,
            epoch=11,
            state="active",
            granted_at=now,
            expires_at=now + 60,
            kv_bytes=8 << 20,
            compute_share=0.5,
            max_rollout_batch=4,
        )
        await put_lease(bus, ex, lease)
        turn = GenerateRequest(
            request_id="wv-1",
            trajectory_id="wtraj",
            turn_index=0,
            prompt_token_ids=[3, 4, 5],
            sampling=SamplingParams(temperature=0.0, max_tokens=3),
            lease_id="wl-1",
            lease_epoch=11,
        )
        reply = await bus.request(GENERATE, turn, executor_id=ex, timeout=30)
        assert reply.status == "ok" and reply.policy_version == 1

        # version 2 names a tensor the policy does not have: refused with a reason, version 1 keeps serving
        bad = dict(state)
        bad["model.layers.99.mlp.gate_proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
        await _publish(client, bad, 2)
        refusal = await _next(failed, 2)
        assert refusal.kind in ("unknown_tensor", "shape", "other") and "layers.99" in refusal.reason
        again = GenerateRequest(**{**{f: getattr(turn, f) for f in turn.__struct_fields__}, "request_id": "wv-2"})
        reply = await bus.request(GENERATE, again, executor_id=ex, timeout=30)
        assert reply.status == "ok" and reply.policy_version == 1

        # versions 3 and 4: version 1's manifest re-announced unsigned, and with its version changed
        # under the publisher's signature: both refused before fetching, version 1 keeps serving
        v1 = await client.published(1, timeout=TIMEOUT_S)
        assert v1.signature and v1.key_id
        for version, spoiled, needle in (
            (3, msgspec.structs.replace(v1, version=3, signature=""), "unsigned"),
            (4, msgspec.structs.replace(v1, version=4), "altered after signing"),
        ):
            await bus.publish(WEIGHT_MANIFEST, spoiled, model="policy", kind=spoiled.kind, version=str(version))
            refusal = await _next(failed, version)
            assert refusal.kind == "signature" and needle in refusal.reason and refusal.kept_version == 1
        last = await bus.js.get_last_msg("ROSE_DLQ", DEAD_LETTER.pattern(service="executor"))
        assert msgspec.json.decode(last.data, type=DeadLetter).kind == "unauthorised"
        reply = await bus.request(
            GENERATE, GenerateRequest(**{**{f: getattr(turn, f) for f in turn.__struct_fields__}, "request_id": "wv-3"}), executor_id=ex, timeout=30
        )
        assert reply.status == "ok" and reply.policy_version == 1
