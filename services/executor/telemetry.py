"""Every interval: read the engine's stats, publish a MetricsSnapshot, and record the OpenTelemetry metrics.

The engine hands out each interval's latency sketches once; this is the only reader. The
Prometheus side (the executor's `/metrics`, and the runtime's metrics endpoint) is the
OpenTelemetry SDK's exporter: serving TTFT/TPOT are histograms recorded per request by the
HTTP API (`serving_finished`), the rest is folded in here once per interval.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from rose.contracts.executor import DeviceTelemetry, LatencySketch, MetricsSnapshot, PoolUsage
from rose.contracts.registry import EXECUTOR_METRICS
from rose.shared.bus import Bus
from rose.shared.metrics import LATENCY_BUCKETS_S, meter, metric_name

from .backend import CoServingEngine
from .outputs import EngineStats
from .protocol import GenerationResult

log = logging.getLogger("rose.executor.telemetry")


class ExecutorInstruments:
    """The executor's instruments; every measurement carries `executor` (its instance id)."""

    def __init__(self) -> None:
        m = meter()
        hist = dict(explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S)
        self.ttft = m.create_histogram(metric_name("executor.ttft"), unit="s", description="Serving time to first token.", **hist)
        self.tpot = m.create_histogram(metric_name("executor.tpot"), unit="s", description="Serving time per output token (after the first).", **hist)
        self.serving_requests = m.create_counter(
            metric_name("executor.serving_requests"), unit="{request}", description="Serving requests finished, per finish reason."
        )
        self.http_errors = m.create_counter(
            metric_name("executor.http_errors"), unit="{response}", description="HTTP error responses, per status code."
        )
        self.tokens = m.create_counter(
            metric_name("executor.generated_tokens"), unit="{token}", description="Tokens generated, per work class (serving, rollout)."
        )
        self.queue = m.create_gauge(metric_name("executor.queue_length"), unit="{request}", description="Requests waiting, per work class.")
        self.running = m.create_gauge(metric_name("executor.running"), unit="{request}", description="Requests running, per work class.")
        self.kv_used = m.create_gauge(metric_name("executor.kv_used"), unit="By", description="KV-cache bytes in use, per pool.")
        self.kv_capacity = m.create_gauge(
            metric_name("executor.kv_capacity"), unit="By", description="KV-cache bytes usable now, per pool (rollout: bounded by the lease)."
        )
        self.prefix_hits = m.create_counter(metric_name("executor.prefix_cache_hits"), unit="{hit}", description="Rollout prefix-cache hits.")
        self.prefix_misses = m.create_counter(metric_name("executor.prefix_cache_misses"), unit="{miss}", description="Rollout prefix-cache misses.")
        self.prefix_host_hits = m.create_counter(
            metric_name("executor.prefix_cache_host_hits"), unit="{hit}", description="Rollout prefix-cache misses restored from the host tier."
        )
        self.preemptions = m.create_counter(
            metric_name("executor.rollout_preemptions"),
            unit="{preemption}",
            description="Rollout sequences preempted (KV dropped, recomputed later).",
        )
        self.lane_failures = m.create_counter(
            metric_name("executor.lane_failures"),
            unit="{iteration}",
            description="Engine iterations that raised: logged, their running requests aborted, the lane went on.",
        )
        self.policy_version = m.create_gauge(
            metric_name("executor.policy_version"), unit="{version}", description="Policy weight version serving rollout."
        )
        self.lease_bytes = m.create_gauge(
            metric_name("executor.rollout_lease"), unit="By", description="KV bytes lent to rollout by the current lease."
        )
        self.lease_held = m.create_gauge(
            metric_name("executor.rollout_lease_held"), description="1 while the executor holds a rollout lease (or is dedicated), else 0."
        )
        self.reclaim = m.create_histogram(
            metric_name("executor.reclaim_latency"), unit="s", description="Serving arrival or lease revocation to rollout yielded.", **hist
        )
        self.rollout_share = m.create_gauge(
            metric_name("executor.rollout_share"),
            description="The SLO guard's share of the device for rollout while serving has work (1: no limit, 0: rollout waits).",
        )
        self.slo_setpoint = m.create_gauge(
            metric_name("executor.slo_guard_setpoint"),
            description="The SLO guard's target for the short-window serving p99, as a fraction of the SLO.",
        )
        self.slo_tail_ratio = m.create_gauge(
            metric_name("executor.slo_guard_tail_ratio"),
            description="The SLO guard's measured short-window serving p99 (and live evidence) over the SLO, worst of TTFT and TPOT.",
        )
        self.burst_alerts = m.create_counter(
            metric_name("executor.burst_alerts"), unit="{alert}", description="Burst alerts this executor published about itself."
        )
        self.rollout_requests = m.create_counter(
            metric_name("executor.rollout_requests"),
            unit="{request}",
            description="Rollout turns answered over the bus, per outcome (ok, rejected, interrupted).",
        )


