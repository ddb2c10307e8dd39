"""What the SLO monitor publishes: per-executor headroom and burst alerts."""

from __future__ import annotations

from typing import Literal

from .base import Fraction, Identifier, Message, NonNegFloat, NonNegInt, UnixSeconds


class Headroom(Message):
    """How much rollout an executor can take now while keeping a margin below its SLOs."""

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


class SloAlert(Message):
    """Serving latency is at risk on an executor: rollout there must yield now."""

    executor_id: Identifier
    at: UnixSeconds
    severity: Literal["burst", "violation", "recovered"]
    reason: str
    arrival_rate_rps: NonNegFloat = 0.0
    serving_queue: NonNegInt = 0
    ttft_p99_ms: NonNegFloat = 0.0
    tpot_p99_ms: NonNegFloat = 0.0
