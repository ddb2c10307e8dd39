"""The scheduler's configuration (TOML + ROSE_*, see shared/config.py)."""

from __future__ import annotations

from typing import Annotated, Literal

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
    sample_candidates: Annotated[int, msgspec.Meta(ge=0)] = 32  # per role, at fleet scale (Fleet.sampled); 0: every executor
    hedge_group_done: Share = 0.75  # hedge stragglers once this share of their group is done ...
    hedge_after_typical: Positive = 1.5  # ... and the turn has run this x the typical turn time
    hedge_always_after_typical: Positive = 4.0  # any turn this far past typical is hedged


class LendingSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Which policy lends serving executors to rollout (`mode`; the decisions are in leases.py):

    - `rose` (default): fine-grained leases sized by the monitor's headroom, renewed while latency
      stays under `leases.keep_fraction` x SLO, revoked on that executor's own alerts;
    - `none`: serving executors are never lent; rollout runs on dedicated executors only (the
      static, resource-fixed baseline);
    - `always`: every live serving executor holds a whole lease (`whole_batch` slots, its whole
      rollout pool) that alerts never revoke (the naive share-everything baseline; pair it with
      the executor's `engine.policy = "naive_share"`);
    - `elastic_baseline`: existing elastic RL systems' coarse lending: a serving executor is lent
      whole only after its headroom has said `lendable` for `idle_s`, at most until `min_serving`
      executors are left unlent, renewed without looking at latency; any alert on any executor
      while leases are held revokes every serving lease at once (whole-job preemption) and
      nothing is lent for `cooldown_s` after that.
    """

    mode: Literal["rose", "none", "always", "elastic_baseline"] = "rose"
    idle_s: PositiveSeconds = 20.0  # elastic_baseline: lendable this long before a lend
    cooldown_s: PositiveSeconds = 30.0  # elastic_baseline: fleet-wide, after a whole-job preemption
    min_serving: Annotated[int, msgspec.Meta(ge=0)] = 1  # elastic_baseline: serving executors never lent
    whole_batch: Annotated[int, msgspec.Meta(ge=1)] = 32  # always / elastic_baseline: rollout slots of a whole lease
    whole_kv_mib: Positive = 4096.0  # always / elastic_baseline: KV of a whole lease (each executor clamps to its rollout pool)


class SchedulerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    bus: BusConfig = msgspec.field(default_factory=BusConfig)
    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    leases: LeaseSettings = msgspec.field(default_factory=LeaseSettings)
    placement: PlacementSettings = msgspec.field(default_factory=PlacementSettings)
    lending: LendingSettings = msgspec.field(default_factory=LendingSettings)
    tick_s: PositiveSeconds = 0.5  # how often leases are re-planned
    seed: int = 0  # of random routing (the baseline)
