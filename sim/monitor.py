"""The simulated SLO monitor: its memory between snapshots (``MonitorState``, which the clock records each tick into)
and its step at each snapshot (``SloMonitor``: burst alerts, step models, every executor's headroom)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from rose.contracts.executor import MetricsSnapshot
from rose.contracts.slo import Headroom, SloAlert
from rose.services.slo_monitor.bursts import BurstState
from rose.services.slo_monitor.config import HeadroomSettings, WindowSettings
from rose.services.slo_monitor.headroom import StepModel
from rose.services.slo_monitor.windows import WindowStats
from rose.shared.bursts import BurstSettings

from .config import SimConfig
from .control import ControlPlane
from .coserve import ServingTick
from .counters import Counters
from .instances import Instances
from .policies import FleetPolicy, monitor_settings, serving_snapshot
from .rollout import RolloutEngines
from .sizing import ServingSetup, SizedFleet

REFIT_TICKS = 30  # the simulated monitor refits each executor's step model every 30 snapshots (its long window)
METRICS_INTERVAL_S = 1.0  # executors' metrics snapshots (services/executor/config.py metrics_interval_s)
SERVING_FIGURES = ("ttft", "tpot", "tpot_mean", "arrivals", "queue", "queue_wait", "bs", "br")  # per serving instance and tick


class MonitorState:
    """The SLO monitor's state: its long window of every serving instance's per-tick figures (a
    ring of ``W`` ticks; the short window is its newest ``S``), every instance's rollout tokens/s
    over the same ticks, each serving instance's burst detector and fitted step model, the
    dedicated executors' open metrics interval, and when the monitor may rest.

    It exists so the clock, which records a tick, and ``SloMonitor``, which reads the windows at
    each metrics snapshot (every ``k_snap`` ticks), share one record whose shape follows the
    monitor's settings.
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

    def windows(self, tick_no: int) -> Windows:
        """The ring as the snapshot after tick ``tick_no`` reads it: the short and long windows, the latest snapshot
        and the history before it."""
        r, W, S, dt = self.ring, self.W, self.S, self.dt
        filled = min(tick_no, W)
        last = (tick_no - 1 - np.arange(filled)) % W  # newest first
        short_idx, long_idx = last[: min(S, filled)], last
        recent_idx, base_idx = last[: self.k_snap], last[self.k_snap :]  # the latest snapshot, the history before it
        L = lambda a: a.tolist()  # noqa: E731  (plain floats: numpy scalars are slow in the loop)
        return Windows(
            long_idx=long_idx,
            snapshots=(len(short_idx), filled, len(base_idx)),
            span_s=len(short_idx) * dt,
            span_l=filled * dt,
            span_b=len(base_idx) * dt,
            span_r=len(recent_idx) * dt,
            ttft_s=L(r["ttft"][:, short_idx].max(axis=1)),
            tpot_s=L(r["tpot"][:, short_idx].max(axis=1)),
            ttft_l=L(r["ttft"][:, long_idx].max(axis=1)),
            tpot_l=L(r["tpot"][:, long_idx].max(axis=1)),
            arr_s=L(r["arrivals"][:, short_idx].sum(axis=1)),
            arr_l=L(r["arrivals"][:, long_idx].sum(axis=1)),
            arr_r=L(r["arrivals"][:, recent_idx].sum(axis=1)),
            arr_b=L(r["arrivals"][:, base_idx].sum(axis=1)),
            bs_peak=L(r["bs"][:, long_idx].max(axis=1)),
            bs_short=L(r["bs"][:, short_idx].max(axis=1)),
            q_now=L(r["queue"][:, last[0]]),
            q_wait=L(r["queue_wait"][:, last[0]]),
            q_prev=L(r["queue"][:, last[1]]) if filled > 1 else [0.0] * self.n_serv,
            tps_peak=L(self.peak_interval_tps(tick_no)[: self.n_serv]),
        )

    def observations(self, d: int, idx: np.ndarray) -> list[tuple[float, float, float]]:
        """Serving instance ``d``'s (serving batch, rollout batch, mean TPOT) at the ticks ``idx``: what its step model is
        fitted on."""
        r = self.ring
        return list(zip(r["bs"][d, idx].tolist(), r["br"][d, idx].tolist(), r["tpot_mean"][d, idx].tolist()))

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


