"""An emulated accelerator: the engine's host side runs for real, only the device's time is modeled.

As NVIDIA Dynamo's mocker and llm-d's inference simulator do for their routers and autoscalers,
an executor with ``engine.device = "emulated:H100"`` runs everything an executor runs (continuous
batching, paged KV pools, the two lanes, quanta, layer safepoints and preemption, the SLO guard,
leases and parking, prefix retention, the weight follower, HTTP, the bus) and replaces only what
the device does for it::

    Engine._run (real)                     EmulatedRunner.forward_sample
      items: prefill chunks + decodes  ──▶   seconds = Roofline.forward_s(decodes, chunks)   (shared/devices.py:
                                             the simulator's step model, the same source of truth)
                                           EmulatedAccelerator.run(lane, seconds, safepoint)
                                             holds this executor's one device timeline that long
                                           emulated_tokens(...)
      tokens, logprobs  ◀──────────────      a cheap generator (no model runs)

Who owns what: the ``Engine`` owns requests, sequences and KV block tables exactly as on a real
device; ``EmulatedDevice`` (chosen once, at start, by ``device.select_device``) owns the models'
emulated shapes, the memory they take and the ``EmulatedAccelerator``, the one timeline both lanes'
runners share. The pools hold accounted blocks, not tensors (``KVPool(storage=False)``): a 7B policy's
KV on an 80 GB device is tens of gigabytes nobody allocates.

The device's semantics are the co-serving interference the simulator prices (sim/coserve.py): one
forward at a time; a serving forward waiting for the device goes before any rollout forward, except that
a serving decode forward owes a rollout forward waiting beside it one turn (serving's next forward is asked
by its thread within microseconds, so without the turn it would win every race and rollout would get
what the interpreter lock left it: nothing at ~9 requests/s); a serving forward that prefills owes none
(compute-bound, it leaves a low-priority stream no SMs; the simulator's lane gets nothing while a first
token is prefilled). A rollout forward running when serving asks keeps the device for at most one
quantum, then yields at its next layer boundary, so each serving iteration waits at most
``min(quantum, rollout step)``. A rollout forward that prefills, abandoned by the engine at a safepoint
(a serving arrival, a revoked lease), ends at its next layer boundary and its work is lost, as on a GPU;
one of decodes alone is a CUDA graph replay there, whose one safepoint is before it. ``should_hold``
(a CPU notion: a forward waiting for a core) does not apply.

Output lengths come from the request, as in Dynamo's mocker: the generator never emits the end of
sequence or a stop id, so a turn ends at its ``max_tokens`` (the emulated agentic environment asks for
the workload's turn length, shared/agentic/env_emulated.py) and a serving request at the trace's
output length. Tokens are uniform over the tokenizer's ordinary ids, drawn from a hash of the
sequence's seed and draw count (the sampler's stream position, so preemption never changes them);
logprobs are ``log(u)`` of the same hash. Policy weights are the small stand-in model's, really
swapped by version; their transfer is priced as the real model's bytes over the link the simulator
prices (``weight_transfer_s``). A trajectory prefix restored from the host tier (prefix_cache.HostTier) copies
nothing, its pool having no storage, and is priced as its KV's bytes over PCIe (``EmulatedRunner.host_load``).

Fidelity: every forward's lateness (how long after its planned end its lane woke) is recorded as a
share of the forward and reported in the device telemetry (``forward_lag``); a host that cannot keep
up shows there first.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from ddsketch import DDSketch

from rose.shared.clock import time_scale
from rose.shared.devices import DEVICES, ModelSpec, Roofline, SyncSpec, model_spec, rollout_tp, serving_tp, usable_bytes
from rose.shared.lora import LoraShape
from rose.shared.sketch import new_sketch

from .config import EmulationSettings
from .forward_item import ForwardItem
from .kv_pool import KVPool
from .protocol import WorkClass
from .sampling import SamplerState
from .weights import StagedWeights

EMULATED_PREFIX = "emulated:"
SAFEPOINT_POLL_S = 0.005  # a running rollout forward asks the engine's safepoint this often (and at once on a serving request)


@dataclass(frozen=True, kw_only=True)
class EmulationSpec:
    """What one emulated executor is: a device kind, the two models' shapes, the instance's GPUs and
    its memory split, and how its weights arrive. Built from the executor's settings (``from_settings``)."""

    device: str  # a key of shared.devices.DEVICES
    serving_model: str  # keys of shared.devices.MODELS
    policy_model: str
    tp: int
    dedicated: bool
    serving_kv_bytes: int
    rollout_kv_bytes: int
    quantum_s: float  # wall seconds (settings are scaled when loaded)
    time_scale: float = 1.0  # wall seconds per emulated second (shared/clock.py): forwards and transfers take this x their time
    sync: SyncSpec = SyncSpec()
    lora: LoraShape | None = None  # the policy is a LoRA adapter of the serving model, of this shape (its base: ``policy_model``)
    co_batched: bool = False  # its rows ride in serving's batches: a serving instance hosts no copy of the base

    @property
    def serving(self) -> ModelSpec:
        return model_spec(self.serving_model)

    @property
    def policy(self) -> ModelSpec:
        return model_spec(self.policy_model)

    def roofline(self, work_class: WorkClass) -> Roofline:
        model = self.serving if work_class is WorkClass.SERVING else self.policy
        return Roofline(DEVICES[self.device], model, self.tp)

    @property
    def adapter_bytes(self) -> float:
        """A LoRA policy's adapter on the emulated model (0: the policy is a model of its own)."""
        return self.policy.lora_params(self.lora) * self.policy.bytes_per_param if self.lora is not None else 0.0

    @property
    def version_bytes(self) -> float:
        """What one policy version is: its adapter, or the whole policy's weights."""
        return self.adapter_bytes if self.lora is not None else self.policy.weight_bytes

    def weight_bytes(self) -> float:
        """What the instance's weights take: the serving model on a serving instance; the policy's own weights
        (a co-batched serving instance has none: its base is the serving model) and its adapter."""
        shares_base = self.co_batched and not self.dedicated
        return (0.0 if shares_base else self.policy.weight_bytes) + self.adapter_bytes + (0.0 if self.dedicated else self.serving.weight_bytes)

    def label(self) -> str:
        models = self.policy_model if self.dedicated else f"{self.serving_model}+{self.policy_model}"
        return f"{self.tp}x{self.device} emulated ({models})"


