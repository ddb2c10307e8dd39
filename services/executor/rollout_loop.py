"""The rollout lane of the two-model mode: rollout runs in bounded quanta beside serving, on its own thread.

The serving model and the policy are two models on one device. Serving's thread runs its iterations
back to back; this one runs rollout's (``Batcher.iterate``) in *quanta* of at most ``quantum_ms``,
and between quanta it does its housekeeping: the controls and weight swaps queued for it
(``RolloutControl.run_pending``), the lease's expiry, a shrunk KV budget, and the question whether
the policy lets it go on (``policies.py``, from ``signals``, which carry the closed loop's share of
the device, slo_guard.py). Inside a quantum each forward asks at its layer safepoints whether to
stop (a serving arrival where the lanes overlap, as on a GPU; the lease gone; a pause) or to hold (on
CPU, beside serving's burst). The co-batched mode (co_batched.py) has no such lane: rollout rows ride
in serving's own iterations.

Who writes what here: ``serving_arrived`` is called on the event loop by ``Engine.submit`` (it may
ask the running quantum to yield); everything else runs on this lane's thread.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from .batcher import Batcher
from .core_lending import CoreLending
from .lease_state import LeaseState
from .metrics import EngineMetrics
from .policies import Signals
from .rollout_control import RolloutControl
from .slo_guard import SloGuard

log = logging.getLogger("rose.executor.engine")

IDLE_WAIT_S = 0.005  # how long an idle lane sleeps before re-checking (a submit wakes it at once)
PAUSE_POLL_S = 0.0005  # how often a paused rollout lane re-asks the policy
SERVING_SWITCH_INTERVAL_S = 0.0005  # GIL switch interval while serving and rollout both run (CPython's default: 5 ms)


@contextlib.contextmanager
def iteration_survives(batcher: Batcher, metrics: EngineMetrics):
    """An iteration that raises (a bug, or a rollout forward process that died twice in a row) must not end
    the lane's thread, which would leave every later request of its class waiting forever: it is logged, the
    class's running requests finish with "abort" (with the tokens they have; their KV is freed) and the lane
    goes on with the rest."""
    try:
        yield
    except Exception as exc:
        log.exception("%s lane: an iteration failed; its %d running requests are aborted", batcher.work_class.value, len(batcher.running))
        metrics.lane_failed(batcher.work_class.value, exc)
        batcher.abort_running()


class ServingWatch:
    """What rollout's decisions read of serving now (``signals``), on whichever thread decides: the closed loop's
    share (slo_guard.py), serving's queue and step time, the SLO, the arrival rate."""

    def __init__(
        self, serving: Batcher, guard: SloGuard, slo: Callable[[], tuple[float | None, float | None]], arrival_rate: Callable[[float], float]
    ) -> None:
        self.serving, self.guard, self.slo, self.arrival_rate = serving, guard, slo, arrival_rate

    def signals(self, *, lanes_overlap: bool, shares_interpreter: bool, priority_streams: bool, rollout_graphs: bool) -> Signals:
        s = self.serving
        now = time.monotonic()
        oldest_wait_ms = s.oldest_wait_ms(now)
        share = self.guard.update(now, oldest_wait_ms, s.iteration_ms if s.running else 0.0)
        slo_ttft_ms, slo_tpot_ms = self.slo()
        return Signals(
            now=now,
            serving_prefill_pending=s.prefill_pending(),
            serving_running=len(s.running),
            serving_iteration_ms=s.iteration_ms,
            slo_tpot_ms=slo_tpot_ms,
            lanes_overlap=lanes_overlap,
            serving_max_batch=s.max_batch,
            shares_interpreter=shares_interpreter,
            slo_ttft_ms=slo_ttft_ms,
            serving_oldest_wait_ms=oldest_wait_ms,
            priority_streams=priority_streams,
            rollout_decode_graphs=rollout_graphs,
            rollout_share=share,
            serving_arrival_rate_rps=self.arrival_rate(now),
        )


