"""Sliding windows of metrics snapshots: merged latency sketches, arrival rates, queues, utilisation.

Executors publish one snapshot per interval with that interval's DDSketches; merging the
sketches of every snapshot in a window gives exact (to the sketch's relative accuracy)
quantiles over the window, per executor and fleet-wide, without keeping raw latencies.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from ddsketch import DDSketch
from ddsketch.mapping import LogarithmicMapping

from rose.contracts.executor import LatencySketch, MetricsSnapshot
from rose.shared.sketch import from_contract, new_sketch


@dataclass(frozen=True, kw_only=True)
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
    serving_queue_wait_ms: float | None = None  # the latest's projected wait of its last queued first token (None: unknown)


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


@lru_cache(maxsize=8)
def _mapping(relative_accuracy: float) -> LogarithmicMapping:
    return LogarithmicMapping(relative_accuracy)  # what DDSketch(relative_accuracy) maps with


class BinSum:
    """A running sum of sketches' bins: add and subtract whole sketches, read a quantile.

    Why not DDSketch objects: rebuilding one per snapshot and merging every window on every
    snapshot cost the monitor ~6 ms per executor-second (a 1,000-executor fleet would need six
    cores). Bins add exactly, so a window keeps its sum and subtracts what leaves it; the
    quantile is read as DDSketch reads it (same rank rule, same key-to-value mapping).
    """

    __slots__ = ("bins", "count", "zero_count", "relative_accuracy")

    def __init__(self) -> None:
        self.bins: dict[int, float] = {}
        self.count = 0.0
        self.zero_count = 0.0
        self.relative_accuracy = 0.0

    def add(self, sketch: LatencySketch, sign: float = 1.0) -> None:
        if not sketch.count:
            return
        if self.relative_accuracy and sketch.relative_accuracy != self.relative_accuracy:
            raise ValueError(f"cannot merge sketches of relative accuracy {sketch.relative_accuracy} and {self.relative_accuracy}")
        self.relative_accuracy = sketch.relative_accuracy
        self.count += sign * sketch.count
        self.zero_count += sign * sketch.zero_count
        bins = self.bins
        for key, c in sketch.bins.items():
            left = bins.get(key, 0.0) + sign * c
            if left > 1e-9:
                bins[key] = left
            else:
                bins.pop(key, None)
        if self.count < 1e-9:
            self.bins.clear()
            self.count = self.zero_count = 0.0

    def quantile(self, q: float) -> float:
        if self.count < 1e-9:
            return 0.0
        rank = q * (self.count - 1)
        if rank < self.zero_count:
            return 0.0
        rank -= self.zero_count
        running, key = 0.0, 0
        for key in sorted(self.bins):
            running += self.bins[key]
            if running > rank:
                break
        return float(_mapping(self.relative_accuracy).value(key))


def _sums(snapshots: Iterable[MetricsSnapshot]) -> tuple[BinSum, BinSum]:
    ttft, tpot = BinSum(), BinSum()
    for s in snapshots:
        ttft.add(s.ttft_ms)
        tpot.add(s.tpot_ms)
    return ttft, tpot


def stats_of(snapshots: list[MetricsSnapshot], *, latency: bool = True, sums: tuple[BinSum, BinSum] | None = None) -> WindowStats:
    """Merge a list of snapshots (oldest first) into one window's figures.

    ``latency=False`` skips the sketches (the burst test needs only arrivals and spans);
    ``sums`` are the window's bin sums when the caller keeps them running.
    """
    ttft, tpot = (sums or _sums(snapshots)) if latency else (BinSum(), BinSum())
    span = sum(s.interval_s for s in snapshots)
    arrivals = sum(s.serving_arrivals for s in snapshots)
    last = snapshots[-1] if snapshots else None
    pool = last.serving_pool if last else None
    return WindowStats(
        span_s=span,
        snapshots=len(snapshots),
        ttft_p99_ms=ttft.quantile(0.99),
        tpot_p99_ms=tpot.quantile(0.99),
        ttft_count=ttft.count,
        arrival_rate_rps=arrivals / span if span > 0 else 0.0,
        arrivals=arrivals,
        serving_queue=last.serving_queue if last else 0,
        serving_running_peak=max((s.serving_running for s in snapshots), default=0),
        rollout_tokens_per_s_peak=max((s.rollout_tokens_per_s for s in snapshots), default=0.0),
        kv_utilisation=(pool.used_blocks / pool.total_blocks) if pool and pool.total_blocks else 0.0,
        compute_utilisation=min(1.0, last.device.utilization) if last and last.device else 0.0,
        serving_queue_wait_ms=last.serving_queue_wait_ms if last else None,
    )


class ExecutorWindow:
    """The snapshots of one executor over the long window, by the executor's own clock (`at`)."""

    def __init__(self, long_s: float) -> None:
        self.long_s = long_s
        self.snapshots: deque[MetricsSnapshot] = deque()
        self.received_at = 0.0  # local clock of the last snapshot, for staleness
        self.sums = (BinSum(), BinSum())  # TTFT and TPOT bins of every snapshot in the deque

    def add(self, snapshot: MetricsSnapshot, received_at: float) -> None:
        if self.snapshots and snapshot.at < self.snapshots[-1].at:
            return  # a replay or reordering: windows are built from newer data only
        self.snapshots.append(snapshot)
        self.sums[0].add(snapshot.ttft_ms)
        self.sums[1].add(snapshot.tpot_ms)
        self.received_at = received_at
        while self.snapshots and snapshot.at - self.snapshots[0].at > self.long_s:
            gone = self.snapshots.popleft()
            self.sums[0].add(gone.ttft_ms, -1.0)
            self.sums[1].add(gone.tpot_ms, -1.0)

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

    def stats(self, seconds: float | None = None, *, latency: bool = True) -> WindowStats:
        if seconds is None:
            return stats_of(list(self.snapshots), latency=latency, sums=self.sums)
        return stats_of(self.recent(seconds), latency=latency)


def fleet_stats(windows: Iterable[ExecutorWindow], seconds: float) -> WindowStats:
    """Fleet-wide: the union of every executor's recent snapshots, sketches merged."""
    everything: list[MetricsSnapshot] = []
    for w in windows:
        everything.extend(w.recent(seconds))
    everything.sort(key=lambda s: s.at)
    stats = stats_of(everything)
    # arrival rate of a fleet is the sum over executors, not the mean over their intervals
    per_exec = [stats_of(w.recent(seconds), latency=False).arrival_rate_rps for w in windows]
    return WindowStats(**{**stats.__dict__, "arrival_rate_rps": sum(per_exec)})
