"""Collecting trajectory groups from the stream, with a staleness bound.

A group is the G trajectories of one task (same `group_id`). It is ready once every member
has arrived (the worker publishes a trajectory for every task, completed or failed), or after
`group_timeout_s` with at least two usable members. Each trajectory's version is the oldest
policy version any of its tokens came from; one more than `max_staleness` versions behind
the trainer is stale: dropped from the group (`drop`, the default) or kept for the group's
baseline but masked out of the loss (`mask`). Failed trajectories count toward completion
and are never trained on. Every outcome is counted in `stats`.

Asynchronous RL (docs/async-rl.md): a step takes the first complete groups, whichever step
handed them out (`take`), so it never waits for an older step's slowest group; such a group is
trained on later if its trajectories are still within the bound, or dropped whole once none is
(`stale_groups`), never taking a step's slot. `trained_past_tail` counts groups trained while a
group handed out before them was still rolling out; `max_trained_lag` is the most versions a
trained trajectory lagged the trainer (never above `max_staleness`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rose.contracts.rollout import Trajectory

from .batch import Sequence, sequences_of
from .config import StalePolicy
from .grpo import group_advantages


@dataclass
class Group:
    group_id: str
    size: int
    created: float = field(default_factory=time.monotonic)
    members: dict[str, Trajectory] = field(default_factory=dict)


def trajectory_version(t: Trajectory) -> int:
    """The oldest version any of its tokens came from (each turn records its oldest token's): a
    trajectory continued across version changes is as stale as its first tokens."""
    return min((turn.policy_version for turn in t.turns), default=0)


def generated_tokens(t: Trajectory) -> int:
    return sum(len(turn.token_ids) for turn in t.turns)


def partial_rollout_costs(stats: dict) -> dict[str, float]:
    """From the collector's stats: the mean versions a trained trajectory lagged the trainer, and the length bias
    (mean tokens generated per trained trajectory over per completed one received; under 1: short ones trained first)."""
    out = {"trained_staleness_mean": stats["trained_lag_total"] / stats["trained"] if stats["trained"] else 0.0}
    if stats["trained"] and stats["completed"] and stats["completed_tokens"]:
        out["length_bias"] = (stats["trained_tokens"] / stats["trained"]) / (stats["completed_tokens"] / stats["completed"])
    return out


class GroupCollector:
    def __init__(self, *, max_staleness: int, stale_policy: StalePolicy = "drop", group_timeout_s: float = 300.0) -> None:
        self.max_staleness, self.stale_policy, self.group_timeout_s = max_staleness, stale_policy, group_timeout_s
        self.groups: dict[str, Group] = {}
        self.stats = {
            "received": 0,
            "duplicates": 0,
            "failed": 0,
            "stale_dropped": 0,
            "stale_masked": 0,
            "unknown_group": 0,
            "zero_variance_groups": 0,
            "groups_used": 0,
            "late": 0,
            "already_used": 0,  # counted by the trainer (arrived once their group was in a step / trained on)
            "stale_groups": 0,
            "trained_past_tail": 0,
            "max_trained_lag": 0,
            # partial rollouts' cost (trainer.py `load`): the staleness of what is trained, and the length bias of what
            # completes first (tokens generated per trained trajectory against per completed one received)
            "completed": 0,
            "completed_tokens": 0,
            "trained": 0,
            "trained_tokens": 0,
            "trained_lag_total": 0,
            "missing": 0,  # members of groups released on the timeout that never arrived (lost or too late)
        }

    def expect(self, group_id: str, size: int) -> None:
        """Announce a group the trainer emitted; trajectories of unknown groups are counted and ignored."""
        self.groups.setdefault(group_id, Group(group_id, size))

    def add(self, t: Trajectory) -> None:
        self.stats["received"] += 1
        group = self.groups.get(t.group_id)
        if group is None:
            self.stats["unknown_group"] += 1
            return
        if t.trajectory_id in group.members:
            self.stats["duplicates"] += 1  # at-least-once delivery: the first copy counts
            return
        group.members[t.trajectory_id] = t
        if t.status == "failed":
            self.stats["failed"] += 1
        elif t.status == "completed":
            self.stats["completed"] += 1
            self.stats["completed_tokens"] += generated_tokens(t)

    def ready(self, now: float | None = None) -> list[Group]:
        now = time.monotonic() if now is None else now
        out = []
        for g in list(self.groups.values()):
            complete = len(g.members) >= g.size
            usable = sum(1 for t in g.members.values() if t.status == "completed")
            if complete or (now - g.created > self.group_timeout_s and usable >= 2):
                self.stats["missing"] += max(0, g.size - len(g.members))
                out.append(self.groups.pop(g.group_id))
        return out

    def _stale(self, t: Trajectory, current_version: int) -> bool:
        return current_version - trajectory_version(t) > self.max_staleness

    def expire(self, ready: list[Group], current_version: int) -> tuple[list[Group], list[Group]]:
        """Ready groups -> (those that still train something, the expired).

        Expired: every completed trajectory is beyond the staleness bound, so the group would
        train nothing; it is dropped whole (counted) instead of taking a slot of a step.
        """
        usable, expired = [], []
        for g in ready:
            done = [t for t in g.members.values() if t.status == "completed"]
            if done and all(self._stale(t, current_version) for t in done):
                self.stats["stale_groups"] += 1
                self.stats["stale_dropped"] += len(done)
                expired.append(g)
            else:
                usable.append(g)
        return usable, expired

    def take(self, ready: list[Group], want: int) -> tuple[list[Group], list[Group]]:
        """The oldest `want` of ready groups, whichever step handed them out, and the rest."""
        ready = sorted(ready, key=lambda g: g.created)
        taken, rest = ready[:want], ready[want:]
        oldest_open = min((g.created for g in self.groups.values()), default=None)
        if oldest_open is not None:  # handed out after a group still rolling out: this step did not wait for that tail
            self.stats["trained_past_tail"] += sum(1 for g in taken if g.created > oldest_open)
        return taken, rest

    def sequences(self, groups: list[Group], current_version: int) -> list[Sequence]:
        """Training sequences of ready groups, with advantages, after the staleness bound."""
        out: list[Sequence] = []
        for g in groups:
            kept: list[tuple[Trajectory, bool]] = []  # (trajectory, trained on)
            for t in g.members.values():
                if t.status != "completed":
                    continue
                stale = self._stale(t, current_version)
                if stale and self.stale_policy == "drop":
                    self.stats["stale_dropped"] += 1
                    continue
                if stale:
                    self.stats["stale_masked"] += 1
                kept.append((t, not stale))
            advantages = group_advantages([t.reward for t, _ in kept])
            if kept and not any(advantages):
                self.stats["zero_variance_groups"] += 1
                continue
            self.stats["groups_used"] += 1
            for (t, train), adv in zip(kept, advantages):
                if not train:
                    continue
                lag = current_version - trajectory_version(t)
                self.stats["max_trained_lag"] = max(self.stats["max_trained_lag"], lag)
                self.stats["trained"] += 1
                self.stats["trained_tokens"] += generated_tokens(t)
                self.stats["trained_lag_total"] += lag
                for s in sequences_of(t):
                    s.advantage = adv
                    out.append(s)
        return out
