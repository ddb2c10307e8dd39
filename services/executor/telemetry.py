"""Every interval: read the engine's stats, publish a MetricsSnapshot, and keep running totals for /metrics.

The engine hands out each interval's latency sketches once; this is the only reader, so the
Prometheus endpoint serves cumulative figures merged here rather than stealing intervals.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from ddsketch import DDSketch

from rose.contracts.executor import DeviceTelemetry, LatencySketch, MetricsSnapshot, PoolUsage
from rose.contracts.registry import EXECUTOR_METRICS
from rose.shared.bus import Bus

from .engine import Engine, EngineStats
from rose.shared.sketch import SKETCH_RELATIVE_ACCURACY, sketch_from_dict

log = logging.getLogger("rose.executor.telemetry")

QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class Totals:
    """Cumulative figures since start, for Prometheus counters and summaries."""

    ttft: DDSketch = field(default_factory=lambda: DDSketch(SKETCH_RELATIVE_ACCURACY))
    tpot: DDSketch = field(default_factory=lambda: DDSketch(SKETCH_RELATIVE_ACCURACY))
    serving_requests: int = 0
    serving_tokens: float = 0.0
    rollout_tokens: float = 0.0
    http_errors: dict[int, int] = field(default_factory=dict)
    last: EngineStats | None = None


class Telemetry:
    def __init__(self, engine: Engine, executor_id: str, role: str, interval_s: float) -> None:
        self.engine = engine
        self.executor_id = executor_id
        self.role = role
        self.interval_s = interval_s
        self.totals = Totals()

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
            serving_running=stats.serving_running,
            rollout_queue=stats.rollout_queue,
            rollout_running=stats.rollout_running,
            serving_tokens_per_s=stats.serving_tokens_per_s,
            rollout_tokens_per_s=stats.rollout_tokens_per_s,
            serving_pool=PoolUsage(**vars(stats.serving_pool)),
            rollout_pool=PoolUsage(**vars(stats.rollout_pool)),
            prefix_hits=stats.prefix_hits,
            prefix_misses=stats.prefix_misses,
            preemptions=stats.preemptions,
            policy_version=stats.policy_version,
            lease_id=stats.lease_id,
            device=DeviceTelemetry(**stats.device) if stats.device else None,
        )

    def _accumulate(self, stats: EngineStats) -> None:
        t = self.totals
        t.ttft.merge(sketch_from_dict(stats.ttft_ms))
        t.tpot.merge(sketch_from_dict(stats.tpot_ms))
        t.serving_requests += stats.serving_completed
        t.serving_tokens += stats.serving_tokens_per_s * stats.interval_s
        t.rollout_tokens += stats.rollout_tokens_per_s * stats.interval_s
        t.last = stats

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
        last = self.totals.last
        if last is None:
            return {}
        return {
            "serving_queue": float(last.serving_queue),
            "serving_running": float(last.serving_running),
            "rollout_running": float(last.rollout_running),
            "rollout_tokens_per_s": round(last.rollout_tokens_per_s, 1),
            "serving_tokens_per_s": round(last.serving_tokens_per_s, 1),
        }

    def prometheus(self) -> str:
        """Prometheus text exposition of the executor's figures."""
        t, last = self.totals, self.totals.last
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{labels} {value:.6g}")

        ex = f'executor="{self.executor_id}"'
        for name, sketch, help_ in (
            ("rose_executor_ttft_seconds", t.ttft, "Serving time to first token."),
            ("rose_executor_tpot_seconds", t.tpot, "Serving time per output token."),
        ):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} summary"]
            for q in QUANTILES:
                lines.append(f'{name}{{{ex},quantile="{q}"}} {(sketch.get_quantile_value(q) or 0.0) / 1e3:.6g}')
            lines.append(f"{name}_sum{{{ex}}} {sketch.sum / 1e3:.6g}")
            lines.append(f"{name}_count{{{ex}}} {sketch.count:.6g}")
        metric("rose_executor_serving_requests_total", "counter", "Serving requests completed.", [(f"{{{ex}}}", t.serving_requests)])
        metric(
            "rose_executor_generated_tokens_total",
            "counter",
            "Tokens generated, per work class.",
            [(f'{{{ex},class="serving"}}', t.serving_tokens), (f'{{{ex},class="rollout"}}', t.rollout_tokens)],
        )
        metric(
            "rose_executor_http_errors_total",
            "counter",
            "HTTP error responses, per status code.",
            [(f'{{{ex},code="{code}"}}', n) for code, n in sorted(t.http_errors.items())] or [(f'{{{ex},code="none"}}', 0)],
        )
        if last is not None:
            metric("rose_executor_queue_length", "gauge", "Requests waiting, per work class.", [(f'{{{ex},class="serving"}}', last.serving_queue), (f'{{{ex},class="rollout"}}', last.rollout_queue)])
            metric("rose_executor_running", "gauge", "Requests running, per work class.", [(f'{{{ex},class="serving"}}', last.serving_running), (f'{{{ex},class="rollout"}}', last.rollout_running)])
            metric(
                "rose_executor_kv_used_bytes",
                "gauge",
                "KV-cache bytes in use, per pool.",
                [(f'{{{ex},pool="serving"}}', last.serving_pool.used_blocks * last.serving_pool.block_bytes), (f'{{{ex},pool="rollout"}}', last.rollout_pool.used_blocks * last.rollout_pool.block_bytes)],
            )
            metric(
                "rose_executor_kv_capacity_bytes",
                "gauge",
                "KV-cache bytes usable now, per pool (rollout: bounded by the lease).",
                [(f'{{{ex},pool="serving"}}', last.serving_pool.total_blocks * last.serving_pool.block_bytes), (f'{{{ex},pool="rollout"}}', last.rollout_pool.total_blocks * last.rollout_pool.block_bytes)],
            )
            metric("rose_executor_prefix_cache_hits_total", "counter", "Rollout prefix-cache hits.", [(f"{{{ex}}}", last.prefix_hits)])
            metric("rose_executor_prefix_cache_misses_total", "counter", "Rollout prefix-cache misses.", [(f"{{{ex}}}", last.prefix_misses)])
            metric("rose_executor_rollout_preemptions_total", "counter", "Rollout sequences preempted.", [(f"{{{ex}}}", last.preemptions)])
            metric("rose_executor_policy_version", "gauge", "Policy weight version being served to rollout.", [(f"{{{ex}}}", last.policy_version)])
            metric("rose_executor_rollout_lease_bytes", "gauge", "KV bytes lent to rollout by the current lease.", [(f"{{{ex}}}", last.lease_budget_bytes)])
        return "\n".join(lines) + "\n"
