"""Several scheduler instances split the fleet (shared/partition.py) and never grant one executor twice.

Two real scheduler processes on a real nats-server, ten executors' heartbeats and headroom
published by the test. Every write to the leases bucket is watched: a grant while another
lease of the same executor is still active would be a double grant. Then one instance is
killed with SIGKILL, and within one lease period (plus the heartbeat misses that declare it
dead) the survivor holds every executor's lease.
"""

from __future__ import annotations

import asyncio
import time

from rose.contracts.lease import Lease
from rose.contracts.registry import HEADROOM, HEARTBEAT, LEASE, SERVICE_REGISTRY
from rose.contracts.service import Heartbeat
from rose.shared.launch import ServiceProcess
from rose.shared.partition import Partition, weight
from rose.testing.messages import beat, headroom
from rose.testing.polling import until
from rose.testing.scheduler import ENV, START_TIMEOUT_S

EXECUTORS = [f"ex-p{i}" for i in range(10)]
TTL_S = float(ENV["ROSE_LEASES__TTL_S"])
HEARTBEAT_S = float(ENV["ROSE_RUNTIME__HEARTBEAT_INTERVAL_S"])
MISSES = 3.0  # PlacementSettings.heartbeat_misses


def test_rendezvous_owner_is_the_same_everywhere_and_moves_only_the_dead_instances_share():
    now = 1000.0
    views = {name: Partition(name) for name in ("a", "b", "c")}
    for me, part in views.items():
        for other in views:
            if other != me:
                part.on_heartbeat(
                    Heartbeat(service="scheduler", instance=other, version="t", host="h", pid=1, started_at=now, sent_at=now, interval_s=1.0), now
                )
    owners = {ex: views["a"].owner(ex, now) for ex in EXECUTORS * 3}
    assert all(views[name].owner(ex, now) == owner for ex, owner in owners.items() for name in views)
    assert sum(views[name].owns(ex, now) for ex in EXECUTORS for name in views) == len(EXECUTORS)  # each exactly once
    later = now + 10.0  # "c" fell silent: only its executors move
    views["a"].on_heartbeat(
        Heartbeat(service="scheduler", instance="b", version="t", host="h", pid=1, started_at=now, sent_at=later, interval_s=1.0), later
    )
    for ex in EXECUTORS:
        before = owners[ex]
        after = views["a"].owner(ex, later)
        assert after == before if before != "c" else after in ("a", "b")
    assert weight("a", "ex") == weight("a", "ex") and weight("a", "ex") != weight("b", "ex")


async def test_two_instances_never_grant_an_executor_twice_and_a_survivor_takes_over(bus, nats_server, tmp_path):
    for ex in EXECUTORS:
        await bus.kv_delete(LEASE, executor_id=ex)
    history: dict[str, list[Lease]] = {ex: [] for ex in EXECUTORS}

    async def on_lease(key: str, lease: Lease | None) -> None:
        if lease is not None and key in history:
            history[key].append(lease)

    await bus.kv_watch(LEASE, on_lease)

    async def executors() -> None:
        while True:
            now = time.time()
            for ex in EXECUTORS:
                await bus.publish(HEARTBEAT, beat(ex, "serving", interval_s=HEARTBEAT_S), service="executor", instance=ex)
                await bus.publish(HEADROOM, headroom(now, ex=ex), executor_id=ex)
            await asyncio.sleep(0.25)

    env = {"NATS_URL": nats_server.url, **ENV}
    procs = {name: ServiceProcess("scheduler", name, env, tmp_path / f"{name}.log").start() for name in ("sched-a", "sched-b")}
    feeder = asyncio.create_task(executors())
    try:
        for p in procs.values():
            await p.wait_ready(bus, START_TIMEOUT_S)

        async def all_leased():
            leases = [await bus.kv_get(LEASE, executor_id=ex) for ex in EXECUTORS]
            return all(lease is not None and lease.state == "active" and lease.expires_at > time.time() for lease in leases)

        await until(all_leased, timeout=20.0, what="a lease on every executor")

        async def both_granted():
            loads = [await bus.kv_get(SERVICE_REGISTRY, service="scheduler", instance=name) for name in procs]
            return all(b is not None and b.load.get("granted", 0) + b.load.get("renewed", 0) > 0 for b in loads)

        await until(both_granted, timeout=10.0, what="lease writes from both instances (the fleet is split)")
        await asyncio.sleep(2 * TTL_S)  # renewals by both instances

        procs["sched-a"].kill()
        killed_at = time.time()

        async def survivor_holds_all():
            leases = [await bus.kv_get(LEASE, executor_id=ex) for ex in EXECUTORS]
            now = time.time()
            return all(lease is not None and lease.state == "active" and lease.expires_at > now + 0.5 for lease in leases)

        # one lease period after sched-a is declared dead: every executor's lease is current again
        await until(survivor_holds_all, timeout=MISSES * HEARTBEAT_S + TTL_S + 2.0, what="the survivor renewing or re-granting every lease")
        await asyncio.sleep(TTL_S)
        assert await survivor_holds_all(), "the survivor let a lease lapse"
        assert time.time() - killed_at < MISSES * HEARTBEAT_S + 3 * TTL_S
    finally:
        feeder.cancel()
        for p in procs.values():
            p.stop()

    for ex, leases in history.items():
        for prev, new in zip(leases, leases[1:]):
            if new.state == "active" and new.lease_id != prev.lease_id:
                assert new.epoch > prev.epoch, f"{ex}: epoch went {prev.epoch} -> {new.epoch}"
                still_active = prev.state == "active" and prev.expires_at > new.granted_at
                assert not still_active, (
                    f"{ex} granted twice: {prev.lease_id} (active until {prev.expires_at}) and {new.lease_id} at {new.granted_at}"
                )
