"""The SLO monitor's metrics: alerts, and per executor the latency it sees, the SLO and the headroom it grants."""

from __future__ import annotations

from rose.contracts.executor import MetricsSnapshot
from rose.contracts.slo import Headroom, SloAlert
from rose.shared.metrics import meter, metric_name

LATE_GRACE_S = 0.25  # clock skew and bus time a snapshot may take before it counts as late


class MonitorMetrics:
    def __init__(self) -> None:
        m = meter()
        self.alerts = m.create_counter(
            metric_name("slo.alerts"), unit="{alert}", description="SLO alerts published, per executor and severity (burst, violation, recovered)."
        )
        self.ttft_p99 = m.create_gauge(metric_name("slo.ttft_p99"), unit="s", description="Serving TTFT p99 over the short window, per executor.")
        self.tpot_p99 = m.create_gauge(metric_name("slo.tpot_p99"), unit="s", description="Serving TPOT p99 over the short window, per executor.")
        self.ttft_target = m.create_gauge(metric_name("slo.ttft_target"), unit="s", description="The serving TTFT SLO the monitor protects.")
        self.tpot_target = m.create_gauge(metric_name("slo.tpot_target"), unit="s", description="The serving TPOT SLO the monitor protects.")
        self.arrival_rate = m.create_gauge(
            metric_name("slo.arrival_rate"), unit="{request}/s", description="Serving arrivals per second over the short window, per executor."
        )
        self.headroom_kv = m.create_gauge(metric_name("slo.headroom_kv"), unit="By", description="KV bytes the executor can lend to rollout now.")
        self.headroom_slots = m.create_gauge(
            metric_name("slo.headroom_slots"), unit="{sequence}", description="Rollout batch slots the executor can take now."
        )
        self.lendable = m.create_gauge(metric_name("slo.lendable"), description="1 when the monitor judges the executor lendable to rollout, else 0.")
        self.snapshots = m.create_counter(
            metric_name("slo.snapshots"), unit="{snapshot}", description="Executor metrics snapshots merged into the windows."
        )
        self.snapshots_late = m.create_counter(
            metric_name("slo.snapshots_late"),
            unit="{snapshot}",
            description="Snapshots merged more than one interval after they were taken (the monitor falls behind).",
        )
        self.snapshots.add(0)
        self.snapshots_late.add(0)

    def headroom(self, h: Headroom) -> None:
        ex = {"executor": h.executor_id, "role": h.role}
        for severity in ("burst", "violation", "recovered"):  # at 0 per executor: a dashboard shows 0, not "No data"
            self.alerts.add(0, {"executor": h.executor_id, "severity": severity})
        self.ttft_p99.set(h.ttft_p99_ms / 1e3, ex)
        self.tpot_p99.set(h.tpot_p99_ms / 1e3, ex)
        self.ttft_target.set(h.slo_ttft_ms / 1e3)
        self.tpot_target.set(h.slo_tpot_ms / 1e3)
        self.arrival_rate.set(h.arrival_rate_rps, ex)
        self.headroom_kv.set(h.kv_bytes, ex)
        self.headroom_slots.set(h.rollout_batch_slots, ex)
        self.lendable.set(1 if h.lendable else 0, ex)

    def snapshot(self, snapshot: MetricsSnapshot, now: float) -> None:
        """Count a merged snapshot, and whether it came in late (its age past one interval plus a grace)."""
        self.snapshots.add(1)
        if now - snapshot.at > snapshot.interval_s + LATE_GRACE_S:
            self.snapshots_late.add(1)

    def alert(self, alert: SloAlert) -> None:
        self.alerts.add(1, {"executor": alert.executor_id, "severity": alert.severity})
