"""The simulator's tallies for its result (engine.py)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

TIMELINE_FIELDS = ("t", "fleet_rps", "rollout_tps", "lent", "violating")


@dataclass
class ServingTally:
    """Serving SLO accounting, per serving instance and second."""

    violations: float = 0.0  # serving instance-seconds over the SLO
    bad_requests: float = 0.0
    requests: float = 0.0
    violations_alone: float = 0.0  # the same trace on the whole fleet serving alone (what static sees)
    lent_instance_s: float = 0.0
    serving_instance_s: float = 0.0  # serving instances taking traffic (counted, not in the result)


@dataclass
class RolloutTally:
    """Rollout tokens and time: where they were generated, turn times, the dedicated executors' throughput."""

    rollout_tokens: float = 0.0
    serving_tokens: float = 0.0  # rollout tokens generated on serving instances
    lane_pool_tokens: float = 0.0  # the lane pool's run: rollout tokens its lane instances generated
    rollout_work_s: float = 0.0  # seconds with a rollout turn queued or running somewhere
    device_s: float = 0.0  # instance-seconds of rollout forwards (prefill and decode), summed over instances
    lane_ceiling_s: float = 0.0  # over those seconds, the serving instances' lane shares at full quanta, summed (instance-seconds)
    turn_durations: list[float] = field(default_factory=list)  # every turn, route to result (rose bench e2e's turn_s_p50)
    ded_snapshots_tps: list[float] = field(default_factory=list)  # dedicated executors' snapshots while running rollout


@dataclass
class TurnOutcomes:
    """What happened to turn attempts: taken back, refused, prefix-cache hits, hedges."""

    interrupted: int = 0
    aborted: int = 0
    bounced: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    prefix_cached_tokens: float = 0.0  # of the later turns' first attempts: their prompt tokens found cached
    prefix_reusable_tokens: float = 0.0  # ... of the context the turn before computed (what a cache could serve)
    # prefill a later turn's first attempt redid because its prefix was not cached where it ran (moved
    # elsewhere, or evicted), priced alone on that instance's roofline: at most what a cache hit would save
    reprefill_s: float = 0.0
    reprefill_moved_s: float = 0.0  # the part of it whose turn ran elsewhere than the previous one (placement's, not eviction's)
    host_hits: int = 0  # of prefix_hits, restored from the instance's host tier
    host_load_s: float = 0.0  # the copies' seconds (each delays its turn; the device computes meanwhile)
    hedges: int = 0
    hedge_wins: int = 0


@dataclass
class ControlTally:
    """The control plane's actions: lease actions, parks, alerts, and the monitor's reasons not to lend."""

    granted: int = 0
    renewed: int = 0
    revoked: int = 0
    expired: int = 0
    parks: int = 0  # leases revoked on a burst, their turns parked rather than interrupted (Lease.park_until)
    alerts: int = 0
    unlendable: collections.Counter = field(default_factory=collections.Counter)  # the monitor's first reason, per executor-second

    def lease(self, kind: str) -> None:
        """One lease action of ``kind`` (granted, renewed, revoked, expired)."""
        setattr(self, kind, getattr(self, kind) + 1)


@dataclass
class Counters:
    """Everything the simulation counts for its result, by what it counts: serving SLO accounting,
    rollout tokens and turn times, turn outcomes, the control plane's actions, and the timeline.

    It exists to keep the run's output apart from its state: nothing in the simulation reads
    these back, so they can change nothing but the result.
    """

    serving: ServingTally = field(default_factory=ServingTally)
    rollout: RolloutTally = field(default_factory=RolloutTally)
    turns: TurnOutcomes = field(default_factory=TurnOutcomes)
    control: ControlTally = field(default_factory=ControlTally)
    timeline: dict[str, list] = field(default_factory=lambda: {k: [] for k in TIMELINE_FIELDS})
