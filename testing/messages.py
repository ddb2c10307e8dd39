"""Contract messages with plausible test values, as the services under test would receive them:
an executor's heartbeat, the SLO monitor's headroom, a lease, an executor's metrics snapshot."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence

from rose.contracts.executor import DeviceTelemetry, ExecutorRole, MetricsSnapshot, PoolUsage
from rose.contracts.lease import Lease, LeaseState
from rose.contracts.service import Heartbeat
from rose.contracts.slo import Headroom
from rose.shared.sketch import new_sketch, to_contract

SNAPSHOT_INTERVAL_S = 0.1  # the interval `snap`'s snapshots say they cover


def beat(instance: str, role: str, *, interval_s: float = 0.5) -> Heartbeat:
    """A 'ready' heartbeat of executor `instance` in `role` (serving or dedicated), sent now."""
    now = time.time()
    return Heartbeat(
        service="executor",
        instance=instance,
        version="test",
        host=socket.gethostname(),
        pid=os.getpid(),
        started_at=now,
        sent_at=now,
        interval_s=interval_s,
        state="ready",
        labels={"role": role},
    )


def headroom(at: float, *, ttft: float = 50.0, tpot: float = 10.0, lendable: bool = True, slots: int = 8, ex: str = "ex-1") -> Headroom:
    """The monitor's headroom for executor `ex` at time `at`, with p99 latencies `ttft` and `tpot` (ms)."""
    return Headroom(
        executor_id=ex,
        at=at,
        kv_bytes=64 << 20,
        compute_share=0.25,
        rollout_batch_slots=slots,
        ttft_p99_ms=ttft,
        tpot_p99_ms=tpot,
        slo_ttft_ms=500.0,
        slo_tpot_ms=100.0,
        arrival_rate_rps=5.0,
        serving_queue=0,
        lendable=lendable,
        reason="test",
    )


def lease_for(executor_id: str, epoch: int = 1, *, state: LeaseState = "active", ttl: float = 60.0) -> Lease:
    """A lease of `executor_id` at `epoch`, granted now for `ttl` seconds."""
    now = time.time()
    return Lease(
        lease_id=f"lease-{epoch}",
        executor_id=executor_id,
        epoch=epoch,
        state=state,
        granted_at=now,
        expires_at=now + ttl,
        kv_bytes=8 << 20,
        compute_share=0.5,
        max_rollout_batch=8,
    )


def snap(
    at: float,
    *,
    ex: str = "ex-1",
    ttft: Sequence[float] = (),
    tpot: Sequence[float] = (),
    arrivals: int = 1,
    queue: int = 0,
    queue_wait_ms: float | None = None,
    serving: int = 2,
    rollout: int = 0,
    role: ExecutorRole = "serving",
    rollout_tps: float = 0.0,
) -> MetricsSnapshot:
    """Executor `ex`'s metrics snapshot at `at`, with latency sketches of the `ttft` and `tpot` samples (ms)."""
    t, p = new_sketch(), new_sketch()
    for v in ttft:
        t.add(v)
    for v in tpot:
        p.add(v)
    return MetricsSnapshot(
        executor_id=ex,
        at=at,
        interval_s=SNAPSHOT_INTERVAL_S,
        role=role,
        ttft_ms=to_contract(t),
        tpot_ms=to_contract(p),
        serving_arrivals=arrivals,
        serving_queue=queue,
        serving_queue_wait_ms=queue_wait_ms,
        serving_running=serving,
        rollout_running=rollout,
        rollout_tokens_per_s=rollout_tps,
        serving_pool=PoolUsage(block_bytes=1024, total_blocks=100, used_blocks=10),
        rollout_pool=PoolUsage(block_bytes=1024, total_blocks=0, used_blocks=0),
        device=DeviceTelemetry(kind="cpu", name="test-cpu", memory_total_bytes=8 << 30, memory_used_bytes=2 << 30, utilization=0.3),
    )
