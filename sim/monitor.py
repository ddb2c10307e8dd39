"""The simulated SLO monitor's memory between its snapshots (engine.py reads it at each snapshot)."""

from __future__ import annotations

import numpy as np

from rose.contracts.executor import MetricsSnapshot
from rose.services.slo_monitor.bursts import BurstState
from rose.services.slo_monitor.config import HeadroomSettings, WindowSettings
from rose.services.slo_monitor.headroom import StepModel
from rose.shared.bursts import BurstSettings

from .coserve import ServingTick

REFIT_TICKS = 30  # the simulated monitor refits each executor's step model every 30 snapshots (its long window)
METRICS_INTERVAL_S = 1.0  # executors' metrics snapshots (services/executor/config.py metrics_interval_s)
SERVING_FIGURES = ("ttft", "tpot", "tpot_mean", "arrivals", "queue", "queue_wait", "bs", "br")  # per serving instance and tick


class MonitorState:
    """The SLO monitor's state: its long window of every serving instance's per-tick figures (a
    ring of ``W`` ticks; the short window is its newest ``S``), every instance's rollout tokens/s
    over the same ticks, each serving instance's burst detector and fitted step model, the
    dedicated executors' open metrics interval, and when the monitor may rest.

    It exists so the clock, which records a tick, and ``Simulation._monitor``, which reads the
    windows at each metrics snapshot (every ``k_snap`` ticks), share one record whose shape
    follows the monitor's settings.
    """

    def __init__(
        self,
        settings: tuple[WindowSettings, BurstSettings, HeadroomSettings],
        dt: float,
        n_serv: int,
        n_ded: int,
        step_ms: float,
        latest: MetricsSnapshot,
        sticky_throughput: bool,
    ) -> None:
        self.win_cfg, self.burst_cfg, self.head_cfg = settings
        self.dt, self.n_serv = dt, n_serv
        self.W = max(2, int(round(self.win_cfg.long_s / dt)))
        self.S = max(1, int(round(self.win_cfg.short_s / dt)))
        self.k_snap = max(1, int(round(METRICS_INTERVAL_S / dt)))  # ticks per metrics snapshot (the monitor's cadence)
        self.ring = {k: np.zeros((n_serv, self.W)) for k in SERVING_FIGURES}
        self.ring_tps = np.zeros((n_serv + n_ded, self.W))
        self.active_from = 0.0  # rose's monitor may rest before this time (no rollout coming)
        self.burst_state = [BurstState() for _ in range(n_serv)]
        self.step_models: list[StepModel] = [StepModel(step_ms, 0.5, 0.5, 0) for _ in range(n_serv)]
        self.latest = latest  # the serving executors' metrics snapshot headroom reads (memory figures)
        # what-if "sticky_throughput": headroom reports the best rollout tokens/s ever measured on an executor
        self.sticky_throughput = sticky_throughput
        self.best_tps = np.zeros(n_serv + n_ded)
        self.ded_window_tokens = np.zeros(n_ded)  # rollout tokens per dedicated executor since its last metrics snapshot

    def record_rollout(self, tick_no: int, tokens: np.ndarray) -> None:
        """Tick ``tick_no``'s rollout tokens per instance."""
        self.ring_tps[:, tick_no % self.W] = tokens / self.dt
        self.ded_window_tokens += tokens[self.n_serv :]

    def record_serving(
        self, tick_no: int, serving_mode: np.ndarray, st: ServingTick, extra: np.ndarray, arrivals: np.ndarray, queue: np.ndarray, br: np.ndarray
    ) -> None:
        """Tick ``tick_no``'s serving figures per serving instance (``serving_mode``: it takes traffic)."""
        col = tick_no % self.W
        r = self.ring
        r["ttft"][:, col] = np.where(serving_mode, st.ttft_p99_s * 1e3, 0.0)
        r["tpot"][:, col] = np.where(serving_mode, st.tpot_p99_s * 1e3, 0.0)
        r["tpot_mean"][:, col] = (st.iteration_s + extra) * 1e3
        r["arrivals"][:, col] = arrivals
        r["queue"][:, col] = queue
        # the queue's last first token, projected as an executor does (shared/bursts.py first_token_wait_ms):
        # the fluid queue drains at the instance's capacity
        r["queue_wait"][:, col] = np.where(queue > 0, queue / np.maximum(st.capacity_rps, 1e-9) * 1e3, 0.0)
        r["bs"][:, col] = st.batch
        r["br"][:, col] = br

    def refit_due(self, tick_no: int) -> bool:
        return tick_no % (REFIT_TICKS * self.k_snap) == 0

    def close_dedicated_interval(self, running: np.ndarray) -> list[float]:
        """Each dedicated executor's metrics snapshot: rollout tokens/s over the interval, for those
        running rollout (``running``: their running turns); the next interval starts."""
        span = self.k_snap * self.dt
        out = [float(self.ded_window_tokens[j]) / span for j in range(len(running)) if running[j] > 0]
        self.ded_window_tokens[:] = 0.0
        return out

    def peak_interval_tps(self, tick_no: int) -> np.ndarray:
        """Per instance, the highest rollout tokens/s of a metrics interval in the long window: what the monitor's
        ``rollout_tokens_per_s_peak`` takes (services/slo_monitor/windows.py), each snapshot reporting its interval's
        mean. The peak of single ticks instead read a lane about 3x its sustained rate (a tick without serving
        work runs rollout alone), and placement then sent the turns there that the dedicated executor had room for
        (docs/benchmarks.md, 2026-12-05 (evening 2))."""
        filled = min(tick_no, self.W)
        if filled == 0:
            return np.zeros(self.ring_tps.shape[0])
        intervals = filled // self.k_snap
        if intervals == 0:  # no whole interval yet: the ticks so far, as one
            return self.ring_tps[:, (tick_no - 1 - np.arange(filled)) % self.W].mean(axis=1)
        newest = (tick_no - 1 - np.arange(intervals * self.k_snap)) % self.W  # newest first, whole intervals
        return self.ring_tps[:, newest].reshape(-1, intervals, self.k_snap).mean(axis=2).max(axis=1)

    def reported_tps(self, d: int, peak: float) -> float:
        """The rollout tokens/s executor ``d``'s headroom reports."""
        if self.sticky_throughput:
            self.best_tps[d] = max(self.best_tps[d], peak)
            return float(self.best_tps[d])
        return float(peak)
