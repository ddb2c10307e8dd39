"""The co-batched mode: a LoRA policy's rollout rows ride inside serving's own iterations, on one thread.

When the policy is a LoRA adapter of the serving model, a rollout sequence is one more row of serving's
packed forward: every row reads the base weights once, together, and rollout rows add their adapter's
low-rank product (adapters.py). So there is no rollout lane and no quantum here: one thread runs
iterations, and each iteration is

    receive (both classes) -> plan serving (first: its prefill chunks for TTFT, its decodes)
      -> the rollout budget (rows, then prefill tokens) that keeps the iteration under the guard's threshold
      -> plan rollout within it -> ONE forward over both (serving in KV pool 0, rollout in pool 1)
      -> process each class's tokens

The threshold is the SLO guard's (slo_guard.py): while serving has running requests, a serving iteration
stays under ``share x setpoint x the TPOT SLO`` (the share falls when serving's own tails near the
setpoint, and is 0 while the executor's burst detector holds). The budget is
``shared.co_batch.co_batch_rows`` (the simulator prices the same rule) over this executor's own measured
fit of an iteration's time against its tokens (``IterationFit``): a closed loop on what a serving
iteration really takes here, not a device constant. With no serving request running, rollout runs as a
rollout lane's iteration would: its batch and its prefill chunk (``rollout_prefill_tokens``: the
roofline's ridge on a GPU, a chunk that costs about a decode step), so a serving arrival waits at most
that one iteration before its prefill goes first.

Reclaim is the next iteration leaving rollout rows out: a revoked lease stops them within one
iteration, a parked one keeps their KV. Controls and weight swaps (an adapter version flips slots) run
between iterations (``RolloutControl.run_pending``), as the two-model lane runs them between quanta.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from rose.shared.co_batch import CoBatchBudget, co_batch_rows

from .batcher import Batcher, Work
from .lease_state import LeaseState
from .metrics import EngineMetrics
from .rollout_control import RolloutControl
from .rollout_loop import IDLE_WAIT_S, ServingWatch, warm_graphs

log = logging.getLogger("rose.executor.co_batched")

FIT_WINDOW = 64  # iterations the fit remembers: a few seconds of serving, so it follows a change of load or host within them
FIT_MIN_SAMPLES = 8  # fewer than this and the fit prices added tokens in proportion to the last iteration (cautious)


class IterationFit:
    """Seconds of an iteration against the tokens it computes, ``a + b x tokens``, least squares over the last
    ``FIT_WINDOW`` iterations. Where the tokens did not vary enough to tell ``a`` from ``b`` (or before
    ``FIT_MIN_SAMPLES``), an added token is priced at the mean cost of a token so far: an overestimate where a
    step is bound by reading the weights, the safe side of a bound on serving's iteration."""

    def __init__(self, window: int = FIT_WINDOW) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self.a, self.b = 0.0, 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self._samples.append((float(tokens), seconds))
        x = np.fromiter((t for t, _ in self._samples), float)
        y = np.fromiter((s for _, s in self._samples), float)
        proportional = float(y.sum() / x.sum())
        if len(x) < FIT_MIN_SAMPLES or x.std() < 0.1 * x.mean():
            self.a, self.b = 0.0, proportional
            return
        b, a = np.polyfit(x, y, 1)
        if b <= 0 or a < 0:  # noise, or a step bound by the weights' read: the mean cost keeps the bound safe
            self.a, self.b = 0.0, proportional
        else:
            self.a, self.b = float(a), float(b)

    def seconds(self, tokens: float) -> float:
        return self.a + self.b * tokens


@contextlib.contextmanager
def both_survive(batchers: tuple[Batcher, ...], metrics: EngineMetrics):
    """A co-batched iteration that raises loses both classes' running requests (they shared the forward), never
    the thread: as ``rollout_loop.iteration_survives``, for both."""
    try:
        yield
    except Exception as exc:
        log.exception("co-batched lane: an iteration failed; its running requests are aborted")
        for b in batchers:
            metrics.lane_failed(b.work_class.value, exc)
            b.abort_running()


