"""An engine backend that drives two real SGLang servers over HTTP, sharing one GPU.

Why: SGLang's kernels, batching and radix cache are far faster than our engine on a GPU, while
the executor's value is the co-serving control around them (leases, SLO-driven reclaim, weight
versions, telemetry). So this backend offers the executor's engine surface
(``backend.CoServingEngine``) and maps it onto SGLang's HTTP API (0.5.3):

- serving: the *serving* server (``sglang_backend.serving_url``) gets every serving request as a
  streamed ``/generate`` at ``serving_priority``; timings are measured here, on our clock.
- rollout: the *rollout* server (``rollout_url``, the policy model, started with
  ``--enable-memory-saver``) gets rollout requests, admitted only under a lease exactly as
  ``Engine`` admits them. Lending is done with SGLang's RL admin calls, serialised by one worker
  so a grant never overtakes a revoke: grant -> ``/resume_memory_occupation {kv_cache}`` then
  ``/continue_generation``; revoke or expiry -> ``/pause_generation {retract}`` then
  ``/release_memory_occupation {kv_cache}``, so the KV memory goes back to the GPU for serving.
- weights: a host mirror of the policy (loaded from the policy directory) is the delta base the
  bus weight follower needs; an update sends only the tensors that differ from the mirror, over
  ``/update_weights_from_tensor`` (same host: shared-memory tensors) or as a safetensors
  directory for ``/update_weights_from_disk`` (a volume both can see). A refusal keeps the mirror.
- stats: both servers' ``/metrics`` are scraped in the background; histogram bucket deltas
  become DDSketches, so the SLO monitor merges them like our engine's.

Everything here runs on the event loop that called ``start()``; ``apply_policy_weights`` and the
lease calls may come from other threads and hop onto it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import torch
from ddsketch import DDSketch
from prometheus_client.parser import text_string_to_metric_families

from rose.shared.bursts import BURST_BASELINE_S, ArrivalBurstDetector, BurstSettings, BurstTrip
from rose.shared.errors import RoseError
from rose.shared.sketch import sketch_to_dict
from rose.shared.weight_layout import save_safetensors

from .config import SGLangBackendSettings
from .device import select_device
from .kv_pool import PoolUsage
from .lease_state import LeaseState
from .metrics import EngineMetrics, IntervalCounters
from .outputs import EngineStats, RequestHandle
from .policies import make_policy
from .protocol import (
    SERVING_MODEL_VERSION,
    EngineLease,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    InvalidRequest,
    RolloutRejected,
    StreamDelta,
    TopLogprobs,
    WorkClass,
    next_delta,
    timings_since,
    validate_request,
)
from .sglang_tensors import serialize_named_tensors
from .weights import StagedWeights, WeightUpdateError, stage

log = logging.getLogger("rose.executor.sglang")

KV_TAGS = ["kv_cache"]
# labels that name one rank of a tensor/pipeline/expert-parallel group: every rank reports the same
# batch, so series that differ only in these are one value (max), not several to add
RANK_LABELS = frozenset({"tp_rank", "pp_rank", "moe_ep_rank"})
TTFT_METRIC = "sglang:time_to_first_token_seconds"
ITL_METRIC = "sglang:inter_token_latency_seconds"
TPOT_METRIC = "sglang:time_per_output_token_seconds"  # older servers (0.4.x) export this instead of ITL
GEN_TOKENS = "sglang:generation_tokens_total"
FINISH_TYPES: tuple[FinishReason, ...] = ("stop", "length", "abort")


class ServerError(RoseError, RuntimeError):
    """An SGLang server answered with an error status; ``message`` is what it said."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url} answered {status}: {message}")
        self.url, self.status, self.message = url, status, message


# ---------------------------------------------------------------------------- wire formats


class SSEDecoder:
    """Server-sent events from arbitrary byte chunks: yields each event's data (lines joined by \\n).

    SGLang writes ``data: <json>\\n\\n`` per chunk and ``data: [DONE]\\n\\n`` at the end; a TCP read
    may split an event anywhere, so bytes are buffered until the blank line that ends it.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        if b"\r" in self._buf:
            keep_cr = self._buf.endswith(b"\r")  # may be half of a \r\n split across reads
            self._buf = self._buf[:-1] if keep_cr else self._buf
            self._buf = self._buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + (b"\r" if keep_cr else b"")
        events: list[str] = []
        while True:
            end = self._buf.find(b"\n\n")
            if end < 0:
                return events
            block, self._buf = self._buf[:end], self._buf[end + 2 :]
            data = [line[5:].removeprefix(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
            if data:
                events.append(b"\n".join(data).decode("utf-8", errors="replace"))


def error_message(text: str) -> str:
    """The human part of an SGLang error body (its several envelopes), else the text itself."""
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:1000]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if body.get(key):
                return str(body[key])
    return text.strip()[:1000]


def finish_reason_of(raw: Any) -> FinishReason | None:
    """SGLang's ``{"type": "stop"|"length"|"abort", ...}`` (or a bare string) -> ours; None while running."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else raw
    return kind if kind in FINISH_TYPES else "abort"


# ---------------------------------------------------------------------------- Prometheus scrape


@dataclass
class Histogram:
    buckets: dict[float, float]  # upper bound -> cumulative count
    sum: float = 0.0
    count: float = 0.0


@dataclass
class Scrape:
    """One server's metrics, each name reduced to one value across label sets (see ``parse_metrics``)."""

    histograms: dict[str, Histogram] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)  # gauges and counters (counters by their `_total` name)


def _reduce(series: dict[tuple, dict[tuple, float]]) -> dict[tuple, float]:
    """{group -> {rank labels -> value}} -> {group -> value}: max over ranks (they repeat one batch)."""
    return {group: max(ranks.values()) for group, ranks in series.items()}