@dataclass(frozen=True)
class Windows:
    """One snapshot's reading of the ring (``MonitorState.windows``), per serving instance as plain floats: the short
    window (``_s``), the long one (``_l``), the latest snapshot (``_r``) and the history before it (``_b``), with
    their spans in seconds and snapshots (short, long, base)."""

    long_idx: np.ndarray  # the long window's ticks, newest first
    snapshots: tuple[int, int, int]
    span_s: float
    span_l: float
    span_b: float
    span_r: float
    ttft_s: list[float]
    tpot_s: list[float]
    ttft_l: list[float]
    tpot_l: list[float]
    arr_s: list[float]
    arr_l: list[float]
    arr_r: list[float]
    arr_b: list[float]
    bs_peak: list[float]
    bs_short: list[float]
    q_now: list[float]
    q_wait: list[float]
    q_prev: list[float]
    tps_peak: list[float]

    def short(self, d: int, kv_util: float, util: float) -> WindowStats:
        return WindowStats(
            span_s=self.span_s,
            snapshots=self.snapshots[0],
            ttft_p99_ms=self.ttft_s[d],
            tpot_p99_ms=self.tpot_s[d],
            ttft_count=self.arr_s[d],
            arrival_rate_rps=self.arr_s[d] / self.span_s,
            arrivals=int(self.arr_s[d]),
            serving_queue=int(self.q_now[d]),
            serving_running_peak=int(self.bs_short[d]),
            rollout_tokens_per_s_peak=self.tps_peak[d],
            kv_utilisation=kv_util,
            compute_utilisation=util,
            serving_queue_wait_ms=self.q_wait[d],
        )

    def recent(self, d: int) -> WindowStats:
        """The latest snapshot's arrivals (what burst detection compares with the history before it)."""
        return WindowStats(
            span_s=self.span_r,
            snapshots=1,
            ttft_p99_ms=0.0,
            tpot_p99_ms=0.0,
            ttft_count=self.arr_r[d],
            arrival_rate_rps=self.arr_r[d] / self.span_r,
            arrivals=int(self.arr_r[d]),
            serving_queue=int(self.q_now[d]),
            serving_running_peak=0,
            rollout_tokens_per_s_peak=0.0,
            kv_utilisation=0.0,
            compute_utilisation=0.0,
        )

    def base(self, d: int) -> WindowStats:
        """The history before the latest snapshot (burst detection's baseline)."""
        return WindowStats(
            span_s=self.span_b,
            snapshots=self.snapshots[2],
            ttft_p99_ms=0.0,
            tpot_p99_ms=0.0,
            ttft_count=self.arr_b[d],
            arrival_rate_rps=self.arr_b[d] / self.span_b if self.span_b else 0.0,
            arrivals=int(self.arr_b[d]),
            serving_queue=0,
            serving_running_peak=0,
            rollout_tokens_per_s_peak=0.0,
            kv_utilisation=0.0,
            compute_utilisation=0.0,
        )

    def long(self, d: int, kv_util: float) -> WindowStats:
        return WindowStats(
            span_s=self.span_l,
            snapshots=self.snapshots[1],
            ttft_p99_ms=self.ttft_l[d],
            tpot_p99_ms=self.tpot_l[d],
            ttft_count=self.arr_l[d],
            arrival_rate_rps=self.arr_l[d] / self.span_l,
            arrivals=int(self.arr_l[d]),
            serving_queue=int(self.q_now[d]),
            serving_running_peak=int(self.bs_peak[d]),
            rollout_tokens_per_s_peak=self.tps_peak[d],
            kv_utilisation=kv_util,
            compute_utilisation=0.0,
        )


