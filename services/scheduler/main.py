"""The elastic rollout scheduler: leases on serving executors, turn-wise routing, straggler hedges.

connect -> recover leases -> subscribe (heartbeats, headroom, alerts, trajectories) -> serve routes
-> loop (plan leases every tick) -> drain.
"""

from __future__ import annotations

import logging

from rose.contracts.registry import EXECUTOR_BURST, HEADROOM, HEARTBEAT, LEASE_EVENT, ROUTE_TURN, SLO_ALERT, TRAJECTORY
from rose.shared.service import ServiceRuntime, service_main

from .config import SchedulerConfig
from .scheduler import Scheduler

log = logging.getLogger(__name__)


async def run(config: SchedulerConfig) -> None:
    holder: list[Scheduler] = []
    async with ServiceRuntime("scheduler", bus=config.bus, runtime=config.runtime, load=lambda: holder[0].load() if holder else {}) as rt:
        s = Scheduler(config, rt.bus)
        holder.append(s)
        await s.recover()
        await rt.bus.subscribe(HEARTBEAT, s.on_heartbeat, service="executor")
        await rt.bus.subscribe(HEARTBEAT, s.on_peer, service="scheduler")  # other instances: who owns which executor
        await rt.bus.subscribe(LEASE_EVENT, s.on_lease_event)  # leases other instances write, for routing
        await rt.bus.subscribe(HEADROOM, s.on_headroom)
        await rt.bus.subscribe(SLO_ALERT, s.on_alert)
        await rt.bus.subscribe(EXECUTOR_BURST, s.on_alert)  # an executor's own burst alert: same handling, sooner
        await rt.bus.subscribe(TRAJECTORY, s.on_trajectory)
        await rt.bus.serve(ROUTE_TURN, s.route, queue="scheduler")
        rt.ready()
        while not rt.stopping:
            try:
                await s.tick()
            except Exception as exc:  # reconnecting: executors enforce expiry on their own meanwhile
                log.warning("lease tick failed: %r", exc)
            await rt.idle(config.tick_s)


def main(argv: list[str]) -> int:
    return service_main(argv, service="scheduler", description="Run the elastic rollout scheduler.", config_cls=SchedulerConfig, run=run)
