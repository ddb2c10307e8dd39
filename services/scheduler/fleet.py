"""What the scheduler knows of the fleet, fed by heartbeats, headroom, alerts, leases and trajectories.

The decisions themselves live in leases.py and placement.py; this only keeps the inputs.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from rose.contracts.lease import Lease
from rose.contracts.service import Heartbeat
from rose.contracts.slo import Headroom

from .config import SchedulerConfig
from .leases import ExecutorView, is_active
from .placement import Candidate

MAX_TRACKED = 100_000  # trajectories remembered for affinity and group progress


@dataclass
class ExecutorInfo:
    executor_id: str
    role: str = "serving"
    heartbeat: Heartbeat | None = None
    seen_at: float = 0.0  # local clock of the last heartbeat
    headroom: Headroom | None = None
    lease: Lease | None = None
    last_alert_at: float = 0.0
    inflight: dict[str, float] = field(default_factory=dict)  # trajectory id -> routed at
    lendable_since: float = 0.0  # first of the unbroken run of `lendable` headrooms (0: not lendable now)


class Fleet:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.executors: dict[str, ExecutorInfo] = {}
        self.affinity: OrderedDict[str, str] = OrderedDict()  # trajectory id -> executor of its last turn
        self.group_done: OrderedDict[str, int] = OrderedDict()
        self.done_trajectories: OrderedDict[str, None] = OrderedDict()

    def info(self, executor_id: str) -> ExecutorInfo:
        return self.executors.setdefault(executor_id, ExecutorInfo(executor_id))

    # ---- inputs ------------------------------------------------------------------------
    def on_heartbeat(self, beat: Heartbeat, now: float | None = None) -> None:
        info = self.info(beat.instance)
        info.heartbeat, info.seen_at = beat, time.time() if now is None else now
        info.role = beat.labels.get("role", info.role)
        if beat.state == "draining":
            info.seen_at = 0.0

    def on_headroom(self, headroom: Headroom) -> None:
        info = self.info(headroom.executor_id)
        info.headroom, info.role = headroom, headroom.role
        info.lendable_since = (info.lendable_since or headroom.at) if headroom.lendable else 0.0

    def on_lease(self, lease: Lease) -> None:
        self.info(lease.executor_id).lease = lease

    def on_alert(self, executor_id: str, at: float) -> None:
        self.info(executor_id).last_alert_at = at

    def on_trajectory(self, trajectory_id: str, group_id: str) -> None:
        if trajectory_id in self.done_trajectories:
            return  # a duplicate delivery counts once
        self.done_trajectories[trajectory_id] = None
        _bound(self.done_trajectories)
        if group_id:
            self.group_done[group_id] = self.group_done.get(group_id, 0) + 1
            self.group_done.move_to_end(group_id)
            _bound(self.group_done)
        self.affinity.pop(trajectory_id, None)
        for info in self.executors.values():
            info.inflight.pop(trajectory_id, None)

    def on_route(self, trajectory_id: str, executor_id: str, now: float, hedge: bool = False) -> None:
        for info in self.executors.values():
            if not hedge:
                info.inflight.pop(trajectory_id, None)  # its previous turn is done
        self.info(executor_id).inflight[trajectory_id] = now
        if not hedge:
            self.affinity[trajectory_id] = executor_id
            self.affinity.move_to_end(trajectory_id)
            _bound(self.affinity)

    # ---- views for the decisions -------------------------------------------------------
    def alive(self, info: ExecutorInfo, now: float) -> bool:
        if info.heartbeat is None:
            return False
        return now - info.seen_at <= self.config.placement.heartbeat_misses * info.heartbeat.interval_s

    def views(self, now: float) -> list[ExecutorView]:
        return [ExecutorView(i.executor_id, i.role, self.alive(i, now), i.headroom, i.lease, i.last_alert_at, i.lendable_since) for i in self.executors.values()]

    def view(self, executor_id: str, now: float) -> ExecutorView:
        i = self.info(executor_id)
        return ExecutorView(i.executor_id, i.role, self.alive(i, now), i.headroom, i.lease, i.last_alert_at, i.lendable_since)

    def candidates(self, now: float) -> list[Candidate]:
        p = self.config.placement
        out = []
        for i in self.executors.values():
            if not self.alive(i, now):
                continue
            for tid, at in list(i.inflight.items()):
                if now - at > p.inflight_ttl_s:
                    del i.inflight[tid]
            h = i.headroom
            throughput = h.rollout_tokens_per_s if h else 0.0
            queued = (h.rollout_queue + h.rollout_running) if h else 0
            load = max(len(i.inflight), queued)
            if i.role == "dedicated":
                slots = h.rollout_batch_slots if h else 1
                out.append(Candidate(i.executor_id, "dedicated", "", 0, throughput, load, slots))
            elif is_active(i.lease, now + p.min_lease_left_s):
                assert i.lease is not None
                out.append(Candidate(i.executor_id, "serving", i.lease.lease_id, i.lease.epoch, throughput, load, i.lease.max_rollout_batch))
        return out


def _bound(d: OrderedDict) -> None:
    while len(d) > MAX_TRACKED:
        d.popitem(last=False)
