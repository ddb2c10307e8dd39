"""The SLO monitor as a real process: headroom published periodically, a burst alerted at once."""

from __future__ import annotations

import asyncio
import time

import pytest

from rose.contracts.registry import EXECUTOR_METRICS, HEADROOM, SLO_ALERT
from rose.shared.launch import ServiceProcess
from rose.testing.messages import snap
from rose.testing.polling import until

START_TIMEOUT_S = 60.0


@pytest.fixture
async def monitor(bus, nats_server, tmp_path):
    proc = ServiceProcess(
        "slo_monitor",
        "mon-test",
        {"NATS_URL": nats_server.url, "ROSE_HEADROOM_INTERVAL_S": "0.3", "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5"},
        tmp_path / "monitor.log",
    ).start()
    try:
        await proc.wait_ready(bus, START_TIMEOUT_S)
        yield proc
    finally:
        proc.stop()


async def test_headroom_then_burst_alert(bus, monitor):
    headrooms, alerts = [], []

    async def on_headroom(h, _d):
        headrooms.append(h)

    async def on_alert(a, _d):
        alerts.append(a)

    await bus.subscribe(HEADROOM, on_headroom, executor_id="ex-mon")
    await bus.subscribe(SLO_ALERT, on_alert, executor_id="ex-mon")
    t0 = time.time()
    for i in range(30):  # 3 s of calm serving at 10 rps
        await bus.publish(EXECUTOR_METRICS, snap(t0 + i * 0.1, ex="ex-mon", ttft=[30.0], tpot=[6.0], arrivals=1, rollout=i % 3), executor_id="ex-mon")
        await asyncio.sleep(0.1)
    assert alerts == []
    assert headrooms, "no headroom published"
    last = headrooms[-1]
    assert last.lendable and last.rollout_batch_slots > 0 and last.role == "serving" and last.ttft_p99_ms > 0, last
    for i in range(30, 40):  # a 4x burst in arrivals, latency not yet moved
        await bus.publish(EXECUTOR_METRICS, snap(t0 + i * 0.1, ex="ex-mon", ttft=[30.0], tpot=[6.0], arrivals=4), executor_id="ex-mon")
        await asyncio.sleep(0.1)
        if alerts:
            break
    assert alerts and alerts[0].severity == "burst" and "arrival" in alerts[0].reason
    # no lending while the burst lasts: the monitor's next headroom says so
    await until(lambda: not headrooms[-1].lendable, 10, "a headroom that lends nothing during the burst")
