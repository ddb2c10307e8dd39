"""Ceilings: the most that lending can add to rollout and to RL throughput, whatever the placement.

A serving instance's rollout lane gets at most its share at full quanta (``coserve.lane_share_ceiling``);
a lane GPU-second is worth at most a dedicated one. So the fleet offers rollout at most
``rollout_capacity_ceiling`` x the dedicated pool's throughput, and an RL step can shrink at most as
Amdahl allows at that capacity (``speedup_ceiling``). ``rose bench sim`` reports both beside rose's
speedup, so a figure under a target says whether the target is out of the fleet's reach or the
placement leaves capacity unused; ``rose plan`` does the same per demand level.

The bound prices a lane GPU-second as a dedicated one. ``lane_value`` prices it at what each
side runs at once at the mean rollout context (a lease holds the sequences its lent KV fits,
a dedicated instance its batch), on the same roofline: the ``_kv`` ceilings are what the
fleet offers at that price, an estimate rather than a bound (shorter contexts fit more).

Amdahl's ceiling assumes the rollout before its tail is bound by capacity. A synchronous step at demand 2
is not: its dedicated pool runs most of the batch at once, and the step waits on its trajectories'
turns and tools in sequence (14B on 16 GPUs: a pool twice the size gives static 1.17x where Amdahl's
ceiling says 1.40x). The fleet ceiling (``grown_pools``, ``fleet_ceiling``) asks the simulator instead:
static's own job on a dedicated pool grown by the fleet's lane capacity, so latency, tools, staleness
and the batch's shape count as they do for rose. It is what the lent capacity buys as whole GPUs;
lanes are worth less (they alternate with serving), so it is the fairer bar, not a bound.

The lane pool (``SimConfig.lane_pool``, ``rose bench sim --lane-pool``) asks what the same capacity buys as
lanes: static's job with each serving instance's lane added to its pool as an instance of its own, at the
share of each second rose's executor leaves a lane at full quanta and with the KV it lends, serving paying
nothing. Where a synchronous step waits on its slowest trajectories, a whole GPU speeds their tokens (a
smaller batch per instance) and a lane does not (its token takes a loaded dedicated instance's time or more:
docs/benchmarks.md, 2026-12-06 session 6), so the two differ most there. It is placed as the pool places,
which keeps a trajectory on a slow instance once it started there, so it is a comparison, not a ceiling.
"""

from __future__ import annotations

import math


def rollout_capacity_ceiling(lane_share: float | None, serving_gpus: int, dedicated_gpus: int, value: float = 1.0) -> float | None:
    """The most rollout throughput the fleet offers over the dedicated pool's alone: the pool plus every
    serving GPU's lane share at full quanta, each lane GPU-second worth ``value`` of a dedicated one (at
    most 1: a lease holds fewer sequences and runs at a lower batch, so it is worth less). None without lanes."""
    if lane_share is None:
        return None
    return 1.0 + serving_gpus * lane_share * value / max(1, dedicated_gpus)


def lane_value(lane_batch: float, lane_step_s: float, lane_tp: int, dedicated_batch: float, dedicated_step_s: float, dedicated_tp: int) -> float:
    """Rollout tokens per GPU-second of a lane (its lease's batch, one decode step each ``lane_step_s``)
    over a dedicated instance's (its batch and step), at most 1."""
    lane = lane_batch / max(lane_step_s, 1e-12) / lane_tp
    dedicated = dedicated_batch / max(dedicated_step_s, 1e-12) / dedicated_tp
    return min(1.0, lane / dedicated) if dedicated > 0 else 1.0


def speedup_ceiling(
    capacity: float, static_step_s: float, train_s: float, tail_s: float, pipelined: bool, rollout_s: float = 0.0, critical_s: float = 0.0
) -> float:
    """The most RL steps/h over static that a rollout capacity ``capacity`` x the dedicated pool's can buy
    (Amdahl): synchronous, training and the rollout's tail (``tail_s``: after 90 % of the trajectories
    finished, the longest ones' turns in sequence) stay, the rest of static's step shrinks by
    ``capacity``; asynchronous, rollout overlaps training and the next batch fills the tail, so a step
    takes at least its training or static's step shrunk by ``capacity``.

    Synchronous, the rollout (``rollout_s`` of static's step) also takes at least ``critical_s``, its
    slowest trajectory's turns in sequence each at the fastest per-token speed (trainer.py
    ``critical_paths``): where static's pool already runs the whole batch at once, the batch is bound by
    its trajectories' latency, and capacity buys only the speed a smaller batch per instance gives."""
    if pipelined:
        return static_step_s / max(train_s, static_step_s / capacity)
    fixed = min(static_step_s, train_s + tail_s)
    step = fixed + (static_step_s - fixed) / capacity
    if critical_s > 0 and rollout_s > 0:
        step = max(step, static_step_s - rollout_s + min(critical_s, rollout_s))
    return static_step_s / step


def speedup_ceiling_over(static: dict, capacity: float | None, pipelined: bool) -> float | None:
    """``speedup_ceiling`` at rollout capacity ``capacity`` over ``static``'s run (an engine result: its
    step, training and rollout tail); None without lanes or a static rate to compare with."""
    if capacity is None or static.get("infeasible") or not static.get("rl_steps_per_hour"):
        return None
    tail_s = static["tail_fraction"] * static["rollout_s_per_step"]  # after 90 % of its trajectories finished
    return speedup_ceiling(
        capacity,
        3600.0 / static["rl_steps_per_hour"],
        static["train_s_per_step"],
        tail_s,
        pipelined,
        static["rollout_s_per_step"],
        static.get("critical_s_per_step", 0.0),
    )


def share_of_gain(speedup: float | None, ceiling: float | None) -> float | None:
    """The share of a ceiling's gain a speedup took: (speedup - 1) / (ceiling - 1); None without a gain to take."""
    if speedup is None or ceiling is None or ceiling <= 1.0 + 1e-9:
        return None
    return (speedup - 1.0) / (ceiling - 1.0)


def grown_pools(dedicated_instances: int, capacity: float | None) -> tuple[int, ...]:
    """The dedicated pool sizes whose static runs bracket the pool grown by ``capacity`` (the fleet
    ceiling's runs): the floor and ceiling of dedicated x capacity, those larger than the pool itself."""
    if capacity is None or capacity <= 1.0 or dedicated_instances <= 0:
        return ()
    grown = dedicated_instances * capacity
    return tuple(sorted({k for k in (math.floor(grown), math.ceil(grown)) if k > dedicated_instances}))


def fleet_ceiling(static_rate: float, dedicated_instances: int, capacity: float | None, grown: dict[int, float]) -> float | None:
    """Static's RL steps/h on its dedicated pool grown by ``capacity``, over static's own: ``grown`` maps
    the ``grown_pools`` sizes to their static runs' steps/h, interpolated linearly at dedicated x
    capacity (the pool itself is ``static_rate``). None without a rate or a pool to grow."""
    sizes = grown_pools(dedicated_instances, capacity)
    if capacity is None or static_rate <= 0 or not sizes or any(k not in grown for k in sizes):
        return None
    target = dedicated_instances * capacity
    rates = {dedicated_instances: static_rate, **{k: grown[k] for k in sizes}}
    lo = max(k for k in rates if k <= target)
    hi = min((k for k in rates if k >= target), default=lo)
    rate = rates[lo] if hi == lo else rates[lo] + (rates[hi] - rates[lo]) * (target - lo) / (hi - lo)
    return rate / static_rate
