"""The headroom model: how much rollout an executor can take and stay below its SLOs with a margin.

Model. A decode step of a co-serving executor takes

    step_ms = base + per_serving * serving_batch + per_rollout * rollout_batch

(measured decode time is close to linear in batch composition; the serving batch's time per
output token *is* this step time, since every running serving sequence gets one token per
step). Each metrics interval is one observation: (serving_running, rollout_running, mean
TPOT of that interval). The coefficients are a least-squares fit over the long window with a
small ridge pull towards a prior (so a window with no rollout variation cannot invent a
coefficient), and slopes clipped at zero.

Headroom. With the serving batch at its peak of the long window (plus one request of
slack), the rollout batch slots are the largest n with

    base + per_serving * (peak + 1) + per_rollout * n  <=  margin * SLO_tpot

capped at `max_rollout_slots`. TTFT is guarded by measurement instead of the model: an
executor is *lendable* only when short- and long-window p99 TPOT is under `grant_fraction`
x SLO and p99 TTFT under `ttft_grant_fraction` x SLO (the executor's own TTFT setpoint: a
lease adds at most a quantum to a first token, and the executor pauses rollout before a first
token passes its setpoint), the serving queue's last first token is projected under that same
gate (``serving_queue_long``) and the model leaves at least one slot.
KV lent is the smaller of `max_lend_kv_bytes` and the executor's rollout pool (or, where it reserves
none, `lend_memory_fraction` of the device memory not in use), halved when the serving pool is above its
high-water mark (``lendable_kv_bytes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rose.contracts.executor import MetricsSnapshot
from rose.contracts.slo import GUARD_SETPOINT

from .config import HeadroomSettings
from .windows import WindowStats

RIDGE = 1e-2  # strength of the pull towards the prior, relative to the data
PRIOR_PER_SERVING_MS = 0.5
PRIOR_PER_ROLLOUT_MS = 0.5
MIN_OBSERVATIONS = 3


@dataclass(frozen=True)
class StepModel:
    base_ms: float
    per_serving_ms: float
    per_rollout_ms: float
    observations: int

    def predict(self, serving_batch: float, rollout_batch: float) -> float:
        return self.base_ms + self.per_serving_ms * serving_batch + self.per_rollout_ms * rollout_batch


def observations(snapshots: list[MetricsSnapshot]) -> list[tuple[float, float, float]]:
    """(serving batch, rollout batch, mean TPOT ms) of every interval that measured TPOT."""
    out = []
    for s in snapshots:
        if s.tpot_ms.count > 0:
            out.append((float(s.serving_running), float(s.rollout_running), s.tpot_ms.sum / s.tpot_ms.count))
    return out


def fit_step_model(obs: list[tuple[float, float, float]], fallback_tpot_ms: float) -> StepModel:
    """Ridge least squares of step time on batch composition; the prior alone when data is thin."""
    if len(obs) < MIN_OBSERVATIONS:
        base = min((o[2] for o in obs), default=fallback_tpot_ms)
        return StepModel(base, PRIOR_PER_SERVING_MS, PRIOR_PER_ROLLOUT_MS, len(obs))
    a = np.array([[1.0, s, r] for s, r, _ in obs])
    y = np.array([t for _, _, t in obs])
    prior = np.array([float(np.min(y)), PRIOR_PER_SERVING_MS, PRIOR_PER_ROLLOUT_MS])
    lam = RIDGE * len(obs)
    coef = np.linalg.solve(a.T @ a + lam * np.eye(3), a.T @ y + lam * prior)
    base, per_s, per_r = float(coef[0]), max(0.0, float(coef[1])), max(0.0, float(coef[2]))
    return StepModel(max(0.0, base), per_s, per_r, len(obs))


def rollout_slots(model: StepModel, serving_peak: int, slo_tpot_ms: float, margin: float, max_slots: int) -> int:
    """The largest rollout batch the model predicts keeps TPOT under margin x SLO."""
    budget = margin * slo_tpot_ms - model.predict(serving_peak + 1, 0.0)
    if budget <= 0:
        return 0
    if model.per_rollout_ms <= 1e-9:
        return max_slots
    return max(0, min(max_slots, math.floor(budget / model.per_rollout_ms)))


@dataclass(frozen=True)
class HeadroomVerdict:
    slots: int
    kv_bytes: int
    compute_share: float
    lendable: bool
    reason: str


def lendable_kv_bytes(latest: MetricsSnapshot | None, kv_utilisation: float, cfg: HeadroomSettings) -> int:
    """KV a lease may hold there: the rollout pool the executor reserved, whole (an engine preallocates it inside
    its memory budget, which already keeps the activation workspace and the allocator's margin out: shared/devices.py
    ``usable_bytes``); where it reserves none (an SGLang policy server between leases has released its memory),
    ``lend_memory_fraction`` of the device memory not in use, which an allocation must fit into beside its
    workspace. Capped by ``max_lend_kv_bytes``; halved while the serving pool is above its high-water mark."""
    kv = cfg.max_lend_kv_bytes
    pool = latest.rollout_pool if latest else None
    device = latest.device if latest else None
    if pool is not None and pool.total_blocks > 0:
        kv = min(kv, pool.total_blocks * pool.block_bytes)
    elif device and device.memory_total_bytes:
        free = max(0, device.memory_total_bytes - device.memory_used_bytes)
        kv = min(kv, int(free * cfg.lend_memory_fraction))
    if kv_utilisation > cfg.kv_high_water:
        kv //= 2
    return kv


def serving_queue_long(short: WindowStats, limit_ttft_ms: float, cfg: HeadroomSettings) -> bool:
    """Too long a serving queue to lend beside: its last first token is projected past the TTFT gate
    (``limit_ttft_ms``, as the p99 is judged); where the executor cannot project it, more than
    ``max_serving_queue`` waiting. A count alone refuses on Poisson noise (shared/bursts.py queue_at_risk)."""
    if short.serving_queue_wait_ms is None:
        return short.serving_queue > cfg.max_serving_queue
    return short.serving_queue > 0 and short.serving_queue_wait_ms >= limit_ttft_ms


def assess(
    short: WindowStats, long: WindowStats, model: StepModel, latest: MetricsSnapshot | None, cfg: HeadroomSettings, alerting: bool
) -> HeadroomVerdict:
    """Headroom of one serving executor from its windows and step model (see the module doc)."""
    slots = rollout_slots(model, long.serving_running_peak, cfg.slo_tpot_ms, cfg.margin, cfg.max_rollout_slots)
    kv = lendable_kv_bytes(latest, short.kv_utilisation, cfg) if slots else 0
    share = slots / cfg.max_rollout_slots
    # a co-batched executor's rows raise serving's TPOT to its guard's setpoint by design: judged against that, not
    # against "well below" (the two-model grant fraction), or its every lease would look unhealthy and be revoked
    co_batched = latest is not None and latest.rollout_mode == "co_batched"
    limit_ttft = cfg.ttft_grant_fraction * cfg.slo_ttft_ms
    limit_tpot = (max(cfg.grant_fraction, GUARD_SETPOINT) if co_batched else cfg.grant_fraction) * cfg.slo_tpot_ms
    reasons = []
    if alerting:
        reasons.append("burst alert active")
    if max(short.ttft_p99_ms, long.ttft_p99_ms) > limit_ttft:
        reasons.append(f"ttft p99 {max(short.ttft_p99_ms, long.ttft_p99_ms):.0f} ms > {limit_ttft:.0f} ms")
    if max(short.tpot_p99_ms, long.tpot_p99_ms) > limit_tpot:
        reasons.append(f"tpot p99 {max(short.tpot_p99_ms, long.tpot_p99_ms):.1f} ms > {limit_tpot:.1f} ms")
    if serving_queue_long(short, limit_ttft, cfg):
        reasons.append(f"serving queue {short.serving_queue}")
    if slots == 0:
        reasons.append("step model leaves no rollout slot")
    if kv == 0 and slots:
        reasons.append("no memory to lend")
    lendable = not reasons
    return HeadroomVerdict(slots, kv, share, lendable, "well below SLO" if lendable else "; ".join(reasons))
