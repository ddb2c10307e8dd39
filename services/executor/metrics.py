"""Engine metrics: mergeable latency sketches and the stats snapshot.

TTFT and TPOT go into DDSketches (relative-accuracy quantiles that merge exactly by
adding bucket counts), one pair per reporting interval: ``take_interval`` hands back the
interval's sketches as plain dicts (same fields as ``contracts.executor.LatencySketch``)
and starts new ones, so the SLO monitor can merge executors and windows.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from ddsketch import DDSketch

from rose.shared.sketch import new_sketch

MAX_RECLAIM_SAMPLES = 10_000
PREFILL_RATE_EMA = 0.2  # weight of the latest forward in the rollout prefill rate


@dataclass(kw_only=True)
class IntervalCounters:
    """What one metrics interval saw, for ``EngineStats``: our engine records it here (``EngineMetrics``);
    the SGLang backend records arrivals, completions and reclaims itself and adds what it scrapes from
    its servers (sketches, token counts, which Prometheus counters give as floats)."""

    started: float = field(default_factory=time.monotonic)
    ttft: DDSketch = field(default_factory=new_sketch)
    tpot: DDSketch = field(default_factory=new_sketch)
    serving_arrivals: int = 0
    serving_completed: int = 0
    serving_tokens: float = 0
    rollout_tokens: float = 0
    reclaim_ms: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class LaneFailure:
    """The last engine iteration that raised: which lane, what, when (monotonic seconds)."""

    lane: str
    error: str
    at: float


class EngineMetrics:
    """Thread-safe recorder shared by the engine's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._interval = IntervalCounters()
        self.preemptions = 0  # rollout sequences whose KV was dropped (recomputed later)
        self.compute_yields = 0  # times the rollout lane yielded to serving
        self.reclaim_ms: list[float] = []  # arrival/revoke -> rollout yielded, all-time (bounded)
        self.max_swap_pause_ms = 0.0
        self.lane_failures = 0  # iterations that raised: their running requests were aborted, the lane went on
        self.co_batched_iterations = 0  # all-time: forwards that carried serving's rows and rollout's (co_batched.py)
        self.serving_tokens_total = 0  # all-time generated tokens per lane (rates: sglang:gen_throughput)
        self.rollout_tokens_total = 0
        self._last_failure_of: dict[str, LaneFailure] = {}
        # prompt tokens per second of the rollout forwards that carried a prefill chunk (EMA): what a turn's prefill
        # gets here, the price of moving a turn away from its prefix cache (services/scheduler/placement.py)
        self.rollout_prefill_tokens_per_s = 0.0

    def lane_failed(self, lane: str, error: BaseException) -> None:
        with self._lock:
            self.lane_failures += 1
            self._last_failure_of[lane] = LaneFailure(lane, f"{type(error).__name__}: {error}", time.monotonic())

    @property
    def last_lane_failure(self) -> LaneFailure | None:
        return max(self._last_failure_of.values(), key=lambda f: f.at, default=None)

    def recent_lane_failure(self, window_s: float, lane: str | None = None) -> LaneFailure | None:
        """The last failure (of ``lane``, or of either) if it is less than ``window_s`` old."""
        failure = self.last_lane_failure if lane is None else self._last_failure_of.get(lane)
        return failure if failure is not None and time.monotonic() - failure.at < window_s else None

    def serving_arrival(self) -> None:
        with self._lock:
            self._interval.serving_arrivals += 1

    def serving_finished(self, ttft_ms: float, tpot_ms: float | None, tokens: int) -> None:
        with self._lock:
            self._interval.ttft.add(ttft_ms)
            if tpot_ms is not None:
                self._interval.tpot.add(tpot_ms)
            self._interval.serving_completed += 1

    def tokens(self, serving: int, rollout: int) -> None:
        with self._lock:
            self._interval.serving_tokens += serving
            self._interval.rollout_tokens += rollout
            self.serving_tokens_total += serving
            self.rollout_tokens_total += rollout

    def rollout_prefilled(self, tokens: int, seconds: float) -> None:
        """A rollout forward that prefilled ``tokens`` prompt tokens (beside its decode steps) took ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        with self._lock:
            old = self.rollout_prefill_tokens_per_s
            self.rollout_prefill_tokens_per_s = rate if old <= 0 else old + PREFILL_RATE_EMA * (rate - old)

    def reclaim(self, ms: float) -> None:
        with self._lock:
            self.compute_yields += 1
            self._interval.reclaim_ms.append(ms)
            if len(self.reclaim_ms) < MAX_RECLAIM_SAMPLES:
                self.reclaim_ms.append(ms)

    def preempted(self, n: int = 1) -> None:
        with self._lock:
            self.preemptions += n

    def swap_pause(self, ms: float) -> None:
        with self._lock:
            self.max_swap_pause_ms = max(self.max_swap_pause_ms, ms)

    def take_interval(self) -> IntervalCounters:
        with self._lock:
            done, self._interval = self._interval, IntervalCounters()
        return done
