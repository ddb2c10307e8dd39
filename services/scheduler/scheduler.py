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

import msgspec

from rose.contracts.lease import Lease, LeaseEvent
from rose.contracts.registry import LEASE, LEASE_EVENT, PLACEMENT
from rose.contracts.rollout import PlacementEvent, Trajectory, TurnRoute, TurnRouteRequest
from rose.contracts.service import Heartbeat
from rose.contracts.slo import Headroom, SloAlert
from rose.shared.bus import Bus, Delivery, KvConflict
from rose.shared.partition import Partition
from rose.shared.tracing import tracer

from .config import SchedulerConfig
from .fleet import Fleet
from .leases import ExecutorView, LeaseAction, is_active, plan_lending, revoke_on_alert
from .placement import hedge_primary, place_turn, should_hedge
from .telemetry import SchedulerMetrics

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, bus: Bus) -> None:
        self.config, self.bus = config, bus
        self.fleet = Fleet(config)
        self.rng = random.Random(config.seed)
        self.counts = {"granted": 0, "renewed": 0, "revoked": 0, "expired": 0, "routed": 0, "hedged": 0, "unroutable": 0, "conflicts": 0}
        self.partition = Partition(bus.instance, config.placement.heartbeat_misses)
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
            attributes={
                "rose.executor_id": lease.executor_id,
                "rose.lease_id": lease.lease_id,
                "rose.lease_epoch": lease.epoch,
                "rose.reason": action.reason,
            },
        ):
            if action.kind in ("revoked", "expired"):
                self.fleet.on_lease(lease)  # stop routing there before anyone can see the revocation
            written = await self._write(action)
            if written is None:
                return
            lease = written
            self.fleet.on_lease(lease)
            self.counts[action.kind] += 1
            self.metrics.lease(action.kind, lease)
            await self.bus.publish(
                LEASE_EVENT,
                LeaseEvent(kind=action.kind, lease=lease, at=time.time(), reason=action.reason),
                kind=action.kind,
                executor_id=lease.executor_id,
            )
        log.info("lease %s %s on %s: %s", lease.lease_id, action.kind, lease.executor_id, action.reason)

    async def _write(self, action: LeaseAction) -> Lease | None:
        """Write the lease as a compare-and-set on what the bucket holds now; the lease written, or None.

        Why: with several scheduler instances (shared/partition.py) two may briefly both believe
        they own an executor; the bucket's revision decides, so no executor is ever granted twice.
        A grant over another writer's active lease, or a renewal of a lease that is no longer the
        current one, is dropped (and the current one adopted); a revocation revokes whatever is
        active there now.
        """
        lease, ex = action.lease, action.lease.executor_id
        current, revision = await self.bus.kv_entry(LEASE, executor_id=ex)
        now = time.time()
        if current is not None and current.lease_id != lease.lease_id:
            if action.kind in ("revoked", "expired") and is_active(current, now):
                park_until = min(lease.park_until, current.expires_at) if lease.park_until else 0.0
                lease = msgspec.structs.replace(current, state="revoked", reason=action.reason, park_until=park_until)
            elif action.kind != "granted" or is_active(current, now) or current.epoch >= lease.epoch:
                self.fleet.on_lease(current)
                self.counts["conflicts"] += 1
                return None
        try:
            await self.bus.kv_swap(LEASE, lease, revision=revision, executor_id=ex)
        except KvConflict:
            self.counts["conflicts"] += 1
            current, _ = await self.bus.kv_entry(LEASE, executor_id=ex)
            if current is not None:
                self.fleet.on_lease(current)
            return None
        return lease

    def owned(self, views: list[ExecutorView], now: float) -> list[ExecutorView]:
        """The executors this instance plans leases for (all of them when it runs alone)."""
        return views if not self.partition.peers else [v for v in views if self.partition.owns(v.executor_id, now)]

    async def tick(self) -> None:
        now = time.time()
        for action in plan_lending(now, self.owned(self.fleet.views(now), now), self.config.leases, self.config.lending):
            await self.apply(action)

    async def on_peer(self, beat: Heartbeat, _d: Delivery) -> None:
        """Another scheduler instance's heartbeat: who is alive decides who owns which executor."""
        self.partition.on_heartbeat(beat)

    async def on_lease_event(self, event: LeaseEvent, _d: Delivery) -> None:
        """Every lease action, ours and other instances' (a core subscription: a scheduler may not create
        JetStream consumers on storage it writes, shared/security.py): routing follows them all."""
        lease, current = event.lease, self.fleet.info(event.lease.executor_id).lease
        newer = (
            current is None
            or lease.epoch > current.epoch
            or (lease.epoch == current.epoch and (lease.state == "revoked" or (current.state == "active" and lease.expires_at >= current.expires_at)))
        )
        if newer:  # events of one executor may arrive out of order from two instances
            self.fleet.on_lease(lease)

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
        for action in revoke_on_alert(self.owned(self.fleet.views(now), now), alert, now, self.config.lending):
            await self.apply(action)

    async def on_trajectory(self, trajectory: Trajectory, _d: Delivery) -> None:
        self.fleet.on_trajectory(trajectory.trajectory_id, trajectory.group_id, [len(t.token_ids) for t in trajectory.turns])
        for t in trajectory.turns:
            self.fleet.on_turn_result(trajectory.trajectory_id, t.turn_index, len(t.token_ids), t.finished_at - t.started_at)

    async def route(self, req: TurnRouteRequest, _d: Delivery) -> TurnRoute:
        now, p = time.time(), self.config.placement

        def nothing(reason: str) -> TurnRoute:
            """No executor for the turn now: the worker asks again after `no_route_retry_s`."""
            return TurnRoute(trajectory_id=req.trajectory_id, turn_index=req.turn_index, reason=reason, retry_after_s=p.no_route_retry_s)

        if req.hedge:
            primary_role = self.fleet.role_of(hedge_primary(req))
            worth, why = should_hedge(
                req,
                self.fleet.group_done.get(req.group_id, 0),
                p,
                self.fleet.candidates(now),
                self.fleet.unfinished(req.batch_id, req.batch_size),
                primary_role,
            )
            if not worth:
                return nothing(why)
        affinity = req.previous_executor or self.fleet.affinity.get(req.trajectory_id, "")
        with tracer().start_as_current_span(
            "scheduler.place", attributes={"rose.trajectory_id": req.trajectory_id, "rose.turn_index": req.turn_index}
        ) as span:
            started, cpu = time.perf_counter(), time.thread_time()
            candidates = self.fleet.candidates(now, sample=p.sample_candidates, keep=(affinity,), rng=self.rng)
            placement = place_turn(
                req,
                candidates,
                affinity,
                p,
                self.rng,
                self.fleet.unfinished(req.batch_id, req.batch_size),
                self.fleet.turn_tokens,
                self.fleet.revoke_rate(now),
                self.fleet.model_error,
            )
            # what a slow route reply spent here, against the time it waited for the event loop (rose.loop_wait_ms on its reply span)
            span.set_attributes(
                {
                    "rose.candidates": len(candidates),
                    "rose.place_ms": (time.perf_counter() - started) * 1000.0,
                    "rose.place_cpu_ms": (time.thread_time() - cpu) * 1000.0,
                    "rose.affinity": affinity,
                }
            )
            if placement is None:
                self.counts["unroutable"] += 1
                self.metrics.unroutable_turn()
                span.set_attribute("rose.reason", "no executor")
                return nothing("no dedicated executor and no serving executor under a lease")
            span.set_attribute("rose.executor_id", placement.executor_id)
            span.set_attribute("rose.reason", placement.reason)
            self.fleet.on_route(req.trajectory_id, placement.executor_id, now, hedge=req.hedge, batch_id=req.batch_id, batch_size=req.batch_size)
            if not req.hedge:
                self.fleet.on_prediction(req.trajectory_id, req.turn_index, placement.role, placement.model_s, placement.model_wait_s)
            self.counts["hedged" if req.hedge else "routed"] += 1
            self.metrics.routed_turn(placement.executor_id, placement.role, req.hedge, affinity, req.routing)
            event = PlacementEvent(
                trajectory_id=req.trajectory_id,
                turn_index=req.turn_index,
                executor_id=placement.executor_id,
                at=now,
                reason=placement.reason,
                lease_id=placement.lease_id,
                lease_epoch=placement.lease_epoch,
                hedge=req.hedge,
                predicted_s=placement.predicted_s,
                model_s=placement.model_s,
                rule=placement.rule,
            )
            self._spawn(self.bus.publish(PLACEMENT, event, executor_id=placement.executor_id))
            # the span's whole time against this thread's CPU in it (no await inside): a long span with little CPU
            # waited for a core (a busy host), which no code here explains
            span.set_attribute("rose.span_cpu_ms", (time.thread_time() - cpu) * 1000.0)
        return TurnRoute(
            trajectory_id=req.trajectory_id,
            turn_index=req.turn_index,
            executor_id=placement.executor_id,
            lease_id=placement.lease_id,
            lease_epoch=placement.lease_epoch,
            role=placement.role,
            reason=placement.reason,
            hedge_after_s=placement.hedge_after_s,
        )

    def _spawn(self, coro) -> None:
        """Publish the audit event without holding up the reply."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def load(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.counts.items()}