def emulation_spec(
    device: str, settings: EmulationSettings, *, dedicated: bool, quantum_ms: float, lora: LoraShape | None = None, co_batched: bool = False
) -> EmulationSpec:
    """The executor's ``[emulation]`` settings for ``engine.device = "emulated:KIND"``, checked and completed
    (a ValueError names what is wrong: an unknown kind or model, weights that leave no room for KV). ``lora``: the
    policy is an adapter of this shape (of the serving model: its base is the serving model's shape)."""
    kind = parse_device(device)
    serving = model_spec(settings.model).name
    policy = model_spec(settings.policy_model or settings.model).name
    if lora is not None and policy != serving:
        raise ValueError(f"a LoRA policy adapts the serving model: emulation.policy_model is {policy}, the serving model {serving}")
    tp = settings.tp or instance_tp(kind, serving, policy, dedicated)
    spec = EmulationSpec(
        device=kind,
        serving_model=serving,
        policy_model=policy,
        tp=tp,
        dedicated=dedicated,
        serving_kv_bytes=0,
        rollout_kv_bytes=0,
        quantum_s=quantum_ms / 1e3,
        time_scale=time_scale(),
        lora=lora,
        co_batched=co_batched,
    )
    serving_kv, rollout_kv = default_memory(kind, tp, spec.weight_bytes(), dedicated)
    if settings.serving_kv_gib:
        serving_kv = int(settings.serving_kv_gib * 2**30)
    if settings.rollout_kv_gib:
        rollout_kv = int(settings.rollout_kv_gib * 2**30)
    return dataclasses.replace(spec, serving_kv_bytes=serving_kv, rollout_kv_bytes=rollout_kv)


