"""The SLO monitor: merges executors' metrics, publishes headroom periodically and burst alerts at once.

connect -> subscribe to executor metrics (and the other monitor instances' heartbeats: several
instances split the executors by rendezvous hashing, shared/partition.py) -> loop (publish
headroom every interval) -> drain.
"""

from __future__ import annotations

import logging
import time

from rose.contracts.executor import MetricsSnapshot
from rose.contracts.registry import EXECUTOR_METRICS, HEADROOM, HEARTBEAT, SLO_ALERT
from rose.contracts.service import Heartbeat
from rose.shared.bus import Bus, Delivery
from rose.shared.partition import Partition
from rose.shared.service import ServiceRuntime, service_main

from .config import SloMonitorConfig
from .monitor import Monitor
from .telemetry import MonitorMetrics

log = logging.getLogger(__name__)


async def publish_headroom(bus: Bus, monitor: Monitor, metrics: MonitorMetrics | None = None) -> None:
    now = time.time()
    for ex in monitor.live(now):
        headroom = monitor.headroom(ex, now)
        if metrics is not None:
            metrics.headroom(headroom)
        await bus.publish(HEADROOM, headroom, executor_id=ex)


async def run(config: SloMonitorConfig) -> None:
    monitor = Monitor(config)
    metrics = MonitorMetrics()
    async with ServiceRuntime("slo_monitor", bus=config.bus, runtime=config.runtime, load=monitor.fleet_load) as rt:
        partition = Partition(rt.bus.instance)

        async def on_peer(beat: Heartbeat, _d: Delivery) -> None:
            partition.on_heartbeat(beat)

        async def on_metrics(snapshot: MetricsSnapshot, _d: Delivery) -> None:
            now = time.time()
            if not partition.owns(snapshot.executor_id, now):
                return  # another monitor instance's executor (shared/partition.py)
            metrics.snapshot(snapshot, now)
            alert = monitor.observe(snapshot, now)
            if alert is not None:
                log.warning("%s on %s: %s", alert.severity, alert.executor_id, alert.reason)
                metrics.alert(alert)
                await rt.bus.publish(SLO_ALERT, alert, executor_id=alert.executor_id)

        # core subscription: the lowest latency path, and a restarted monitor needs no history
        await rt.bus.subscribe(EXECUTOR_METRICS, on_metrics)
        await rt.bus.subscribe(HEARTBEAT, on_peer, service="slo_monitor")  # other instances split the executors with us
        rt.ready()
        while not rt.stopping:
            try:
                await publish_headroom(rt.bus, monitor, metrics)
            except Exception as exc:  # reconnecting: the next round will do
                log.warning("could not publish headroom: %r", exc)
            await rt.idle(config.headroom_interval_s)


def main(argv: list[str]) -> int:
    return service_main(argv, service="slo_monitor", description="Run the SLO monitor.", config_cls=SloMonitorConfig, run=run)
