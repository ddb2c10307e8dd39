"""The co-serving engine: the serving model and an RL policy on one device, serving always first.

How a request flows, and who owns what (the package doc draws the types)::

    submit (event loop) ──queue──▶ Batcher (serving | rollout)  ◀── the lane thread that runs its iterations
                                     receive -> plan -> forward -> process -> deliver (to the caller's loop)

- ``Batcher`` (batcher.py): one work class's queues, sequences, KV pool and forward runner.
- ``LeaseState`` (lease_state.py): the rollout lease, written by the lease guard on the event loop.
- ``RolloutControl`` (rollout_control.py): pause, abort, flush, release, weight swaps: carried out between
  rollout iterations.
- The lane threads: serving's loop (here) runs serving iterations back to back; in the two-model mode
  ``RolloutLoop`` (rollout_loop.py) runs rollout in bounded quanta on a lane of its own.

Callers use it from asyncio: ``submit`` returns a handle that is an async iterator of ``StreamDelta`` and
whose ``result()`` is the ``GenerationResult``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Callable

import torch

from rose.shared.bursts import ArrivalBurstDetector, BurstTrip, first_token_wait_ms
from rose.shared.errors import RoseError
from rose.shared.lora import Adapter, base_dir_of, check_base, is_adapter_dir, read_adapter
from rose.shared.sketch import sketch_to_dict

from .adapters import POLICY_SLOTS, AdapterBank, NamedAdapterError, NamedAdapters
from .batcher import Batcher
from .co_batched import CoBatchedLoop
from .config import ROLLOUT_MODES
from .core_lending import CoreLending
from .device import ROLLOUT_PRIORITY, SERVING_PRIORITY, select_device
from .engine_config import DEFAULT_CONFIG, HEAP_FREEZE, EngineConfig
from .kv_pool import KVPool
from .lease_state import LeaseState
from .metrics import EngineMetrics
from .outputs import EngineStats, RequestHandle
from .policies import make_policy
from .prefix_cache import HostTier, PrefixCache, RetainedPrefixes
from .protocol import SERVING_MODEL_VERSION, EngineLease, GenerationRequest, InvalidRequest, RolloutRejected, WorkClass, validate_request
from .rollout_control import RolloutControl
from .rollout_loop import IDLE_WAIT_S, PAUSE_POLL_S, RolloutLoop, ServingWatch, iteration_survives, warm_graphs
from .rollout_process import ProcessRunner, child_pid, child_rss_bytes, shared_memory_shortfall
from .sampling import SamplerState
from .scheduling import Limits
from .sequence import Sequence
from .slo_guard import GuardState, SloGuard
from .weights import AdapterPolicyWeights, FullPolicyWeights, MergedAdapterWeights, PolicyWeights, checked_version, fold_in

__all__ = ["Engine", "EngineConfig"]

log = logging.getLogger("rose.executor.engine")


class EngineModeError(RoseError, ValueError):
    """The engine's rollout mode does not fit its policy (co-batched needs a LoRA adapter of the serving model)."""


