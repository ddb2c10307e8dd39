"""What a serving burst is, and the executor's own detector of one: it sees every serving arrival first.

The SLO monitor (services/slo_monitor/bursts.py) and every executor call the same thing a burst:
``BurstSettings`` and ``burst_threshold`` are that one definition, here because two services use it.

The SLO monitor detects bursts from metrics snapshots (one interval late, then a bus hop); the
executor has each arrival the moment it is submitted. On every serving arrival this detector
applies the monitor's own arrival-rate test (``slo_monitor.bursts.burst_threshold``: the last
``window_s`` of arrivals against what the baseline before them predicts, beyond Poisson noise)
and its queue test (first tokens waiting, at least ``queue_threshold`` and growing), with the
monitor's settings, so both sides call the same thing a burst. When it trips, the engine's
listener publishes an ``SloAlert`` (severity "burst") for this executor at once on
``executor.burst``; the scheduler stops routing turns here and revokes the lease on it, and the
executor's lease guard yields rollout without waiting for the round trip. While the burst lasts
the alert repeats every ``realert_s``. The monitor keeps headroom, violations and recovery.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Annotated

import msgspec

from rose.shared.config import PositiveSeconds

Positive = Annotated[float, msgspec.Meta(gt=0.0)]
Share = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]


class BurstSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Early burst detection: arrival rate and queue growth, before latency suffers."""

    window_s: PositiveSeconds = 0.5  # the recent arrivals compared with the long-window baseline
    rate_ratio: Positive = 2.0  # recent arrivals >= this x the baseline's expectation is a burst ...
    noise_z: Positive = 3.0  # ... and above expectation + z x sqrt(expectation) (Poisson noise) ...
    min_arrivals: Annotated[int, msgspec.Meta(ge=1)] = 4  # ... and at least this many
    min_baseline_s: PositiveSeconds = 2.0  # a shorter history is no baseline: rate test off
    min_baseline_rps: Positive = 1.0  # the baseline never counts as lower than this
    queue_threshold: Annotated[int, msgspec.Meta(ge=1)] = 4  # a serving queue this long and growing
    risk_fraction: Share = 0.8  # short-window p99 above this x SLO: at risk
    recover_s: PositiveSeconds = 3.0  # calm this long after an alert: "recovered"
    realert_s: PositiveSeconds = 1.0  # while the burst lasts, repeat the alert this often


def burst_threshold(expected: float, cfg: BurstSettings) -> float:
    """Arrivals in the recent window that the baseline explains only as a burst."""
    return max(cfg.rate_ratio * expected, expected + cfg.noise_z * math.sqrt(expected), cfg.min_arrivals)


BURST_BASELINE_S = 30.0  # the history the recent arrivals are compared with (the monitor's long window)


@dataclass(frozen=True)
class BurstTrip:
    """A burst found at one arrival: why, and the figures the alert carries."""

    reason: str
    arrival_rate_rps: float
    serving_queue: int


class ArrivalBurstDetector:
    """Fed every serving arrival (``arrival``); returns a BurstTrip when an alert is due."""

    def __init__(self, settings: BurstSettings | None = None, baseline_s: float = BURST_BASELINE_S) -> None:
        self.cfg, self.baseline_s = settings if settings is not None else BurstSettings(), baseline_s
        self._arrivals: deque[float] = deque()
        self._first: float | None = None
        self._last_alert: float | None = None
        self._last_queue = 0
        self.bursting = False  # the last arrival met the burst test (alerts repeat only every realert_s)
        self._lock = threading.Lock()  # arrivals come on the event loop, the rollout lane asks the rate

    def rate(self, now: float) -> float:
        """Arrivals per second over the last ``window_s`` (the policy's fill-rate estimate)."""
        with self._lock:
            return self._recent(now) / self.cfg.window_s

    def _recent(self, now: float) -> int:
        n = 0
        for t in reversed(self._arrivals):  # newest first: stops at the window's edge
            if now - t > self.cfg.window_s:
                break
            n += 1
        return n

    def arrival(self, now: float, queue: int) -> BurstTrip | None:
        """One serving arrival at ``now`` (monotonic s) with ``queue`` requests awaiting their first token;
        a BurstTrip when an alert is due. ``bursting`` says whether this arrival met the test at all."""
        cfg = self.cfg
        if self._first is None:
            self._first = now
        with self._lock:
            self._arrivals.append(now)
            while self._arrivals and now - self._arrivals[0] > self.baseline_s + cfg.window_s:
                self._arrivals.popleft()
            recent = self._recent(now)
        base_span = min(self.baseline_s, now - self._first - cfg.window_s)
        trip = None
        if base_span >= cfg.min_baseline_s:
            base_rate = max((len(self._arrivals) - recent) / base_span, cfg.min_baseline_rps)
            if recent >= burst_threshold(base_rate * cfg.window_s, cfg):
                trip = BurstTrip(f"arrival rate {recent / cfg.window_s:.1f}/s vs baseline {base_rate:.1f}/s (executor)", recent / cfg.window_s, queue)
        if trip is None and queue >= cfg.queue_threshold and queue > self._last_queue:
            trip = BurstTrip(f"serving queue growing: {self._last_queue} -> {queue} (executor)", recent / cfg.window_s, queue)
        self._last_queue = queue
        self.bursting = trip is not None
        if trip is None or (self._last_alert is not None and now - self._last_alert < cfg.realert_s):
            return None
        self._last_alert = now
        return trip