def parse_device(name: str) -> str:
    """``emulated:H100`` -> ``H100`` (a ValueError naming the kinds otherwise)."""
    kind = name[len(EMULATED_PREFIX) :].strip().upper()
    if kind not in DEVICES:
        raise ValueError(f"device {name!r}: an emulated device is one of {', '.join(EMULATED_PREFIX + k for k in DEVICES)}")
    return kind


def default_memory(device: str, tp: int, weights: float, dedicated: bool) -> tuple[int, int]:
    """(serving KV bytes, rollout KV bytes) when the launcher gave none: what the engine may use
    (shared.devices.usable_bytes) less the instance's ``weights`` (``EmulationSpec.weight_bytes``), split evenly
    between serving and what a lease can lend; a dedicated instance keeps a token serving pool and gives rollout
    the rest. Launchers that know the serving trace size the serving pool as the simulator does (cli/emulate.py)."""
    kv = usable_bytes(DEVICES[device], tp) - weights
    if kv <= 0:
        raise ValueError(f"{tp}x{device} cannot hold the weights ({weights / 1e9:.0f} GB) with room for a KV cache: use a larger tp")
    serving_kv = min(kv / 2, 2**30) if dedicated else kv / 2
    return int(serving_kv), int(kv - serving_kv)


def instance_tp(device: str, serving: str, policy: str, dedicated: bool) -> int:
    """GPUs per instance, as the simulator sizes them (shared/devices.py serving_tp / rollout_tp)."""
    spec = DEVICES[device]
    return rollout_tp(model_spec(policy), spec) if dedicated else serving_tp(model_spec(serving), model_spec(policy), spec)


