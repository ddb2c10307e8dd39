"""Early burst detection per executor, before latency is already past the SLO.

Three signals, checked on every snapshot as it arrives (so an alert goes out at once):
- arrival rate: arrivals over the last `window_s` against what the long-window baseline
  rate (the history before them, at least `min_baseline_s`) predicts for that span: a burst
  is `rate_ratio` x the expectation and a count Poisson noise reaches at most
  `false_alarms_per_hour`, tested over `window_s` and twice and four times it at each
  snapshot (shared/bursts.py burst_threshold, RATE_WINDOWS: the executor's test);
- queue growth: the serving queue is at least `queue_threshold`, grew since the last
  snapshot and is projected to wait `risk_fraction` of the TTFT SLO (shared/bursts.py
  `queue_at_risk`: a count alone is Poisson noise at an ordinary load);
- latency risk: short-window p99 TTFT or TPOT above `risk_fraction` x SLO ("violation"
  once it is past the SLO itself).
While any signal holds, the alert is repeated every `realert_s`; after `recover_s` of calm a
"recovered" alert is sent once. The detector is a plain object: tests feed it snapshots.

How early is possible: arrivals are the evidence, so detection time is bounded by how many
arrivals it takes to tell a burst from Poisson noise. Measured on seeded Poisson traffic with
0.1 s snapshots and a 3x burst: at 8 req/s the 0.25 s window detects in ~300 ms median
(~1 s p90); at 20 req/s ~300 ms median (~400 ms p90). A CUSUM of the Poisson likelihood ratio
was tried in its place and was no faster at the same false-alarm rate. Serving latency does
not wait for this: the executor yields rollout compute within one quantum of every serving
arrival on its own; the alert takes back the lease (memory, routing) after detection.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rose.contracts.slo import AlertSeverity, SloAlert
from rose.shared.bursts import BurstSettings, burst_threshold, queue_at_risk, rate_windows

from .config import HeadroomSettings
from .windows import ExecutorWindow, WindowStats, stats_of


@dataclass
class BurstState:
    alerting: bool = False
    last_alert_at: float = 0.0
    calm_since: float = 0.0
    last_queue: int = 0


def signals(window: ExecutorWindow, cfg: BurstSettings, slo: HeadroomSettings, short: WindowStats) -> tuple[AlertSeverity, str] | None:
    """(severity, reason) of the strongest signal in the window now (``short``: its short-window stats), or None when calm."""
    latest = window.latest
    if latest is None:
        return None
    snaps = window.snapshots
    previous = snaps[-2].serving_queue if len(snaps) > 1 else 0
    return classify(
        short,
        lambda: [stats_of(window.recent(s), latency=False) for s in rate_windows(cfg)],
        lambda: stats_of(window.older_than(rate_windows(cfg)[-1]), latency=False),
        latest.serving_queue,
        previous,
        cfg,
        slo,
        latest.serving_queue_wait_ms,
    )


def classify(
    short: WindowStats,
    recent: Sequence[WindowStats] | Callable[[], Sequence[WindowStats]],
    baseline: WindowStats | Callable[[], WindowStats],
    queue: int,
    previous_queue: int,
    cfg: BurstSettings,
    slo: HeadroomSettings,
    queue_wait_ms: float | None = None,
) -> tuple[AlertSeverity, str] | None:
    """The signals as a pure function of window figures (the simulator calls this too).

    ``short``: the short window (latency); ``recent`` / ``baseline``: the windows of arrivals
    tested (shared/bursts.py ``rate_windows``) and the history before the longest (or callables computing them,
    only if needed);
    ``queue`` / ``previous_queue``: the serving queue in the latest and the previous snapshot;
    ``queue_wait_ms``: the latest's projected wait of its last queued first token (None: unknown).
    """
    if short.ttft_p99_ms > slo.slo_ttft_ms or short.tpot_p99_ms > slo.slo_tpot_ms:
        return "violation", f"p99 ttft {short.ttft_p99_ms:.0f} ms / tpot {short.tpot_p99_ms:.1f} ms past the SLO"
    recent = recent() if callable(recent) else recent
    baseline = baseline() if callable(baseline) else baseline
    tested = [w for w in recent if w.span_s > 0]
    if baseline.span_s >= cfg.min_baseline_s and tested:
        base_rate = max(baseline.arrival_rate_rps, cfg.min_baseline_rps)
        for w in tested:
            tests_per_hour = 3600.0 * w.snapshots / w.span_s * len(tested)  # each window, at each snapshot
            if w.arrivals >= burst_threshold(base_rate * w.span_s, tests_per_hour, cfg):
                return "burst", f"arrival rate {w.arrival_rate_rps:.1f}/s vs baseline {base_rate:.1f}/s"
    if queue_at_risk(queue, previous_queue, queue_wait_ms, slo.slo_ttft_ms, cfg):
        return "burst", f"serving queue growing: {previous_queue} -> {queue}"
    if short.ttft_p99_ms > cfg.risk_fraction * slo.slo_ttft_ms or short.tpot_p99_ms > cfg.risk_fraction * slo.slo_tpot_ms:
        return "burst", f"p99 ttft {short.ttft_p99_ms:.0f} ms / tpot {short.tpot_p99_ms:.1f} ms near the SLO"
    return None


def next_alert(st: BurstState, found: tuple[AlertSeverity, str] | None, now: float, cfg: BurstSettings) -> tuple[AlertSeverity, str] | None:
    """The alert's (severity, reason) to send now, if any, given this snapshot's signal; updates ``st``."""
    if found is not None:
        st.calm_since = now
        if not st.alerting or now - st.last_alert_at >= cfg.realert_s:
            st.alerting, st.last_alert_at = True, now
            return found
        return None
    if st.alerting and now - st.calm_since >= cfg.recover_s:
        st.alerting = False
        return "recovered", f"calm for {cfg.recover_s:.1f}s"
    return None


class BurstDetector:
    def __init__(self, executor_id: str, cfg: BurstSettings, slo: HeadroomSettings, short_s: float) -> None:
        self.executor_id = executor_id
        self.cfg, self.slo, self.short_s = cfg, slo, short_s
        self.state = BurstState()

    def observe(self, window: ExecutorWindow, now: float) -> SloAlert | None:
        """The alert to publish now, if any (called on every new snapshot of this executor)."""
        st = self.state
        short = window.stats(self.short_s)
        found = signals(window, self.cfg, self.slo, short)
        latest = window.latest
        assert latest is not None
        common = dict(
            executor_id=self.executor_id,
            at=now,
            arrival_rate_rps=stats_of(window.recent(self.cfg.window_s), latency=False).arrival_rate_rps,
            serving_queue=latest.serving_queue,
            ttft_p99_ms=short.ttft_p99_ms,
            tpot_p99_ms=short.tpot_p99_ms,
        )
        decided = next_alert(st, found, now, self.cfg)
        if decided is None:
            return None
        return SloAlert(severity=decided[0], reason=decided[1], **common)  # type: ignore[arg-type]
