"""The SLO monitor's configuration (TOML + ROSE_*, see shared/config.py)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from rose.contracts.slo import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS
from rose.shared.bursts import BurstSettings
from rose.shared.config import BusConfig, PositiveSeconds, RuntimeConfig

Positive = Annotated[float, msgspec.Meta(gt=0.0)]
Share = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
MIB = 1 << 20


class WindowSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    short_s: PositiveSeconds = 3.0  # what "now" means for latency and load
    long_s: PositiveSeconds = 30.0  # the baseline bursts are told apart from, and the step-model fit
    stale_s: PositiveSeconds = 5.0  # an executor silent this long gets no headroom


class HeadroomSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The headroom model's knobs (see headroom.py for the model)."""

    slo_ttft_ms: Positive = DEFAULT_SLO_TTFT_MS
    slo_tpot_ms: Positive = DEFAULT_SLO_TPOT_MS
    margin: Share = 0.7  # lend only what keeps predicted latency below margin x SLO
    grant_fraction: Share = 0.5  # "well below the SLO": p99 TPOT under this x SLO
    # p99 TTFT under this x SLO: a lease adds at most a rollout quantum to a first token (the executor yields at every
    # arrival and pauses rollout once a first token is projected past its setpoint, services/executor/slo_guard.py
    # SETPOINT = 0.8, of the SLO), so the gate is that setpoint; half the SLO kept every 70B serving instance from
    # lending (its p99 TTFT alone is 550-660 ms of 1000 at 0.35 load: the p99 prompt's prefill is 270 ms of it)
    ttft_grant_fraction: Share = 0.8
    max_rollout_slots: Annotated[int, msgspec.Meta(ge=1)] = 32
    max_lend_kv_bytes: Annotated[int, msgspec.Meta(ge=0)] = 256 * MIB
    lend_memory_fraction: Share = 0.5  # of the device memory not in use, where an executor reserves no rollout pool
    kv_high_water: Share = 0.8  # serving KV use above this halves what is lent
    max_serving_queue: Annotated[int, msgspec.Meta(ge=0)] = 2  # only where an executor cannot project its queue's wait


class SloMonitorConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    bus: BusConfig = msgspec.field(default_factory=BusConfig)
    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    windows: WindowSettings = msgspec.field(default_factory=WindowSettings)
    bursts: BurstSettings = msgspec.field(default_factory=BurstSettings)
    headroom: HeadroomSettings = msgspec.field(default_factory=HeadroomSettings)
    headroom_interval_s: PositiveSeconds = 1.0
