"""The simulator's input: one fleet, one policy, one RL job (engine.py runs it, sizing.py sizes its fleet).

A module of its own so that sizing.py can read it without importing the engine, which imports
sizing.py; callers keep importing ``SimConfig`` from the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast, get_args

from rose.contracts.executor import RolloutMode
from rose.services.executor.config import EngineSettings
from rose.shared.devices import TRAIN_MFU, SyncSpec
from rose.shared.lora import LoraShape
from rose.shared.workload import RolloutSpec

from .traces import DiurnalBursty, Trace

MAX_ROLLOUT_BATCH = 256  # sequences per rollout engine (vLLM's default max_num_seqs)
# The adapter a co-batched job is priced with (not the one `rose models init --lora` builds for the tiny CPU models,
# shared/lora.py DEFAULT_LORA: rank 1): rank 32 on every linear layer, Tinker's default (Thinking Machines' LoRA
# training service; "LoRA Without Regret", 2025: rank 1 already matches full fine-tuning in RL); alpha = rank, scale 1.
# A production rank bounds the kernels' cost from above, and it barely depends on the rank: they are bound by their
# launches (shared/devices.py LORA_LINEAR_S).
PRICED_LORA = LoraShape(rank=32, alpha=32.0)


def as_rollout_mode(name: str) -> RolloutMode:
    """``name`` as a rollout mode, or a ValueError naming the modes (a command line's word, checked at the boundary)."""
    modes = get_args(RolloutMode)
    if name not in modes:
        raise ValueError(f"unknown rollout mode {name!r}; use one of {', '.join(modes)}")
    return cast(RolloutMode, name)


FETCH_WINDOW_S = 1.0  # shared/bus.py CONSUME_FETCH_TIMEOUT_S


@dataclass
class SimConfig:
    model: str = "7B"
    device: str = "H100"
    gpus: int = 8
    policy: str = "rose"
    policy_model: str | None = None  # default: the serving model's size
    rollout_gpu_ratio: float = 0.5
    trainer_gpu_ratio: float = 1.0
    train_mfu: float = TRAIN_MFU
    train_s: float | None = None  # a measured training time per step (calibration), instead of the FLOPs model
    steps: int = 3
    dt: float = 1.0
    seed: int = 0
    load: float = 0.35  # mean serving load as a fraction of the fleet's SLO capacity (synthetic trace; peaks ~0.75)
    start_hour: float = 10.0
    trace_shape: DiurnalBursty = field(default_factory=DiurnalBursty)
    trace: Trace | None = None  # an imported trace in req/s (overrides load and trace_shape)
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 100.0
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    sync: SyncSpec = field(default_factory=SyncSpec)
    warmup_s: float = 40.0  # serving only before the first step: the monitor's 30 s windows fill up
    max_sim_s: float = 8 * 3600.0
    quantum_ms: float = 10.0
    trajectories: int | None = None  # per step (default: rollouts.batch_trajectories of the dedicated pool)
    perf: tuple | None = None  # (serving, policy on a serving instance, policy on a dedicated instance) step models
    n_serving: int | None = None  # override the instance counts (calibration runs)
    n_dedicated: int | None = None
    # the lane pool's run (sim/ceiling.py; static only): every serving instance's rollout lane also as an instance of the
    # rollout pool, at the share of each second rose's executor leaves it at full quanta and with the KV it lends,
    # placed on as the dedicated pool is; serving pays nothing for it
    lane_pool: bool = False
    memory: dict | None = None  # override memory figures (calibration runs)
    record_timeline: bool = False
    # what-if changes to the services' inputs (not their logic), to measure two gaps the simulator
    # shows: "kv_slots": headroom slots capped by what the lent KV holds at the mean rollout context
    # (the monitor counts compute only); "sticky_throughput": headroom reports the best rollout
    # tokens/s ever measured on an executor (the monitor's 30 s peak forgets it during training)
    what_if: frozenset = frozenset()
    max_rollout_batch: int = MAX_ROLLOUT_BATCH  # sequences per rollout engine (calibration runs: the executor's own)
    # asynchronous RL as the reference trainer runs it (services/trainer: grpo.prefetch_steps, grpo.max_staleness):
    # 0 = synchronous (the paper-style grid); N >= 1: N steps of tasks are handed out ahead of the one training
    # (at most max_staleness: a batch rolled out further ahead would be dropped as stale), see ``Trainer.pipelined``
    prefetch_steps: int = 0
    max_staleness: int = 2
    # partial rollouts across steps (grpo.over_provision, APRIL's over-provisioning): a step's batch goes out with this
    # share of its groups more (N + k), the trainer takes the first N complete groups and the unfinished ones roll on
    # into the next steps (their tokens keep the versions they were sampled with), dropped past max_staleness, counted;
    # > 0 also in synchronous mode (``Trainer.pipelined`` with no prefetch)
    over_provision: float = 0.0
    # the executors' host tier for retained prefixes, x each instance's rollout KV (engine.host_kv_ratio; 0: none)
    host_kv_ratio: float = EngineSettings().host_kv_ratio
    early_hand_out: bool = True  # grpo.early_hand_out: one more batch out while a step waits and no executor has a rollout queue
    worker_concurrency: int | None = None  # trajectories in flight per rollout worker fleet (None: unbounded)
    trajectory_fetch_s: float = FETCH_WINDOW_S  # pipelined trainer: its consumer's fetch window (0: sees a trajectory at once)
    # how rollout shares a serving instance (sim.ROLLOUT_MODES): "two_model", a policy copy on a lane of its own in bounded
    # quanta; "co_batched", the policy a LoRA adapter (``lora``) of the serving model, its sequences rows in serving's own
    # iterations (co_batched.py), its dedicated instances the base and the adapter
    rollout_mode: RolloutMode = "two_model"
    lora: LoraShape = PRICED_LORA