def parse_metrics(text: str) -> Scrape:
    """Parse Prometheus text; series of one name are added up (data-parallel ranks, label variants),
    except series that differ only in tensor/pipeline ranks, which report the same thing (max)."""
    hist: dict[str, dict[str, dict[tuple, dict[tuple, float]]]] = {}
    values: dict[str, dict[tuple, dict[tuple, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            ranks = tuple(sorted((k, v) for k, v in labels.items() if k in RANK_LABELS))
            group = tuple(sorted((k, v) for k, v in labels.items() if k not in RANK_LABELS and k != "le"))
            if family.type == "histogram":
                for suffix in ("_bucket", "_sum", "_count"):
                    if sample.name == family.name + suffix:
                        key = f"{suffix}:{labels['le']}" if suffix == "_bucket" else suffix
                        hist.setdefault(family.name, {}).setdefault(key, {}).setdefault(group, {})[ranks] = sample.value
            elif family.type == "counter":
                if sample.name.endswith("_created"):
                    continue
                name = sample.name if sample.name.endswith("_total") else sample.name + "_total"
                values.setdefault(name, {}).setdefault(group, {})[ranks] = sample.value
            elif family.type in ("gauge", "untyped", "unknown"):
                values.setdefault(sample.name, {}).setdefault(group, {})[ranks] = sample.value
    out = Scrape()
    for name, parts in hist.items():
        h = Histogram({})
        for key, series in parts.items():
            total = sum(_reduce(series).values())
            if key.startswith("_bucket:"):
                h.buckets[float(key[len("_bucket:") :])] = total
            elif key == "_sum":
                h.sum = total
            else:
                h.count = total
        out.histograms[name] = h
    for name, series in values.items():
        out.values[name] = sum(_reduce(series).values())
    return out


def histogram_delta(prev: Histogram | None, cur: Histogram) -> tuple[list[tuple[float, float, float]], float]:
    """Observations between two scrapes: ([(lower, upper, count) per bucket], sum of values).

    A server restart resets its counters: when anything went down, the current scrape is all new.
    """
    bounds = sorted(cur.buckets)
    reset = prev is None or cur.count < prev.count or any(cur.buckets[b] < prev.buckets.get(b, 0.0) for b in bounds)
    base = Histogram({}) if reset or prev is None else prev
    out = []
    lower, below = 0.0, 0.0
    for upper in bounds:
        cumulative = cur.buckets[upper] - base.buckets.get(upper, 0.0)
        count = cumulative - below
        if count > 0:
            out.append((lower, upper, count))
        lower, below = upper, cumulative
    return out, cur.sum - base.sum


def add_buckets(sketch: DDSketch, buckets: list[tuple[float, float, float]], total: float, scale: float = 1000.0) -> float:
    """Add bucketed observations to a DDSketch, each bucket's count at one representative value.

    Prometheus keeps only counts per bucket, so a value inside each bucket stands for them all:
    the mean (``total / count``) when every observation fell in one bucket (exact for that
    interval), else the geometric midpoint ``sqrt(lower * upper)`` (DDSketch's error is relative,
    and the geometric midpoint bounds it by ``sqrt(upper / lower)``), half the upper bound for
    the first bucket (lower bound 0), and for the overflow bucket (upper = +Inf) what the sum
    leaves over for it, never below its lower bound. ``scale`` converts units (s -> ms).
    Returns the number of observations added.
    """
    n = sum(c for _, _, c in buckets)
    if n <= 0:
        return 0.0
    if len(buckets) == 1:
        lower, upper, count = buckets[0]
        mean = total / count
        sketch.add((mean if lower <= mean <= upper else _midpoint(lower, upper)) * scale, count)
        return n
    finite = 0.0
    for lower, upper, count in buckets:
        if math.isfinite(upper):
            finite += _midpoint(lower, upper) * count
            sketch.add(_midpoint(lower, upper) * scale, count)
    for lower, upper, count in buckets:
        if not math.isfinite(upper):
            sketch.add(max(lower, (total - finite) / count) * scale, count)
    return n


def _midpoint(lower: float, upper: float) -> float:
    if not math.isfinite(upper):
        return lower
    return upper / 2 if lower <= 0 else math.sqrt(lower * upper)


# ---------------------------------------------------------------------------- per-request state


@dataclass(kw_only=True)
class _Job:
    request: GenerationRequest
    handle: RequestHandle
    rid: str  # the id on the SGLang server (unique, fixed length: SGLang aborts by rid prefix)
    arrival: float
    task: asyncio.Task | None = None
    posted: bool = False
    aborted: bool = False
    done: bool = False
    accepted_at: float | None = None  # the server answered (headers)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # when the request asked for alternatives
    versions: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    emitted_tokens: int = 0
    emitted_text: int = 0
    finish: FinishReason | None = None
    cached_tokens: int = 0
    retractions: int = 0

    @property
    def rollout(self) -> bool:
        return self.request.work_class is WorkClass.ROLLOUT


@dataclass(frozen=True)
class ModelInfo:
    """What we need of a model directory without loading its weights."""

    vocab_size: int
    max_positions: int
    kv_bytes_per_token: int

    @classmethod
    def of(cls, directory: str, dtype: torch.dtype) -> ModelInfo:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(directory, local_files_only=True)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        elem = torch.empty((), dtype=dtype).element_size()
        return cls(cfg.vocab_size, cfg.max_position_embeddings, 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * elem)


# ---------------------------------------------------------------------------- the backend


class SGLangBackend:
    """``CoServingEngine`` over a serving SGLang server and a rollout SGLang server."""

    def __init__(
        self,
        settings: SGLangBackendSettings,
        *,
        serving_dir: str,
        policy_dir: str,
        dtype: torch.dtype = torch.float32,
        policy: str = "rose",
        device: str = "auto",
        slo_ttft_ms: float | None = None,
        slo_tpot_ms: float | None = None,
        rollout_kv_bytes: int = 0,
        bursts: BurstSettings | None = None,
        burst_baseline_s: float = BURST_BASELINE_S,
    ) -> None:
        from rose.shared.models import load_for_inference, load_tokenizer

        self.settings = settings
        self.serving_url = settings.serving_url.rstrip("/")
        self.rollout_url = settings.rollout_url.rstrip("/")
        self.policy_dir = Path(policy_dir)
        self.policy = make_policy(policy)
        self.device = select_device(device)
        self.policy_version = 0
        self.slo_ttft_ms, self.slo_tpot_ms = slo_ttft_ms, slo_tpot_ms
        # what a lease may grant: SGLang cannot bound its pool at run time, so this is the executor's setting, reported
        self.lendable_kv_bytes = rollout_kv_bytes
        self.bursts = ArrivalBurstDetector(
            bursts or BurstSettings(), burst_baseline_s
        )  # the same detector as the home engine's, on serving arrivals here
        self.on_burst: list[Callable[[BurstTrip], None]] = []
        self._tokenizers = {WorkClass.SERVING: load_tokenizer(serving_dir), WorkClass.ROLLOUT: load_tokenizer(policy_dir)}
        self._mirror = load_for_inference(policy_dir, "cpu", dtype)  # the policy as the rollout server should have it
        self._models = {WorkClass.SERVING: ModelInfo.of(serving_dir, dtype), WorkClass.ROLLOUT: ModelInfo.of(policy_dir, dtype)}
        from rose.shared.nats_server import state_dir

        self.staging_dir = Path(settings.staging_dir) if settings.staging_dir else state_dir() / "sglang-weights"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None
        self._jobs: dict[str, _Job] = {}
        self.lease = LeaseState()
        self._expiry: asyncio.TimerHandle | None = None
        self._ops: asyncio.Queue | None = None
        self._pending_ops: list[str] = []
        self._kv_tokens: dict[WorkClass, int] = {}  # each server's KV capacity in tokens (/get_server_info)
        self._server_lent: bool | None = None  # what the rollout server was last told successfully (None: unknown)
        self._server_parked = False  # paused in place by a burst's revocation (KV kept), not yet continued
        self._lent = asyncio.Event()  # rollout requests go out only while set (lease held, server lent)
        self._weights_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self._scrape_now = asyncio.Event()
        self.scrapes = 0  # completed scrape rounds (the first one is only the baseline of the counters)
        self._last_scrape: dict[str, Scrape] = {}
        self._scrape_ok: dict[str, bool] = {}
        self._lock = threading.Lock()  # the counters: stats() may be called from any thread
        self._interval = IntervalCounters()
        self.metrics = EngineMetrics()  # no local lanes: /health reports ok here, each server's own /health tells the rest
        self._compute_yields = 0
        self._max_swap_pause_ms = 0.0
        self._prefix_hits = self._prefix_misses = self._preemptions = 0
        self._started = self._stopping = False

    @classmethod
    def from_dirs(cls, serving_dir: str, policy_dir: str, settings: SGLangBackendSettings, **kw: Any) -> SGLangBackend:
        return cls(settings, serving_dir=serving_dir, policy_dir=policy_dir, **kw)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Open the HTTP session and start the lending worker and the metrics scraper (on the running loop)."""
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        s = self.settings
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=s.max_connections),
            timeout=aiohttp.ClientTimeout(total=None, connect=s.connect_timeout_s, sock_connect=s.connect_timeout_s),
        )
        self._ops = asyncio.Queue()
        if not self._pending_ops:  # no lease yet: the rollout server must not hold KV memory serving may need
            self._pending_ops.append("revoke")
        for op in self._pending_ops:
            self._ops.put_nowait(op)
        self._pending_ops.clear()
        if self.lease.current is not None:
            self._arm_expiry(self.lease.current)
        self._tasks = [
            self._loop.create_task(self._lending_worker(), name="sglang-lending"),
            self._loop.create_task(self._scrape_loop(), name="sglang-scrape"),
            self._loop.create_task(self._probe_servers(), name="sglang-probe"),
        ]

    async def stop(self) -> None:
        """Abort what is in flight (finished with "abort"), hand the rollout server's KV back, close."""
        if not self._started or self._stopping:
            self._stopping = True
            return
        self._stopping = True
        jobs = list(self._jobs.values())
        await asyncio.gather(*(self._abort_on_server(j, grace=False) for j in jobs if j.posted and not j.done), return_exceptions=True)
        for job in jobs:
            if job.task is not None:
                job.task.cancel()
        await asyncio.gather(*(j.task for j in jobs if j.task is not None), return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._expiry is not None:
            self._expiry.cancel()
        if self._server_lent is not False and self.policy.admits_rollout:
            try:
                async with asyncio.timeout(self.settings.connect_timeout_s):
                    await self._reclaim()
            except (TimeoutError, Exception) as exc:
                log.warning("could not pause the rollout server while stopping: %s", exc)
        if self._session is not None:
            await self._session.close()

    # ------------------------------------------------------------------ public API
    def tokenizer_for(self, work_class: WorkClass):
        return self._tokenizers[work_class]

    def max_positions(self, work_class: WorkClass) -> int:
        return self._models[work_class].max_positions

    def submit(self, request: GenerationRequest, *, require_lease: bool = True) -> RequestHandle:
        """Validate and send; call from the running loop. Raises InvalidRequest or RolloutRejected.

        Rollout without a valid lease is refused unless ``require_lease`` is False: then it waits
        here until a lease comes (it never reaches the rollout server without one either way).
        """
        if self._stopping:
            raise RolloutRejected("draining", "the engine is stopping")
        if not self._started:
            raise RuntimeError("SGLangBackend.start() has not been called")
        self._validate(request)
        rollout = request.work_class is WorkClass.ROLLOUT
        if rollout and (require_lease or not self.policy.admits_rollout):
            self.lease.check_admits(self.policy.admits_rollout, self.policy.name)
        loop = asyncio.get_running_loop()
        # the abort closes over `job`, bound on the next line (a closure reads it when called)
        handle = RequestHandle(request.request_id, loop, cancel=lambda _rid: self._on_loop(lambda: self._cancel(job)))
        job = _Job(request=request, handle=handle, rid=f"rose-{uuid.uuid4().hex}", arrival=time.monotonic())
        self._jobs[job.rid] = job
        job.task = loop.create_task(self._run(job), name=f"sglang-{request.request_id}")
        if not rollout:
            with self._lock:
                self._interval.serving_arrivals += 1
            self._serving_arrived()
        return handle

    def _serving_arrived(self) -> None:
        """The burst detector sees every serving arrival, with the requests still before their first token; a trip
        goes to ``on_burst`` (the executor publishes the alert; the scheduler revokes the lease)."""
        pending = sum(1 for j in self._jobs.values() if not j.rollout and not j.done and not j.token_times)
        trip = self.bursts.arrival(time.monotonic(), pending, None, self.slo_ttft_ms)
        if trip is not None and self.policy.admits_rollout:
            for listener in self.on_burst:
                listener(trip)

    async def __aenter__(self) -> SGLangBackend:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def set_rollout_lease(self, budget_bytes: int, expires_at_monotonic: float, lease_id: str = "") -> None:
        """Grant (or renew) the lease. SGLang cannot bound its KV pool at run time, so the budget is
        reported, not enforced: the rollout server's share of the GPU is its --mem-fraction-static."""
        lease = self.lease.grant(budget_bytes, expires_at_monotonic, lease_id)
        self._on_loop(lambda: self._arm_expiry(lease))
        if self.policy.admits_rollout:
            self._enqueue("grant")

    def set_rollout_budget(self, budget_bytes: int) -> None:
        lease = self.lease.current
        if lease is not None:
            self.set_rollout_lease(budget_bytes, lease.expires_at, lease.lease_id)

    def park_rollout(self, until_monotonic: float) -> None:
        """The lease was revoked on a burst: refuse new rollout and pause the rollout server in place
        (its requests keep their KV) until a new lease continues it or ``until_monotonic`` ends the
        lease as an expiry does (pause with retract, KV released)."""
        lease = self.lease.park(until_monotonic)
        if lease is not None:
            self._on_loop(lambda: self._arm_expiry(lease))
            self._enqueue("park")

    def revoke_rollout(self) -> None:
        """Take the lease back now: the rollout server pauses (retract) and releases its KV cache."""
        self.lease.revoke()
        self._enqueue("revoke")

    def set_slo(self, ttft_ms: float | None, tpot_ms: float | None) -> None:
        self.slo_ttft_ms, self.slo_tpot_ms = ttft_ms, tpot_ms

    def apply_policy_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> concurrent.futures.Future:
        """Validate now against the mirror (raises WeightUpdateError, nothing sent), then send what changed.

        The future resolves with the pause in ms (how long the rollout server took to load the
        update, during which its generation waits) once the server has the new version.
        """
        staged = stage(self._mirror, state_dict, version)
        if self._loop is None or self._stopping:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_exception(WeightUpdateError("the SGLang backend is not running: start() it first"))
            return done
        return asyncio.run_coroutine_threadsafe(self._update_weights(staged), self._loop)

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The host mirror of the rollout server's policy (read-only use: the follower's delta base, a digest)."""
        return self._mirror.state_dict()

    def stats(self) -> EngineStats:
        """The interval since the previous call, from the latest scrapes; never waits for a server."""
        self._scrape_now.set()  # refresh for the next call, in the background
        now = time.monotonic()
        with self._lock:
            interval, self._interval = self._interval, IntervalCounters(started=now)
        span = max(1e-9, now - interval.started)
        serving, rollout = self._last_scrape.get("serving", Scrape()), self._last_scrape.get("rollout", Scrape())
        waiting_here = sum(1 for j in self._jobs.values() if j.rollout and not j.posted and not j.done)
        try:
            device = vars(self.device.telemetry())
        except Exception as exc:  # e.g. NVML missing: telemetry goes on without device figures
            log.debug("device telemetry unavailable: %s", exc)
            device = {}
        return EngineStats(
            interval_s=span,
            ttft_ms=sketch_to_dict(interval.ttft),
            tpot_ms=sketch_to_dict(interval.tpot),
            serving_arrivals=interval.serving_arrivals,
            serving_completed=interval.serving_completed,
            serving_queue=int(serving.values.get("sglang:num_queue_reqs", 0)),
            serving_running=int(serving.values.get("sglang:num_running_reqs", 0)),
            rollout_queue=int(rollout.values.get("sglang:num_queue_reqs", 0)) + waiting_here,
            rollout_running=int(rollout.values.get("sglang:num_running_reqs", 0)),
            serving_tokens_per_s=interval.serving_tokens / span,
            rollout_tokens_per_s=interval.rollout_tokens / span,
            serving_pool=self._pool(WorkClass.SERVING, serving),
            rollout_pool=self._pool(WorkClass.ROLLOUT, rollout),
            prefix_hits=self._prefix_hits,
            prefix_misses=self._prefix_misses,
            preemptions=self._preemptions,
            compute_yields=self._compute_yields,
            reclaim_latency_ms=interval.reclaim_ms,
            max_swap_pause_ms=self._max_swap_pause_ms,
            policy_version=self.policy_version,
            lease_id=self.lease.lease_id,
            lease_budget_bytes=self.lease.budget_bytes,
            rollout_parked=self.lease.parked,
            device=device,
        )

    # ------------------------------------------------------------------ validation and admission (as Engine)
    def _validate(self, request: GenerationRequest) -> None:
        info = self._models[request.work_class]
        validate_request(request, info.vocab_size, info.max_positions)

    # ------------------------------------------------------------------ loop plumbing
    def _on_loop(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the backend's loop: now when already there, else soon (thread-safe)."""
        loop = self._loop
        if loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            fn()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(fn)

    def _enqueue(self, op: str) -> None:
        """Queue a lending call for the rollout server: ``grant``, ``park`` or ``revoke``, carried out in order."""
        if op == "revoke":
            self._on_loop(self._lent.clear)
        if self._ops is None:
            self._pending_ops.append(op)
        else:
            self._on_loop(lambda: self._ops.put_nowait(op))  # type: ignore[union-attr]

    def _arm_expiry(self, lease: EngineLease) -> None:
        """Expire the lease locally on time, whatever the scheduler does (as Engine does)."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if self._loop is None or math.isinf(lease.expires_at):
            return
        self._expiry = self._loop.call_later(max(0.0, lease.expires_at - time.monotonic()), self._expire, lease)

    def _expire(self, lease: EngineLease) -> None:
        """The lease's time is up (``LeaseState.expire_if_due`` says how it ended: expired, or revoked if parked)."""
        if self.lease.current is lease and self.lease.expire_if_due():
            self._enqueue("revoke")

    async def _probe_servers(self) -> None:
        """Once at start: each server's KV capacity (for the pool stats), and whether the rollout server runs
        another version than the mirror (it outlived an executor restart).

        A version mismatch is not fixed here: the weight follower starts from no base and applies the
        latest version in full, which sends every tensor that differs from the mirror.
        """
        infos = {}
        for work_class, url in ((WorkClass.SERVING, self.serving_url), (WorkClass.ROLLOUT, self.rollout_url)):
            try:
                infos[work_class] = await self._call(url, "/get_server_info", method="GET", timeout=self.settings.connect_timeout_s)
            except (TimeoutError, Exception) as exc:
                log.warning("SGLang server %s is not answering yet: %s", url, exc)
                continue
            tokens = infos[work_class].get("max_total_num_tokens") if isinstance(infos[work_class], dict) else None
            if isinstance(tokens, int) and not isinstance(tokens, bool):
                self._kv_tokens[work_class] = tokens
        info = infos.get(WorkClass.ROLLOUT)
        label = info.get("weight_version") if isinstance(info, dict) else None
        if label not in (None, "default", str(self.policy_version)):
            log.warning(
                "rollout server %s reports weight_version %r, this executor starts from %s (version %d): "
                "the next applied version brings them in line",
                self.rollout_url,
                label,
                self.policy_dir,
                self.policy_version,
            )

    # ------------------------------------------------------------------ HTTP helpers
    def _headers(self, admin: bool) -> dict[str, str]:
        key = (self.settings.admin_api_key or self.settings.api_key) if admin else self.settings.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _call(self, base: str, path: str, body: Any = None, *, method: str = "POST", timeout: float | None = None) -> Any:
        """One admin call; returns the JSON (or text) body, raises ServerError on an error status."""
        assert self._session is not None
        url = base + path
        t = aiohttp.ClientTimeout(total=timeout or self.settings.admin_timeout_s, connect=self.settings.connect_timeout_s)
        async with self._session.request(method, url, json=body, headers=self._headers(admin=True), timeout=t) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise ServerError(url, resp.status, error_message(text))
        try:
            return json.loads(text) if text.strip() else None
        except ValueError:
            return text

    # ------------------------------------------------------------------ lending (one worker: ordered, idempotent)
    async def _lending_worker(self) -> None:
        assert self._ops is not None
        while True:
            kind = await self._ops.get()
            lease = self.lease.current
            if kind == "grant" and lease is None:
                continue  # revoked or expired before its turn: nothing to lend
            if kind == "park" and (lease is None or lease.admits):
                continue  # ended, or granted again, before its turn
            try:
                if kind == "grant":
                    await self._lend()
                elif kind == "park":
                    await self._park()
                else:
                    await self._reclaim()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._server_lent = None  # unknown now: the next grant or revoke sends its calls again
                log.warning("rollout server %s: %s failed: %s", self.rollout_url, kind, exc)
                if kind == "grant" and self.lease.current is not None:
                    self._lent.set()  # let rollout requests go and fail (abort) rather than wait forever

    async def _lend(self) -> None:
        if self._server_lent is not True:
            await self._call(self.rollout_url, "/resume_memory_occupation", {"tags": KV_TAGS})
            await self._call(self.rollout_url, "/continue_generation", {})
            self._server_lent, self._server_parked = True, False
            log.info("rollout server %s lent: KV cache resumed, generation continued", self.rollout_url)
        elif self._server_parked:
            await self._call(self.rollout_url, "/continue_generation", {})
            self._server_parked = False
            log.info("rollout server %s lent again: its parked requests continue where they were", self.rollout_url)
        if self.lease.current is not None:
            self._lent.set()

    async def _park(self) -> None:
        """Pause generation in place: the requests keep their KV for a new lease to continue."""
        self._lent.clear()
        if self._server_lent is False:
            return
        await self._call(self.rollout_url, "/pause_generation", {"mode": "in_place"})
        self._server_parked = True
        self._reclaimed()
        log.info("rollout server %s parked: generation paused in place, KV kept", self.rollout_url)

    def _reclaimed(self) -> None:
        """A reclaim sample: the rollout server stopped generating; from when the lease ended (or was parked), once."""
        since = self.lease.take_reclaim_start()
        if since is not None:
            with self._lock:
                self._interval.reclaim_ms.append((time.monotonic() - since) * 1000.0)
                self._compute_yields += 1

    async def _reclaim(self) -> None:
        self._lent.clear()
        if self._server_lent is False:
            return
        await self._call(self.rollout_url, "/pause_generation", {"mode": "retract"})
        self._reclaimed()  # (a park already took this reclaim's sample: none is left)
        await self._call(self.rollout_url, "/release_memory_occupation", {"tags": KV_TAGS})
        self._server_lent, self._server_parked = False, False
        log.info("rollout server %s reclaimed: generation paused (retract), KV cache released", self.rollout_url)

    # ------------------------------------------------------------------ requests
    def _body(self, job: _Job, stream: bool) -> dict[str, Any]:
        s = job.request.sampling
        params: dict[str, Any] = {"temperature": s.temperature, "top_p": s.top_p, "max_new_tokens": s.max_tokens, "ignore_eos": s.ignore_eos}
        if s.top_k != -1:
            params["top_k"] = s.top_k
        if s.stop:
            params["stop"] = list(s.stop)
        if s.stop_token_ids:
            params["stop_token_ids"] = list(s.stop_token_ids)
        if s.seed is not None:
            params["sampling_seed"] = s.seed
        body: dict[str, Any] = {
            "input_ids": list(job.request.prompt_token_ids),
            "sampling_params": params,
            "return_logprob": True,
            "stream": stream,
            "rid": job.rid,
        }
        if s.top_logprobs:
            body["top_logprobs_num"] = s.top_logprobs  # meta_info.output_top_logprobs: per token, [[logprob, id, text], ...]
        priority = self.settings.rollout_priority if job.rollout else self.settings.serving_priority
        if priority is not None:
            body["priority"] = priority
        return body

    async def _run(self, job: _Job) -> None:
        """One request from submit to its result; every way out delivers a result (or InvalidRequest)."""
        url = self.rollout_url if job.rollout else self.serving_url
        try:
            if job.rollout:
                await self._lent.wait()
            if job.aborted:
                raise asyncio.CancelledError
            job.posted = True
            stream = job.request.stream or not job.rollout  # serving always streams: TTFT is measured here
            await (self._generate_stream(job, url) if stream else self._generate_once(job, url))
            if job.finish is None:
                log.warning("request %s: %s ended the response without a finish reason; finishing with abort", job.request.request_id, url)
            self._finish(job, job.finish or "abort")
        except asyncio.CancelledError:
            self._finish(job, "abort")
        except InvalidRequest as exc:
            self._fail(job, exc)
        except (TimeoutError, aiohttp.ClientError, OSError, ServerError, ValueError) as exc:
            log.warning("request %s to %s failed (%s: %s); finishing with abort", job.request.request_id, url, type(exc).__name__, exc)
            self._finish(job, "abort")
        except Exception:
            log.exception("request %s to %s failed; finishing with abort", job.request.request_id, url)
            self._finish(job, "abort")
        finally:
            self._jobs.pop(job.rid, None)

    def _timeout(self) -> aiohttp.ClientTimeout:
        s = self.settings
        return aiohttp.ClientTimeout(total=s.request_timeout_s, connect=s.connect_timeout_s, sock_read=s.request_timeout_s)

    async def _check(self, resp: aiohttp.ClientResponse, url: str) -> None:
        if resp.status == 200:
            return
        message = error_message(await resp.text())
        if resp.status == 400:
            raise InvalidRequest(message)
        raise ServerError(url, resp.status, message)

    async def _generate_stream(self, job: _Job, url: str) -> None:
        assert self._session is not None
        async with self._session.post(url + "/generate", json=self._body(job, True), headers=self._headers(False), timeout=self._timeout()) as resp:
            await self._check(resp, url)
            job.accepted_at = time.monotonic()
            decoder = SSEDecoder()
            async for chunk in resp.content.iter_any():
                for data in decoder.feed(chunk):
                    if data.strip() == "[DONE]":
                        return
                    event = json.loads(data)
                    if isinstance(event, dict) and "error" in event:  # SGLang reports a ValueError in-band once streaming
                        raise InvalidRequest(error_message(data))
                    self._absorb(job, event, time.monotonic())

    async def _generate_once(self, job: _Job, url: str) -> None:
        assert self._session is not None
        async with self._session.post(url + "/generate", json=self._body(job, False), headers=self._headers(False), timeout=self._timeout()) as resp:
            await self._check(resp, url)
            job.accepted_at = time.monotonic()
            out = await resp.json(content_type=None)
        if isinstance(out, list):  # a batch of one
            out = out[0] if out else {}
        self._absorb(job, out, time.monotonic(), cumulative=True)

    def _absorb(self, job: _Job, out: dict[str, Any], now: float, cumulative: bool | None = None) -> None:
        """Fold one SGLang output (cumulative by default, or incremental) into the job; stream a delta."""
        if cumulative is None:
            cumulative = self.settings.stream_output == "cumulative"
        meta = out.get("meta_info") or {}
        items = meta.get("output_token_logprobs") or []
        ids = out.get("output_ids")
        if ids is None:
            ids = [int(item[1]) for item in items]
        start = len(job.token_ids) if cumulative else 0
        new_ids = [int(t) for t in ids[start:]]
        new_lps = [float("nan") if item[0] is None else float(item[0]) for item in items[(len(job.logprobs) if cumulative else 0) :]]
        new_lps = (new_lps + [float("nan")] * len(new_ids))[: len(new_ids)]  # one logprob per token, whatever the server sent
        version = SERVING_MODEL_VERSION if not job.rollout else _version(meta.get("weight_version"), self.policy_version)
        job.token_ids += new_ids
        job.logprobs += new_lps
        if job.request.sampling.top_logprobs:
            tops = (meta.get("output_top_logprobs") or [])[(len(job.top_logprobs) if cumulative else 0) :]
            tops = [tuple((int(t), float(lp)) for lp, t, *_ in (top or []) if lp is not None) for top in tops]
            job.top_logprobs += (tops + [()] * len(new_ids))[: len(new_ids)]
        job.versions += [version] * len(new_ids)
        job.token_times += [now] * len(new_ids)
        text = out.get("text")
        if text is not None:
            job.text = text if cumulative else job.text + text
        job.cached_tokens = int(meta.get("cached_tokens") or job.cached_tokens)
        job.retractions = int(meta.get("num_retractions") or job.retractions)
        reason = finish_reason_of(meta.get("finish_reason"))
        if reason is not None:
            job.finish = reason
            if reason == "abort" and isinstance(meta.get("finish_reason"), dict):
                log.info("request %s aborted by the server: %s", job.request.request_id, meta["finish_reason"].get("message"))
        elif job.request.stream:
            delta = self._delta(job, final=False)
            if delta is not None:
                job.handle.deliver(delta, None)

    def _delta(self, job: _Job, final: bool) -> StreamDelta | None:
        """New tokens and text since the last delta (see protocol.next_delta, as Engine)."""
        delta, job.emitted_text = next_delta(
            job.request, job.token_ids, job.logprobs, job.text, job.emitted_tokens, job.emitted_text, final, job.finish, job.top_logprobs
        )
        if delta is not None:
            job.emitted_tokens = len(job.token_ids)
        return delta

    def _finish(self, job: _Job, reason: FinishReason) -> None:
        if job.done:
            return
        job.done = True
        job.finish = reason
        now = time.monotonic()
        req = job.request
        delta = (
            self._delta(job, final=True)
            if req.stream
            else StreamDelta(
                request_id=req.request_id,
                token_ids=tuple(job.token_ids),
                logprobs=tuple(job.logprobs),
                text=job.text,
                finished=True,
                finish_reason=reason,
                top_logprobs=tuple(job.top_logprobs),
            )
        )
        timings = timings_since(job.arrival, job.token_times, job.accepted_at, job.retractions, now)  # queue: until the server took it
        versions = tuple(job.versions)
        result = GenerationResult(
            request_id=req.request_id,
            work_class=req.work_class,
            token_ids=tuple(job.token_ids),
            logprobs=tuple(job.logprobs),
            text=job.text,
            finish_reason=reason,
            token_versions=versions,
            policy_version=versions[-1] if versions else (self.policy_version if job.rollout else SERVING_MODEL_VERSION),
            prefix_cached_tokens=job.cached_tokens,
            timings=timings,
            top_logprobs=tuple(job.top_logprobs),
        )
        with self._lock:
            if not job.rollout and reason != "abort":
                self._interval.serving_completed += 1
            if job.rollout:
                self._preemptions += job.retractions
                if req.trajectory_id is not None and job.posted:
                    if job.cached_tokens > 0:
                        self._prefix_hits += 1
                    else:
                        self._prefix_misses += 1
        job.handle.deliver(delta, result)

    def _fail(self, job: _Job, exc: Exception) -> None:
        """The server refused the request (400): ``result()`` raises it, the delta stream just ends."""
        if job.done:
            return
        job.done = True
        log.info("request %s refused by the server: %s", job.request.request_id, exc)
        job.handle.fail(exc)

    def _cancel(self, job: _Job) -> None:
        """Abort: on the server when the request is there (it answers with what it made, "abort"), else here."""
        if job.done or job.aborted:
            return
        job.aborted = True
        if not job.posted:
            if job.task is not None:
                job.task.cancel()
            return
        assert self._loop is not None
        self._loop.create_task(self._abort_on_server(job))

    async def _abort_on_server(self, job: _Job, grace: bool = True) -> None:
        url = self.rollout_url if job.rollout else self.serving_url
        try:
            await self._call(url, "/abort_request", {"rid": job.rid}, timeout=self.settings.connect_timeout_s)
        except (TimeoutError, Exception) as exc:
            log.warning("could not abort %s on %s (%s); dropping the connection", job.request.request_id, url, exc)
            if job.task is not None:
                job.task.cancel()
            return
        if grace and job.task is not None:
            await asyncio.wait({job.task}, timeout=self.settings.abort_grace_s)
            if not job.task.done():  # the server did not end it (e.g. it had not registered the rid yet)
                job.task.cancel()

    # ------------------------------------------------------------------ weights
    def _changed(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        live = self._mirror.state_dict()
        return {name: t for name, t in tensors.items() if not _same_bits(t, live[name])}

    async def _update_weights(self, staged: StagedWeights) -> float:
        version = staged.version
        label = str(version)
        async with self._weights_lock:  # diff against the mirror as the previous update left it
            changed = await asyncio.to_thread(self._changed, staged.tensors)
            staging: Path | None = None
            try:
                if not changed:
                    started = time.perf_counter()
                    await self._call(self.rollout_url, "/update_weight_version", {"new_version": label, "abort_all_requests": False})
                elif self.settings.weight_sync == "tensor":
                    named = list(changed.items())  # kept alive until the server has answered (it maps their memory)
                    payload = await asyncio.to_thread(serialize_named_tensors, named)
                    started = time.perf_counter()
                    reply = await self._call(
                        self.rollout_url,
                        "/update_weights_from_tensor",
                        {"serialized_named_tensors": [payload], "load_format": None, "flush_cache": True, "weight_version": label},
                    )
                    _check_success(reply)
                    del named
                else:
                    staging = await asyncio.to_thread(self._write_staging, changed, version)
                    started = time.perf_counter()
                    reply = await self._call(self.rollout_url, "/update_weights_from_disk", {"model_path": str(staging), "weight_version": label})
                    _check_success(reply)
            except ServerError as exc:
                if staging is not None:
                    shutil.rmtree(staging, ignore_errors=True)
                raise WeightUpdateError(f"the rollout server refused version {version}: {exc.message}") from None
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                if staging is not None:
                    shutil.rmtree(staging, ignore_errors=True)
                raise WeightUpdateError(f"could not send version {version} to the rollout server {self.rollout_url}: {exc!r}") from None
            pause_ms = (time.perf_counter() - started) * 1000.0
            if changed:
                StagedWeights(changed, version).apply(self._mirror)
            self.policy_version = version
            with self._lock:
                self._max_swap_pause_ms = max(self._max_swap_pause_ms, pause_ms)
            if staging is not None:
                self._drop_old_staging(keep=staging)
            log.info(
                "policy version %d on the rollout server: %d tensors sent (%s), %.1f ms", version, len(changed), self.settings.weight_sync, pause_ms
            )
            return pause_ms

    def _write_staging(self, changed: dict[str, torch.Tensor], version: int) -> Path:
        """A complete model directory of the new version (the mirror with the changes), for /update_weights_from_disk."""
        target = self.staging_dir / f"v{version}"
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        for item in self.policy_dir.iterdir():  # config, tokenizer, generation config: everything but the weights
            if item.is_file() and not item.name.endswith((".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json", ".pt")):
                shutil.copy2(item, target / item.name)
        state = {**self._mirror.state_dict(), **changed}
        save_safetensors(state, target / "model.safetensors")
        return target

    def _drop_old_staging(self, keep: Path) -> None:
        for old in self.staging_dir.glob("v*"):
            if old != keep and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ metrics
    async def _scrape_loop(self) -> None:
        while True:
            await self._scrape_once()
            self.scrapes += 1
            waiter = asyncio.ensure_future(self._scrape_now.wait())  # a stats() call asks for a fresh scrape
            try:  # asyncio.wait, not wait_for: wait_for on 3.11 can swallow the cancel that stop() sends
                await asyncio.wait({waiter}, timeout=self.settings.scrape_interval_s)
            finally:
                waiter.cancel()
            self._scrape_now.clear()

    async def _scrape_once(self) -> None:
        names = ("serving", "rollout")
        texts = await asyncio.gather(
            *(self._fetch_metrics(self.serving_url if n == "serving" else self.rollout_url) for n in names), return_exceptions=True
        )
        for name, text in zip(names, texts):
            url = self.serving_url if name == "serving" else self.rollout_url
            if isinstance(text, BaseException):
                if self._scrape_ok.get(name, True):
                    log.warning("cannot scrape %s/metrics: %s", url, text)
                self._scrape_ok[name] = False
                continue
            if not self._scrape_ok.get(name, True):
                log.info("scraping %s/metrics again", url)
            self._scrape_ok[name] = True
            try:
                scrape = parse_metrics(text)
            except ValueError as exc:
                log.warning("%s/metrics is not Prometheus text: %s", url, exc)
                continue
            self._fold(name, self._last_scrape.get(name), scrape)
            self._last_scrape[name] = scrape

    async def _fetch_metrics(self, base: str) -> str:
        assert self._session is not None
        t = aiohttp.ClientTimeout(total=self.settings.scrape_timeout_s)
        async with self._session.get(base + "/metrics", headers=self._headers(False), timeout=t) as resp:
            if resp.status != 200:
                raise ServerError(base + "/metrics", resp.status, (await resp.text())[:200])
            return await resp.text()

    def _fold(self, name: str, prev: Scrape | None, cur: Scrape) -> None:
        """Add what happened between two scrapes of one server to the current interval.

        The serving server's TTFT histogram fills the TTFT sketch; its inter-token latencies fill the
        TPOT sketch (per token, where our engine records one mean per request: the same quantity
        for an SLO on time per output token, weighted by tokens instead of requests).
        """
        if prev is None:
            return  # the first scrape only sets the baseline: its counts are from before we looked
        tokens = cur.values.get(GEN_TOKENS, 0.0) - prev.values.get(GEN_TOKENS, 0.0)
        if tokens < 0:  # the server restarted
            tokens = cur.values.get(GEN_TOKENS, 0.0)
        with self._lock:
            if name == "rollout":
                self._interval.rollout_tokens += tokens
                return
            self._interval.serving_tokens += tokens
            ttft = cur.histograms.get(TTFT_METRIC)
            if ttft is not None:
                add_buckets(self._interval.ttft, *histogram_delta(prev.histograms.get(TTFT_METRIC), ttft))
            itl_name = ITL_METRIC if ITL_METRIC in cur.histograms else TPOT_METRIC
            itl = cur.histograms.get(itl_name)
            if itl is not None:
                add_buckets(self._interval.tpot, *histogram_delta(prev.histograms.get(itl_name), itl))

    def _pool(self, work_class: WorkClass, scrape: Scrape) -> PoolUsage:
        """KV use in tokens (one block = one token, SGLang's page size 1); the rollout pool is empty while not lent."""
        info = self._models[work_class]
        if work_class is WorkClass.ROLLOUT and self._server_lent is False:
            return PoolUsage(info.kv_bytes_per_token, 0, 0)
        total = int(scrape.values.get("sglang:max_total_num_tokens", 0)) or self._kv_tokens.get(work_class, 0)
        if "sglang:num_used_tokens" in scrape.values:
            used = int(scrape.values["sglang:num_used_tokens"])
        else:
            usage = scrape.values.get("sglang:token_usage", 0.0)
            used = int(round(usage * total)) if total else 0
        return PoolUsage(info.kv_bytes_per_token, max(total, used), used)


def _version(label: Any, default: int) -> int:
    """SGLang's weight_version string as our integer version, when it is one."""
    if isinstance(label, int) and not isinstance(label, bool):
        return label
    if isinstance(label, str) and label.isdigit():
        return int(label)
    return default


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads and -0.0 included): a weight that did not change is not sent."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8), b.detach().contiguous().reshape(-1).view(torch.uint8))


def _check_success(reply: Any) -> None:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise ServerError("", 200, str(reply.get("message", "success: false")))
