"""The scheduler's configuration (TOML + ROSE_*, see shared/config.py)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from rose.shared.config import BusConfig, PositiveSeconds, RuntimeConfig

Share = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Positive = Annotated[float, msgspec.Meta(gt=0.0)]


class LeaseSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Lease policy. Grant below `grant` headroom (the monitor's `lendable`), keep up to `keep_fraction`
    x SLO: the gap between the two is the hysteresis that stops a lease from flapping."""

    ttl_s: PositiveSeconds = 10.0  # an executor enforces expiry on its own if renewals stop
    renew_before_s: PositiveSeconds = 4.0
    keep_fraction: Share = 0.8
    cooldown_s: PositiveSeconds = 5.0  # no new grant this long after an alert
    headroom_max_age_s: PositiveSeconds = 3.0  # older headroom neither grants nor renews
    min_slots: Annotated[int, msgspec.Meta(ge=1)] = 1


class PlacementSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    min_lease_left_s: PositiveSeconds = 1.0  # do not route a turn under a lease about to end
    overload_factor: Positive = 1.5  # affinity yields to load when load > slots x this
    inflight_ttl_s: PositiveSeconds = 120.0  # a routed turn never heard of again stops counting as load
    heartbeat_misses: Positive = 3.0  # an executor is gone after this many missed heartbeats
    no_route_retry_s: PositiveSeconds = 0.5
    hedge_group_done: Share = 0.75  # hedge stragglers once this share of their group is done ...
    hedge_after_typical: Positive = 1.5  # ... and the turn has run this x the typical turn time
    hedge_always_after_typical: Positive = 4.0  # any turn this far past typical is hedged


class SchedulerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    bus: BusConfig = msgspec.field(default_factory=BusConfig)
    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    leases: LeaseSettings = msgspec.field(default_factory=LeaseSettings)
    placement: PlacementSettings = msgspec.field(default_factory=PlacementSettings)
    tick_s: PositiveSeconds = 0.5  # how often leases are re-planned
    seed: int = 0  # of random routing (the baseline)