class _Lag:
    """Thread-safe sketch of how late forwards ended, in percent of their planned time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sketch = new_sketch()

    def add(self, percent: float) -> None:
        with self._lock:
            self._sketch.add(max(0.0, percent))

    def take(self) -> DDSketch:
        with self._lock:
            sketch, self._sketch = self._sketch, new_sketch()
        return sketch


class EmulatedAccelerator:
    """One device timeline shared by an executor's two lanes (the module doc gives its semantics)."""

    def __init__(self, layers: int, quantum_s: float) -> None:
        self.layers = max(1, layers)
        self.quantum_s = quantum_s
        self._cv = threading.Condition()
        self._held = False
        self._serving_waiting = 0
        # alternation: a serving forward that ends owes a rollout forward waiting for the device its turn (at most a
        # quantum while serving waits), else the serving lane's next forward, asked from the same thread within its
        # host work, would win every race for the device and rollout's share would be whatever the GIL left it
        self._rollout_waiting = 0
        self._rollout_owed = False
        self._busy_s = 0.0  # device-busy seconds so far (all forwards, abandoned ones included)
        self.planned_s = 0.0  # what the step model asked for, all forwards so far (the time the host should have matched)
        self.lag = _Lag()
        # how late each lane's last forward ended: the host's wake-up jitter, which the lane's next forward makes up
        # (the device's timeline stays on schedule instead of drifting by every late wake-up)
        self.late_s: dict[WorkClass, float] = {}

    @property
    def busy_s(self) -> float:
        return self._busy_s

    def run(self, lane: WorkClass, seconds: float, should_stop: Callable[[], bool] | None = None, host_s: float = 0.0, prefill: bool = False) -> bool:
        """An iteration of ``seconds`` (the step model's): the host already spent ``host_s`` of it preparing the
        forward, so the device is held for the rest. False when the engine abandoned the forward at a safepoint
        (rollout only: it then ends at the next layer boundary). A serving forward that carries ``prefill`` owes
        rollout no turn: compute-bound, it leaves a low-priority stream no SMs (the simulator's rollout gets
        nothing while a first token is being prefilled)."""
        if seconds <= 0.0:
            return True
        with self._cv:
            self.planned_s += seconds
        seconds = max(0.0, seconds - host_s)
        if seconds <= 0.0:
            return True
        if lane is WorkClass.SERVING:
            self._acquire_serving()
            try:
                self._hold_until(time.monotonic() + seconds, seconds)
            finally:
                self._release(seconds, owes_rollout=not prefill)
            return True
        return self._run_rollout(seconds, should_stop)

    def _acquire_serving(self) -> None:
        with self._cv:
            self._serving_waiting += 1
            self._cv.notify_all()  # a rollout forward in flight looks at once (it yields within its quantum)
            while self._held or (self._rollout_owed and self._rollout_waiting):
                self._cv.wait()
            self._serving_waiting -= 1
            self._held = True

    def _release(self, held_s: float, owes_rollout: bool = False) -> None:
        with self._cv:
            self._held = False
            self._rollout_owed = owes_rollout
            self._busy_s += held_s
            self._cv.notify_all()

    def _hold_until(self, end: float, planned_s: float) -> None:
        while (left := end - time.monotonic()) > 0:
            time.sleep(left)
        late = time.monotonic() - end
        self.late_s[WorkClass.SERVING] = late
        self.lag.add(100.0 * late / planned_s)

    def _run_rollout(self, seconds: float, should_stop: Callable[[], bool] | None) -> bool:
        layer_s = seconds / self.layers
        done = 0.0  # device seconds of this forward already run
        while True:
            with self._cv:
                self._rollout_waiting += 1
                while self._held or (self._serving_waiting and not self._rollout_owed):
                    self._cv.wait()
                self._rollout_waiting -= 1
                self._held = True
                self._rollout_owed = False
            start = time.monotonic()
            outcome = self._rollout_slice(start, seconds - done, layer_s, done, should_stop)
            ran = time.monotonic() - start
            self._release(ran)
            done += ran
            if outcome is not None:
                return outcome

    def _rollout_slice(self, start: float, left: float, layer_s: float, done: float, should_stop) -> bool | None:
        """Hold the device from ``start``: True when the forward's ``left`` seconds ran out, False when
        abandoned, None when it yields to a serving forward (after a quantum) and goes on later."""
        end = start + left
        while True:
            now = time.monotonic()
            if now >= end:
                self.late_s[WorkClass.ROLLOUT] = now - end
                self.lag.add(100.0 * (now - end) / max(left + done, 1e-9))
                return True
            if should_stop is not None and should_stop():
                self._to_layer_boundary(start, done, layer_s, end)
                return False
            with self._cv:
                if self._serving_waiting and now - start >= self.quantum_s:
                    yield_now = True
                else:
                    yield_now = False
                    wake = end if not self._serving_waiting else min(end, start + self.quantum_s)
                    self._cv.wait(min(wake - now, SAFEPOINT_POLL_S))
            if yield_now:
                self._to_layer_boundary(start, done, layer_s, end)
                return None

    @staticmethod
    def _to_layer_boundary(start: float, done: float, layer_s: float, end: float) -> None:
        """Run on to the end of the layer in progress (a safepoint is between layers)."""
        ran = done + time.monotonic() - start
        boundary = start - done + math.ceil(ran / layer_s - 1e-9) * layer_s
        while (left := min(boundary, end) - time.monotonic()) > 0:
            time.sleep(left)


