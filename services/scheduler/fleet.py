"""What the scheduler knows of the fleet, fed by heartbeats, headroom, alerts, leases and trajectories.

The decisions themselves live in leases.py and placement.py; this only keeps the inputs.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from rose.contracts.lease import Lease
from rose.contracts.service import Heartbeat
from rose.contracts.slo import Headroom

from .config import SchedulerConfig
from .leases import ExecutorView, is_active
from .placement import Candidate

MAX_TRACKED = 100_000  # trajectories remembered for affinity and group progress
REVOKE_WINDOW_S = 300.0  # revocations counted over this long for the leased-turn hazard
TURN_EMA = 0.02  # weight of one finished turn in a role's model error
MAX_MODEL_ERROR = 20.0  # a single turn moves the error estimate by at most this factor
PRUNE_EVERY_S = 1.0  # `candidates` runs on every route request: prune stale in-flight turns at most this often


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
    pruned_at: float = 0.0  # when `inflight` was last pruned of turns never heard of again
    capacity: int = 0  # rollout sequences it ran the last time others waited there (its KV limit, as measured)


class Fleet:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.executors: dict[str, ExecutorInfo] = {}
        self.affinity: OrderedDict[str, str] = OrderedDict()  # trajectory id -> executor of its last turn
        self.routed_to: OrderedDict[str, set[str]] = OrderedDict()  # trajectory id -> executors its turns in flight went to
        self.group_done: OrderedDict[str, int] = OrderedDict()
        self.done_trajectories: OrderedDict[str, None] = OrderedDict()
        # the tail rule's inputs (placement.in_tail): each trajectory's RL batch, each batch's size and finished count
        self.batch_of: OrderedDict[str, str] = OrderedDict()
        self.batch_size: OrderedDict[str, int] = OrderedDict()
        self.batch_done: OrderedDict[str, int] = OrderedDict()
        self.turn_tokens = 0.0  # generated tokens per turn, a moving mean over finished trajectories (0: none yet)
        self.revocations: deque[float] = deque(maxlen=10_000)  # when active leases ended early or expired
        # (trajectory, turn) -> (role, model s, of which the wait for a slot)
        self.predictions: OrderedDict[tuple[str, int], tuple[str, float, float]] = OrderedDict()
        self.model_error: dict[str, float] = {}  # role -> observed / predicted turn time (placement's correction)

    def info(self, executor_id: str) -> ExecutorInfo:
        return self.executors.setdefault(executor_id, ExecutorInfo(executor_id))

    def role_of(self, executor_id: str) -> str:
        """An executor's role as last heard, lease or not ("": never heard of)."""
        known = self.executors.get(executor_id)
        return known.role if known is not None else ""

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
        if headroom.rollout_queue > 0 and headroom.rollout_running > 0:
            info.capacity = headroom.rollout_running
        info.lendable_since = (info.lendable_since or headroom.at) if headroom.lendable else 0.0

    def on_lease(self, lease: Lease, now: float | None = None) -> None:
        info = self.info(lease.executor_id)
        old = info.lease
        if lease.state == "revoked" and old is not None and old.state == "active" and old.lease_id == lease.lease_id:
            self.revocations.append(time.time() if now is None else now)  # turns under it were interrupted (or parked)
        info.lease = lease

    def on_alert(self, executor_id: str, at: float) -> None:
        self.info(executor_id).last_alert_at = at

    def on_trajectory(self, trajectory_id: str, group_id: str, turn_tokens: list[int] | None = None) -> None:
        if trajectory_id in self.done_trajectories:
            return  # a duplicate delivery counts once
        self.done_trajectories[trajectory_id] = None
        _bound(self.done_trajectories)
        batch = self.batch_of.pop(trajectory_id, "")
        if batch:
            self.batch_done[batch] = self.batch_done.get(batch, 0) + 1
        for n in turn_tokens or ():
            self.turn_tokens = float(n) if self.turn_tokens <= 0 else 0.98 * self.turn_tokens + 0.02 * float(n)
        if group_id:
            self.group_done[group_id] = self.group_done.get(group_id, 0) + 1
            self.group_done.move_to_end(group_id)
            _bound(self.group_done)
        self.affinity.pop(trajectory_id, None)
        self._forget_turns(trajectory_id)

    def on_turn_result(self, trajectory_id: str, turn_index: int, tokens: int, seconds: float) -> None:
        """A finished turn (from a trajectory's turn records) against the time placement predicted for a typical
        turn where it was placed, its run scaled to the turn's tokens (the wait for a slot is the same for a short
        turn as for a long one: scaled too, a short turn behind a queue read as a model many times off, and one
        burst of first turns lifted the dedicated role's error to 9x): the model's error per role, a moving mean."""
        key = (trajectory_id, turn_index)
        role, predicted, wait = self.predictions.pop(key, ("", 0.0, 0.0))
        if not role or predicted <= 0 or seconds <= 0 or tokens <= 0 or self.turn_tokens <= 0:
            return
        expected = wait + (predicted - wait) * tokens / self.turn_tokens
        ratio = min(MAX_MODEL_ERROR, max(1.0 / MAX_MODEL_ERROR, seconds / expected))
        old = self.model_error.get(role, 0.0)
        self.model_error[role] = ratio if old <= 0 else (1 - TURN_EMA) * old + TURN_EMA * ratio

    def on_prediction(self, trajectory_id: str, turn_index: int, role: str, model_s: float, wait_s: float = 0.0) -> None:
        """Placement's model of a typical turn where it placed this one (``model_s``, of which ``wait_s`` waiting)."""
        if model_s > 0:
            self.predictions[(trajectory_id, turn_index)] = (role, model_s, min(wait_s, model_s))
            _bound(self.predictions)

    def on_route(self, trajectory_id: str, executor_id: str, now: float, hedge: bool = False, batch_id: str = "", batch_size: int = 0) -> None:
        if batch_id and trajectory_id not in self.done_trajectories:
            self.batch_of[trajectory_id] = batch_id
            _bound(self.batch_of)
            if batch_size:
                self.batch_size[batch_id] = batch_size
                _bound(self.batch_size)
        if not hedge:
            self._forget_turns(trajectory_id)  # its previous turn is done
        self.info(executor_id).inflight[trajectory_id] = now
        self.routed_to.setdefault(trajectory_id, set()).add(executor_id)
        self.routed_to.move_to_end(trajectory_id)
        _bound(self.routed_to)
        if not hedge:
            self.affinity[trajectory_id] = executor_id
            self.affinity.move_to_end(trajectory_id)
            _bound(self.affinity)

    def _forget_turns(self, trajectory_id: str) -> None:
        """The trajectory's turns stop counting as load where they were routed (an index, not a fleet scan)."""
        for ex in self.routed_to.pop(trajectory_id, ()):
            info = self.executors.get(ex)
            if info is not None:
                info.inflight.pop(trajectory_id, None)

    # ---- views for the decisions -------------------------------------------------------
    def revoke_rate(self, now: float, window_s: float = REVOKE_WINDOW_S) -> float:
        """Revocations per lease-second over the last `window_s`: the hazard a turn on leased capacity runs."""
        while self.revocations and self.revocations[0] < now - window_s:
            self.revocations.popleft()
        held = sum(1 for i in self.executors.values() if i.role != "dedicated" and is_active(i.lease, now))
        return len(self.revocations) / (max(1, held) * window_s)

    def unfinished(self, batch_id: str, batch_size: int = 0) -> int | None:
        """Trajectories of this batch not finished yet (None: the batch or its size is unknown)."""
        size = batch_size or self.batch_size.get(batch_id, 0)
        return max(0, size - self.batch_done.get(batch_id, 0)) if batch_id and size else None

    def alive(self, info: ExecutorInfo, now: float) -> bool:
        if info.heartbeat is None:
            return False
        return now - info.seen_at <= self.config.placement.heartbeat_misses * info.heartbeat.interval_s

    def views(self, now: float) -> list[ExecutorView]:
        return [
            ExecutorView(i.executor_id, i.role, self.alive(i, now), i.headroom, i.lease, i.last_alert_at, i.lendable_since)
            for i in self.executors.values()
        ]

    def view(self, executor_id: str, now: float) -> ExecutorView:
        i = self.info(executor_id)
        return ExecutorView(i.executor_id, i.role, self.alive(i, now), i.headroom, i.lease, i.last_alert_at, i.lendable_since)

    def sampled(self, per_role: int, keep: tuple[str, ...], rng: random.Random) -> list[ExecutorInfo]:
        """At most `per_role` executors of each role drawn at random, plus those named in `keep`.

        Why: a route request that predicts every executor costs O(fleet) (~30 ms at 1,000
        executors); the best of a few random choices is nearly as good as the best of all
        (power-of-d choices), and the affinity executor is always among them.
        """
        by_role: dict[str, list[ExecutorInfo]] = {}
        for i in self.executors.values():
            by_role.setdefault(i.role, []).append(i)
        chosen = {i.executor_id: i for infos in by_role.values() for i in (infos if len(infos) <= per_role else rng.sample(infos, per_role))}
        for ex in keep:
            if ex and ex in self.executors:
                chosen[ex] = self.executors[ex]
        return list(chosen.values())

    def candidates(self, now: float, *, sample: int = 0, keep: tuple[str, ...] = (), rng: random.Random | None = None) -> list[Candidate]:
        """The executors a turn may go to now; `sample` > 0 looks at that many per role (see `sampled`)."""
        p = self.config.placement
        out = []
        infos = self.sampled(sample, keep, rng or random.Random()) if sample and len(self.executors) > 2 * sample else list(self.executors.values())
        # an executor never seen queueing counts as its role's median measured capacity (a pool is mostly alike)
        known = {r: sorted(i.capacity for i in infos if i.role == r and i.capacity > 0) for r in ("dedicated", "serving")}
        median = {r: v[len(v) // 2] if v else 0 for r, v in known.items()}
        for i in infos:
            if not self.alive(i, now):
                continue
            if i.inflight and now - i.pruned_at > PRUNE_EVERY_S:
                i.pruned_at = now
                for tid, at in list(i.inflight.items()):
                    if now - at > p.inflight_ttl_s:
                        del i.inflight[tid]
            h = i.headroom
            throughput = h.rollout_tokens_per_s if h else 0.0
            queued = (h.rollout_queue + h.rollout_running) if h else 0
            load = max(len(i.inflight), queued)
            capacity = i.capacity or median.get(i.role, 0)
            recent = sum(1 for at in i.inflight.values() if at > h.at) if h else -1
            running_queued = (h.rollout_running, h.rollout_queue, capacity, recent) if h else (0, 0, capacity, -1)
            # as measured there: the executor times its forwards by the wall clock, so a lane's rate already holds the
            # serving forwards its rollout yielded to (scaling it by the lease's compute share counted the share twice)
            prefill_rate = h.rollout_prefill_tokens_per_s if h else 0.0
            if i.role == "dedicated":
                slots = h.rollout_batch_slots if h else 1
                out.append(Candidate(i.executor_id, "dedicated", "", 0, throughput, load, slots, *running_queued, prefill_rate=prefill_rate))
            elif is_active(i.lease, now + p.min_lease_left_s):
                assert i.lease is not None
                out.append(
                    Candidate(
                        i.executor_id,
                        "serving",
                        i.lease.lease_id,
                        i.lease.epoch,
                        throughput,
                        load,
                        i.lease.max_rollout_batch,
                        *running_queued,
                        prefill_rate=prefill_rate,
                    )
                )
        return out


def _bound(d: OrderedDict) -> None:
    while len(d) > MAX_TRACKED:
        d.popitem(last=False)
