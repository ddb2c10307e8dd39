"""What any co-serving engine hands back: a ``RequestHandle`` per submitted request, an ``EngineStats`` per
metrics interval.

A module of its own because both engines produce them (``engine.Engine`` and ``sglang_backend.SGLangBackend``)
and the services consume them through ``backend.CoServingEngine``: neither engine imports the other for them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from .kv_pool import PoolUsage
from .protocol import GenerationResult, StreamDelta
from .slo_guard import GuardState


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    """One snapshot; latency sketches and rates cover the interval since the previous call."""

    interval_s: float
    ttft_ms: dict  # contracts.executor.LatencySketch fields
    tpot_ms: dict
    serving_arrivals: int
    serving_completed: int
    serving_queue: int
    serving_running: int
    rollout_queue: int
    rollout_running: int
    serving_tokens_per_s: float
    rollout_tokens_per_s: float
    serving_pool: PoolUsage
    rollout_pool: PoolUsage
    prefix_hits: int
    prefix_misses: int
    preemptions: int
    compute_yields: int
    reclaim_latency_ms: list[float]  # samples of this interval
    max_swap_pause_ms: float
    policy_version: int
    lease_id: str
    lease_budget_bytes: int
    device: dict = field(default_factory=dict)
    lane_failures: int = 0  # all-time: iterations that raised (logged; their running requests aborted)
    slo_guard: GuardState | None = None  # the closed loop's state at the snapshot (slo_guard.py)
    serving_queue_wait_ms: float | None = None  # the queue's last first token, projected (None: unknown)
    rollout_parked: bool = False  # a burst parked the lease: rollout keeps its KV here and computes nothing
    prefix_host_hits: int = 0  # all-time: of prefix_misses (the device's), those the host tier restored
    host_kv_bytes: int = 0  # what the host tier holds now
    rollout_prefill_tokens_per_s: float = 0.0  # what a turn's prefill gets here lately (0: none measured yet)
    rollout_mode: str = "two_model"  # contracts.executor.RolloutMode: co_batched rows raise serving's TPOT by design


class RequestHandle:
    """Async iterator of ``StreamDelta``; ``await result()`` gives the ``GenerationResult``.

    Two sides, both on the caller's event loop: the engine that accepted the request (``Engine`` or
    ``SGLangBackend``) produces through ``deliver`` and ``fail`` and gives ``cancel`` its abort; the
    caller consumes (``async for``, ``result``, ``done``, ``cancel``)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, cancel: Callable[[str], object] | None = None) -> None:
        self.request_id = request_id
        self._loop = loop
        self._deltas: asyncio.Queue = asyncio.Queue()
        self._result: asyncio.Future = loop.create_future()
        self._cancel = cancel  # the accepting engine's abort for this request id

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamDelta:
        item = await self._deltas.get()
        if item is None:
            raise StopAsyncIteration
        return item

    async def result(self) -> GenerationResult:
        return await asyncio.shield(self._result)

    def done(self) -> bool:
        """True once the result is in: a caller can watch a request (or tell a parked one from a finished one) without awaiting it."""
        return self._result.done()

    def cancel(self) -> None:
        """Abort the generation; it finishes with finish_reason "abort"."""
        if self._cancel:
            self._cancel(self.request_id)

    # the producer's side, on the loop thread
    def deliver(self, delta: StreamDelta | None, result: GenerationResult | None) -> None:
        """New output and/or the final result (the first result wins; the delta stream ends with it)."""
        if delta is not None:
            self._deltas.put_nowait(delta)
        if result is not None and not self.done():
            self._result.set_result(result)
            self._deltas.put_nowait(None)

    def fail(self, exc: BaseException) -> None:
        """The request was refused after it was accepted: ``result()`` raises ``exc``, the delta stream just ends."""
        if not self.done():
            self._result.set_exception(exc)
            self._deltas.put_nowait(None)