def _mix(x: int) -> int:
    """splitmix64: a well-spread 64-bit hash of ``x`` (no state, no torch op)."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class EmulatedRunner:
    """The forward of one lane on an emulated device: price the packed batch, hold the device, sample cheaply."""

    graphs = None  # no CUDA graphs to capture (``Engine._warm_graphs``)
    graph_failures = 0

    def __init__(
        self,
        accelerator: EmulatedAccelerator,
        steps: Roofline,
        work_class: WorkClass,
        model: torch.nn.Module,
        tokenizer: Any,
        pool: KVPool,
        time_scale: float = 1.0,
        lora: LoraShape | None = None,
    ) -> None:
        self.accelerator, self.steps, self.work_class, self.model, self.pool = accelerator, steps, work_class, model, pool
        self.lora = lora  # a LoRA policy's shape: its rows (items naming an adapter slot) add the adapter's kernels
        self.time_scale = time_scale
        self._last_end = 0.0  # monotonic end of this lane's last forward (the host's work since counts toward the next step)
        self.pending_load_s = 0.0  # host-tier restores since this lane's last forward, which its next forward carries
        self.vocab_size = len(tokenizer)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 32768))
        self.max_positions = max(self.max_positions, 32768)  # the emulated model's context (Qwen2.5 and Llama 3.1: >= 32k)
        self._never = frozenset(getattr(tokenizer, "all_special_ids", []) or [])

    def use_cuda_graphs(self, max_batch: int) -> None:
        pass

    def forward_sample(
        self,
        items: list[ForwardItem],
        samples: list[tuple[int, SamplerState]],
        should_stop: Callable[[], bool] | None = None,
        should_hold: Callable[[], bool] | None = None,
    ) -> tuple[list[int], list[float]] | None:
        decodes = [float(it.start + 1) for it in items if len(it.token_ids) == 1 and it.start > 0]
        chunks = [(float(len(it.token_ids)), float(it.start)) for it in items if not (len(it.token_ids) == 1 and it.start > 0)]
        # The step model's time is the whole iteration, its fixed cost being the engine's own host work (scheduling,
        # sampling, launches): the real host work since this lane's last forward is counted against that allowance
        host_s = min(max(0.0, time.monotonic() - self._last_end), self.steps.overhead_s * self.time_scale)
        host_s += self.accelerator.late_s.pop(self.work_class, 0.0)  # the last forward's lateness is made up here, once
        if not chunks and should_stop is not None:  # decodes alone are a CUDA graph replay: its one safepoint is before it
            if should_stop():
                return None
            should_stop = None
        adapted = float(sum(len(it.token_ids) for it in items if it.adapter is not None))
        seconds = self.steps.forward_s(decodes, chunks, adapted_tokens=adapted, lora=self.lora) * self.time_scale + self.pending_load_s
        self.pending_load_s = 0.0
        ran = self.accelerator.run(self.work_class, seconds, should_stop, host_s, prefill=bool(chunks))
        self._last_end = time.monotonic()
        if not ran:
            return None
        tokens, logprobs = [], []
        for row, state in samples:
            token, lp = self._sample(items[row], state)
            tokens.append(token)
            logprobs.append(lp)
        return tokens, logprobs

    def host_load(self, tokens: int) -> None:
        """``tokens`` tokens' KV were restored from the host tier into this lane's pool: the copy over PCIe
        (``Roofline.host_load_s`` x the time scale) is charged to the lane's next forward on the device timeline.
        An upper bound: a GPU's copy engines overlap such a load with compute; here it holds the device."""
        self.pending_load_s += float(self.steps.host_load_s(tokens)) * self.time_scale

    def _sample(self, item: ForwardItem, state: SamplerState) -> tuple[int, float]:
        """A token and its logprob from a hash of the sequence's seed and draw count (greedy: of its
        context), never a special or stop id: lengths are the request's max_tokens."""
        never = self._never | set(state.params.stop_token_ids)
        position = item.start + len(item.token_ids)
        key = (state.seed * 1_000_003 + state.draws) if not state.greedy else (item.token_ids[-1] * 65_537 + position)
        if not state.greedy:
            state.skip()  # one uniform of the sampler's stream, as the real sampler draws
        for attempt in range(64):
            h = _mix(key * 131 + attempt)
            token = h % self.vocab_size
            if token not in never:
                break
        logprob = math.log(((h >> 40) + 1) / 2.0**24)
        if state.params.top_logprobs:
            others = [(_mix(h + k) % self.vocab_size, logprob - 0.5 * k) for k in range(1, state.params.top_logprobs)]
            state.top_logprobs.append(((token, logprob), *others))
        return token, logprob

    def prepare_weights(self, staged: StagedWeights) -> None:
        pass

    def apply_weights(self, staged: StagedWeights) -> float:
        """The stand-in policy's weights really swap (the follower's digests and versions stay exact)."""
        return staged.apply(self.model)
