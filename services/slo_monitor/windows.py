"""Sliding windows of metrics snapshots: merged latency sketches, arrival rates, queues, utilisation.

Executors publish one snapshot per interval with that interval's DDSketches; merging the
sketches of every snapshot in a window gives exact (to the sketch's relative accuracy)
quantiles over the window, per executor and fleet-wide, without keeping raw latencies.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from ddsketch import DDSketch

from rose.contracts.executor import MetricsSnapshot
from rose.shared.sketch import from_contract, new_sketch


@dataclass(frozen=True)
class WindowStats:
    """What a window of snapshots says; latencies in ms, rates per second."""

    span_s: float
    snapshots: int
    ttft_p99_ms: float
    tpot_p99_ms: float
    ttft_count: float
    arrival_rate_rps: float
    arrivals: int
    serving_queue: int  # the latest
    serving_running_peak: int
    rollout_tokens_per_s_peak: float
    kv_utilisation: float  # serving pool, latest
    compute_utilisation: float  # device, latest


def merged(snapshots: Iterable[MetricsSnapshot]) -> tuple[DDSketch, DDSketch]:
    ttft, tpot = new_sketch(), new_sketch()
    for s in snapshots:
        if s.ttft_ms.count:
            ttft.merge(from_contract(s.ttft_ms))
        if s.tpot_ms.count:
            tpot.merge(from_contract(s.tpot_ms))
    return ttft, tpot


def p99(sketch: DDSketch) -> float:
    return float(sketch.get_quantile_value(0.99) or 0.0) if sketch.count else 0.0


def stats_of(snapshots: list[MetricsSnapshot]) -> WindowStats:
    """Merge a list of snapshots (oldest first) into one window's figures."""
    ttft, tpot = merged(snapshots)
    span = sum(s.interval_s for s in snapshots)
    arrivals = sum(s.serving_arrivals for s in snapshots)
    last = snapshots[-1] if snapshots else None
    pool = last.serving_pool if last else None
    return WindowStats(
        span_s=span,
        snapshots=len(snapshots),
        ttft_p99_ms=p99(ttft),
        tpot_p99_ms=p99(tpot),
        ttft_count=ttft.count,
        arrival_rate_rps=arrivals / span if span > 0 else 0.0,
        arrivals=arrivals,
        serving_queue=last.serving_queue if last else 0,
        serving_running_peak=max((s.serving_running for s in snapshots), default=0),
        rollout_tokens_per_s_peak=max((s.rollout_tokens_per_s for s in snapshots), default=0.0),
        kv_utilisation=(pool.used_blocks / pool.total_blocks) if pool and pool.total_blocks else 0.0,
        compute_utilisation=min(1.0, last.device.utilization) if last and last.device else 0.0,
    )


class ExecutorWindow:
    """The snapshots of one executor over the long window, by the executor's own clock (`at`)."""

    def __init__(self, long_s: float) -> None:
        self.long_s = long_s
        self.snapshots: deque[MetricsSnapshot] = deque()
        self.received_at = 0.0  # local clock of the last snapshot, for staleness

    def add(self, snapshot: MetricsSnapshot, received_at: float) -> None:
        if self.snapshots and snapshot.at < self.snapshots[-1].at:
            return  # a replay or reordering: windows are built from newer data only
        self.snapshots.append(snapshot)
        self.received_at = received_at
        while self.snapshots and snapshot.at - self.snapshots[0].at > self.long_s:
            self.snapshots.popleft()

    @property
    def latest(self) -> MetricsSnapshot | None:
        return self.snapshots[-1] if self.snapshots else None

    def recent(self, seconds: float) -> list[MetricsSnapshot]:
        """Snapshots whose interval ended within `seconds` of the newest one."""
        if not self.snapshots:
            return []
        newest = self.snapshots[-1].at
        return [s for s in self.snapshots if newest - s.at < seconds]

    def older_than(self, seconds: float) -> list[MetricsSnapshot]:
        if not self.snapshots:
            return []
        newest = self.snapshots[-1].at
        return [s for s in self.snapshots if newest - s.at >= seconds]

    def stats(self, seconds: float | None = None) -> WindowStats:
        return stats_of(list(self.snapshots) if seconds is None else self.recent(seconds))


def fleet_stats(windows: Iterable[ExecutorWindow], seconds: float) -> WindowStats:
    """Fleet-wide: the union of every executor's recent snapshots, sketches merged."""
    everything: list[MetricsSnapshot] = []
    for w in windows:
        everything.extend(w.recent(seconds))
    everything.sort(key=lambda s: s.at)
    stats = stats_of(everything)
    # arrival rate of a fleet is the sum over executors, not the mean over their intervals
    per_exec = [stats_of(w.recent(seconds)).arrival_rate_rps for w in windows]
    return WindowStats(**{**stats.__dict__, "arrival_rate_rps": sum(per_exec)})