class RolloutLoop:
    """The rollout lane's thread in the two-model mode (the module doc)."""

    def __init__(
        self,
        *,
        rollout: Batcher,
        serving: Batcher,
        watch: ServingWatch,
        lease: LeaseState,
        control: RolloutControl,
        policy: Any,
        device: Any,
        cores: CoreLending,
        overlap_at: dict[int, bool],
        metrics: EngineMetrics,
        stopping: Callable[[], bool],
        rollout_threads: int | None,
        shares_interpreter: bool,
    ) -> None:
        self.rollout, self.serving, self.watch, self.lease, self.control = rollout, serving, watch, lease, control
        self.policy, self.device, self.cores, self.metrics = policy, device, cores, metrics
        self._overlap_at = overlap_at  # whether the lane, narrow / wide, competes with serving for compute
        self._stopping = stopping
        self._threads = rollout_threads
        self.shares_interpreter = shares_interpreter  # rollout's ops run on serving's interpreter (no forward process)
        self.overlaps_serving = True  # the running quantum competes with serving for compute (same SMs, or CPU cores)
        self._yield_at: float | None = None  # a serving arrival asked the running quantum to yield, then
        self._in_quantum = False
        self._serving_prioritised = False
        self._default_switch_interval = sys.getswitchinterval()

    # ---- the event loop's side
    def serving_arrived(self) -> None:
        """A serving request arrived: where the lanes overlap, the running quantum yields at its next safepoint."""
        self.cores.recall()
        if self.policy.yields_on_arrival and self._in_quantum and self.overlaps_serving and self._yield_at is None:
            self._yield_at = time.monotonic()

    # ---- the lane's thread
    def run(self) -> None:
        self.device.init_thread(self._threads)
        rt = self.rollout
        warm_graphs(rt)  # before any lease: its pool holds nothing yet
        while not self._stopping():
            self._between_quanta()
            rt.receive()
            if not rt.has_work() or not self.lease.admits or self.control.holds_rollout:
                self._idle()
                rt.wakeup.wait(IDLE_WAIT_S)
                rt.wakeup.clear()
                continue
            s = self.serving
            self.prioritise_serving(bool(s.inbox or s.waiting or s.running) and not self.policy.shares_serving_lane)
            self._fit_width()
            if not self.policy.may_run_rollout(self.signals()):
                self._idle(keep_priority=True)
                time.sleep(self._pause_poll_s())
                continue
            try:
                with iteration_survives(rt, self.metrics):
                    self._run_quantum()
            finally:
                self._in_quantum = False
        self.prioritise_serving(False)

    def signals(self) -> Signals:
        return self.watch.signals(
            lanes_overlap=self.overlaps_serving,
            shares_interpreter=self.shares_interpreter,
            priority_streams=self.device.priority_streams,
            # an emulated device is a GPU engine with CUDA graphs: the roofline's fixed cost per step assumes them
            rollout_graphs=getattr(self.rollout.runner, "graphs", None) is not None or not self.device.host_is_device,
        )

    def _run_quantum(self) -> None:
        """Run rollout iterations while the next is expected to fit the quantum (at least one)."""
        rt = self.rollout
        budget_ms = self.policy.quantum_ms
        with rt.lane.run():
            self._in_quantum = True
            start = time.perf_counter()
            self._iterate(admit=True)
            if budget_ms is None:  # unbounded: the batch admitted now runs to completion
                while rt.running and not self._stopping() and self.lease.current is not None:
                    self._iterate(admit=False)
            else:
                while rt.has_work() and self._yield_at is None and (time.perf_counter() - start) * 1000.0 + rt.iteration_ms <= budget_ms:
                    self._fit_width()
                    self._iterate(admit=True)
            self._in_quantum = False
        yielded_at = self._yield_at
        if yielded_at is not None:
            self._yield_at = None
            self.metrics.reclaim((time.monotonic() - yielded_at) * 1000.0)

    def _iterate(self, admit: bool) -> None:
        rt = self.rollout
        started = time.perf_counter()
        limits = None if self.policy.may_prefill_rollout(self.signals()) else rt.limited(prefill_tokens=0)  # decodes only: prompts wait
        steered = self.policy.yields_on_arrival
        rt.iterate(admit, limits, should_stop=self._safepoint if steered else None, should_hold=self._holds if steered else None)
        rt.time_iteration(started)

    def _safepoint(self) -> bool:
        """Between layers of a rollout forward: True abandons it (lease gone, stopping, paused, or a serving arrival
        while the lanes overlap, as on a GPU). On CPU an arrival only narrows the lane off the serving core, so the
        forward goes on beside serving."""
        if self.lease.current is None or self._stopping() or self.control.paused is not None:
            return True
        if self.cores.enabled:
            self._fit_width()
        return self._yield_at is not None

    def _holds(self) -> bool:
        """Asked with the safepoint: while the policy would not start rollout now (on CPU, beside serving: a serving
        backlog, a serving step near the TPOT SLO), the forward in flight waits at its next layer safepoint instead
        of running on beside serving for the rest of its tens of milliseconds. Where the lanes overlap, an arrival
        abandons it instead."""
        return not self.overlaps_serving and not self.policy.may_run_rollout(self.signals())

    def _between_quanta(self) -> None:
        """Housekeeping the rollout lane does only between quanta, never inside a batch."""
        self.control.run_pending()
        self.lease.expire_if_due()
        rt = self.rollout
        rt.pool.set_budget_bytes(self.lease.budget_bytes)
        if rt.pool.over_budget_blocks:
            rt.shrink()
        reclaimed_from = self.lease.take_reclaim_start()
        if reclaimed_from is not None:
            self.metrics.reclaim((time.monotonic() - reclaimed_from) * 1000.0)

    def _idle(self, keep_priority: bool = False) -> None:
        """Not computing: give a lent core back at once and stay narrow (no safepoint would narrow later)."""
        self._fit_width(may_widen=False)
        if not keep_priority:
            self.prioritise_serving(False)

    def _fit_width(self, may_widen: bool = True) -> None:
        """Widen over a lent serving core or narrow off a recalled one (CPU). Once the lane no longer overlaps
        serving, a pending serving arrival has its core back: a reclaim sample."""
        cores = self.cores
        cores.fit(may_widen)
        self.overlaps_serving = self._overlap_at[cores.wide if cores.is_wide else cores.narrow]
        yielded_at = self._yield_at
        if yielded_at is not None and not self.overlaps_serving:
            self._yield_at = None
            self.metrics.reclaim((time.monotonic() - yielded_at) * 1000.0)

    def _pause_poll_s(self) -> float:
        """How long a paused rollout lane waits before asking again: one serving iteration. What paused it (first
        tokens waiting, the step time, the tails, a burst) changes at serving's iteration boundaries; asking more
        often only takes the interpreter lock from the serving lane, which a held rollout should not cost (at least
        PAUSE_POLL_S, for an idle lane)."""
        return max(PAUSE_POLL_S, self.serving.iteration_ms / 1000.0)

    def prioritise_serving(self, on: bool) -> None:
        """While serving and rollout both have work, hand the interpreter lock over sooner.

        Both lanes are Python threads: between torch ops they need the GIL, and CPython lets a thread keep it for
        a whole switch interval (5 ms) before another that asks gets it. A short interval while serving is busy is
        the interpreter's share of "serving first" (the stream priority of the GIL); it costs a little throughput,
        so only then."""
        if not self.device.host_is_device:
            return  # an emulated device computes nothing on the host: the interpreter lock is not its stream
        if on != self._serving_prioritised:
            sys.setswitchinterval(SERVING_SWITCH_INTERVAL_S if on else self._default_switch_interval)
            self._serving_prioritised = on


def warm_graphs(batcher: Batcher) -> None:
    """CUDA: capture the lane's common decode graphs before its first request (cuda_graphs.py)."""
    graphs = getattr(batcher.runner, "graphs", None)
    if graphs is not None and hasattr(batcher.runner, "warm_cuda_graphs"):
        with batcher.lane.run():
            log.info("%s lane: %d CUDA graphs captured", batcher.work_class.value, batcher.runner.warm_cuda_graphs())
