"""An engine backend that drives real SGLang servers over HTTP: two sharing one GPU, or one with LoRA.

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
- weights: a host mirror of the policy is the delta base; an update sends only the tensors that
  changed, over ``/update_weights_from_tensor`` or ``/update_weights_from_disk`` (sglang_weights.py).
- stats: both servers' ``/metrics`` are scraped in the background; histogram bucket deltas
  become DDSketches, so the SLO monitor merges them like our engine's (sglang_wire.py parses them).

LoRA mode (the policy directory holds a LoRA adapter of the serving model, ``engine.rollout_mode =
"co_batched"``): one server, the serving one (SGLang's ``--enable-lora``), runs both classes, as our
engine's co-batched mode does. Serving requests name no adapter (the base); rollout requests name
the live policy version's adapter (``lora_path``); each new version is written as a peft adapter
directory and loaded with SGLang's ``/load_lora_adapter``, and the previous one unloaded once no
request in flight names it (sglang_lora.py); each token records the version whose adapter made it.
The lease still governs rollout (no rollout request goes out without one), but a reclaim cannot
pause or release that server's memory, since serving runs on it: it stops sending rollout requests
and aborts the ones in flight (``/abort_request``), whose partial output comes back as a revoked
turn's does; a burst's park does the same (no in-place pause of rollout alone exists there).
Serving's latency sketches are then measured here, per request (the server's histograms mix both
classes). The adapter must be one of the serving model's (``check_base``, against its weights).
Two-server mode stays for full-weight policies.

Everything here runs on the event loop that called ``start()``; ``apply_policy_weights`` and the
lease calls may come from other threads and hop onto it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import torch

from rose.shared.bursts import BURST_BASELINE_S, ArrivalBurstDetector, BurstSettings, BurstTrip
from rose.shared.errors import RoseError
from rose.shared.lora import check_base, is_adapter_dir, read_adapter
from rose.shared.sketch import sketch_to_dict

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
    Timings,
    WorkClass,
    next_delta,
    timings_since,
    validate_request,
)
from .sglang_lora import LoraVersions
from .sglang_requests import Job, ModelInfo
from .sglang_scrapes import ServerScrapes
from .sglang_weights import MirroredWeights
from .sglang_wire import Scrape, ServerError, SSEDecoder, error_message, finish_reason_of, fold_scrape, pool_usage, version_of
from .weights import StagedWeights, WeightUpdateError

log = logging.getLogger("rose.executor.sglang")

KV_TAGS = ["kv_cache"]


class BackendModeError(RoseError, ValueError):
    """The rollout mode does not fit the policy on this backend (LoRA mode needs an adapter and co_batched)."""


# ---------------------------------------------------------------------------- the backend


class SGLangBackend:
    """``CoServingEngine`` over a serving SGLang server and a rollout SGLang server, or (LoRA mode) over one server
    that serves the base and runs the policy's adapter versions (the module doc)."""

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
        rollout_mode: str | None = None,
    ) -> None:
        """``rollout_mode``: "co_batched" for a LoRA policy (LoRA mode), "two_model" for a full-weight one (two
        servers); None: as the policy directory says (logged). Refused (BackendModeError) where they do not fit."""
        from rose.shared.models import load_tokenizer
        from rose.shared.nats_server import state_dir

        self.settings = settings
        self.serving_url = settings.serving_url.rstrip("/")
        self.rollout_url = settings.rollout_url.rstrip("/")
        self.policy_dir = Path(policy_dir)
        self.staging_dir = Path(settings.staging_dir) if settings.staging_dir else state_dir() / "sglang-weights"
        self.policy = make_policy(policy)
        self.device = select_device(device)
        self.policy_version = 0
        self.slo_ttft_ms, self.slo_tpot_ms = slo_ttft_ms, slo_tpot_ms
        # what a lease may grant: SGLang cannot bound its pool at run time, so this is the executor's setting, reported
        self.lendable_kv_bytes = rollout_kv_bytes
        # the same detector as the home engine's, on serving arrivals here
        self.bursts = ArrivalBurstDetector(bursts or BurstSettings(), burst_baseline_s)
        self.on_burst: list[Callable[[BurstTrip], None]] = []
        self._tokenizers = {WorkClass.SERVING: load_tokenizer(serving_dir), WorkClass.ROLLOUT: load_tokenizer(policy_dir)}
        self.lora: LoraVersions | None = None  # LoRA mode: the policy's adapter versions on the one server
        self.weights: MirroredWeights | LoraVersions = self._init_policy(serving_dir, dtype, rollout_mode)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None
        self._jobs: dict[str, Job] = {}
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
        self._lock = threading.Lock()  # the counters: stats() may be called from any thread
        self._interval = IntervalCounters()
        urls = {"serving": self.serving_url} | ({} if self.lora is not None else {"rollout": self.rollout_url})  # LoRA mode: one server
        self.scrapes = ServerScrapes(
            urls,
            lambda: self._headers(False),
            interval_s=settings.scrape_interval_s,
            timeout_s=settings.scrape_timeout_s,
            on_scrape=self._fold_scrape if self.lora is None else None,  # LoRA mode counts per request instead (``_count_here``)
        )
        self.metrics = EngineMetrics()  # no local lanes: /health reports ok here, each server's own /health tells the rest
        self._compute_yields = 0
        self._max_swap_pause_ms = 0.0
        self._prefix_hits = self._prefix_misses = self._preemptions = 0
        self._started = self._stopping = False

    @classmethod
    def from_dirs(cls, serving_dir: str, policy_dir: str, settings: SGLangBackendSettings, **kw: Any) -> SGLangBackend:
        return cls(settings, serving_dir=serving_dir, policy_dir=policy_dir, **kw)

    def _init_policy(self, serving_dir: str, dtype: torch.dtype, rollout_mode: str | None) -> MirroredWeights | LoraVersions:
        """The policy as this backend holds it: a host mirror of the rollout server's model (two servers), or the
        adapter's versions on the serving server (LoRA mode: refused unless the adapter is the serving model's)."""
        from rose.shared.models import load_for_inference

        lora = is_adapter_dir(self.policy_dir)
        if rollout_mode is None:
            rollout_mode = "co_batched" if lora else "two_model"
            log.info(
                "sglang backend: the policy in %s is %s, so rollout_mode %s", self.policy_dir, "a LoRA adapter" if lora else "a model", rollout_mode
            )
        if lora != (rollout_mode == "co_batched"):
            raise BackendModeError(
                f"engine.rollout_mode is {rollout_mode!r} and the policy in {self.policy_dir} is {'a LoRA adapter' if lora else 'a model'}: "
                "on the sglang backend a LoRA policy runs co_batched (one SGLang server with --enable-lora serves the base and runs the "
                'adapter) and a full-weight policy two_model (a rollout server of its own); set engine.rollout_mode = "co_batched" for '
                'an adapter of the serving model (`rose models init DIR --lora`), "two_model" for a model'
            )
        if not lora:
            mirror = load_for_inference(self.policy_dir, "cpu", dtype)
            self._models = {WorkClass.SERVING: ModelInfo.of(serving_dir, dtype), WorkClass.ROLLOUT: ModelInfo.of(str(self.policy_dir), dtype)}
            return MirroredWeights(mirror, self.policy_dir, self.staging_dir, self.rollout_url, self._call, self.settings.weight_sync)
        adapter = read_adapter(self.policy_dir)
        base = load_for_inference(serving_dir, "cpu", dtype).state_dict()  # its weights once, to hold the adapter against
        check_base(adapter, base, f"{serving_dir} (this executor's serving model, the sglang server's)")
        if self.rollout_url != self.serving_url:
            log.info(
                "sglang backend, LoRA mode: rollout runs on the serving server %s; rollout_url %s is not used", self.serving_url, self.rollout_url
            )
        self.rollout_url = self.serving_url
        self.lora = LoraVersions(adapter, self.policy_dir, self.staging_dir, self.serving_url, self._call)
        info = ModelInfo.of(serving_dir, dtype)
        self._models = {WorkClass.SERVING: info, WorkClass.ROLLOUT: info}
        return self.lora

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
            self._loop.create_task(self.scrapes.run(self._session), name="sglang-scrape"),
            self._loop.create_task(self._probe_servers(), name="sglang-probe"),
        ]

    async def stop(self) -> None:
        """Abort what is in flight (finished with "abort"), hand the rollout server's KV (LoRA mode: the adapters) back."""
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
        try:
            async with asyncio.timeout(self.settings.connect_timeout_s):
                if self.lora is not None:
                    await self.lora.unload_all()  # LoRA mode: the server's adapter slots back
                elif self._server_lent is not False and self.policy.admits_rollout:
                    await self._reclaim()
        except (TimeoutError, Exception) as exc:
            log.warning("could not pause the rollout server (or unload the policy's adapters) while stopping: %s", exc)
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
        job = Job(request=request, handle=handle, rid=f"rose-{uuid.uuid4().hex}", arrival=time.monotonic())
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
        """The lease was revoked on a burst: refuse new rollout and pause the rollout server in place (its requests
        keep their KV) until a new lease continues it or ``until_monotonic`` ends the lease as an expiry does (pause
        with retract, KV released). LoRA mode: the rollout requests in flight are aborted, as on a revoke."""
        lease = self.lease.park(until_monotonic)
        if lease is not None:
            self._on_loop(lambda: self._arm_expiry(lease))
            self._enqueue("park")

    def revoke_rollout(self) -> None:
        """Take the lease back now: the rollout server pauses (retract) and frees its KV (LoRA mode: rollout is aborted)."""
        self.lease.revoke()
        self._enqueue("revoke")

    def set_slo(self, ttft_ms: float | None, tpot_ms: float | None) -> None:
        self.slo_ttft_ms, self.slo_tpot_ms = ttft_ms, tpot_ms

    def apply_policy_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> concurrent.futures.Future:
        """Validate now against the mirror (raises WeightUpdateError, nothing sent), then send what changed.

        The future resolves with the pause in ms (how long the rollout server took to load the
        update, during which its generation waits) once the server has the new version.
        """
        staged = self.weights.stage(state_dict, version)
        if self._loop is None or self._stopping:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_exception(WeightUpdateError("the SGLang backend is not running: start() it first"))
            return done
        return asyncio.run_coroutine_threadsafe(self._update_weights(staged), self._loop)

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The host mirror of the rollout server's policy, or (LoRA mode) the live adapter's tensors by peft name
        (read-only use: the follower's delta base, a digest)."""
        return self.weights.state_dict()

    def stats(self) -> EngineStats:
        """The interval since the previous call, from the latest scrapes; never waits for a server."""
        self.scrapes.refresh()  # for the next call, in the background
        now = time.monotonic()
        with self._lock:
            interval, self._interval = self._interval, IntervalCounters(started=now)
        span = max(1e-9, now - interval.started)
        serving, rollout = self.scrapes.last("serving"), self.scrapes.last("rollout")
        s_queue, s_running, r_queue, r_running = self._queues(serving, rollout)
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
            serving_queue=s_queue,
            serving_running=s_running,
            rollout_queue=r_queue,
            rollout_running=r_running,
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
            rollout_mode="co_batched" if self.lora is not None else "two_model",
        )

    def _queues(self, serving: Scrape, rollout: Scrape) -> tuple[int, int, int, int]:
        """(serving queued, serving running, rollout queued, rollout running): each server's gauges, and the rollout
        requests still waiting here for a lease. LoRA mode: one server, whose gauges count both classes; rollout's
        running requests are the ones this backend has out, the rest is serving's (its queue may hold rollout's too)."""
        waiting_here = sum(1 for j in self._jobs.values() if j.rollout and not j.posted and not j.done)
        s_queue, s_running = int(serving.values.get("sglang:num_queue_reqs", 0)), int(serving.values.get("sglang:num_running_reqs", 0))
        if self.lora is None:
            return (
                s_queue,
                s_running,
                int(rollout.values.get("sglang:num_queue_reqs", 0)) + waiting_here,
                int(rollout.values.get("sglang:num_running_reqs", 0)),
            )
        out = sum(1 for j in self._jobs.values() if j.rollout and j.posted and not j.done)
        return s_queue, max(0, s_running - out), waiting_here, out

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
        if self.lora is not None:  # LoRA mode: versions are adapter names, not the server's label
            if isinstance(info, dict) and not info.get("enable_lora", True):
                log.warning(
                    "SGLang server %s runs without --enable-lora: the policy's adapter cannot load there (restart it with --enable-lora)",
                    self.serving_url,
                )
            return
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
                    await (self._lend_lora(self.lora) if self.lora else self._lend())
                elif self.lora:
                    await self._reclaim_lora()  # a park too: rollout alone cannot pause in place on the shared server
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

    async def _lend_lora(self, lora: LoraVersions) -> None:
        """LoRA mode: the policy's adapter loaded (version 0, the first time), then rollout requests may go out."""
        await lora.load_first()
        if self.lease.current is not None:
            self._lent.set()

    async def _reclaim_lora(self) -> None:
        """LoRA mode: serving runs on the same server, so its memory stays; rollout stops going out, and the rollout
        requests in flight are aborted there (each answers with what it made: a revoked turn's partial output)."""
        self._lent.clear()
        jobs = [j for j in self._jobs.values() if j.rollout and j.posted and not j.done]
        await asyncio.gather(*(self._abort_on_server(j) for j in jobs), return_exceptions=True)
        self._reclaimed()
        log.info("SGLang server %s: rollout reclaimed, %d rollout requests aborted (serving keeps the server)", self.serving_url, len(jobs))

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
    def _body(self, job: Job, stream: bool) -> dict[str, Any]:
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
        if job.adapter is not None:
            body["lora_path"] = job.adapter.name  # SGLang's GenerateReqInput.lora_path: the adapter's name
        return body

    async def _run(self, job: Job) -> None:
        """One request from submit to its result; every way out delivers a result (or InvalidRequest)."""
        url = self.rollout_url if job.rollout else self.serving_url
        try:
            if job.rollout:
                await self._lent.wait()
            if job.aborted:
                raise asyncio.CancelledError
            if job.rollout and self.lora is not None:
                job.adapter = self.lora.acquire()  # the live version's adapter: every token of this request is its version
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
            if job.adapter is not None and self.lora is not None:
                self.lora.release(job.adapter)  # the last request on a replaced version unloads it

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

    async def _generate_stream(self, job: Job, url: str) -> None:
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

    async def _generate_once(self, job: Job, url: str) -> None:
        assert self._session is not None
        async with self._session.post(url + "/generate", json=self._body(job, False), headers=self._headers(False), timeout=self._timeout()) as resp:
            await self._check(resp, url)
            job.accepted_at = time.monotonic()
            out = await resp.json(content_type=None)
        if isinstance(out, list):  # a batch of one
            out = out[0] if out else {}
        self._absorb(job, out, time.monotonic(), cumulative=True)

    def _absorb(self, job: Job, out: dict[str, Any], now: float, cumulative: bool | None = None) -> None:
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
        if not job.rollout:
            version = SERVING_MODEL_VERSION
        else:  # LoRA mode: the version whose adapter the request names; two servers: the one the server reports
            version = job.adapter.version if job.adapter is not None else version_of(meta.get("weight_version"), self.policy_version)
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

    def _delta(self, job: Job, final: bool) -> StreamDelta | None:
        """New tokens and text since the last delta (see protocol.next_delta, as Engine)."""
        delta, job.emitted_text = next_delta(
            job.request, job.token_ids, job.logprobs, job.text, job.emitted_tokens, job.emitted_text, final, job.finish, job.top_logprobs
        )
        if delta is not None:
            job.emitted_tokens = len(job.token_ids)
        return delta

    def _finish(self, job: Job, reason: FinishReason) -> None:
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
            if self.lora is not None:  # one server: its histograms and token counter mix both classes, so measured here
                self._count_here(job, timings, reason)
            if job.rollout:
                self._preemptions += job.retractions
                if req.trajectory_id is not None and job.posted:
                    if job.cached_tokens > 0:
                        self._prefix_hits += 1
                    else:
                        self._prefix_misses += 1
        job.handle.deliver(delta, result)

    def _count_here(self, job: Job, timings: Timings, reason: FinishReason) -> None:
        """LoRA mode: a finished request's tokens, and a serving one's TTFT and mean TPOT (as our engine records them)."""
        if job.rollout:
            self._interval.rollout_tokens += len(job.token_ids)
            return
        self._interval.serving_tokens += len(job.token_ids)
        if reason != "abort" and job.token_times:
            self._interval.ttft.add(timings.ttft_ms)
            if len(job.token_times) > 1:
                self._interval.tpot.add(timings.tpot_ms)

    def _fail(self, job: Job, exc: Exception) -> None:
        """The server refused the request (400): ``result()`` raises it, the delta stream just ends."""
        if job.done:
            return
        job.done = True
        log.info("request %s refused by the server: %s", job.request.request_id, exc)
        job.handle.fail(exc)

    def _cancel(self, job: Job) -> None:
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

    async def _abort_on_server(self, job: Job, grace: bool = True) -> None:
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
    async def _update_weights(self, staged: StagedWeights) -> float:
        version = staged.version
        async with self._weights_lock:  # against the version the previous update left
            try:
                pause_ms = await self.weights.update(staged)
            except ServerError as exc:
                raise WeightUpdateError(f"the SGLang server {self.rollout_url} refused version {version}: {exc.message}") from None
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                raise WeightUpdateError(f"could not send version {version} to the rollout server {self.rollout_url}: {exc!r}") from None
            self.policy_version = version
            with self._lock:
                self._max_swap_pause_ms = max(self._max_swap_pause_ms, pause_ms)
            return pause_ms

    # ------------------------------------------------------------------ metrics
    def _fold_scrape(self, name: str, prev: Scrape | None, scrape: Scrape) -> None:
        """A two-model mode server's new scrape: its counters' growth since ``prev`` into the interval's."""
        with self._lock:
            fold_scrape(self._interval, name == "rollout", prev, scrape)

    def _pool(self, work_class: WorkClass, scrape: Scrape) -> PoolUsage:
        """KV use in tokens; the rollout pool is empty while not lent, and in LoRA mode (one pool: serving's)."""
        info = self._models[work_class]
        if work_class is WorkClass.ROLLOUT and (self._server_lent is False or self.lora is not None):
            return PoolUsage(info.kv_bytes_per_token, 0, 0)
        return pool_usage(scrape, info.kv_bytes_per_token, self._kv_tokens.get(work_class, 0))
