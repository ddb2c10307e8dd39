"""Turn-wise placement as a pure function of explicit inputs, so a simulator can import it.

Each turn of a trajectory is placed on its own:
1. candidates are dedicated rollout executors and serving executors holding an active lease
   with at least `min_lease_left_s` to run, alive, not excluded by the worker;
2. with affinity routing, the executor that holds the trajectory's prefix cache (where its
   previous turn ran) wins unless it is overloaded (load > slots x `overload_factor`);
3. otherwise the least loaded by *weighted* load: (load + 1) / relative throughput, where
   throughput is the rollout tokens/s measured on that executor (heterogeneous devices: a
   device twice as fast takes twice the turns); random routing, the baseline, picks uniformly.
Stragglers: a hedge (duplicate) is placed only when most of the group is done or the turn is
far past the typical turn time, preferring dedicated executors; the first result wins.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rose.contracts.rollout import TurnRouteRequest

from .config import PlacementSettings


@dataclass(frozen=True)
class Candidate:
    executor_id: str
    role: str  # "serving" | "dedicated"
    lease_id: str
    lease_epoch: int
    throughput: float  # measured rollout tokens/s (0: not measured yet)
    load: int  # turns in flight there
    slots: int  # rollout batch slots the executor can run


@dataclass(frozen=True)
class Placement:
    executor_id: str
    lease_id: str
    lease_epoch: int
    role: str
    reason: str


def weights(candidates: list[Candidate]) -> dict[str, float]:
    """Relative throughput; an executor not yet measured counts as the median of those that are."""
    measured = sorted(c.throughput for c in candidates if c.throughput > 0)
    default = measured[len(measured) // 2] if measured else 1.0
    return {c.executor_id: (c.throughput if c.throughput > 0 else default) / default for c in candidates}


def _least_loaded(candidates: list[Candidate]) -> Candidate:
    w = weights(candidates)
    return min(candidates, key=lambda c: ((c.load + 1) / w[c.executor_id], c.executor_id))


def _placed(c: Candidate, reason: str) -> Placement:
    return Placement(c.executor_id, c.lease_id, c.lease_epoch, c.role, reason)


def place_turn(req: TurnRouteRequest, candidates: list[Candidate], affinity: str, s: PlacementSettings, rng: random.Random) -> Placement | None:
    """Where this turn runs, or None when no executor can take it."""
    pool = [c for c in candidates if c.executor_id not in req.exclude]
    if not pool:
        return None
    if req.hedge:
        dedicated = [c for c in pool if c.role == "dedicated" and c.executor_id != affinity]
        others = [c for c in pool if c.executor_id != affinity]
        choice = dedicated or others
        return _placed(_least_loaded(choice), "hedge on dedicated" if dedicated else "hedge") if choice else None
    if req.routing == "random":
        return _placed(rng.choice(sorted(pool, key=lambda c: c.executor_id)), "random")
    if affinity:
        home = next((c for c in pool if c.executor_id == affinity), None)
        if home is not None and home.load <= max(1, home.slots) * s.overload_factor:
            return _placed(home, "prefix affinity")
        reason = "affinity executor overloaded" if home is not None else "affinity executor unavailable"
        return _placed(_least_loaded(pool), f"{reason}; least weighted load")
    return _placed(_least_loaded(pool), "least weighted load")


def should_hedge(req: TurnRouteRequest, group_done: int, s: PlacementSettings) -> tuple[bool, str]:
    """Is this straggling turn worth a duplicate? (first result wins)"""
    typical = req.typical_turn_s
    if typical <= 0:
        return False, "no typical turn time yet"
    late = req.elapsed_s / typical
    if late >= s.hedge_always_after_typical:
        return True, f"turn at {late:.1f}x the typical time"
    if req.group_size > 1 and group_done / req.group_size >= s.hedge_group_done and late >= s.hedge_after_typical:
        return True, f"{group_done}/{req.group_size} of the group done, turn at {late:.1f}x typical"
    return False, "not a straggler"