class Engine:
    """Hosts the serving model and the RL policy on one device and schedules serving and rollout work.

    The policy is a model of its own (``policy_model``), or a LoRA adapter (``adapter``) of a base: of the
    serving model itself in the co-batched mode (``rollout_mode``), where rollout rows ride in serving's own
    batches; of ``policy_model``, a copy of that base, in the two-model mode."""

    def __init__(
        self,
        serving_model,
        serving_tokenizer,
        policy_model,
        policy_tokenizer,
        config: EngineConfig = DEFAULT_CONFIG,
        policy: str = "rose",
        *,
        adapter: Adapter | None = None,
    ) -> None:
        self.config = config
        self.mode = config.rollout_mode
        self.policy = make_policy(policy, config.quantum_ms, config.guard_fraction, config.static_share)
        self.device = select_device(config.device, config.emulation)
        self.metrics = EngineMetrics()
        self.policy_version = 0
        self.lease = LeaseState()
        self.slo_ttft_ms, self.slo_tpot_ms = config.slo_ttft_ms, config.slo_tpot_ms
        self.slo_guard = SloGuard(config.slo_ttft_ms, config.slo_tpot_ms)  # the closed loop on serving's tails (slo_guard.py)
        self.bursts = ArrivalBurstDetector(config.bursts, config.burst_baseline_s)  # this executor's own burst detector (shared/bursts.py)
        self.on_burst: list[Callable[[BurstTrip], None]] = []  # called on the event loop when it trips (the executor publishes an alert)
        self._ids = itertools.count()
        self._seeds = torch.Generator().manual_seed(config.seed)
        self._threads: list = []
        self._stopping = self._started = False
        self.lora = adapter is not None
        co_batched = self.mode == "co_batched"
        self._check_mode(adapter)
        if co_batched:
            assert adapter is not None  # _check_mode: co-batched runs an adapter
            serving_model.to(self.device.torch_device)
            bank = self._adapter_bank(adapter, serving_model)
            # adapters loaded by name beside the policy's: serving's own batches take any of them
            self.named_adapters = NamedAdapters(bank, POLICY_SLOTS) if config.named_adapter_slots else None
            self.weights = self._init_co_batched(serving_model, serving_tokenizer, policy_tokenizer, bank)
        else:
            self.named_adapters = None
            self.weights = self._init_two_model(serving_model, serving_tokenizer, policy_model, policy_tokenizer, adapter)
        self.control = RolloutControl(
            self.rollout,
            offload_weights=None if co_batched else lambda: self.device.offload(self.rollout.model),
            reload_weights=None if co_batched else lambda: self.device.reload(self.rollout.model),
            runs_now=lambda: not self._started or not self.policy.admits_rollout or self._stopping,
        )
        self._watch = ServingWatch(self.serving, self.slo_guard, lambda: (self.slo_ttft_ms, self.slo_tpot_ms), self.bursts.rate)
        self._init_lanes()

    def _check_mode(self, adapter: Adapter | None) -> None:
        if self.mode not in ROLLOUT_MODES:
            raise EngineModeError(f"unknown rollout mode {self.mode!r}; use one of {', '.join(ROLLOUT_MODES)}")
        if self.mode == "co_batched" and adapter is None:
            raise EngineModeError(
                "rollout_mode co_batched runs rollout rows in the serving model's own batches, so the policy must be a LoRA "
                "adapter of the serving model; this one is a model of its own (build one: `rose models init DIR --lora`, "
                'or set engine.rollout_mode = "two_model")'
            )
        if self.mode == "co_batched" and self.policy.name == "static_partition":
            raise EngineModeError("static_partition is a duty cycle of a rollout lane: it runs in the two_model mode only")

    def _adapter_bank(self, adapter: Adapter, serving_model) -> AdapterBank:
        """The LoRA policy's slots (and the named adapters') beside the serving model, version 0 in slot 0; refused
        (AdapterError, saying which model and why) unless the serving model is the one the adapter was built on."""
        check_base(adapter, serving_model.state_dict(), "this executor's serving model")
        dtype = next(serving_model.parameters()).dtype
        slots = POLICY_SLOTS + self.config.named_adapter_slots
        bank = AdapterBank.for_adapter(adapter, slots=slots, device=self.device.torch_device, dtype=dtype)
        bank.load(0, {n: t.to(dtype) for n, t in adapter.tensors.items()}, version=0)
        return bank

    def _init_two_model(self, serving_model, serving_tokenizer, policy_model, policy_tokenizer, adapter: Adapter | None) -> PolicyWeights:
        """Two models, two lanes: each class its model on the device, its KV pool and its forward runner. A LoRA
        policy runs folded into its base's copy (``MergedAdapterWeights``): rollout's forwards cost a plain model's."""
        config, dev = self.config, self.device.torch_device
        serving_model.to(dev)
        policy_model.to(dev)
        pristine = None
        if adapter is not None:
            check_base(adapter, policy_model.state_dict(), "the policy's base")
            pristine = fold_in(policy_model, adapter)
        serving_lane = self.device.lane("serving", SERVING_PRIORITY)
        rollout_lane = serving_lane if self.policy.shares_serving_lane else self.device.lane("rollout", ROLLOUT_PRIORITY)
        s_pool = self._pool("serving", WorkClass.SERVING, serving_model, config.serving_kv_bytes)
        r_pool = self._pool("rollout", WorkClass.ROLLOUT, policy_model, config.rollout_kv_bytes)
        r_pool.set_budget_bytes(0)  # no lease yet
        r_runner = self._rollout_runner(policy_model, policy_tokenizer, r_pool)
        self.serving = self._serving_batcher(
            serving_model, serving_tokenizer, s_pool, self.device.runner(serving_model, s_pool, WorkClass.SERVING, serving_tokenizer), serving_lane
        )
        self.rollout = Batcher(
            WorkClass.ROLLOUT,
            policy_model,
            policy_tokenizer,
            r_pool,
            r_runner,
            Limits(config.rollout_max_batch, config.rollout_prefill_tokens or self.device.rollout_prefill_tokens, config.block_size),
            rollout_lane,
            metrics=self.metrics,
            version=lambda: self.policy_version,
            prefixes=RetainedPrefixes(r_pool, r_runner, int(config.host_kv_ratio * r_pool.capacity_bytes)),
        )
        if config.cuda_graphs:
            for rt in (self.serving, self.rollout):
                if hasattr(rt.runner, "use_cuda_graphs") and not isinstance(rt.runner, ProcessRunner):  # (the CPU's child never sees CUDA)
                    rt.runner.use_cuda_graphs(rt.limits.max_batch)
        full = FullPolicyWeights(policy_model, r_runner)
        return MergedAdapterWeights(adapter, pristine, full) if adapter is not None and pristine is not None else full

    def _init_co_batched(self, serving_model, serving_tokenizer, policy_tokenizer, bank: AdapterBank) -> PolicyWeights:
        """One model, one lane, one runner over two KV pools: serving's rows in pool 0, rollout's (through the
        adapter's live slot) in pool 1, each pool its own tensor of the serving model's shape."""
        config = self.config
        lane = self.device.lane("serving", SERVING_PRIORITY)
        s_pool = self._pool("serving", WorkClass.SERVING, serving_model, config.serving_kv_bytes)
        r_pool = self._pool("rollout", WorkClass.ROLLOUT, serving_model, config.rollout_kv_bytes)
        r_pool.set_budget_bytes(0)  # no lease yet
        runner = self.device.runner(serving_model, [s_pool, r_pool], WorkClass.SERVING, serving_tokenizer, adapters=bank)
        self.serving = self._serving_batcher(serving_model, serving_tokenizer, s_pool, runner, lane)
        weights = AdapterPolicyWeights(bank)
        self.rollout = Batcher(
            WorkClass.ROLLOUT,
            serving_model,
            policy_tokenizer,
            r_pool,
            runner,
            Limits(config.rollout_max_batch, config.rollout_prefill_tokens or self.device.rollout_prefill_tokens, config.block_size),
            lane,
            metrics=self.metrics,
            version=lambda: self.policy_version,
            prefixes=RetainedPrefixes(r_pool, runner, int(config.host_kv_ratio * r_pool.capacity_bytes)),
            wakeup=self.serving.wakeup,  # one thread runs both classes' iterations: either's work wakes it
            pool_index=1,
            adapter_slot=weights.slot,
        )
        if config.cuda_graphs and hasattr(runner, "use_cuda_graphs"):
            runner.use_cuda_graphs(self.serving.limits.max_batch)  # serving-only decode steps; adapted ones run eagerly
        return weights

    def _serving_batcher(self, model, tokenizer, pool: KVPool, runner, lane) -> Batcher:
        config = self.config
        return Batcher(
            WorkClass.SERVING,
            model,
            tokenizer,
            pool,
            runner,
            Limits(config.serving_max_batch, config.serving_prefill_tokens, config.block_size),
            lane,
            metrics=self.metrics,
            version=lambda: SERVING_MODEL_VERSION,
            guard=self.slo_guard,
        )

    def _pool(self, name: str, work_class: WorkClass, model, configured_bytes: int) -> KVPool:
        return KVPool(
            name,
            self.device.kv_shape(model, work_class),
            self.device.kv_bytes(work_class, configured_bytes),
            self.config.block_size,
            self.device.torch_device,
            storage=self.device.backs_kv,
        )

    def _rollout_runner(self, policy_model, policy_tokenizer, pool: KVPool):
        """Rollout's forwards: in a child process off this interpreter's lock (CPU, where configured and shared
        memory allows), else on the device's own runner."""
        narrow = self.config.rollout_threads or self.device.threads_per_lane
        in_child = self.config.rollout_process and self.device.kind == "cpu" and self.policy.admits_rollout
        if in_child and (short := shared_memory_shortfall(policy_model, pool)):
            log.warning(
                "rollout forwards stay in this process: shared memory lacks %d MiB for the policy and its KV pool "
                "(raise it: docker's --shm-size / compose's shm_size)",
                short >> 20,
            )
            in_child = False
        if not in_child:
            return self.device.runner(policy_model, pool, WorkClass.ROLLOUT, policy_tokenizer)
        idle = self.policy.rollout_cpu_idle and self.config.rollout_is_guest
        runner = ProcessRunner(policy_model, pool, narrow, idle_priority=idle)
        runner.held_poll_s = lambda: max(PAUSE_POLL_S, self.serving.iteration_ms / 1000.0)  # a held forward asks again once per serving iteration
        return runner

    def _init_lanes(self) -> None:
        """The threads' loops, chosen once: the two-model mode's rollout lane (with its CPU core lending), or the
        co-batched mode's one loop over both classes."""
        narrow = self.config.rollout_threads or self.device.threads_per_lane
        runner = self.rollout.runner
        lends = self.mode == "two_model" and self.policy.widens_when_serving_idle and self.config.lend_serving_core
        wide = self.device.max_lane_width(narrow) if lends else narrow
        set_width = runner.set_width if isinstance(runner, ProcessRunner) else self.device.set_thread_width
        self.core_lending = CoreLending(narrow, wide, set_width)  # CPU: the serving core lent while serving has no work
        self._rollout_loop: RolloutLoop | None = None
        self._co_batched: CoBatchedLoop | None = None
        if self.mode == "co_batched":
            self._co_batched = CoBatchedLoop(
                serving=self.serving,
                rollout=self.rollout,
                watch=self._watch,
                lease=self.lease,
                control=self.control,
                policy=self.policy,
                device=self.device,
                metrics=self.metrics,
                stopping=lambda: self._stopping,
                lane_threads=self.config.rollout_threads,
            )
            return
        self._rollout_loop = RolloutLoop(
            rollout=self.rollout,
            serving=self.serving,
            watch=self._watch,
            lease=self.lease,
            control=self.control,
            policy=self.policy,
            device=self.device,
            cores=self.core_lending,
            # whether the rollout lane, narrow / wide, competes with serving for compute (asked at every safepoint)
            overlap_at={w: self.policy.shares_serving_lane or self.device.lanes_overlap(w) for w in (narrow, wide)},
            metrics=self.metrics,
            stopping=lambda: self._stopping,
            rollout_threads=self.config.rollout_threads,
            shares_interpreter=self.device.host_is_device and not isinstance(runner, ProcessRunner),
        )

    @classmethod
    def from_dirs(cls, serving_dir: str, policy_dir: str, config: EngineConfig = DEFAULT_CONFIG, policy: str = "rose") -> Engine:
        """An engine over local model directories. A policy directory that holds a LoRA adapter (peft's files) is a
        LoRA policy: of the serving model in the co-batched mode, of its own base (loaded as a second copy) in the
        two-model mode."""
        from rose.shared.models import load_for_inference, load_tokenizer

        serving = load_for_inference(serving_dir, "cpu", config.dtype)
        adapter = read_adapter(policy_dir) if is_adapter_dir(policy_dir) else None
        if adapter is None:
            policy_model = load_for_inference(policy_dir, "cpu", config.dtype)
        elif config.rollout_mode == "co_batched":
            policy_model = None  # the serving model is the base: its weights, read once for both classes
        else:
            policy_model = load_for_inference(str(base_dir_of(policy_dir, adapter)), "cpu", config.dtype)
        return cls(serving, load_tokenizer(serving_dir), policy_model, load_tokenizer(policy_dir), config, policy, adapter=adapter)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the lane threads (a rollout forward process first: the first one takes seconds, see forward_context)."""
        if self._started:
            return
        self._started = True
        HEAP_FREEZE.hold()
        if self._co_batched is not None:
            self._threads = [threading.Thread(target=self._co_batched.run, name="rose-serving", daemon=True)]
        else:
            self._threads = [threading.Thread(target=self._serving_loop, name="rose-serving", daemon=True)]
            if isinstance(self.rollout.runner, ProcessRunner):
                self.rollout.runner.start()
            if self.policy.admits_rollout and self._rollout_loop is not None:
                self._threads.append(threading.Thread(target=self._rollout_loop.run, name="rose-rollout", daemon=True))
        for t in self._threads:
            t.start()

    async def stop(self) -> None:
        """Stop both lanes; unfinished requests finish with finish_reason "abort"."""
        if self._started and not self._stopping:
            HEAP_FREEZE.release()
        self._stopping = True
        for rt in (self.serving, self.rollout):
            rt.wakeup.set()
        await asyncio.to_thread(self._join_threads)
        if isinstance(self.rollout.runner, ProcessRunner):
            await asyncio.to_thread(self.rollout.runner.close)
        if self._rollout_loop is not None:
            self._rollout_loop.prioritise_serving(False)
        for rt in (self.serving, self.rollout):
            rt.finish_all()

    async def __aenter__(self) -> Engine:
        await asyncio.to_thread(self.start)  # off the loop: it may wait seconds for its rollout forward process
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _join_threads(self) -> None:
        for t in self._threads:
            t.join()

    @property
    def stopping(self) -> bool:
        """True once ``stop`` was called: the lanes wind down and ``submit`` takes nothing new."""
        return self._stopping

    @property
    def lanes_alive(self) -> bool:
        """True while the engine is started, not stopping, and every lane's thread runs."""
        return self._started and not self._stopping and all(t.is_alive() for t in self._threads)

    # ------------------------------------------------------------------ reading the engine
    def work_for(self, work_class: WorkClass) -> Batcher:
        """This class's batcher, to read: its pool, model, runner, lane, limits and queues (``queue_lengths``);
        only the lane that runs its iterations changes it."""
        return self.serving if work_class is WorkClass.SERVING else self.rollout

    @property
    def lendable_kv_bytes(self) -> int:
        """What a lease may grant: the rollout pool (an emulated device's is sized in its own memory)."""
        return self.rollout.pool.capacity_bytes

    def tokenizer_for(self, work_class: WorkClass):
        return self.work_for(work_class).tokenizer

    def max_positions(self, work_class: WorkClass) -> int:
        return self.work_for(work_class).runner.max_positions

    @property
    def rollout_shares_interpreter(self) -> bool:
        """True where rollout's ops run on this process's interpreter beside serving's (a host device, no rollout
        child process): only then does the policy guard the interpreter lock serving's lane waits for."""
        return self._rollout_loop is not None and self._rollout_loop.shares_interpreter

    @property
    def prefix_cache(self) -> PrefixCache:
        """The rollout pool's retained prefixes on the device, to read."""
        assert self.rollout.prefixes is not None  # the rollout batcher always retains
        return self.rollout.prefixes.device

    @property
    def host_tier(self) -> HostTier:
        """Their copies in host memory, to read."""
        assert self.rollout.prefixes is not None
        return self.rollout.prefixes.host

    def cuda_graph_stats(self) -> dict[str, dict | None]:
        """Each lane's CUDA graph counts by work class value, None for a lane that used none (off CUDA):
        captures, replays, and refusals (``failures``: after the first, that lane ran eagerly)."""
        stats: dict[str, dict | None] = {}
        for rt in (self.serving, self.rollout):
            graphs, failures = getattr(rt.runner, "graphs", None), getattr(rt.runner, "graph_failures", 0)
            stats[rt.work_class.value] = (
                None
                if graphs is None and not failures
                else {"captures": graphs.captures if graphs else None, "replays": graphs.replays if graphs else None, "failures": failures}
            )
        return stats

    # ------------------------------------------------------------------ requests
    def submit(self, request: GenerationRequest, *, require_lease: bool = True) -> RequestHandle:
        """Validate and queue; call from a running asyncio loop. Raises InvalidRequest or RolloutRejected.

        A rollout request is refused without a valid lease unless ``require_lease`` is False:
        then it waits in the queue until a lease comes (rollout never runs without one either way).
        """
        if self._stopping:
            raise RolloutRejected("draining", "the engine is stopping")
        rt = self.work_for(request.work_class)
        self._validate(rt, request)
        if rt is self.rollout and (require_lease or not self.policy.admits_rollout):
            self.lease.check_admits(self.policy.admits_rollout, self.policy.name)
        handle = RequestHandle(request.request_id, asyncio.get_running_loop(), cancel=rt.cancel)
        named = self._named_adapter(request.lora, handle) if request.lora is not None else None
        seed = request.sampling.seed if request.sampling.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        rt.queue(Sequence(next(self._ids), request, handle, SamplerState(request.sampling, seed), named))
        if rt is self.serving:
            self._serving_arrived()
        return handle

    def _validate(self, rt: Batcher, request: GenerationRequest) -> None:
        validate_request(request, rt.runner.vocab_size, rt.runner.max_positions)
        total = len(request.prompt_token_ids) + request.sampling.max_tokens
        if rt.pool.blocks_for(total) > rt.pool.num_blocks:
            raise InvalidRequest(f"{total} tokens exceed the {rt.work_class.value} KV pool ({rt.pool.num_blocks * rt.pool.block_size} tokens)")

    def _named_adapter(self, name: str, handle: RequestHandle) -> tuple[int, int]:
        """The (slot, version label) of the adapter a request names, the request counted as one that uses it."""
        if self.named_adapters is None:
            raise InvalidRequest(self._no_named_adapters(), "lora_path")
        try:
            entry = self.named_adapters.acquire(name, handle)
        except NamedAdapterError as exc:
            raise InvalidRequest(str(exc), "lora_path") from None
        return entry.slot, entry.version

    def _serving_arrived(self) -> None:
        """A serving arrival: the burst detector sees it (its trip holds rollout back and alerts the scheduler),
        and a rollout quantum competing with serving yields."""
        self.metrics.serving_arrival()
        now = time.monotonic()
        trip: BurstTrip | None = self.bursts.arrival(now, self.serving.prefill_pending(), self._serving_queue_wait_ms(now), self.slo_ttft_ms)
        if self.bursts.bursting and self.policy.admits_rollout:
            self.slo_guard.hold(now, self.bursts.cfg.window_s)  # yield at once and while it lasts, lease or not
        if trip is not None and self.policy.admits_rollout:
            for listener in self.on_burst:  # the alert that tells the scheduler (every realert_s)
                listener(trip)
        if self._rollout_loop is not None:
            self._rollout_loop.serving_arrived()

    # ------------------------------------------------------------------ the lease (leases.py's LeaseGuard writes it)
    def set_rollout_lease(self, budget_bytes: int, expires_at_monotonic: float, lease_id: str = "") -> None:
        """Grant (or change) the lease: rollout may use up to budget_bytes of KV until expiry."""
        self.lease.grant(budget_bytes, expires_at_monotonic, lease_id)
        self.rollout.wakeup.set()

    def set_rollout_budget(self, budget_bytes: int) -> None:
        """Resize the current lease's memory budget; shrinking takes effect within one quantum."""
        if self.lease.resize(budget_bytes) is not None:
            self.rollout.wakeup.set()

    def revoke_rollout(self) -> None:
        """Take the lease back now: rollout yields within one quantum and frees its KV."""
        self.lease.revoke()
        self.rollout.wakeup.set()

    def park_rollout(self, until_monotonic: float) -> None:
        """The lease was revoked on a burst: rollout runs nothing and takes nothing new; the requests it holds keep
        their KV (parked) until a new lease resumes them or ``until_monotonic`` ends the lease (as revoked)."""
        if self.lease.park(until_monotonic) is not None:
            self.rollout.wakeup.set()

    @property
    def rollout_lease(self) -> EngineLease | None:
        """The rollout lease held now (None: none); an expired one stays until the rollout lane drops it."""
        return self.lease.current

    @property
    def holds_rollout_lease(self) -> bool:
        return self.policy.admits_rollout and self.lease.admits

    def set_slo(self, ttft_ms: float | None, tpot_ms: float | None) -> None:
        self.slo_ttft_ms, self.slo_tpot_ms = ttft_ms, tpot_ms
        self.slo_guard.set_slo(ttft_ms, tpot_ms)

    # ------------------------------------------------------------------ policy weights
    def apply_policy_weights(self, state_dict: dict, version: int) -> concurrent.futures.Future:
        """Validate now (raises WeightUpdateError, old weights kept), swap between rollout iterations.

        Returns a future resolved with the swap pause in ms once the new version is live
        (``await asyncio.wrap_future(f)`` from asyncio). An empty ``state_dict`` is a version that changed no weight
        (shared/weight_sync.py): only the label later tokens record moves, between iterations as any swap, nothing copied.
        """
        if not state_dict:
            checked_version(version)
            return self.control.between_iterations(lambda: self._relabel(version))
        swap = self.weights.prepare(state_dict, version)  # here, not in the lane's pause (a standby bank or slot is filled)
        return self.control.between_iterations(lambda: self._swap(swap, version))

    def _relabel(self, version: int) -> float:
        """The same weights under a new version. Prefixes retained under the old label are not reused (the prefix cache
        matches labels): a prefill more, never a token of other weights."""
        self.policy_version = version
        return 0.0

    def _swap(self, swap: Callable[[], float], version: int) -> float:
        pause_ms = swap()
        self.policy_version = version
        if self.rollout.prefixes is not None:
            self.rollout.prefixes.flush()  # KV of the old version is stale, on the device and in host memory
        self.metrics.swap_pause(pause_ms)
        return pause_ms

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The live policy parameters, or the live adapter's tensors by peft name (read-only use: a weight
        follower's base, a digest)."""
        return self.weights.state_dict()

    # ------------------------------------------------------------------ named adapters (SGLang's /load_lora_adapter)
    def load_adapter(self, name: str, adapter: Adapter, *, version: int = 0, source: str = "") -> None:
        """Hold ``adapter`` under ``name`` (co-batched mode): rollout requests naming it (``GenerationRequest.lora``)
        run through it, in serving's batches. Refused, nothing changed: EngineModeError (two-model mode), AdapterError
        (not an adapter of the serving model, or not the policy's shape), NamedAdapterError (name taken, no slot).
        ``version``: the label its tokens record (SGLang's adapters carry none: 0); ``source``: where it came from."""
        if self.named_adapters is None:
            raise EngineModeError(self._no_named_adapters())
        check_base(adapter, self.serving.model.state_dict(), "this executor's serving model")
        self.named_adapters.load(name, adapter, version, source)

    async def unload_adapter(self, name: str) -> None:
        """Stop taking requests that name ``name`` now (NamedAdapterError: no such name), and free its slot once every
        request in flight that names it is done (it waits for them, as SGLang's unload does). Call it on the event loop
        that submits those requests (it awaits their handles)."""
        if self.named_adapters is None:
            raise EngineModeError(self._no_named_adapters())
        entry = self.named_adapters.unregister(name)
        await asyncio.gather(*(user.result() for user in entry.users), return_exceptions=True)
        self.named_adapters.release(entry)

    def _no_named_adapters(self) -> str:
        return (
            f"this engine holds no adapters by name: its rollout mode is {self.mode} with a "
            f"{'LoRA' if self.lora else 'full-weight'} policy; named adapters ride in serving's own batches, "
            'which needs engine.rollout_mode = "co_batched" and a policy that is a LoRA adapter of the serving model'
        )

    # ------------------------------------------------------------------ stats
    def stats(self) -> EngineStats:
        now = time.monotonic()
        interval = self.metrics.take_interval()
        span = max(1e-9, now - interval.started)
        s, r = self.serving, self.rollout
        prefixes = r.prefixes
        assert prefixes is not None
        device = dict(vars(self.device.telemetry(child_pid(r.runner))))
        device["process_rss_bytes"] += child_rss_bytes(r.runner)  # the rollout forward process is part of the executor
        return EngineStats(
            interval_s=span,
            ttft_ms=sketch_to_dict(interval.ttft),
            tpot_ms=sketch_to_dict(interval.tpot),
            serving_arrivals=interval.serving_arrivals,
            serving_completed=interval.serving_completed,
            serving_queue=len(s.inbox) + len(s.waiting),
            serving_queue_wait_ms=self._serving_queue_wait_ms(now),
            serving_running=len(s.running),
            rollout_queue=len(r.inbox) + len(r.waiting),
            rollout_running=len(r.running),
            serving_tokens_per_s=interval.serving_tokens / span,
            rollout_tokens_per_s=interval.rollout_tokens / span,
            rollout_prefill_tokens_per_s=self.metrics.rollout_prefill_tokens_per_s,
            serving_pool=s.pool.usage(),
            rollout_pool=r.pool.usage(prefixes.cached_blocks),
            prefix_hits=prefixes.device.hits,
            prefix_misses=prefixes.device.misses,
            prefix_host_hits=prefixes.host.hits,
            host_kv_bytes=prefixes.host.bytes_held,
            preemptions=self.metrics.preemptions,
            compute_yields=self.metrics.compute_yields,
            lane_failures=self.metrics.lane_failures,
            reclaim_latency_ms=interval.reclaim_ms,
            max_swap_pause_ms=self.metrics.max_swap_pause_ms,
            policy_version=self.policy_version,
            lease_id=self.lease.lease_id,
            rollout_parked=self.lease.parked,
            lease_budget_bytes=self.lease.budget_bytes,
            device=device,
            slo_guard=self._guard_state(now),
            rollout_mode=self.mode,
        )

    def _serving_queue_wait_ms(self, now: float) -> float | None:
        """When the last serving request awaiting its first token is projected to get it (the burst tests);
        None before serving's first iteration is timed (the queue's length decides then)."""
        s = self.serving
        if s.iteration_ms <= 0.0:
            return None
        return first_token_wait_ms(s.oldest_wait_ms(now), s.prefill_pending(), s.iteration_ms)

    def _guard_state(self, now: float) -> GuardState:
        """The guard's state now: its control step runs here too, so it relaxes while rollout is idle."""
        s = self.serving
        self.slo_guard.update(now, s.oldest_wait_ms(now), s.iteration_ms if s.running else 0.0)
        return self.slo_guard.state

    # ------------------------------------------------------------------ the serving lane
    def _serving_loop(self) -> None:
        self.device.init_thread()
        rt = self.serving
        warm_graphs(rt)
        while not self._stopping:
            rt.receive()
            if not rt.has_work():
                rt.count_unprefilled()  # nothing running: none, and no oldest arrival
                self._serving_wait(IDLE_WAIT_S)
                continue
            self.core_lending.take_back()
            with rt.lane.run(), iteration_survives(rt, self.metrics):
                started = time.perf_counter()
                rt.iterate(admit=True)
                rt.time_iteration(started)

    def _serving_wait(self, seconds: float) -> None:
        """Wait up to ``seconds`` for a submit or abort, lending this lane's core to rollout meanwhile."""
        rt = self.serving
        rt.wakeup.clear()
        if rt.inbox or rt.aborts:
            return
        self.core_lending.lend()
        rt.wakeup.wait(seconds)
