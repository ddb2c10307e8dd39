"""What a serving burst is, and the executor's own detector of one: it sees every serving arrival first.

The SLO monitor (services/slo_monitor/bursts.py) and every executor call the same thing a burst:
``BurstSettings`` and ``burst_threshold`` are that one definition, here because two services use it.

The SLO monitor detects bursts from metrics snapshots (one interval late, then a bus hop); the
executor has each arrival the moment it is submitted. On every serving arrival this detector
applies the monitor's arrival-rate test (``burst_threshold``: the last ``window_s``, and twice and
four times it, of arrivals against what the baseline before them predicts, past a count Poisson
noise reaches ``false_alarms_per_hour``) and its queue test (``queue_at_risk``: first tokens
waiting, at least ``queue_threshold``, growing, and projected to wait ``risk_fraction`` of the
TTFT SLO), with the monitor's settings, so both sides call the same thing a burst. When it
trips, the engine's listener publishes an ``SloAlert`` (severity "burst") for this executor at once on
``executor.burst``; the scheduler stops routing turns here and revokes the lease on it, and the
executor's lease guard yields rollout without waiting for the round trip. While the burst lasts
the alert repeats every ``realert_s``. The monitor keeps headroom, violations and recovery.
"""

from __future__ import annotations

import functools
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

    window_s: PositiveSeconds = 0.5  # the shortest window of recent arrivals compared with the baseline (RATE_WINDOWS)
    rate_ratio: Positive = 2.0  # recent arrivals >= this x the baseline's expectation is a burst ...
    false_alarms_per_hour: Positive = 1.0  # ... and Poisson noise at the baseline rate reaches them this rarely ...
    min_arrivals: Annotated[int, msgspec.Meta(ge=1)] = 4  # ... and at least this many
    min_baseline_s: PositiveSeconds = 2.0  # a shorter history is no baseline: rate test off
    min_baseline_rps: Positive = 1.0  # the baseline never counts as lower than this
    queue_threshold: Annotated[int, msgspec.Meta(ge=1)] = 4  # a serving queue this long and growing (and at risk: queue_at_risk)
    risk_fraction: Share = 0.8  # short-window p99 above this x SLO: at risk
    recover_s: PositiveSeconds = 3.0  # calm this long after an alert: "recovered"
    realert_s: PositiveSeconds = 1.0  # while the burst lasts, repeat the alert this often


RATE_WINDOWS = (1, 2, 4)  # the rate test's windows, in multiples of window_s (every arrival at the executor, every snapshot at the monitor)


def rate_windows(cfg: BurstSettings) -> list[float]:
    """The spans of recent arrivals the rate test compares with the baseline before the longest, shortest first."""
    return [m * cfg.window_s for m in RATE_WINDOWS]


def burst_threshold(expected: float, tests_per_hour: float, cfg: BurstSettings) -> int:
    """Arrivals in a recent window that the baseline explains only as a burst: at least ``rate_ratio`` x
    the ``expected`` count and ``min_arrivals``, and a count Poisson noise at the baseline reaches so
    rarely that ``tests_per_hour`` tests of it raise ``false_alarms_per_hour`` (the caller counts every
    window it tests).

    A z-score (expectation + 3 sqrt) tested at every arrival raised 135-200 false alarms per executor-hour
    on Poisson traffic at 2.5-20 requests/s (a scan over overlapping windows tests far more often than
    once a window), and each revoked a lease for nothing: 43 of 45 revocations in an emulated run
    (docs/benchmarks.md, 2026-12-04). The detection time that one false alarm an hour leaves is the
    arrivals-only bound the elastic bench prints (Lorden: about 1 s at x3, 0.4 s at x5 from 8 requests/s);
    the longer windows reach it, the executor's local reclaim keeps the SLO meanwhile.
    """
    noise = _poisson_quantile(round(expected, 2), cfg.false_alarms_per_hour / max(tests_per_hour, 1e-9))
    return max(math.ceil(cfg.rate_ratio * expected), noise, cfg.min_arrivals)


@functools.lru_cache(maxsize=4096)
def _poisson_quantile(mean: float, p: float) -> int:
    """The smallest k with P(Poisson(mean) >= k) <= p (p < 1/2: k lies above the mode)."""
    if p >= 0.5:
        return 0
    mode = math.floor(mean)
    top = mode + int(40.0 * math.sqrt(mean + 1.0)) + 40  # the tail past here is far below any p asked
    term = math.exp(mode * math.log(mean) - mean - math.lgamma(mode + 1)) if mean > 0 else 1.0
    pmf = [term]
    for i in range(mode + 1, top + 1):
        term *= mean / i
        pmf.append(term)
    tail = 0.0
    for i in range(top, mode - 1, -1):  # tail(i) = P(X >= i), growing as i falls
        tail += pmf[i - mode]
        if tail > p:
            return i + 1
    return mode


