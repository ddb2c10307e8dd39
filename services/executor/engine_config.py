"""What an ``Engine`` is built from: its configuration (``EngineConfig``) and the process-wide heap freeze
its lanes hold while it runs. A module of its own so the engine's pieces (engine.py, co_batched.py) and the
builders of an engine (the executor service, benches, tests) share one definition of each setting."""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass

import torch

from rose.shared.bursts import BURST_BASELINE_S, BurstSettings

from .adapters import NAMED_SLOTS
from .config import MIB, EngineSettings, RolloutMode
from .emulated import EmulationSpec
from .kv_pool import DEFAULT_BLOCK_SIZE
from .policies import DEFAULT_GUARD_FRACTION, DEFAULT_STATIC_SHARE


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


HEAP_FREEZE = _HeapFreeze()
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
    rollout_threads: int | None = None  # CPU only: torch threads of the rollout lane, or of the co-batched mode's one lane (default 1)
    lend_serving_core: bool = _SERVICE.lend_serving_core  # CPU, rose: the rollout lane widens over the serving lane's core while serving has no work
    rollout_process: bool = False  # CPU: rollout forwards run in a child process, off this interpreter's lock (rollout_process.py)
    # rollout borrows a serving executor's host: where the policy says so (rose), its forward process runs at the OS's
    # idle priority. False on a dedicated executor, whose device is rollout's own (normal priority).
    rollout_is_guest: bool = True
    cuda_graphs: bool = _SERVICE.cuda_graphs  # CUDA: decode steps replay captured graphs (cuda_graphs.py)
    seed: int = _SERVICE.seed
    device: str = _SERVICE.device
    dtype: torch.dtype = getattr(torch, _SERVICE.dtype)
    rollout_mode: RolloutMode = _SERVICE.rollout_mode  # two_model, or co_batched (a LoRA policy's rows in serving's batches)
    # co-batched: adapters held by name beside the policy's own (SGLang's /load_lora_adapter, its --max-loras-per-batch),
    # each a slot of the adapter bank allocated at start (a rank-8 all-linear slot of a 7B model: ~40 MB in bf16)
    named_adapter_slots: int = NAMED_SLOTS
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
            rollout_mode=settings.rollout_mode,
            lend_serving_core=settings.lend_serving_core,
            rollout_process=settings.rollout_process,
            cuda_graphs=settings.cuda_graphs,
            slo_ttft_ms=settings.slo_ttft_ms,
            slo_tpot_ms=settings.slo_tpot_ms,
            seed=settings.seed,
            device=settings.device,
            dtype=getattr(torch, settings.dtype),
        )


DEFAULT_CONFIG = EngineConfig()  # an engine built without a config: the service's defaults, no SLO, rollout in this process
