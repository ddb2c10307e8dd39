"""What the SLO monitor publishes: per-executor headroom and burst alerts."""

from __future__ import annotations

from typing import Literal

from .base import Fraction, Identifier, Message, NonNegFloat, NonNegInt, UnixSeconds
from .executor import ExecutorRole

AlertSeverity = Literal["burst", "violation", "recovered"]
# The serving SLO every service assumes unless configured: p99 time to first token and per output token.
DEFAULT_SLO_TTFT_MS = 500.0
DEFAULT_SLO_TPOT_MS = 100.0
# The executor's closed loop holds serving's short-window p99 at this share of the SLO (services/executor/slo_guard.py);
# the margin below 1 absorbs one window's reaction time. A co-batched executor's serving runs up to it by design.
GUARD_SETPOINT = 0.8


class Headroom(Message):
    """How much rollout an executor can take now while keeping a margin below its SLOs.

    `rollout_batch_slots` comes from the monitor's step-time model (see
    `services/slo_monitor/headroom.py`); `lendable` is the monitor's verdict that latency is
    well below the SLO. The device fields and `rollout_tokens_per_s` (the best rollout
    throughput measured on this executor) let the scheduler weigh heterogeneous devices.
    """

    executor_id: Identifier
    at: UnixSeconds
    kv_bytes: NonNegInt
    compute_share: Fraction
    rollout_batch_slots: NonNegInt
    ttft_p99_ms: NonNegFloat
    tpot_p99_ms: NonNegFloat
    slo_ttft_ms: NonNegFloat
    slo_tpot_ms: NonNegFloat
    arrival_rate_rps: NonNegFloat
    serving_queue: NonNegInt
    role: ExecutorRole = "serving"
    lendable: bool = False
    reason: str = ""
    ttft_p99_long_ms: NonNegFloat = 0.0
    tpot_p99_long_ms: NonNegFloat = 0.0
    arrival_rate_long_rps: NonNegFloat = 0.0
    kv_utilisation: Fraction = 0.0
    compute_utilisation: Fraction = 0.0
    rollout_running: NonNegInt = 0
    rollout_queue: NonNegInt = 0
    rollout_tokens_per_s: NonNegFloat = 0.0
    # the executor's latest, timed by the wall clock (a lane's holds the serving forwards its rollout yielded to)
    rollout_prefill_tokens_per_s: NonNegFloat = 0.0
    device_kind: str = ""
    device_name: str = ""
    device_memory_bytes: NonNegInt = 0


class SloAlert(Message):
    """Serving latency is at risk on an executor: rollout there must yield now."""

    executor_id: Identifier
    at: UnixSeconds
    severity: AlertSeverity
    reason: str
    arrival_rate_rps: NonNegFloat = 0.0
    serving_queue: NonNegInt = 0
    ttft_p99_ms: NonNegFloat = 0.0
    tpot_p99_ms: NonNegFloat = 0.0