def first_token_wait_ms(oldest_wait_ms: float, pending: int, iteration_ms: float) -> float:
    """When the last request awaiting its first token is projected to get it: the oldest has waited
    ``oldest_wait_ms``, and each of the ``pending`` ones takes about one serving iteration more."""
    return oldest_wait_ms + pending * iteration_ms


def queue_at_risk(queue: int, previous_queue: int, wait_ms: float | None, slo_ttft_ms: float | None, cfg: BurstSettings) -> bool:
    """A serving queue that signals a burst: at least ``queue_threshold``, longer than before, and, where
    the TTFT SLO and the queue's projected wait (``first_token_wait_ms``) are known, projected to wait
    ``risk_fraction`` of that SLO, as the latency test asks of the p99.

    A count alone is Poisson noise at an ordinary load: an emulated H100 serving 7B at 10 requests/s
    with a 315 ms p99 TTFT (SLO 1000 ms) saw four first tokens waiting, and growing, often enough that
    54 of a run's 67 lease revocations were this test alone (`rose bench e2e --emulate 4xH100`,
    2026-12-04), while the simulator's fluid queue, empty below capacity, never fired it. A queue
    the executor drains well within the SLO is not a burst; one that will not be is, before the p99
    shows it. Without the wait (a backend that cannot tell it) the count decides, as before."""
    if queue < cfg.queue_threshold or queue <= previous_queue:
        return False
    if wait_ms is None or not slo_ttft_ms:
        return True
    return wait_ms >= cfg.risk_fraction * slo_ttft_ms


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
        self._windows = rate_windows(self.cfg)  # the rate test's spans, shortest first (fixed with the settings)
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

    def _recent(self, now: float, window_s: float | None = None) -> int:
        window_s = self.cfg.window_s if window_s is None else window_s
        n = 0
        for t in reversed(self._arrivals):  # newest first: stops at the window's edge
            if now - t > window_s:
                break
            n += 1
        return n

    def _rate_trip(self, now: float, queue: int) -> BurstTrip | None:
        """The arrival-rate test over each of RATE_WINDOWS against the baseline before the longest.
        The arrival being tested is given, so the noise is in the others of its window."""
        cfg, windows = self.cfg, self._windows
        assert self._first is not None
        base_span = min(self.baseline_s, now - self._first - windows[-1])
        if base_span < cfg.min_baseline_s:
            return None
        with self._lock:
            counts = [(w, self._recent(now, w)) for w in windows]
            held = len(self._arrivals)
        base_rate = max((held - counts[-1][1]) / base_span, cfg.min_baseline_rps)
        tests_per_hour = base_rate * 3600.0 * len(windows)
        for window_s, n in counts:
            if n - 1 >= burst_threshold(base_rate * window_s, tests_per_hour, cfg):
                return BurstTrip(f"arrival rate {n / window_s:.1f}/s vs baseline {base_rate:.1f}/s (executor)", n / window_s, queue)
        return None

    def arrival(self, now: float, queue: int, queue_wait_ms: float | None = None, slo_ttft_ms: float | None = None) -> BurstTrip | None:
        """One serving arrival at ``now`` (monotonic s) with ``queue`` requests awaiting their first token,
        the last of them projected to get it in ``queue_wait_ms`` (``first_token_wait_ms``); a BurstTrip when
        an alert is due. ``bursting`` says whether this arrival met the test at all."""
        cfg = self.cfg
        if self._first is None:
            self._first = now
        with self._lock:
            self._arrivals.append(now)
            while self._arrivals and now - self._arrivals[0] > self.baseline_s + self._windows[-1]:
                self._arrivals.popleft()
        trip = self._rate_trip(now, queue)
        if trip is None and queue_at_risk(queue, self._last_queue, queue_wait_ms, slo_ttft_ms, cfg):
            trip = BurstTrip(f"serving queue growing: {self._last_queue} -> {queue} (executor)", self.rate(now), queue)
        self._last_queue = queue
        self.bursting = trip is not None
        if trip is None or (self._last_alert is not None and now - self._last_alert < cfg.realert_s):
            return None
        self._last_alert = now
        return trip