class CoBatchedLoop:
    """The co-batched mode's one thread (the module doc)."""

    def __init__(
        self,
        *,
        serving: Batcher,
        rollout: Batcher,
        watch: ServingWatch,
        lease: LeaseState,
        control: RolloutControl,
        policy: Any,
        device: Any,
        metrics: EngineMetrics,
        stopping: Callable[[], bool],
        lane_threads: int | None = None,
    ) -> None:
        self.serving, self.rollout, self.watch, self.lease, self.control = serving, rollout, watch, lease, control
        self.policy, self.device, self.metrics = policy, device, metrics
        self._stopping = stopping
        self.lane_threads = lane_threads
        self.fit = IterationFit()
        self.last_budget = CoBatchBudget(0, 0)  # the last iteration's, to read (tests, telemetry)

    def run(self) -> None:
        # CPU: the one lane's torch threads (``EngineConfig.rollout_threads``, default one: on the 2-core VM two intra-op
        # threads per forward spun 30x slower whenever another process wanted a core, docs/benchmarks.md 2026-12-07)
        self.device.init_thread(self.lane_threads)
        s, r = self.serving, self.rollout
        warm_graphs(s)
        while not self._stopping():
            self._between_iterations()
            s.receive()
            r.receive()
            rollout_ok = self.policy.admits_rollout and self.lease.admits and not self.control.holds_rollout
            if not s.has_work() and not (rollout_ok and r.has_work()):
                s.count_unprefilled()
                s.wakeup.clear()
                if not (s.inbox or s.aborts or r.inbox or r.aborts):
                    s.wakeup.wait(IDLE_WAIT_S)
                continue
            with s.lane.run(), both_survive((s, r), self.metrics):
                self.iterate(rollout_ok)

    def iterate(self, rollout_ok: bool) -> None:
        """One iteration: serving's work, the rollout rows its budget affords, one forward, both processed."""
        s, r = self.serving, self.rollout
        started = time.perf_counter()
        s_work = s.plan(admit=True)
        s.count_unprefilled()
        r_work = self._plan_rollout(s_work) if rollout_ok else []
        if not s_work and not r_work:
            return
        tokens = sum(n for _, n in s_work) + sum(n for _, n in r_work)
        s_samples = s.sample_rows(s_work)
        items = s.forward_items(s_work) + r.forward_items(r_work)
        sampled = s.runner.forward_sample(items, s_samples + r.sample_rows(r_work, len(s_work)))
        assert sampled is not None  # no safepoint: a co-batched iteration runs whole (it is serving's)
        taken, logprobs = sampled
        ns = len(s_samples)
        if s_work and r_work:
            self.metrics.co_batched_iterations += 1  # (this thread alone writes it)
        s.process(s.advance(s_work, taken[:ns], logprobs[:ns]))
        r.process(r.advance(r_work, taken[ns:], logprobs[ns:]))
        seconds = time.perf_counter() - started
        self.fit.observe(tokens, seconds)
        s.time_iteration(started)  # serving's iteration time, rollout rows included: what serving's TPOT is made of
        if r_work:
            r.time_iteration(started)
            prefill = sum(n for sq, n in r_work if n > 1 or sq.num_cached < sq.prompt_len)
            if prefill:
                self.metrics.rollout_prefilled(prefill, seconds)

    def _plan_rollout(self, s_work: Work) -> Work:
        """The rollout rows and prefill tokens the guard affords beside ``s_work``, planned (admitted, blocks held)."""
        s, r = self.serving, self.rollout
        serving_tokens = sum(n for _, n in s_work)
        waiting_prompt = sum(len(sq.tokens) - sq.num_cached for sq in r.waiting)
        unprefilled = sum(len(sq.tokens) - sq.num_cached - 1 for sq in r.running if len(sq.tokens) - sq.num_cached > 1)
        max_rows = min(r.max_batch, len(r.running) + len(r.waiting))
        max_prefill = min(r.limits.prefill_tokens, waiting_prompt + unprefilled)
        if not s.running:  # nothing of serving's to slow down: the batch and its chunk, as a rollout lane's iteration
            budget = CoBatchBudget(max_rows, max_prefill)
        else:
            budget = co_batch_rows(
                lambda rows, prefill: self.fit.seconds(serving_tokens + rows + prefill),
                threshold_s=self._threshold_s(),
                max_rows=max_rows,
                max_prefill_tokens=max_prefill,
            )
        self.last_budget = budget
        if budget.rows <= 0:
            return []
        return r.plan(admit=True, limits=r.limited(prefill_tokens=budget.prefill_tokens), rows=budget.rows)

    def _threshold_s(self) -> float:
        """The guard's bound on an iteration while serving runs: ``share x setpoint x TPOT SLO`` (the quantum
        without a TPOT SLO; no bound where the policy ignores the SLO)."""
        if not self.policy.yields_to_alerts:
            return math.inf  # naive_share: the SLO is not its business
        signals = self.watch.signals(lanes_overlap=True, shares_interpreter=True, priority_streams=True, rollout_graphs=True)
        if signals.slo_tpot_ms is None:
            return signals.rollout_share * self.policy.quantum_ms / 1000.0
        return signals.rollout_share * self.policy.guard_fraction * signals.slo_tpot_ms / 1000.0

    def _between_iterations(self) -> None:
        """Controls and weight swaps, the lease's expiry, a shrunk KV budget: never inside an iteration."""
        self.control.run_pending()
        self.lease.expire_if_due()
        r = self.rollout
        r.pool.set_budget_bytes(self.lease.budget_bytes)
        if r.pool.over_budget_blocks:
            r.shrink()
        reclaimed_from = self.lease.take_reclaim_start()
        if reclaimed_from is not None:
            self.metrics.reclaim((time.monotonic() - reclaimed_from) * 1000.0)
