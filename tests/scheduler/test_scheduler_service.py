"""The scheduler as a real process: leases in the KV bucket, events, routing, alert reclaim, restart."""

from __future__ import annotations

import asyncio
import contextlib
import time

from nats.js.errors import NotFoundError

from rose.contracts.registry import EVENTS_STREAM, EXECUTOR_BURST, HEADROOM, HEARTBEAT, LEASE, LEASE_EVENT, ROUTE_TURN, SLO_ALERT
from rose.contracts.rollout import TurnRouteRequest
from rose.contracts.slo import SloAlert
from rose.shared.launch import ServiceProcess
from rose.testing.messages import beat, headroom
from rose.testing.polling import until
from rose.testing.scheduler import ENV, START_TIMEOUT_S


@contextlib.asynccontextmanager
async def fake_executors(bus, calm: dict[str, bool]):
    """Heartbeats for a serving and a dedicated executor, and the monitor's headroom for them."""

    async def loop():
        while True:
            now = time.time()
            await bus.publish(HEARTBEAT, beat("ex-s1", "serving"), service="executor", instance="ex-s1")
            await bus.publish(HEARTBEAT, beat("ex-d1", "dedicated"), service="executor", instance="ex-d1")
            await bus.publish(HEADROOM, headroom(now, ex="ex-s1", lendable=calm["ex-s1"]), executor_id="ex-s1")
            await asyncio.sleep(0.25)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()


async def test_lease_lifecycle_routing_and_restart(bus, nats_server, tmp_path):
    await bus.kv_delete(LEASE, executor_id="ex-s1")
    env = {"NATS_URL": nats_server.url, **ENV}
    proc = ServiceProcess("scheduler", "sched-test", env, tmp_path / "scheduler.log").start()
    calm = {"ex-s1": True}
    try:
        await proc.wait_ready(bus, START_TIMEOUT_S)
        async with fake_executors(bus, calm):
            # granted, epoch 1, with an event on the stream
            lease = await until(lambda: _active(bus))
            assert lease.executor_id == "ex-s1" and lease.max_rollout_batch == 8 and lease.kv_bytes == 64 << 20
            first_epoch = lease.epoch
            # the event follows the bucket write (scheduler.py commits the lease, then publishes), so wait for it
            event = await until(lambda: _last_event(bus, "granted", "ex-s1"), timeout=5.0, what="the granted event")
            assert b"ex-s1" in event.data
            # renewed while healthy: same id, later expiry
            renewed = await until(lambda: _active(bus, newer_than=lease.expires_at))
            assert renewed.lease_id == lease.lease_id

            # turn-wise routing: affinity for the previous executor, the lease id and epoch attached
            route = await bus.request(ROUTE_TURN, TurnRouteRequest(trajectory_id="tr-1", turn_index=1, prompt_tokens=8, previous_executor="ex-s1"))
            assert route.executor_id == "ex-s1" and route.lease_id == lease.lease_id and route.lease_epoch == first_epoch
            assert route.reason == "prefix affinity"

            # a burst alert takes it back at once; routing falls back to the dedicated executor
            calm["ex-s1"] = False
            await bus.publish(SLO_ALERT, SloAlert(executor_id="ex-s1", at=time.time(), severity="burst", reason="test burst"), executor_id="ex-s1")
            revoked = await until(lambda: _state(bus, "revoked"), timeout=5.0, step=0.02)
            assert revoked.epoch == first_epoch and "burst" in revoked.reason
            route = await bus.request(ROUTE_TURN, TurnRouteRequest(trajectory_id="tr-1", turn_index=2, prompt_tokens=9, previous_executor="ex-s1"))
            assert route.executor_id == "ex-d1" and route.role == "dedicated" and "unavailable" in route.reason

            # calm again: after the cooldown a new lease with the next epoch
            calm["ex-s1"] = True
            regranted = await until(lambda: _active(bus))
            assert regranted.epoch == first_epoch + 1 and regranted.lease_id != lease.lease_id

            # kill -9 the scheduler: the executor keeps its lease until expiry; a new scheduler recovers it
            proc.kill()
            proc = ServiceProcess("scheduler", "sched-test-2", env, tmp_path / "scheduler2.log").start()
            await proc.wait_ready(bus, START_TIMEOUT_S)
            again = await until(lambda: _active(bus, newer_than=regranted.expires_at))
            assert again.epoch >= regranted.epoch

            # the executor's own burst alert (executor.burst, services/executor/main.py) takes it back the same way
            calm["ex-s1"] = False
            await bus.publish(
                EXECUTOR_BURST, SloAlert(executor_id="ex-s1", at=time.time(), severity="burst", reason="executor-side burst"), executor_id="ex-s1"
            )
            revoked = await until(lambda: _state(bus, "revoked"), timeout=5.0, step=0.02)
            assert "executor-side burst" in revoked.reason and revoked.epoch >= again.epoch
    finally:
        proc.stop()


async def _active(bus, newer_than: float = 0.0):
    lease = await bus.kv_get(LEASE, executor_id="ex-s1")
    if lease is not None and lease.state == "active" and lease.expires_at > max(newer_than, time.time()):
        return lease
    return None


async def _state(bus, state: str):
    lease = await bus.kv_get(LEASE, executor_id="ex-s1")
    return lease if lease is not None and lease.state == state else None


async def _last_event(bus, kind: str, executor_id: str):
    """The last lease event of `kind` for `executor_id` on the events stream, or None while there is none yet."""
    try:
        return await bus.js.get_last_msg(EVENTS_STREAM.name, LEASE_EVENT.subject(kind=kind, executor_id=executor_id))
    except NotFoundError:
        return None
