"""The co-serving engine: a serving model and an RL policy model on one device.

Two lanes, one thread each (see ``device.py``): the serving lane runs serving iterations
back to back; the rollout lane runs rollout work in bounded *quanta* between which it
does its housekeeping (weight swap, lease expiry, pool shrink) and asks the policy
whether it may continue. Each iteration is the same four steps for both classes:
receive (take submitted requests) -> plan (``scheduling.plan_iteration``, pure) -> run
(paged forward of the prefill chunks, then of the decodes) -> process (sample, stop,
stream out, free). On CPU the rollout lane's forwards and sampling may run in a child process
(``EngineConfig.rollout_process``, see ``rollout_process.py``). Callers use it from asyncio: ``submit`` returns a handle that is an
async iterator of ``StreamDelta`` and whose ``result()`` is the ``GenerationResult``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import itertools
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rose.contracts.executor import RejectReason
from rose.shared.bursts import BURST_BASELINE_S, ArrivalBurstDetector, BurstSettings, BurstTrip, first_token_wait_ms
from rose.shared.sketch import sketch_to_dict

from .config import MIB, EngineSettings
from .core_lending import CoreLending
from .device import ROLLOUT_PRIORITY, SERVING_PRIORITY, select_device
from .emulated import EmulatedRunner, EmulationSpec
from .forward_item import ForwardItem
from .kv_pool import DEFAULT_BLOCK_SIZE, KVPool
from .metrics import EngineMetrics
from .model_runner import PagedModelRunner
from .outputs import EngineStats, RequestHandle
from .policies import DEFAULT_GUARD_FRACTION, DEFAULT_STATIC_SHARE, Signals, make_policy
from .prefix_cache import HostEntry, HostTier, PrefixCache
from .protocol import (
    SERVING_MODEL_VERSION,
    EngineLease,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    InvalidRequest,
    RolloutRejected,
    StreamDelta,
    WorkClass,
    check_lease_admits,
    next_delta,
    timings_since,
    validate_request,
)
from .rollout_process import ProcessRunner, child_pid, child_rss_bytes, shared_memory_shortfall
from .sampling import SamplerState, find_stop
from .scheduling import Limits, plan_iteration, plan_shrink
from .sequence import Sequence
from .slo_guard import GuardState, SloGuard
from .weights import StagedWeights, stage

log = logging.getLogger("rose.executor.engine")

IDLE_WAIT_S = 0.005  # how long an idle lane sleeps before re-checking (a submit wakes it at once)
PAUSE_POLL_S = 0.0005  # how often a paused rollout lane re-asks the policy
SERVING_SWITCH_INTERVAL_S = 0.0005  # GIL switch interval while serving and rollout both run (CPython's default: 5 ms)
EMA_ALPHA = 0.2
PAUSE_MODES = ("abort", "retract", "in_place")  # as SGLang's /pause_generation
MEMORY_TAGS = ("kv_cache", "weights")  # as SGLang's /release_memory_occupation


class _HeapFreeze:
    """``gc.freeze()`` while any engine runs, undone when the last one stops.

    Why freeze: the models' many Python objects never die while an engine serves; frozen, they stay
    out of the collector's full passes, which hold the GIL (a serving token's worth of time) while
    they walk every live object. Why undo: the freeze is process-wide and the collector never frees
    a frozen cycle, so without ``unfreeze`` every engine started and stopped in one process (a
    bench grid, a test session) stayed in memory for good, with its rollout child's shared weight
    banks and KV: ~145 MiB each, 12 GB after an 88-minute ``rose bench coserve`` grid."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0

    def hold(self) -> None:
        with self._lock:
            self._running += 1
            gc.collect()
            gc.freeze()

    def release(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                gc.unfreeze()


_HEAP_FREEZE = _HeapFreeze()
_SERVICE = EngineSettings()  # the executor service's [engine] defaults: EngineConfig's, one definition of each


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What an ``Engine`` runs with: built by the executor service from its ``[engine]`` settings
    (``from_settings``), or directly by a benchmark or a test.

    Defaults are the service's (``config.EngineSettings``), except two that a direct user gets on purpose:
    no SLO until one is given (``slo_*_ms`` None; ``Engine.set_slo``), and rollout forwards in this process
    (``rollout_process`` False: the service turns the child process on; tests and benches ask for it)."""

    serving_kv_bytes: int = int(_SERVICE.serving_kv_mib * MIB)
    rollout_kv_bytes: int = int(_SERVICE.rollout_kv_mib * MIB)  # the most a lease can grant; the lease bounds actual use
    host_kv_ratio: float = _SERVICE.host_kv_ratio  # the host tier's bytes over the rollout pool's (SGLang's --hicache-ratio); 0: off
    block_size: int = DEFAULT_BLOCK_SIZE
    serving_max_batch: int = _SERVICE.serving_max_batch
    rollout_max_batch: int = _SERVICE.rollout_max_batch
    serving_prefill_tokens: int = 512  # prefill-chunk budget per serving iteration
    rollout_prefill_tokens: int | None = None  # per rollout iteration (None: the device's, ``rollout_prefill_tokens``)
    quantum_ms: float = _SERVICE.quantum_ms
    guard_fraction: float = DEFAULT_GUARD_FRACTION
    static_share: float = DEFAULT_STATIC_SHARE
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    rollout_threads: int | None = None  # CPU only: torch threads of the rollout lane (default 1)
    lend_serving_core: bool = _SERVICE.lend_serving_core  # CPU, rose: the rollout lane widens over the serving lane's core while serving has no work
    rollout_process: bool = False  # CPU: rollout forwards run in a child process, off this interpreter's lock (rollout_process.py)
    # rollout borrows a serving executor's host: where the policy says so (rose), its forward process runs at the OS's
    # idle priority. False on a dedicated executor, whose device is rollout's own (normal priority).
    rollout_is_guest: bool = True
    cuda_graphs: bool = _SERVICE.cuda_graphs  # CUDA: decode steps replay captured graphs (cuda_graphs.py)
    seed: int = _SERVICE.seed
    device: str = _SERVICE.device
    dtype: torch.dtype = getattr(torch, _SERVICE.dtype)
    emulation: EmulationSpec | None = None  # device "emulated:KIND": the emulated models and memory (emulated.py)
    bursts: BurstSettings = BurstSettings()  # the executor's own burst detector (shared/bursts.py)
    burst_baseline_s: float = BURST_BASELINE_S

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> EngineConfig:
        """The executor service's ``[engine]`` settings as the engine's config (fields the settings lack keep their defaults)."""
        return cls(
            serving_kv_bytes=int(settings.serving_kv_mib * MIB),
            rollout_kv_bytes=int(settings.rollout_kv_mib * MIB),
            host_kv_ratio=settings.host_kv_ratio,
            serving_max_batch=settings.serving_max_batch,
            rollout_max_batch=settings.rollout_max_batch,
            quantum_ms=settings.quantum_ms,
            lend_serving_core=settings.lend_serving_core,
            rollout_process=settings.rollout_process,
            cuda_graphs=settings.cuda_graphs,
            slo_ttft_ms=settings.slo_ttft_ms,
            slo_tpot_ms=settings.slo_tpot_ms,
            seed=settings.seed,
            device=settings.device,
            dtype=getattr(torch, settings.dtype),
        )


class _ClassRuntime:
    """Everything one work class owns: its model, pool, queues, lane."""

    def __init__(
        self, work_class: WorkClass, model, tokenizer, pool: KVPool, limits: Limits, lane, runner: PagedModelRunner | ProcessRunner | EmulatedRunner
    ) -> None:
        self.work_class = work_class
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        self.runner = runner
        self.limits = limits
        self.lane = lane
        self.inbox: deque[Sequence] = deque()
        self.aborts: deque[str] = deque()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.wakeup = threading.Event()
        self.eos_id = getattr(tokenizer, "eos_token_id", None)
        self.decode = text_decoder(tokenizer)
        self.iteration_ms = 0.0  # EMA
        self.unprefilled = 0  # running sequences not past prefill (read by the rollout lane)
        self.unprefilled_since: float | None = None  # the oldest one's arrival (monotonic), None when none

    def count_unprefilled(self) -> None:
        """Running sequences whose prompt is not all in the KV cache yet, and the oldest one's arrival
        (their first tokens are at stake: the rollout lane's TTFT guard reads both)."""
        pending = [s.arrival for s in self.running if s.num_cached < s.prompt_len]
        self.unprefilled, self.unprefilled_since = len(pending), min(pending, default=None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


class Engine:
    """Hosts both models on one device and schedules serving and rollout work."""

    def __init__(
        self, serving_model, serving_tokenizer, policy_model, policy_tokenizer, config: EngineConfig = EngineConfig(), policy: str = "rose"
    ) -> None:
        self.config = config
        self.policy = make_policy(policy, config.quantum_ms, config.guard_fraction, config.static_share)
        self.device = select_device(config.device, config.emulation)
        dev = self.device.torch_device
        serving_model.to(dev)
        policy_model.to(dev)
        serving_lane = self.device.lane("serving", SERVING_PRIORITY)
        rollout_lane = serving_lane if self.policy.shares_serving_lane else self.device.lane("rollout", ROLLOUT_PRIORITY)
        s_pool, r_pool = (
            KVPool(
                name,
                self.device.kv_shape(model, wc),
                self.device.kv_bytes(wc, configured),
                config.block_size,
                dev,
                storage=self.device.backs_kv,
            )
            for name, wc, model, configured in (
                ("serving", WorkClass.SERVING, serving_model, config.serving_kv_bytes),
                ("rollout", WorkClass.ROLLOUT, policy_model, config.rollout_kv_bytes),
            )
        )
        r_pool.set_budget_bytes(0)  # no lease yet
        narrow = config.rollout_threads or self.device.threads_per_lane
        in_child = config.rollout_process and self.device.kind == "cpu" and self.policy.admits_rollout
        if in_child and (short := shared_memory_shortfall(policy_model, r_pool)):
            log.warning(
                "rollout forwards stay in this process: shared memory lacks %d MiB for the policy and its KV pool "
                "(raise it: docker's --shm-size / compose's shm_size)",
                short >> 20,
            )
            in_child = False
        idle = self.policy.rollout_cpu_idle and config.rollout_is_guest
        r_runner = (
            ProcessRunner(policy_model, r_pool, narrow, idle_priority=idle)
            if in_child
            else self.device.runner(policy_model, r_pool, WorkClass.ROLLOUT, policy_tokenizer)
        )
        if isinstance(r_runner, ProcessRunner):
            r_runner.held_poll_s = self._pause_poll_s  # a held forward asks again once per serving iteration
        self._rollout_in_child = in_child  # its forwards no longer hand the serving lane's interpreter lock back and forth
        self._serving = _ClassRuntime(
            WorkClass.SERVING,
            serving_model,
            serving_tokenizer,
            s_pool,
            Limits(config.serving_max_batch, config.serving_prefill_tokens, config.block_size),
            serving_lane,
            self.device.runner(serving_model, s_pool, WorkClass.SERVING, serving_tokenizer),
        )
        self._rollout = _ClassRuntime(
            WorkClass.ROLLOUT,
            policy_model,
            policy_tokenizer,
            r_pool,
            Limits(config.rollout_max_batch, config.rollout_prefill_tokens or self.device.rollout_prefill_tokens, config.block_size),
            rollout_lane,
            r_runner,
        )
        if config.cuda_graphs:
            for rt in (self._serving, self._rollout):
                if isinstance(rt.runner, PagedModelRunner):  # (the CPU's child-process runner never sees CUDA)
                    rt.runner.use_cuda_graphs(rt.limits.max_batch)
        self.prefix_cache = PrefixCache()
        self.host_tier = HostTier(int(config.host_kv_ratio * r_pool.capacity_bytes))  # copies of its entries in host memory
        self.metrics = EngineMetrics()
        self.policy_version = 0
        self.slo_ttft_ms, self.slo_tpot_ms = config.slo_ttft_ms, config.slo_tpot_ms
        self.slo_guard = SloGuard(config.slo_ttft_ms, config.slo_tpot_ms)  # the closed loop on serving's tails (slo_guard.py)
        self.bursts = ArrivalBurstDetector(config.bursts, config.burst_baseline_s)  # this executor's own burst detector (shared/bursts.py)
        self.on_burst: list[Callable[[BurstTrip], None]] = []  # called on the event loop when it trips (the executor publishes an alert)
        self._ids = itertools.count()
        self._seeds = torch.Generator().manual_seed(config.seed)
        self._lease: EngineLease | None = None
        self._lease_ended: RejectReason = "no_lease"
        self._revoked_at: float | None = None
        self._controls: deque[tuple[Callable[[], object], concurrent.futures.Future]] = deque()
        self._paused: str | None = None  # pause_rollout mode while paused
        self._released: frozenset[str] = frozenset()  # rollout memory given back (release_rollout_memory)
        self._yield_at: float | None = None
        # whether the running rollout quantum competes with serving for compute (same SMs; or CPU
        # cores, when the rollout lane is widened); only then must it yield to a serving arrival
        self._rollout_overlaps_serving = True
        self._serving_prioritised = False
        self._default_switch_interval = sys.getswitchinterval()
        self._in_quantum = False
        wide = self.device.max_lane_width(narrow) if self.policy.widens_when_serving_idle and config.lend_serving_core else narrow
        set_width = r_runner.set_width if isinstance(r_runner, ProcessRunner) else self.device.set_thread_width
        self._cores = CoreLending(narrow, wide, set_width)  # CPU: the serving core lent while serving has no work
        # whether the rollout lane, narrow / wide, competes with serving for compute (asked at every safepoint)
        self._overlap_at = {w: self.policy.shares_serving_lane or self.device.lanes_overlap(w) for w in (narrow, wide)}
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._started = False
        self._last_stats = time.monotonic()

    @classmethod
    def from_dirs(cls, serving_dir: str, policy_dir: str, config: EngineConfig = EngineConfig(), policy: str = "rose") -> Engine:
        from rose.shared.models import load_for_inference, load_tokenizer

        return cls(
            load_for_inference(serving_dir, "cpu", config.dtype),
            load_tokenizer(serving_dir),
            load_for_inference(policy_dir, "cpu", config.dtype),
            load_tokenizer(policy_dir),
            config,
            policy,
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._started:
            return
        self._started = True
        _HEAP_FREEZE.hold()
        self._threads = [threading.Thread(target=self._serving_loop, name="rose-serving", daemon=True)]
        if isinstance(self._rollout.runner, ProcessRunner):
            self._rollout.runner.start()  # waits until the child is ready (the first: seconds, see forward_context)
        if self.policy.admits_rollout:
            self._threads.append(threading.Thread(target=self._rollout_loop, name="rose-rollout", daemon=True))
        for t in self._threads:
            t.start()

    async def stop(self) -> None:
        """Stop both lanes; unfinished requests finish with finish_reason "abort"."""
        if self._started and not self._stopping:
            _HEAP_FREEZE.release()
        self._stopping = True
        for rt in (self._serving, self._rollout):
            rt.wakeup.set()
        await asyncio.to_thread(self._join_threads)
        if isinstance(self._rollout.runner, ProcessRunner):
            await asyncio.to_thread(self._rollout.runner.close)
        self._prioritise_serving(False)
        for rt in (self._serving, self._rollout):
            for seq in list(rt.inbox) + list(rt.waiting) + list(rt.running):
                self._finish(rt, seq, "abort")
            rt.inbox.clear()
            rt.waiting.clear()
            rt.running.clear()

    def _join_threads(self) -> None:
        for t in self._threads:
            t.join()

    # ------------------------------------------------------------------ public API
    def tokenizer_for(self, work_class: WorkClass):
        return self._runtime(work_class).tokenizer

    def max_positions(self, work_class: WorkClass) -> int:
        return self._runtime(work_class).runner.max_positions

    # read-outs for the SGLang-compatible API and the benchmarks: read without the lanes' cooperation,
    # so a reader may see a value a moment stale; only the engine changes what they return
    def max_batch(self, work_class: WorkClass) -> int:
        """The most sequences of this class one iteration runs."""
        return self._runtime(work_class).limits.max_batch

    def pool_for(self, work_class: WorkClass) -> KVPool:
        """This class's KV block pool, to read (block size, blocks, usage, whether its memory is released)."""
        return self._runtime(work_class).pool

    def model_for(self, work_class: WorkClass):
        """This class's model, to read (its config, where its weights live): it changes only by ``apply_policy_weights``."""
        return self._runtime(work_class).model

    def runner_for(self, work_class: WorkClass) -> PagedModelRunner | ProcessRunner | EmulatedRunner:
        """What runs this class's forwards (in this process, in a rollout child process, or emulated), to read: its CUDA graphs, its child."""
        return self._runtime(work_class).runner

    def lane_for(self, work_class: WorkClass):
        """This class's lane (its thread; its CUDA stream and that stream's priority on a GPU), to read."""
        return self._runtime(work_class).lane

    @property
    def core_lending(self) -> CoreLending:
        """The CPU's loan of the serving lane's idle core to the rollout lane, to read (``enabled``, ``is_wide``, ``returns``)."""
        return self._cores

    @property
    def rollout_shares_interpreter(self) -> bool:
        """True where rollout's ops run on this process's interpreter beside serving's (a host device, no rollout child
        process): only then does the policy guard the interpreter lock serving's lane waits for."""
        return self.device.host_is_device and not self._rollout_in_child

    def queue_lengths(self, work_class: WorkClass) -> tuple[int, int]:
        """This class's (running, queued) sequences; queued counts those submitted and not yet running."""
        rt = self._runtime(work_class)
        return len(rt.running), len(rt.inbox) + len(rt.waiting)

    @property
    def rollout_lease(self) -> EngineLease | None:
        """The rollout lease held now (None: none); an expired one stays until the rollout lane drops it."""
        return self._lease

    @property
    def stopping(self) -> bool:
        """True once ``stop`` was called: the lanes wind down and ``submit`` takes nothing new."""
        return self._stopping

    @property
    def lanes_alive(self) -> bool:
        """True while the engine is started, not stopping, and every lane's thread runs."""
        return self._started and not self._stopping and all(t.is_alive() for t in self._threads)

    def cuda_graph_stats(self) -> dict[str, dict | None]:
        """Each lane's CUDA graph counts by work class value, None for a lane that used none (off CUDA):
        captures, replays, and refusals (``failures``: after the first, that lane ran eagerly)."""
        stats: dict[str, dict | None] = {}
        for rt in (self._serving, self._rollout):
            graphs, failures = getattr(rt.runner, "graphs", None), getattr(rt.runner, "graph_failures", 0)
            stats[rt.work_class.value] = (
                None
                if graphs is None and not failures
                else {
                    "captures": graphs.captures if graphs else None,
                    "replays": graphs.replays if graphs else None,
                    "failures": failures,
                }
            )
        return stats

    def submit(self, request: GenerationRequest, *, require_lease: bool = True) -> RequestHandle:
        """Validate and queue; call from a running asyncio loop. Raises InvalidRequest or RolloutRejected.

        A rollout request is refused without a valid lease unless ``require_lease`` is False:
        then it waits in the queue until a lease comes (rollout never runs without one either way).
        """
        if self._stopping:
            raise RolloutRejected("draining", "the engine is stopping")
        rt = self._runtime(request.work_class)
        self._validate(rt, request)
        if rt is self._rollout and (require_lease or not self.policy.admits_rollout):
            self._check_lease_admits()

        def abort(request_id: str, rt: _ClassRuntime = rt) -> None:
            rt.aborts.append(request_id)
            rt.wakeup.set()

        handle = RequestHandle(request.request_id, asyncio.get_running_loop(), cancel=abort)
        seed = request.sampling.seed if request.sampling.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        seq = Sequence(next(self._ids), request, handle, SamplerState(request.sampling, seed))
        rt.inbox.append(seq)
        if rt is self._serving:
            self.metrics.serving_arrival()
            now = time.monotonic()
            trip = self.bursts.arrival(now, _prefill_pending(rt), self._serving_queue_wait_ms(now), self.slo_ttft_ms)
            if self.bursts.bursting and self.policy.admits_rollout:
                self.slo_guard.hold(now, self.bursts.cfg.window_s)  # yield at once and while it lasts, lease or not
            if trip is not None and self.policy.admits_rollout:
                for listener in self.on_burst:  # the alert that tells the scheduler (every realert_s)
                    listener(trip)
            self._cores.recall()
            if self.policy.yields_on_arrival and self._in_quantum and self._rollout_overlaps_serving and self._yield_at is None:
                self._yield_at = time.monotonic()
        rt.wakeup.set()
        return handle

    def set_rollout_lease(self, budget_bytes: int, expires_at_monotonic: float, lease_id: str = "") -> None:
        """Grant (or change) the lease: rollout may use up to budget_bytes of KV until expiry."""
        self._lease = EngineLease(max(0, int(budget_bytes)), expires_at_monotonic, lease_id)
        self._rollout.wakeup.set()

    def set_rollout_budget(self, budget_bytes: int) -> None:
        """Resize the current lease's memory budget; shrinking takes effect within one quantum."""
        if self._lease is not None:
            self.set_rollout_lease(budget_bytes, self._lease.expires_at, self._lease.lease_id)

    def revoke_rollout(self) -> None:
        """Take the lease back now: rollout yields within one quantum and frees its KV."""
        if self._lease is not None:
            self._revoked_at = time.monotonic()
        self._lease = None
        self._lease_ended = "lease_revoked"
        self._rollout.wakeup.set()

    def park_rollout(self, until_monotonic: float) -> None:
        """The lease was revoked on a burst: rollout runs nothing and takes nothing new; the requests
        it holds keep their KV (parked) until a new lease resumes them or ``until_monotonic`` ends
        the lease as an expiry does."""
        if self._lease is not None:
            if self._lease.admits:
                self._revoked_at = time.monotonic()  # its compute is reclaimed at the next quantum boundary: a reclaim sample
            self._lease = self._lease.parked(until_monotonic)
            self._lease_ended = "lease_revoked"
            self._rollout.wakeup.set()

    @property
    def holds_rollout_lease(self) -> bool:
        lease = self._lease
        return self.policy.admits_rollout and lease is not None and lease.admits_now()

    def set_slo(self, ttft_ms: float | None, tpot_ms: float | None) -> None:
        self.slo_ttft_ms, self.slo_tpot_ms = ttft_ms, tpot_ms
        self.slo_guard.set_slo(ttft_ms, tpot_ms)

    def apply_policy_weights(self, state_dict: dict, version: int) -> concurrent.futures.Future:
        """Validate now (raises WeightUpdateError, old weights kept), swap between quanta.

        Returns a future resolved with the swap pause in ms once the new version is live
        (``await asyncio.wrap_future(f)`` from asyncio).
        """
        staged = stage(self._rollout.model, state_dict, version)
        self._rollout.runner.prepare_weights(staged)  # here, not in the rollout lane's pause (rollout_process: the standby bank)
        return self._control(lambda: self._swap(staged))

    # ------------------------------------------------------------------ rollout control (SGLang-style admin)
    def pause_rollout(self, mode: str) -> concurrent.futures.Future:
        """Stop rollout at the next safepoint; resolves with the number of rollout requests affected.

        ``abort``: every queued and running rollout request finishes now with finish_reason
        "abort". ``retract``: running requests give back their KV and wait (they continue by
        recompute, nothing lost). ``in_place``: requests keep their KV and simply wait.
        New requests queue until ``continue_rollout``.
        """
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self._paused = mode
        return self._control(lambda: self._pause_now(mode))

    def continue_rollout(self) -> None:
        self._paused = None
        self._rollout.wakeup.set()

    @property
    def rollout_paused(self) -> str | None:
        return self._paused

    def abort_rollout(self, request_id: str | None = None) -> None:
        """Abort one rollout request by id, or every one (None); they finish with "abort"."""
        rt = self._rollout
        ids = [request_id] if request_id is not None else [s.request.request_id for s in list(rt.inbox) + list(rt.waiting) + list(rt.running)]
        rt.aborts.extend(ids)
        rt.wakeup.set()

    def flush_prefix_cache(self) -> concurrent.futures.Future:
        """Drop every retained trajectory prefix, on the device and in the host tier (SGLang's /flush_cache: a user
        asked); resolves with the number of device blocks freed."""
        return self._control(lambda: self._flush_now())

    def release_rollout_memory(self, tags: tuple[str, ...]) -> concurrent.futures.Future:
        """Give the rollout side's memory back: ``kv_cache`` (the rollout KV pool's storage) and/or
        ``weights`` (the policy parameters, moved to host memory). Rollout holds still until
        ``resume_rollout_memory``; its requests keep their tokens and continue by recompute.
        Resolves with the bytes freed on the device per tag."""
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise InvalidRequest(f"unknown memory tags {bad}: use {', '.join(MEMORY_TAGS)}")
        self._released = self._released | set(tags)
        return self._control(lambda: self._release_now(tuple(tags)))

    def resume_rollout_memory(self, tags: tuple[str, ...]) -> concurrent.futures.Future:
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise InvalidRequest(f"unknown memory tags {bad}: use {', '.join(MEMORY_TAGS)}")
        return self._control(lambda: self._resume_now(tuple(tags)))

    @property
    def released_memory(self) -> frozenset[str]:
        return self._released

    def _control(self, action: Callable[[], object]) -> concurrent.futures.Future:
        """Run `action` on the rollout lane between quanta (at once when no lane is running)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        if not self._started or not self.policy.admits_rollout or self._stopping:
            _settle(done, action)
        else:
            self._controls.append((action, done))
            self._rollout.wakeup.set()
        return done

    def _pause_now(self, mode: str) -> int:
        rt = self._rollout
        self._receive(rt)
        affected = len(rt.waiting) + len(rt.running)
        if mode == "abort":
            self.abort_rollout()
            self._receive(rt)
        elif mode == "retract":
            for seq in list(rt.running):
                self._preempt(rt, seq)
        return affected

    def _flush_now(self) -> int:
        """Drop every retained prefix, on the device and in the host tier; the number of device blocks freed."""
        self.host_tier.clear()
        return self._drop_device_prefixes()

    def _drop_device_prefixes(self) -> int:
        """Free the blocks of every prefix retained on the device; the number freed."""
        blocks = self.prefix_cache.clear()
        self._rollout.pool.free(blocks)
        return len(blocks)

    def _release_now(self, tags: tuple[str, ...]) -> dict[str, int]:
        rt = self._rollout
        freed = {}
        if "kv_cache" in tags and not rt.pool.released:
            self._receive(rt)
            for seq in list(rt.running):
                self._preempt(rt, seq)
            for seq in rt.waiting:  # a waiting turn may hold its retained prefix
                if seq.blocks:
                    rt.pool.free(seq.drop_kv())
            self._drop_device_prefixes()  # the host tier keeps its copies: turns after the resume restore from them
            freed["kv_cache"] = rt.pool.release()
        if "weights" in tags:
            freed["weights"] = self.device.offload(rt.model)
        return freed

    def _resume_now(self, tags: tuple[str, ...]) -> dict[str, int]:
        rt = self._rollout
        restored = {}
        if "kv_cache" in tags:
            restored["kv_cache"] = rt.pool.restore()
        if "weights" in tags:
            restored["weights"] = self.device.reload(rt.model)
        self._released = self._released - set(tags)
        rt.wakeup.set()
        return restored

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The live policy parameters (read-only use: a weight follower's base, a digest)."""
        return self.model_for(WorkClass.ROLLOUT).state_dict()

    def stats(self) -> EngineStats:
        now = time.monotonic()
        interval = self.metrics.take_interval()
        span = max(1e-9, now - interval.started)
        lease = self._lease
        device = dict(vars(self.device.telemetry(child_pid(self._rollout.runner))))
        device["process_rss_bytes"] += child_rss_bytes(self._rollout.runner)  # the rollout forward process is part of the executor
        return EngineStats(
            interval_s=span,
            ttft_ms=sketch_to_dict(interval.ttft),
            tpot_ms=sketch_to_dict(interval.tpot),
            serving_arrivals=interval.serving_arrivals,
            serving_completed=interval.serving_completed,
            serving_queue=len(self._serving.inbox) + len(self._serving.waiting),
            serving_queue_wait_ms=self._serving_queue_wait_ms(now),
            serving_running=len(self._serving.running),
            rollout_queue=len(self._rollout.inbox) + len(self._rollout.waiting),
            rollout_running=len(self._rollout.running),
            serving_tokens_per_s=interval.serving_tokens / span,
            rollout_tokens_per_s=interval.rollout_tokens / span,
            rollout_prefill_tokens_per_s=self.metrics.rollout_prefill_tokens_per_s,
            serving_pool=self._serving.pool.usage(),
            rollout_pool=self._rollout.pool.usage(self.prefix_cache.cached_blocks),
            prefix_hits=self.prefix_cache.hits,
            prefix_misses=self.prefix_cache.misses,
            prefix_host_hits=self.host_tier.hits,
            host_kv_bytes=self.host_tier.bytes_held,
            preemptions=self.metrics.preemptions,
            compute_yields=self.metrics.compute_yields,
            lane_failures=self.metrics.lane_failures,
            reclaim_latency_ms=interval.reclaim_ms,
            max_swap_pause_ms=self.metrics.max_swap_pause_ms,
            policy_version=self.policy_version,
            lease_id=lease.lease_id if lease else "",
            rollout_parked=lease is not None and not lease.admits,
            lease_budget_bytes=lease.budget_bytes if lease else 0,
            device=device,
            slo_guard=self._guard_state(now),
        )

    def _serving_queue_wait_ms(self, now: float) -> float | None:
        """When the last serving request awaiting its first token is projected to get it (the burst tests);
        None before serving's first iteration is timed (the queue's length decides then)."""
        s = self._serving
        if s.iteration_ms <= 0.0:
            return None
        return first_token_wait_ms(_oldest_wait_ms(s, now), _prefill_pending(s), s.iteration_ms)

    def _guard_state(self, now: float) -> GuardState:
        """The guard's state now: its control step runs here too, so it relaxes while rollout is idle."""
        s = self._serving
        self.slo_guard.update(now, _oldest_wait_ms(s, now), s.iteration_ms if s.running else 0.0)
        return self.slo_guard.state

    # ------------------------------------------------------------------ validation and admission
    def _runtime(self, work_class: WorkClass) -> _ClassRuntime:
        return self._serving if work_class is WorkClass.SERVING else self._rollout

    def _validate(self, rt: _ClassRuntime, request: GenerationRequest) -> None:
        validate_request(request, rt.runner.vocab_size, rt.runner.max_positions)
        total = len(request.prompt_token_ids) + request.sampling.max_tokens
        if rt.pool.blocks_for(total) > rt.pool.num_blocks:
            raise InvalidRequest(f"{total} tokens exceed the {rt.work_class.value} KV pool ({rt.pool.num_blocks * rt.pool.block_size} tokens)")

    def _check_lease_admits(self) -> None:
        check_lease_admits(self.policy.admits_rollout, self.policy.name, self._lease, self._lease_ended)

    # ------------------------------------------------------------------ serving lane
    def _serving_loop(self) -> None:
        self.device.init_thread()
        rt = self._serving
        self._warm_graphs(rt)
        while not self._stopping:
            self._receive(rt)
            if not rt.has_work():
                rt.count_unprefilled()  # nothing running: none, and no oldest arrival
                self._serving_wait(rt, IDLE_WAIT_S)
                continue
            self._cores.take_back()
            with rt.lane.run(), self._lane_survives(rt):
                self._iterate_timed(rt, admit=True)

    @staticmethod
    def _warm_graphs(rt: _ClassRuntime) -> None:
        """CUDA: capture the lane's common decode graphs before its first request (cuda_graphs.py)."""
        if isinstance(rt.runner, PagedModelRunner) and rt.runner.graphs is not None:
            with rt.lane.run():
                log.info("%s lane: %d CUDA graphs captured", rt.work_class.value, rt.runner.warm_cuda_graphs())

    def _serving_wait(self, rt: _ClassRuntime, seconds: float) -> None:
        """Wait up to ``seconds`` for a submit or abort, lending this lane's core to rollout meanwhile."""
        rt.wakeup.clear()
        if rt.inbox or rt.aborts:
            return
        self._cores.lend()
        rt.wakeup.wait(seconds)

    # ------------------------------------------------------------------ rollout lane
    def _rollout_loop(self) -> None:
        self.device.init_thread(self.config.rollout_threads)
        rt = self._rollout
        self._warm_graphs(rt)  # before any lease: its pool holds nothing yet
        while not self._stopping:
            self._between_quanta(rt)
            self._receive(rt)
            if not rt.has_work() or self._lease is None or not self._lease.admits or self._paused or self._released:
                self._rollout_idle()
                rt.wakeup.wait(IDLE_WAIT_S)
                rt.wakeup.clear()
                continue
            s = self._serving
            self._prioritise_serving(bool(s.inbox or s.waiting or s.running) and not self.policy.shares_serving_lane)
            self._fit_width()
            if not self.policy.may_run_rollout(self._signals()):
                self._rollout_idle(keep_priority=True)
                time.sleep(self._pause_poll_s())
                continue
            with self._lane_survives(rt):
                self._run_quantum(rt)

    @contextlib.contextmanager
    def _lane_survives(self, rt: _ClassRuntime):
        """An iteration that raises (a bug, or a rollout forward process that died twice in a row)
        must not end the lane's thread, which would leave every later request of its class
        waiting forever: it is logged, the lane's running requests finish with "abort" (with the
        tokens they have; their KV is freed) and the lane goes on with the rest."""
        try:
            yield
        except Exception as exc:
            log.exception("%s lane: an iteration failed; its %d running requests are aborted", rt.work_class.value, len(rt.running))
            self.metrics.lane_failed(rt.work_class.value, exc)
            running, rt.running = rt.running, []
            for seq in running:
                self._abort(rt, seq)
            self._in_quantum = False

    def _rollout_idle(self, keep_priority: bool = False) -> None:
        """Not computing: give a lent core back at once and stay narrow (no safepoint would narrow later)."""
        self._fit_width(may_widen=False)
        if not keep_priority:
            self._prioritise_serving(False)

    def _fit_width(self, may_widen: bool = True) -> None:
        """Widen over a lent serving core or narrow off a recalled one (CPU). Once the lane no longer
        overlaps serving, a pending serving arrival has its core back: a reclaim sample."""
        cores = self._cores
        cores.fit(may_widen)
        self._rollout_overlaps_serving = self._overlap_at[cores.wide if cores.is_wide else cores.narrow]
        yielded_at = self._yield_at
        if yielded_at is not None and not self._rollout_overlaps_serving:
            self._yield_at = None
            self.metrics.reclaim((time.monotonic() - yielded_at) * 1000.0)

    def _pause_poll_s(self) -> float:
        """How long a paused rollout lane waits before asking again: one serving iteration. What
        paused it (first tokens waiting, the step time, the tails, a burst) changes at serving's
        iteration boundaries; asking more often only takes the interpreter lock from the serving
        lane, which a held rollout should not cost (at least PAUSE_POLL_S, for an idle lane)."""
        return max(PAUSE_POLL_S, self._serving.iteration_ms / 1000.0)

    def _prioritise_serving(self, on: bool) -> None:
        """While serving and rollout both have work, hand the interpreter lock over sooner.

        Both lanes are Python threads: between torch ops they need the GIL, and CPython lets a
        thread keep it for a whole switch interval (5 ms) before another that asks gets it. A
        short interval while serving is busy is the interpreter's share of "serving first"
        (the stream priority of the GIL); it costs a little throughput, so only then.
        """
        if not self.device.host_is_device:
            return  # an emulated device computes nothing on the host: the interpreter lock is not its stream
        if on != self._serving_prioritised:
            sys.setswitchinterval(SERVING_SWITCH_INTERVAL_S if on else self._default_switch_interval)
            self._serving_prioritised = on

    def _signals(self) -> Signals:
        s = self._serving
        now = time.monotonic()
        oldest_wait_ms = _oldest_wait_ms(s, now)
        share = self.slo_guard.update(now, oldest_wait_ms, s.iteration_ms if s.running else 0.0)
        return Signals(
            now=now,
            serving_prefill_pending=_prefill_pending(s),
            serving_running=len(s.running),
            serving_iteration_ms=s.iteration_ms,
            slo_tpot_ms=self.slo_tpot_ms,
            lanes_overlap=self._rollout_overlaps_serving,
            serving_max_batch=s.limits.max_batch,
            shares_interpreter=self.rollout_shares_interpreter,
            slo_ttft_ms=self.slo_ttft_ms,
            serving_oldest_wait_ms=oldest_wait_ms,
            priority_streams=self.device.priority_streams,
            # an emulated device is a GPU engine with CUDA graphs: the roofline's fixed cost per step assumes them
            rollout_decode_graphs=getattr(self._rollout.runner, "graphs", None) is not None or not self.device.host_is_device,
            rollout_share=share,
            serving_arrival_rate_rps=self.bursts.rate(now),
        )

    def _run_quantum(self, rt: _ClassRuntime) -> None:
        """Run rollout iterations while the next is expected to fit the quantum (at least one)."""
        budget_ms = self.policy.quantum_ms
        with rt.lane.run():
            self._in_quantum = True
            start = time.perf_counter()
            self._iterate_timed(rt, admit=True)
            if budget_ms is None:  # unbounded: the batch admitted now runs to completion
                while rt.running and not self._stopping and self._lease is not None:
                    self._iterate_timed(rt, admit=False)
            else:
                while rt.has_work() and self._yield_at is None and (time.perf_counter() - start) * 1000.0 + rt.iteration_ms <= budget_ms:
                    self._fit_width()
                    self._iterate_timed(rt, admit=True)
            self._in_quantum = False
        yielded_at = self._yield_at
        if yielded_at is not None:
            self._yield_at = None
            self.metrics.reclaim((time.monotonic() - yielded_at) * 1000.0)

    def _iterate_timed(self, rt: _ClassRuntime, admit: bool) -> None:
        start = time.perf_counter()
        self._iterate(rt, admit)
        rt.iteration_ms += EMA_ALPHA * ((time.perf_counter() - start) * 1000.0 - rt.iteration_ms)

    def _between_quanta(self, rt: _ClassRuntime) -> None:
        """Housekeeping the rollout lane does only between quanta, never inside a batch."""
        while self._controls:
            action, done = self._controls.popleft()
            _settle(done, action)
        lease = self._lease
        if lease is not None and time.monotonic() >= lease.expires_at:
            self._lease, self._lease_ended = None, "lease_expired" if lease.admits else "lease_revoked"
            if lease.admits:  # a parked lease's compute was reclaimed (and sampled) when it was parked
                self._revoked_at = self._revoked_at or time.monotonic()
            lease = None
        rt.pool.set_budget_bytes(lease.budget_bytes if lease else 0)
        if rt.pool.over_budget_blocks:
            self._shrink(rt)
        if (lease is None or not lease.admits) and self._revoked_at is not None:
            self.metrics.reclaim((time.monotonic() - self._revoked_at) * 1000.0)
            self._revoked_at = None

    def _swap(self, staged: StagedWeights) -> float:
        pause_ms = self._rollout.runner.apply_weights(staged)
        self.policy_version = staged.version
        self._flush_now()  # KV of the old version is stale, on the device and in host memory
        self.metrics.swap_pause(pause_ms)
        return pause_ms

    def _shrink(self, rt: _ClassRuntime) -> None:
        """Give blocks back: evict retained prefixes (LRU), then preempt youngest rollouts."""
        entries = [len(e.blocks) for e in self.prefix_cache.entries().values()]
        n_evict, victims = plan_shrink(rt.pool.over_budget_blocks, entries, [(s.seq_id, len(s.blocks)) for s in rt.running])
        for _ in range(n_evict):
            rt.pool.free(self.prefix_cache.evict_lru())
        for seq_id in victims:
            self._preempt(rt, next(s for s in rt.running if s.seq_id == seq_id))

    def _preempt(self, rt: _ClassRuntime, seq: Sequence) -> None:
        rt.running.remove(seq)
        rt.pool.free(seq.drop_kv())
        rt.waiting.appendleft(seq)
        self.metrics.preempted()

    # ------------------------------------------------------------------ one iteration
    def _abort(self, rt: _ClassRuntime, seq: Sequence) -> None:
        """Free a sequence's KV (taken off its queue by the caller) and finish it with "abort"."""
        rt.pool.free(seq.blocks)
        seq.blocks = []
        self._finish(rt, seq, "abort")

    def _receive(self, rt: _ClassRuntime) -> None:
        while rt.aborts:
            rid = rt.aborts.popleft()
            for queue in (rt.inbox, rt.waiting, rt.running):
                for seq in [s for s in queue if s.request.request_id == rid]:
                    queue.remove(seq)
                    self._abort(rt, seq)
        while rt.inbox:
            seq = rt.inbox.popleft()
            if rt is self._rollout and seq.request.trajectory_id is not None:
                self._attach_prefix(rt, seq, seq.request.trajectory_id)
            rt.waiting.append(seq)

    def _attach_prefix(self, rt: _ClassRuntime, seq: Sequence, trajectory_id: str) -> None:
        """Hand the trajectory's retained prefix to its new turn: the device's entry, else the host tier's copy."""
        prompt = tuple(seq.tokens)
        hit, to_free = self.prefix_cache.take(trajectory_id, prompt, self.policy_version, rt.pool.block_size)
        rt.pool.free(to_free)
        if hit is not None:
            seq.blocks, seq.num_cached, seq.prefix_cached_tokens = hit.blocks, hit.reused_tokens, hit.reused_tokens
        else:
            self._restore_from_host(rt, seq, trajectory_id, prompt)

    def _restore_from_host(self, rt: _ClassRuntime, seq: Sequence, trajectory_id: str, prompt: tuple[int, ...]) -> None:
        """Write the host tier's copy of the prefix into newly allocated blocks, only where the pool has them free
        within its budget now: a restore saves a prefill, which is not worth an eviction or a preemption (the
        entry then stays for a later turn). The runner prices the copy where the device is emulated."""
        pool = rt.pool
        room = 0 if pool.released else pool.free_blocks * pool.block_size
        hit = self.host_tier.take(trajectory_id, prompt, self.policy_version, room_tokens=room)
        if hit is None:
            return
        blocks = pool.allocate(pool.blocks_for(hit.reused_tokens))
        pool.write_blocks(blocks, hit.payload.head(len(blocks)) if hit.payload is not None else None)
        rt.runner.host_load(hit.reused_tokens)
        seq.blocks, seq.num_cached, seq.prefix_cached_tokens = blocks, hit.reused_tokens, hit.reused_tokens

    def _iterate(self, rt: _ClassRuntime, admit: bool) -> None:
        limits = rt.limits
        if rt is self._rollout and not self.policy.may_prefill_rollout(self._signals()):
            limits = replace(limits, prefill_tokens=0)  # decode steps only: prompts wait (and admissions with them)
        plan = plan_iteration(
            [s.view() for s in rt.running],
            [s.view() for s in rt.waiting],
            rt.pool.free_blocks,
            self.prefix_cache.cached_blocks if rt is self._rollout else 0,
            limits,
            admit,
        )
        by_id = {s.seq_id: s for s in itertools.chain(rt.running, rt.waiting)}
        for seq_id in plan.preempt:
            self._preempt(rt, by_id[seq_id])
        freed = 0
        while freed < plan.evict_cached_blocks:
            blocks = self.prefix_cache.evict_lru()
            rt.pool.free(blocks)
            freed += len(blocks)
        now = time.monotonic()
        for seq_id in plan.admit:
            seq = by_id[seq_id]
            rt.waiting.remove(seq)
            rt.running.append(seq)
            if seq.first_scheduled is None:
                seq.first_scheduled = now
        for seq_id, n in plan.new_blocks.items():
            by_id[seq_id].blocks.extend(rt.pool.allocate(n))
        work = [(by_id[sid], n) for sid, n in plan.prefill] + [(by_id[sid], 1) for sid in plan.decode]
        rt.count_unprefilled()
        if not work:
            return
        prefill = sum(n for sid, n in plan.prefill) if rt is self._rollout else 0
        started = time.perf_counter()
        ready = self._run(rt, work)  # prefill chunks and decode steps in one packed forward
        if prefill and ready is not None:
            self.metrics.rollout_prefilled(prefill, time.perf_counter() - started)
        if ready is not None:  # None: abandoned at a layer safepoint, rollout yields to serving now
            self._process(rt, ready)
        rt.count_unprefilled()

    def _run(self, rt: _ClassRuntime, work: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int, float]] | None:
        """Forward the planned tokens and sample for the sequences that reach their end:
        returns those, each with its new token and logprob.

        Rollout forwards stop at the next layer safepoint once serving needs the device or
        the lease is gone (None is returned and nothing advances).
        """
        if not work:
            return []
        items = [ForwardItem(s.blocks, s.num_cached, s.tokens[s.num_cached : s.num_cached + n]) for s, n in work]
        ends = [row for row, (s, n) in enumerate(work) if s.num_cached + n == len(s.tokens)]
        steered = rt is self._rollout and self.policy.yields_on_arrival
        sampled = rt.runner.forward_sample(
            items,
            [(row, work[row][0].sampler) for row in ends],
            should_stop=self._rollout_safepoint if steered else None,
            should_hold=self._rollout_holds if steered else None,
        )
        if sampled is None:
            return None
        for seq, n in work:
            seq.num_cached += n
        return [(work[row][0], token, lp) for row, token, lp in zip(ends, *sampled)]

    def _rollout_safepoint(self) -> bool:
        """Between layers of a rollout forward: True abandons it (lease gone, stopping, paused, or a
        serving arrival while the lanes overlap, as on a GPU). On CPU an arrival only narrows the
        lane off the serving core, so the forward goes on beside serving."""
        if self._lease is None or self._stopping or self._paused is not None:
            return True
        if self._cores.enabled:
            self._fit_width()
        return self._yield_at is not None

    def _rollout_holds(self) -> bool:
        """Asked with the safepoint: while the policy would not start rollout now (on CPU, beside
        serving: a serving backlog, a serving step near the TPOT SLO), the forward in flight waits
        at its next layer safepoint instead of running on beside serving for the rest of its
        tens of milliseconds. Where the lanes overlap, an arrival abandons it instead."""
        return not self._rollout_overlaps_serving and not self.policy.may_run_rollout(self._signals())

    def _process(self, rt: _ClassRuntime, ready: list[tuple[Sequence, int, float]]) -> None:
        if not ready:
            return
        now = time.monotonic()
        version = self.policy_version if rt is self._rollout else SERVING_MODEL_VERSION
        outbox = []
        for seq, token, lp in ready:
            seq.tokens.append(token)
            seq.logprobs.append(lp)
            seq.versions.append(version)
            seq.token_times.append(now)
            reason = self._finish_reason(rt, seq, token)
            if reason is not None:
                rt.running.remove(seq)
                self._retire_kv(rt, seq)
                outbox.append(self._finish(rt, seq, reason, deliver=False))
            elif seq.request.stream and _delta_due(seq):
                delta = self._delta(seq, final=False)
                if delta is not None:
                    outbox.append((seq.handle, delta, None))
        if rt is self._serving:
            self.metrics.tokens(len(ready), 0)
        else:
            self.metrics.tokens(0, len(ready))
        _deliver(outbox)

    def _finish_reason(self, rt: _ClassRuntime, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.request.sampling
        if token in p.stop_token_ids or (token == rt.eos_id and not p.ignore_eos):
            return "stop"
        if p.stop:
            seq.text = rt.decode(seq.output)
            longest = max(len(s) for s in p.stop)
            at = find_stop(seq.text, p.stop, seq.emitted_text - longest)
            if at != -1:
                seq.text, seq.text_final = seq.text[:at], True
                return "stop"
        elif seq.request.stream and _delta_due(seq):
            seq.text = rt.decode(seq.output)
        if len(seq.output) >= p.max_tokens or len(seq.tokens) >= rt.runner.max_positions:
            return "length"
        return None

    def _delta(self, seq: Sequence, final: bool) -> StreamDelta | None:
        """New tokens and text since the last delta (see protocol.next_delta)."""
        delta, seq.emitted_text = next_delta(
            seq.request,
            seq.output,
            seq.logprobs,
            seq.text,
            seq.emitted_tokens,
            seq.emitted_text,
            final,
            seq.finish_reason,
            seq.sampler.top_logprobs,
        )
        if delta is not None:
            seq.emitted_tokens = len(seq.output)
        return delta

    def _retire_kv(self, rt: _ClassRuntime, seq: Sequence) -> None:
        """Free a finished sequence's KV, or retain it for the trajectory's next turn."""
        if rt is self._rollout and seq.request.trajectory_id is not None and seq.num_cached > 0:
            cached = tuple(seq.tokens[: seq.num_cached])
            keep = rt.pool.blocks_for(seq.num_cached)
            rt.pool.free(seq.blocks[keep:])
            self._write_through(rt, seq.request.trajectory_id, cached, seq.blocks[:keep])
            rt.pool.free(self.prefix_cache.put(seq.request.trajectory_id, cached, seq.blocks[:keep], self.policy_version))
        else:
            rt.pool.free(seq.blocks)
        seq.blocks = []

    def _write_through(self, rt: _ClassRuntime, trajectory_id: str, tokens: tuple[int, ...], blocks: list[int]) -> None:
        """Copy a prefix being retained to the host tier now (SGLang's write_through): its eviction and the pool's
        release, both on latency-critical paths, then have nothing to copy."""
        nbytes = len(blocks) * rt.pool.block_bytes
        if self.host_tier.fits(nbytes):
            self.host_tier.put(trajectory_id, HostEntry(tokens, self.policy_version, nbytes, rt.pool.read_blocks(blocks)))

    def _finish(self, rt: _ClassRuntime, seq: Sequence, reason: FinishReason, deliver: bool = True):
        seq.finish_reason = reason
        if not seq.text_final:
            seq.text = rt.decode(seq.output)
        delta = (
            self._delta(seq, final=True)
            if seq.request.stream
            else StreamDelta(
                request_id=seq.request.request_id,
                token_ids=tuple(seq.output),
                logprobs=tuple(seq.logprobs),
                text=seq.text,
                finished=True,
                finish_reason=reason,
                top_logprobs=tuple(seq.sampler.top_logprobs),
            )
        )
        result = self._result(rt, seq, reason)
        if rt is self._serving and reason != "abort":
            t = result.timings
            self.metrics.serving_finished(t.ttft_ms, t.tpot_ms if len(seq.output) > 1 else None, len(seq.output))
            self.slo_guard.observe(t.ttft_ms, t.tpot_ms if len(seq.output) > 1 else None, time.monotonic())
        item = (seq.handle, delta, result)
        if deliver:
            _deliver([item])
        return item

    def _result(self, rt: _ClassRuntime, seq: Sequence, reason: FinishReason) -> GenerationResult:
        timings = timings_since(seq.arrival, seq.token_times, seq.first_scheduled, seq.preemptions, time.monotonic())
        versions = tuple(seq.versions)
        return GenerationResult(
            request_id=seq.request.request_id,
            work_class=seq.request.work_class,
            token_ids=tuple(seq.output),
            logprobs=tuple(seq.logprobs),
            text=seq.text,
            finish_reason=reason,
            token_versions=versions,
            policy_version=versions[-1] if versions else self.policy_version,
            prefix_cached_tokens=seq.prefix_cached_tokens,
            timings=timings,
            top_logprobs=tuple(seq.sampler.top_logprobs),
        )


def _delta_due(seq: Sequence) -> bool:
    """A streamed request's deltas go out with its first token, then every ``stream_interval`` tokens."""
    n = len(seq.output)
    return n == 1 or n - seq.emitted_tokens >= seq.request.stream_interval


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, straight from the fast (Rust) tokenizer where that is
    the same thing: transformers' wrapper converts every id in Python first, which cost a streamed serving token
    more than the rest of its bookkeeping (tests/executor/test_engine.py checks the two agree)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    return lambda ids: backend.decode(ids, skip_special_tokens=True)


def _prefill_pending(rt: _ClassRuntime) -> int:
    """Requests of ``rt`` not past their prefill: queued, or running and not through it."""
    return len(rt.inbox) + len(rt.waiting) + rt.unprefilled


def _oldest_wait_ms(rt: _ClassRuntime, now: float) -> float:
    """How long the longest-waiting request of ``rt`` not yet past prefill has waited (0 if none).
    Read from another lane's thread: the queues may change under it, so each head is read once."""
    oldest = rt.unprefilled_since
    for queue in (rt.waiting, rt.inbox):
        try:
            arrival = queue[0].arrival
        except IndexError:
            continue
        oldest = arrival if oldest is None else min(oldest, arrival)
    return 0.0 if oldest is None else (now - oldest) * 1000.0


def _settle(done: concurrent.futures.Future, action: Callable[[], object]) -> None:
    try:
        done.set_result(action())
    except Exception as exc:  # handed to the caller, never raised on the lane
        done.set_exception(exc)


def _deliver(items: list) -> None:
    """Hand deltas/results to their event loops, one callback per loop per iteration."""
    by_loop: dict = {}
    for handle, delta, result in items:
        by_loop.setdefault(handle._loop, []).append((handle, delta, result))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver_on_loop, batch)
        except RuntimeError:
            pass  # the caller's loop is closed; nobody is listening


def _deliver_on_loop(batch: list) -> None:
    for handle, delta, result in batch:
        handle.deliver(delta, result)
