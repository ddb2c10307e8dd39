"""The executor's closed-loop SLO guard: rollout's share of the device follows its own serving tails.

The instantaneous rules in ``policies.py`` react to what serving is doing this millisecond; they
cannot see that the host got slower (a noisy neighbour, another model, a GPU with other clocks).
This controller closes the loop on the outcome instead: every serving request that finishes adds
its TTFT and TPOT to a short window, and the guard steers ``share`` — the scale of rollout's
instantaneous thresholds (``policies.Rose``: rollout pauses once a first token is projected past
share x setpoint x the TTFT SLO, or the serving step is past share x setpoint x the TPOT SLO; at 0
it waits whenever serving has work) — so that the window's p99 stays at ``SETPOINT`` x the SLO:

- tail ratio r = max(p99 TTFT / TTFT SLO, p99 TPOT / TPOT SLO) over the window, and the live
  evidence of requests still in flight (the oldest first token's wait, the serving step time);
- once per control period (one TPOT SLO: a serving token's time), if r is above the setpoint and
  there is *new* evidence for it (a sample or a live signal of this period past the setpoint),
  the share halves (tighten fast: multiplicative decrease; one outlier halves once, it does not
  keep halving while it ages out of the window);
- if r is below ``RELAX_BELOW`` x the setpoint, the share grows by a step that takes
  ``RELAX_WINDOWS`` windows from nothing to everything (relax slowly: additive increase).

Every constant is a multiple of the SLO, so the loop adapts by itself to another host or model.
Without an SLO there is nothing to steer by: the share stays 1 (the instantaneous rules remain).
The guard is plain and thread-safe: the serving lane adds samples, the rollout lane asks.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, replace

from rose.contracts.slo import GUARD_SETPOINT

SETPOINT = GUARD_SETPOINT  # the target of the window's p99, as a share of the SLO (contracts/slo.py: the monitor reads it too)
TAIL_QUANTILE = 0.99
WINDOW_TTFT_SLOS = 5.0  # the window spans this many TTFT SLOs: every request in it finished within a few SLOs of now
RELAX_WINDOWS = 3.0  # from share 0 back to 1 takes this many windows: slower than the tightening by far
RELAX_BELOW = 0.9  # relax only with the tail this far under the setpoint (a dead band: no flapping at it)
DECREASE = 0.5  # multiplicative decrease per control period with new evidence


@dataclass(frozen=True, kw_only=True)
class GuardState:
    """What the guard exports (metrics, the bench's plot)."""

    share: float  # rollout's share of the device while serving has work, 0..1
    setpoint: float  # the p99 target as a fraction of the SLO
    tail_ratio: float  # the window's p99 (and live evidence) over the SLO, worst of TTFT and TPOT
    ttft_p99_ms: float
    tpot_p99_ms: float
    samples: int  # serving requests in the window


class SloGuard:
    """Steers ``share`` so that the short-window serving p99 stays at ``setpoint`` x the SLO."""

    def __init__(self, slo_ttft_ms: float | None, slo_tpot_ms: float | None, *, setpoint: float = SETPOINT) -> None:
        self.setpoint = setpoint
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, float, float | None]] = deque()  # (finished at, ttft ms, tpot ms)
        self._share = 1.0
        self._hold_until = 0.0  # rollout's share is 0 until then (a burst the executor detected: ``hold``)
        self._last_update: float | None = None
        self._fresh_max = 0.0  # the worst ratio among samples since the last control step
        self._state = GuardState(share=1.0, setpoint=setpoint, tail_ratio=0.0, ttft_p99_ms=0.0, tpot_p99_ms=0.0, samples=0)
        self.set_slo(slo_ttft_ms, slo_tpot_ms)

    def set_slo(self, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> None:
        with self._lock:
            self.slo_ttft_ms, self.slo_tpot_ms = slo_ttft_ms, slo_tpot_ms
            ref = slo_ttft_ms or slo_tpot_ms
            self.window_s = WINDOW_TTFT_SLOS * ref / 1000.0 if ref else 0.0
            self.period_s = (slo_tpot_ms or slo_ttft_ms or 0.0) / 1000.0
            if not self.active:
                self._share = 1.0

    @property
    def active(self) -> bool:
        return bool(self.slo_ttft_ms or self.slo_tpot_ms)

    @property
    def share(self) -> float:
        """The loop's own share, set by the tails (a burst's hold is on top of it: ``held``)."""
        return self._share

    @property
    def state(self) -> GuardState:
        return self._state

    def _ratio(self, ttft_ms: float | None, tpot_ms: float | None) -> float:
        r = 0.0
        if ttft_ms is not None and self.slo_ttft_ms:
            r = ttft_ms / self.slo_ttft_ms
        if tpot_ms is not None and self.slo_tpot_ms:
            r = max(r, tpot_ms / self.slo_tpot_ms)
        return r

    def observe(self, ttft_ms: float, tpot_ms: float | None, now: float) -> None:
        """One serving request finished (``now``: monotonic seconds)."""
        if not self.active:
            return
        with self._lock:
            self._samples.append((now, ttft_ms, tpot_ms))
            self._fresh_max = max(self._fresh_max, self._ratio(ttft_ms, tpot_ms))

    def hold(self, now: float, hold_s: float) -> None:
        """A measured disturbance: the executor's burst detector tripped (arrivals beyond what the
        baseline explains, or the serving queue growing). The tails it will raise are still a window
        away, so rollout's share is 0 from now until ``hold_s`` after the last trip (feed-forward;
        the detector trips on every arrival while the burst lasts). The loop's own share is left as
        the tails set it: once the hold ends, only tails the burst really raised keep rollout back."""
        if not self.active:
            return
        with self._lock:
            self._hold_until = max(self._hold_until, now + hold_s)
            self._state = replace(self._state, share=0.0)

    def held(self, now: float) -> bool:
        return now < self._hold_until

    def update(self, now: float, oldest_wait_ms: float = 0.0, serving_step_ms: float = 0.0) -> float:
        """Run the control step if a period has passed; returns the share. ``oldest_wait_ms``: the
        longest wait of a serving request still before its first token; ``serving_step_ms``: the
        serving iteration time now (~ the TPOT of the tokens being made): live evidence."""
        if not self.active:
            return 1.0
        last = self._last_update
        if last is not None and now - last < self.period_s:
            return 0.0 if self.held(now) else self._share
        with self._lock:
            self._last_update = now
            while self._samples and now - self._samples[0][0] > self.window_s:
                self._samples.popleft()
            ttfts = sorted(s[1] for s in self._samples)
            tpots = sorted(s[2] for s in self._samples if s[2] is not None)
            ttft_p99, tpot_p99 = _quantile(ttfts, TAIL_QUANTILE), _quantile(tpots, TAIL_QUANTILE)
            live = self._ratio(oldest_wait_ms or None, serving_step_ms or None)
            ratio = max(self._ratio(ttft_p99, tpot_p99), live)
            fresh = max(self._fresh_max, live)
            self._fresh_max = 0.0
            share = self._share
            if ratio > self.setpoint and fresh > self.setpoint:
                share *= DECREASE
            elif ratio < RELAX_BELOW * self.setpoint and self.window_s > 0:
                elapsed = now - last if last is not None else self.period_s
                share = min(1.0, share + elapsed / (RELAX_WINDOWS * self.window_s))
            self._share = share
            if self.held(now):
                share = 0.0
            self._state = GuardState(
                share=share, setpoint=self.setpoint, tail_ratio=ratio, ttft_p99_ms=ttft_p99, tpot_p99_ms=tpot_p99, samples=len(ttfts)
            )
        return share


def _quantile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank quantile (with fewer than 1/(1-q) samples: the maximum, the conservative reading)."""
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]
