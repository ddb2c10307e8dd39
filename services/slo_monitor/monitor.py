"""The monitor's state: one window, burst detector and step model per executor, fleet-wide views."""

from __future__ import annotations

import time

from rose.contracts.executor import MetricsSnapshot
from rose.contracts.slo import Headroom, SloAlert

from .bursts import BurstDetector
from .config import SloMonitorConfig
from .headroom import assess, fit_step_model, observations
from .windows import ExecutorWindow, fleet_stats


class Monitor:
    def __init__(self, config: SloMonitorConfig) -> None:
        self.config = config
        self.windows: dict[str, ExecutorWindow] = {}
        self.detectors: dict[str, BurstDetector] = {}
        self.alerts_sent = 0

    def observe(self, snapshot: MetricsSnapshot, now: float | None = None) -> SloAlert | None:
        """Take in a snapshot; returns an alert to publish at once, if the executor is bursting."""
        now = time.time() if now is None else now
        c = self.config
        ex = snapshot.executor_id
        window = self.windows.setdefault(ex, ExecutorWindow(c.windows.long_s))
        window.add(snapshot, now)
        if snapshot.role == "dedicated":
            return None  # no serving SLO at stake
        detector = self.detectors.setdefault(ex, BurstDetector(ex, c.bursts, c.headroom, c.windows.short_s))
        alert = detector.observe(window, now)
        if alert is not None:
            self.alerts_sent += 1
        return alert

    def live(self, now: float) -> list[str]:
        stale = self.config.windows.stale_s
        return [ex for ex, w in self.windows.items() if now - w.received_at <= stale]

    def headroom(self, executor_id: str, now: float) -> Headroom:
        c = self.config
        window = self.windows[executor_id]
        latest = window.latest
        assert latest is not None
        short, long = window.stats(c.windows.short_s), window.stats()
        detector = self.detectors.get(executor_id)
        alerting = detector.state.alerting if detector else False
        if latest.role == "dedicated":
            slots, kv, share, lendable, reason = c.headroom.max_rollout_slots, 0, 1.0, True, "dedicated rollout executor"
        else:
            model = fit_step_model(observations(list(window.snapshots)), short.tpot_p99_ms or c.headroom.slo_tpot_ms / 4)
            v = assess(short, long, model, latest, c.headroom, alerting)
            slots, kv, share, lendable, reason = v.slots, v.kv_bytes, v.compute_share, v.lendable, v.reason
        device = latest.device
        return Headroom(
            executor_id=executor_id,
            at=now,
            kv_bytes=kv,
            compute_share=share,
            rollout_batch_slots=slots,
            ttft_p99_ms=short.ttft_p99_ms,
            tpot_p99_ms=short.tpot_p99_ms,
            slo_ttft_ms=c.headroom.slo_ttft_ms,
            slo_tpot_ms=c.headroom.slo_tpot_ms,
            arrival_rate_rps=short.arrival_rate_rps,
            serving_queue=latest.serving_queue,
            role=latest.role,
            lendable=lendable,
            reason=reason,
            ttft_p99_long_ms=long.ttft_p99_ms,
            tpot_p99_long_ms=long.tpot_p99_ms,
            arrival_rate_long_rps=long.arrival_rate_rps,
            kv_utilisation=min(1.0, short.kv_utilisation),
            compute_utilisation=short.compute_utilisation,
            rollout_running=latest.rollout_running,
            rollout_queue=latest.rollout_queue,
            rollout_tokens_per_s=long.rollout_tokens_per_s_peak,
            rollout_prefill_tokens_per_s=latest.rollout_prefill_tokens_per_s,
            device_kind=device.kind if device else "",
            device_name=device.name if device else "",
            device_memory_bytes=device.memory_total_bytes if device else 0,
        )

    def fleet_load(self) -> dict[str, float]:
        """Fleet-wide figures for the heartbeat (sketches merged across executors)."""
        if not self.windows:
            return {}
        s = fleet_stats(self.windows.values(), self.config.windows.short_s)
        return {
            "executors": float(len(self.windows)),
            "ttft_p99_ms": round(s.ttft_p99_ms, 2),
            "tpot_p99_ms": round(s.tpot_p99_ms, 2),
            "arrival_rate_rps": round(s.arrival_rate_rps, 2),
            "alerts_sent": float(self.alerts_sent),
        }