class SloMonitor:
    """The SLO monitor's step at each metrics snapshot, with the services' own functions (the policy's ``classify``,
    ``next_alert``, ``fit_step_model``, ``assess``): per serving executor, burst alerts (to the scheduler and the
    executor's guard, policies.py ``on_alert``), its step model refitted every ``REFIT_TICKS`` snapshots, and its
    headroom; per dedicated executor, its headroom. Headroom goes out through the control plane (``report``).

    It exists apart from its memory (``state``, a ``MonitorState``: the clock records into it, the trainer tells it
    when it may rest) because its step reads the rollout engines (turns running and queued, prefill rates) and acts
    through the control plane, which the record does not need.
    """

    def __init__(
        self,
        policy: FleetPolicy,
        cfg: SimConfig,
        sized: SizedFleet,
        serving: ServingSetup,
        inst: Instances,
        rollout: RolloutEngines,
        control: ControlPlane,
        counts: Counters,
    ) -> None:
        self.policy, self.cfg = policy, cfg
        self.sized, self.serving, self.inst = sized, serving, inst
        self.rollout, self.control, self.counts = rollout, control, counts
        shape, memory = sized.shape, sized.memory
        self.state = MonitorState(
            monitor_settings(cfg.slo_ttft_ms, cfg.slo_tpot_ms, sized.max_rollout_batch, int(max(0.0, memory.cohost_free_bytes))),
            cfg.dt,
            shape.n_serv,
            inst.D - shape.n_serv,  # the dedicated pool and any lane instances
            max(0.0, float(shape.sperf.decode_s(1.0, sized.traffic.prompt_mean)) * 1e3),
            serving_snapshot(shape.device.name, memory.total_s, memory.cohost_free_bytes, memory.kvb_p, cfg.rollout_mode),
            "sticky_throughput" in cfg.what_if,
        )

    def serving_snapshot(self, now: float, tick_no: int, st: ServingTick) -> None:
        """Every serving executor's snapshot after tick ``tick_no`` (``st``: its serving second)."""
        pol, m, traffic = self.policy, self.state, self.sized.traffic
        w = m.windows(tick_no)
        L = lambda a: a.tolist()  # noqa: E731  (plain floats: numpy scalars are slow in the loop)
        kv_util = L(np.minimum(1.0, st.batch * (traffic.prompt_mean + traffic.output_mean) / max(1.0, self.serving.kv_tokens)))
        util = L(1.0 - np.exp(-st.batch))
        refit = m.refit_due(tick_no)
        bundle = self.rollout.turns.bundle
        running_now, queued = L(self.rollout.admitted_view[0] * bundle), L(self.rollout.admitted_view[1])
        prefill = L(self.rollout.prefill_rates())
        for d in range(self.inst.n_serv):
            short = w.short(d, kv_util[d], util[d])
            self._alert(d, now, w, short)
            if refit:
                m.step_models[d] = pol.fit_step_model(m.observations(d, w.long_idx), w.tpot_s[d] or self.cfg.slo_tpot_ms / 4)
            v = pol.assess(short, w.long(d, kv_util[d]), m.step_models[d], m.latest, m.head_cfg, m.burst_state[d].alerting)
            if not v.lendable:
                self.counts.control.unlendable[re.sub(r"\d+(\.\d+)? ms", "N ms", v.reason.split(";")[0])] += 1
            rollout = (int(running_now[d]), queued[d] * bundle, prefill[d])
            self.control.report(self._serving_headroom(d, now, w, v, kv_util[d], rollout))

    def _alert(self, d: int, now: float, w: Windows, short: WindowStats) -> None:
        """Burst detection on serving executor ``d`` (the monitor's ``BurstDetector``): an alert it decides goes to the
        scheduler and the executor's guard."""
        pol, m = self.policy, self.state
        found = pol.classify(short, [w.recent(d)], w.base(d), int(w.q_now[d]), int(w.q_prev[d]), m.burst_cfg, m.head_cfg, w.q_wait[d])
        decided = pol.next_alert(m.burst_state[d], found, now, m.burst_cfg)
        if decided is None:
            return
        alert = SloAlert(
            executor_id=self.inst.ids[d],
            at=now,
            severity=decided[0],
            reason=decided[1],
            arrival_rate_rps=w.arr_r[d] / w.span_r,
            serving_queue=int(w.q_now[d]),
            ttft_p99_ms=w.ttft_s[d],
            tpot_p99_ms=w.tpot_s[d],
        )
        if alert.severity != "recovered":
            self.counts.control.alerts += 1
        pol.on_alert(self.control, d, alert, now)

    def _serving_headroom(self, d: int, now: float, w: Windows, v, kv_util: float, rollout: tuple[int, int, float]) -> Headroom:
        """Serving executor ``d``'s headroom from ``assess``'s verdict ``v``; ``rollout``: its rollout turns running
        and queued (sequences) and its prefill rate."""
        c, shape, memory = self.cfg, self.sized.shape, self.sized.memory
        running, queued, prefill = rollout
        slots = v.slots if "kv_slots" not in c.what_if else min(v.slots, self.sized.kv_slots(v.kv_bytes))
        return Headroom(
            executor_id=self.inst.ids[d],
            at=now,
            kv_bytes=v.kv_bytes,
            compute_share=v.compute_share,
            rollout_batch_slots=slots,
            ttft_p99_ms=w.ttft_s[d],
            tpot_p99_ms=w.tpot_s[d],
            slo_ttft_ms=c.slo_ttft_ms,
            slo_tpot_ms=c.slo_tpot_ms,
            arrival_rate_rps=w.arr_s[d] / w.span_s,
            serving_queue=int(w.q_now[d]),
            role="serving",
            lendable=v.lendable,
            reason=v.reason,
            ttft_p99_long_ms=w.ttft_l[d],
            tpot_p99_long_ms=w.tpot_l[d],
            arrival_rate_long_rps=w.arr_l[d] / w.span_l,
            kv_utilisation=kv_util,
            rollout_running=running,
            rollout_queue=queued,
            rollout_tokens_per_s=self.state.reported_tps(d, w.tps_peak[d]),
            rollout_prefill_tokens_per_s=prefill,
            device_kind="cuda",
            device_name=shape.device.name,
            device_memory_bytes=int(memory.total_s),
        )

    def dedicated_snapshot(self, now: float, tick_no: int) -> None:
        """Every dedicated executor's metrics snapshot (rollout tokens/s over the interval, kept when rollout is running:
        what rose bench e2e averages into calibration.dedicated_rollout_tokens_per_s) and its headroom."""
        m, n, bundle = self.state, self.inst.n_serv, self.rollout.turns.bundle
        nr, nq = self.rollout.admitted_view
        self.counts.rollout.ded_snapshots_tps.extend(m.close_dedicated_interval(nr[n:]))
        peak_tps = m.peak_interval_tps(tick_no)
        prefill = self.rollout.prefill_rates()
        for d in range(n, self.inst.D):
            self.control.report(self._dedicated_headroom(d, now, nr[d] * bundle, nq[d] * bundle, peak_tps[d], prefill[d]))

    def _dedicated_headroom(self, d: int, now: float, running: float, queued: float, tps: float, prefill_rate: float) -> Headroom:
        """Dedicated executor ``d``'s headroom: its whole engine, lendable, its slots as its caps allow."""
        c = self.cfg
        slots = int(self.inst.slots[d])
        if "kv_slots" in c.what_if:
            slots = min(slots, self.sized.kv_slots(self.inst.kvcap[d]))
        return Headroom(
            executor_id=self.inst.ids[d],
            at=now,
            kv_bytes=0,
            compute_share=1.0,
            rollout_batch_slots=slots,
            ttft_p99_ms=0.0,
            tpot_p99_ms=0.0,
            slo_ttft_ms=c.slo_ttft_ms,
            slo_tpot_ms=c.slo_tpot_ms,
            arrival_rate_rps=0.0,
            serving_queue=0,
            role="dedicated",
            lendable=True,
            reason="dedicated rollout executor",
            rollout_running=int(running),
            rollout_queue=int(queued),
            rollout_tokens_per_s=float(self.state.reported_tps(d, tps)),
            rollout_prefill_tokens_per_s=float(prefill_rate),
        )
