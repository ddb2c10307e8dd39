"""Rollout over the bus: admitted only under the current lease; rejections say why; metrics are published."""

from __future__ import annotations

import time

import msgspec

from rose.contracts import GenerateRequest, Lease, MetricsSnapshot, SamplingParams
from rose.contracts.registry import EXECUTOR_METRICS, GENERATE, LEASE
from rose.shared.codec import decode
from rose.testing.messages import lease_for
from rose.testing.polling import put_lease, until


def _turn(lease: Lease | None, i: int = 0, **kw) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"turn-{i}-{time.monotonic_ns()}",
        trajectory_id="traj-1",
        turn_index=i,
        prompt_token_ids=[5, 6, 7, 8],
        sampling=SamplingParams(temperature=0.0, max_tokens=6),
        lease_id=lease.lease_id if lease else "",
        lease_epoch=lease.epoch if lease else 0,
        **kw,
    )


async def test_lease_lifecycle_admission(bus, executor):
    ex, _ = executor
    await put_lease(bus, ex, None)
    reply = await bus.request(GENERATE, _turn(None), executor_id=ex)
    assert reply.status == "rejected" and reply.reject_reason in ("no_lease", "lease_revoked")

    lease = lease_for(ex, epoch=1)
    await put_lease(bus, ex, lease)
    reply = await bus.request(GENERATE, _turn(lease), executor_id=ex, timeout=30)
    assert reply.status == "ok", reply.error
    assert 1 <= len(reply.token_ids) <= 6 and len(reply.logprobs) == len(reply.token_ids)
    assert reply.executor_id == ex and reply.finish_reason in ("stop", "length")

    stale = msgspec.structs.replace(_turn(lease), lease_epoch=0)
    reply = await bus.request(GENERATE, stale, executor_id=ex)
    assert reply.status == "rejected" and reply.reject_reason == "stale_lease_epoch"

    await put_lease(bus, ex, lease_for(ex, epoch=1, state="revoked"))
    reply = await bus.request(GENERATE, _turn(lease), executor_id=ex)
    assert reply.status == "rejected" and reply.reject_reason == "lease_revoked"

    short = lease_for(ex, epoch=2, ttl=0.5)
    await bus.kv_put(LEASE, short, executor_id=ex)  # expired before a metrics snapshot could show it applied

    async def refused_as_expired():  # once the executor's watcher has it
        reply = await bus.request(GENERATE, _turn(short), executor_id=ex)
        return reply if reply.reject_reason == "lease_expired" else None

    reply = await until(refused_as_expired, 10, "the short lease refused as expired")
    assert reply.status == "rejected"


async def test_second_turn_hits_the_retained_prefix(bus, executor):
    ex, _ = executor
    lease = lease_for(ex, epoch=3)
    await put_lease(bus, ex, lease)
    first = await bus.request(GENERATE, _turn(lease, 0), executor_id=ex, timeout=30)
    assert first.status == "ok", first.error
    second_prompt = [5, 6, 7, 8, *first.token_ids, 9, 10]
    second = GenerateRequest(
        request_id=f"turn-1-{time.monotonic_ns()}",
        trajectory_id="traj-1",
        turn_index=1,
        prompt_token_ids=second_prompt,
        sampling=SamplingParams(temperature=0.0, max_tokens=4),
        lease_id=lease.lease_id,
        lease_epoch=lease.epoch,
    )
    reply = await bus.request(GENERATE, second, executor_id=ex, timeout=30)
    assert reply.status == "ok" and reply.prefix_cached_tokens > 0


async def test_invalid_turn_is_rejected_with_reason(bus, executor):
    ex, _ = executor
    lease = lease_for(ex, epoch=4)
    await put_lease(bus, ex, lease)
    too_long = GenerateRequest(
        request_id="too-long",
        trajectory_id="traj-2",
        turn_index=0,
        prompt_token_ids=[1] * 10,
        sampling=SamplingParams(max_tokens=60000),
        lease_id=lease.lease_id,
        lease_epoch=lease.epoch,
    )
    reply = await bus.request(GENERATE, too_long, executor_id=ex)
    assert reply.status == "rejected" and reply.reject_reason == "invalid" and "max_tokens" in reply.error


async def test_metrics_snapshots_are_published(bus, executor):
    ex, _ = executor
    sub = await bus.nc.subscribe(EXECUTOR_METRICS.subject(executor_id=ex))
    msg = await sub.next_msg(timeout=5)
    await sub.unsubscribe()
    snap = decode(msg.data, MetricsSnapshot)
    assert snap.executor_id == ex and snap.serving_pool is not None and snap.device is not None
    assert snap.device.kind == "cpu" and snap.device.process_rss_bytes > 0