class Telemetry:
    def __init__(self, engine: CoServingEngine, executor_id: str, role: str, interval_s: float) -> None:
        self.engine = engine
        self.executor_id = executor_id
        self.role = role
        self.interval_s = interval_s
        self.last: EngineStats | None = None
        self.instruments = ExecutorInstruments()
        self._cumulative = {"prefix_hits": 0, "prefix_misses": 0, "prefix_host_hits": 0, "preemptions": 0, "lane_failures": 0}

    def snapshot(self, stats: EngineStats) -> MetricsSnapshot:
        return MetricsSnapshot(
            executor_id=self.executor_id,
            at=time.time(),
            interval_s=stats.interval_s,
            role=self.role,  # type: ignore[arg-type]
            ttft_ms=LatencySketch(**stats.ttft_ms),
            tpot_ms=LatencySketch(**stats.tpot_ms),
            serving_arrivals=stats.serving_arrivals,
            serving_completed=stats.serving_completed,
            serving_queue=stats.serving_queue,
            serving_queue_wait_ms=stats.serving_queue_wait_ms,
            serving_running=stats.serving_running,
            rollout_queue=stats.rollout_queue,
            rollout_running=stats.rollout_running,
            serving_tokens_per_s=stats.serving_tokens_per_s,
            rollout_tokens_per_s=stats.rollout_tokens_per_s,
            rollout_prefill_tokens_per_s=stats.rollout_prefill_tokens_per_s,
            serving_pool=PoolUsage(**vars(stats.serving_pool)),
            rollout_pool=PoolUsage(**vars(stats.rollout_pool)),
            prefix_hits=stats.prefix_hits,
            prefix_misses=stats.prefix_misses,
            prefix_host_hits=stats.prefix_host_hits,
            host_kv_bytes=stats.host_kv_bytes,
            preemptions=stats.preemptions,
            policy_version=stats.policy_version,
            lease_id=stats.lease_id,
            rollout_parked=stats.rollout_parked,
            rollout_mode=stats.rollout_mode,  # type: ignore[arg-type]  # (the engines set a RolloutMode)
            device=msgspec.convert(stats.device, DeviceTelemetry) if stats.device else None,
        )

    def bind(self, executor_id: str) -> None:
        """Once the service runtime is up (its meter provider installed, the instance named): counters that
        a dashboard or an alert reads start at 0, so they show 0, not "No data". (Added before the provider
        exists, a measurement goes to the API's proxy and is lost: the executors' http_errors never
        appeared in the compose cluster's Prometheus, scripts/compose-check, 4 December 2026.)"""
        self.executor_id = executor_id
        self.instruments.http_errors.add(0, self._attrs())

    def _attrs(self, **extra: str) -> dict[str, str]:
        return {"executor": self.executor_id, **extra}

    def serving_finished(self, result: GenerationResult) -> None:
        """One serving request done (called by the HTTP API): TTFT/TPOT histograms and the request count."""
        i, t = self.instruments, result.timings
        i.serving_requests.add(1, self._attrs(finish_reason=result.finish_reason))
        if result.finish_reason == "abort" or not result.token_ids:
            return
        i.ttft.record(t.ttft_ms / 1e3, self._attrs())
        if len(result.token_ids) > 1:
            i.tpot.record(t.tpot_ms / 1e3, self._attrs())

    def http_error(self, status: int) -> None:
        self.instruments.http_errors.add(1, self._attrs(code=str(status)))

    def burst_alerted(self) -> None:
        self.instruments.burst_alerts.add(1, self._attrs())

    def rollout_answered(self, outcome: str, reason: str = "") -> None:
        self.instruments.rollout_requests.add(1, self._attrs(outcome=outcome, reason=reason))

    def _accumulate(self, stats: EngineStats) -> None:
        """Fold one interval's engine stats into the instruments."""
        i = self.instruments
        serving, rollout = self._attrs(**{"class": "serving"}), self._attrs(**{"class": "rollout"})
        i.tokens.add(stats.serving_tokens_per_s * stats.interval_s, serving)
        i.tokens.add(stats.rollout_tokens_per_s * stats.interval_s, rollout)
        i.queue.set(stats.serving_queue, serving)
        i.queue.set(stats.rollout_queue, rollout)
        i.running.set(stats.serving_running, serving)
        i.running.set(stats.rollout_running, rollout)
        for pool_name, pool in (("serving", stats.serving_pool), ("rollout", stats.rollout_pool)):
            i.kv_used.set(pool.used_blocks * pool.block_bytes, self._attrs(pool=pool_name))
            i.kv_capacity.set(pool.total_blocks * pool.block_bytes, self._attrs(pool=pool_name))
        i.kv_used.set(stats.host_kv_bytes, self._attrs(pool="host"))  # the rollout pool's host tier
        for key, counter, value in (
            ("prefix_hits", i.prefix_hits, stats.prefix_hits),
            ("prefix_misses", i.prefix_misses, stats.prefix_misses),
            ("prefix_host_hits", i.prefix_host_hits, stats.prefix_host_hits),
            ("preemptions", i.preemptions, stats.preemptions),
            ("lane_failures", i.lane_failures, stats.lane_failures),
        ):  # the engine counts since start: add what is new
            counter.add(max(0, value - self._cumulative[key]), self._attrs())
            self._cumulative[key] = value
        i.policy_version.set(stats.policy_version, self._attrs())
        i.lease_bytes.set(stats.lease_budget_bytes, self._attrs())
        i.lease_held.set(1 if stats.lease_id else 0, self._attrs())
        for ms in stats.reclaim_latency_ms:
            i.reclaim.record(ms / 1e3, self._attrs())
        if stats.slo_guard is not None:
            i.rollout_share.set(stats.slo_guard.share, self._attrs())
            i.slo_setpoint.set(stats.slo_guard.setpoint, self._attrs())
            i.slo_tail_ratio.set(stats.slo_guard.tail_ratio, self._attrs())
        self.last = stats

    async def run(self, bus: Bus) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            stats = self.engine.stats()
            self._accumulate(stats)
            try:
                await bus.publish(EXECUTOR_METRICS, self.snapshot(stats), executor_id=self.executor_id)
            except Exception as exc:  # reconnecting: the totals keep counting, the next snapshot goes out
                log.warning("could not publish metrics: %r", exc)

    def load(self) -> dict[str, float]:
        """What the heartbeat reports as load."""
        last = self.last
        if last is None:
            return {}
        # forwards that carried serving's rows and rollout's (co_batched.py); the engines that keep no such count leave it out
        co_batched = getattr(getattr(self.engine, "metrics", None), "co_batched_iterations", None)
        return {
            "serving_queue": float(last.serving_queue),
            "serving_running": float(last.serving_running),
            "rollout_queue": float(last.rollout_queue),
            "rollout_running": float(last.rollout_running),
            "rollout_tokens_per_s": round(last.rollout_tokens_per_s, 1),
            "serving_tokens_per_s": round(last.serving_tokens_per_s, 1),
            "policy_version": float(last.policy_version),
            **({"co_batched_iterations": float(co_batched)} if co_batched is not None else {}),
            "lease_held": 1.0 if last.lease_id and not last.rollout_parked else 0.0,
            "lease_parked": 1.0 if last.rollout_parked else 0.0,
            **({"rollout_share": round(last.slo_guard.share, 3)} if last.slo_guard is not None else {}),
        }
