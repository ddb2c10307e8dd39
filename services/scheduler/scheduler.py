"""The scheduler's handlers: they feed the fleet view, apply lease decisions, answer route requests.

The decisions are pure functions (leases.py, placement.py); this class does the I/O around
them: every lease action is written to the bucket, published as a LeaseEvent and traced as a
span; every placement is published as a PlacementEvent inside its span.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from rose.contracts.lease import LeaseEvent
from rose.contracts.registry import LEASE, LEASE_EVENT, PLACEMENT
from rose.contracts.rollout import PlacementEvent, Trajectory, TurnRoute, TurnRouteRequest
from rose.contracts.service import Heartbeat
from rose.contracts.slo import Headroom, SloAlert
from rose.shared.bus import Bus, Delivery
from rose.shared.tracing import tracer

from .config import SchedulerConfig
from .fleet import Fleet
from .leases import LeaseAction, plan_lending, revoke_on_alert
from .placement import place_turn, should_hedge
from .telemetry import SchedulerMetrics

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, bus: Bus) -> None:
        self.config, self.bus = config, bus
        self.fleet = Fleet(config)
        self.rng = random.Random(config.seed)
        self.counts = {"granted": 0, "renewed": 0, "revoked": 0, "expired": 0, "routed": 0, "hedged": 0, "unroutable": 0}
        self._background: set[asyncio.Task] = set()
        self.metrics = SchedulerMetrics()

    async def recover(self) -> None:
        """Leases (and their epochs) outlive a scheduler restart in the KV bucket."""
        for lease in await self.bus.kv_values(LEASE):
            self.fleet.on_lease(lease)

    async def apply(self, action: LeaseAction) -> None:
        lease = action.lease
        with tracer().start_as_current_span(
            f"lease.{action.kind}",
            attributes={"rose.executor_id": lease.executor_id, "rose.lease_id": lease.lease_id, "rose.lease_epoch": lease.epoch, "rose.reason": action.reason},
        ):
            if action.kind in ("revoked", "expired"):
                self.fleet.on_lease(lease)  # stop routing there before anyone can see the revocation
            await self.bus.kv_put(LEASE, lease, executor_id=lease.executor_id)
            self.fleet.on_lease(lease)
            self.counts[action.kind] += 1
            self.metrics.lease(action.kind, lease)
            await self.bus.publish(
                LEASE_EVENT, LeaseEvent(kind=action.kind, lease=lease, at=time.time(), reason=action.reason), kind=action.kind, executor_id=lease.executor_id
            )
        log.info("lease %s %s on %s: %s", lease.lease_id, action.kind, lease.executor_id, action.reason)

    async def tick(self) -> None:
        for action in plan_lending(time.time(), self.fleet.views(time.time()), self.config.leases, self.config.lending):
            await self.apply(action)

    # ---- handlers ------------------------------------------------------------------------
    async def on_heartbeat(self, beat: Heartbeat, _d: Delivery) -> None:
        self.fleet.on_heartbeat(beat)

    async def on_headroom(self, headroom: Headroom, _d: Delivery) -> None:
        self.fleet.on_headroom(headroom)

    async def on_alert(self, alert: SloAlert, _d: Delivery) -> None:
        now = time.time()
        if alert.severity != "recovered":
            self.fleet.on_alert(alert.executor_id, now)
        self.fleet.info(alert.executor_id)
        for action in revoke_on_alert(self.fleet.views(now), alert, now, self.config.lending):
            await self.apply(action)

    async def on_trajectory(self, trajectory: Trajectory, _d: Delivery) -> None:
        self.fleet.on_trajectory(trajectory.trajectory_id, trajectory.group_id)

    async def route(self, req: TurnRouteRequest, _d: Delivery) -> TurnRoute:
        now, p = time.time(), self.config.placement
        nothing = dict(trajectory_id=req.trajectory_id, turn_index=req.turn_index, retry_after_s=p.no_route_retry_s)
        if req.hedge:
            worth, why = should_hedge(req, self.fleet.group_done.get(req.group_id, 0), p)
            if not worth:
                return TurnRoute(reason=why, **nothing)
        affinity = req.previous_executor or self.fleet.affinity.get(req.trajectory_id, "")
        with tracer().start_as_current_span("scheduler.place", attributes={"rose.trajectory_id": req.trajectory_id, "rose.turn_index": req.turn_index}) as span:
            placement = place_turn(req, self.fleet.candidates(now), affinity, p, self.rng)
            if placement is None:
                self.counts["unroutable"] += 1
                self.metrics.unroutable_turn()
                span.set_attribute("rose.reason", "no executor")
                return TurnRoute(reason="no dedicated executor and no serving executor under a lease", **nothing)
            span.set_attribute("rose.executor_id", placement.executor_id)
            span.set_attribute("rose.reason", placement.reason)
            self.fleet.on_route(req.trajectory_id, placement.executor_id, now, hedge=req.hedge)
            self.counts["hedged" if req.hedge else "routed"] += 1
            self.metrics.routed_turn(placement.executor_id, placement.role, req.hedge, affinity, req.routing)
            event = PlacementEvent(
                trajectory_id=req.trajectory_id, turn_index=req.turn_index, executor_id=placement.executor_id, at=now,
                reason=placement.reason, lease_id=placement.lease_id, lease_epoch=placement.lease_epoch, hedge=req.hedge,
            )
            self._spawn(self.bus.publish(PLACEMENT, event, executor_id=placement.executor_id))
        return TurnRoute(
            trajectory_id=req.trajectory_id, turn_index=req.turn_index, executor_id=placement.executor_id, lease_id=placement.lease_id,
            lease_epoch=placement.lease_epoch, role=placement.role, reason=placement.reason,  # type: ignore[arg-type]
        )

    def _spawn(self, coro) -> None:
        """Publish the audit event without holding up the reply."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def load(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.counts.items()}
