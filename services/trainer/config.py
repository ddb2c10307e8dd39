"""The trainer's configuration (TOML + ROSE_*, see shared/config.py)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

import msgspec

from rose.contracts.rollout import Routing
from rose.shared.config import BusConfig, DTypeName, PositiveSeconds, RuntimeConfig
from rose.shared.devices import TRAIN_MFU, device_spec, model_spec
from rose.shared.models import PolicyModelRef
from rose.shared.workload import RolloutSpec

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
StalePolicy = Literal["drop", "mask"]  # a group past the staleness bound: dropped, or its stale tokens masked (groups.py)
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[float, msgspec.Meta(gt=0.0)]


class GrpoSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    group_size: Annotated[int, msgspec.Meta(ge=2)] = 8  # trajectories per task
    groups_per_step: PositiveInt = 4
    lr: Positive = 1e-4
    # the lr rises linearly to `lr` over this many steps: a fresh AdamW's first steps move every weight by the
    # full lr whatever its gradient (its second moment is one sample), which threw a warm-started tiny policy off
    # (bench e2e at seed 11: reward 0.14 -> 0 after one step at lr 5e-3; docs/benchmarks.md, 2026-12-04)
    lr_warmup_steps: NonNegInt = 0
    clip_eps: Positive = 0.2
    max_grad_norm: Positive = 1.0
    max_staleness: NonNegInt = 2  # versions a trajectory may lag the trainer and still be trained on
    stale_policy: StalePolicy = "drop"
    group_timeout_s: PositiveSeconds = 300.0  # train on an incomplete group (>= 2 usable) after this
    micro_batch: PositiveInt = 16  # sequences per forward/backward
    epochs: PositiveInt = 1  # optimizer steps over each step's batch (later ones clipped against the behaviour policy)
    prefetch_steps: NonNegInt = 1  # steps of tasks queued ahead of the one being trained (asynchronous RL, docs/async-rl.md)
    # with prefetch_steps >= 1: hand one more step out while a step waits, when no executor has a rollout queue
    # (capacity idles), up to max_staleness ahead (docs/async-rl.md); the usual lead returns after training
    early_hand_out: bool = True
    # partial rollouts across steps (APRIL): the first step hands out this many groups more, so N + k are in flight and a
    # step trains on the first N complete; the unfinished roll on into later steps (each turn keeps its tokens' logprobs
    # and versions) and are trained, masked or dropped by max_staleness like any other (groups.py); 0: none
    over_provision: NonNegInt = 0

    def __post_init__(self) -> None:
        if self.max_staleness < self.prefetch_steps:
            # a prefetched step's trajectories are about prefetch_steps versions old when trained: all would be dropped
            raise ValueError(
                f"grpo.max_staleness ({self.max_staleness}) must be at least grpo.prefetch_steps ({self.prefetch_steps}): "
                "the batches handed out ahead are that many versions old when trained (docs/async-rl.md)"
            )


class SftSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The warm start on scripted expert traces; `steps = 0` skips it."""

    steps: NonNegInt = 200
    lr: Positive = 3e-3
    batch_size: PositiveInt = 16
    traces_per_env: PositiveInt = 400


class TasksSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    envs: list[str] = msgspec.field(default_factory=lambda: ["arithmetic"])
    seed: int = 0
    max_turns: PositiveInt = 3
    max_tokens: PositiveInt = 16  # per turn
    routing: Routing = "affinity"
    max_operand: Annotated[int, msgspec.Meta(ge=1, le=10**6)] = 99  # arithmetic difficulty (operands 0..N)
    problems: NonNegInt = 0  # 0: a fresh problem for every group; N: cycle through a fixed set of N (a prompt dataset, in epochs)
    # the emulated job's workload (env "emulated", shared/workload.py RolloutSpec fields that differ from its defaults)
    workload: dict[str, float] = msgspec.field(default_factory=dict)
    # hand the tasks to the rollout gateway's external agents (rollout.agent_task) instead of the rollout workers' environments;
    # the environment still names the problem and the reward function (services/gateway/rewards.py)
    agent: bool = False

    def __post_init__(self) -> None:
        from rose.shared.agentic.agentic_envs import tool_env_names  # noqa: PLC0415 - loads the envs

        unknown = [name for name in self.envs if name not in tool_env_names()]
        if unknown or not self.envs:
            raise ValueError(f"tasks.envs must name tool environments ({', '.join(tool_env_names())}), not {unknown or 'nothing'}")
        self.rollout_spec()  # raises, naming the field, on an unknown one

    def rollout_spec(self) -> RolloutSpec:
        """The emulated job's workload: the defaults with `workload`'s fields."""
        fields = {f.name: f.type for f in dataclasses.fields(RolloutSpec)}
        bad = sorted(set(self.workload) - set(fields))
        if bad:
            raise ValueError(f"tasks.workload: unknown fields {bad}; known: {sorted(fields)}")
        changes: dict[str, Any] = {k: int(v) if fields[k] in (int, "int") else v for k, v in self.workload.items()}
        return dataclasses.replace(RolloutSpec(), **changes)


class EmulatedTraining(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An emulated training cluster, the trainer half of an emulated fleet (services/executor/emulated.py):
    `device` set, each GRPO step's forward and backward are replaced by the time the step model gives for
    the `model`'s FLOPs over the batch's tokens on `gpus` such GPUs (shared.devices.train_seconds, as the
    simulator prices it, times the time scale), and a real sparse update of the stand-in policy, so every
    version is a real delta on the wire. Groups, staleness, the ledger, early hand-out, checkpoints and
    publishing stay the real ones. Empty `device`: real training."""

    device: str = ""  # A100, H100, H200 (shared/devices.py); "": train the model for real
    model: str = "7B"  # the policy's shape whose training is timed
    gpus: Annotated[float, msgspec.Meta(gt=0.0)] = 8.0  # the trainer's GPUs (the simulator's trainer_gpu_ratio x its fleet)
    mfu: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = TRAIN_MFU
    changed_fraction: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.02  # of the stand-in's elements each step changes (anchors.md: 2-4 %)

    def __post_init__(self) -> None:
        if self.device:
            device_spec(self.device)
            model_spec(self.model)


class PublishSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str = "policy"  # the name executors follow (executor `weights.model`)
    dtype: DTypeName = "bfloat16"  # bf16 deltas are ~2-4 % of elements per step
    staging_dir: str = ""  # a path the weight publisher can read (same host or shared volume); empty: via the object store
    published_timeout_s: PositiveSeconds = 600.0


class CheckpointSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Checkpoint/resume (checkpoint.py): a restarted trainer continues its job where it was."""

    every_steps: NonNegInt = 1  # GRPO steps between checkpoints (and one after the warm start); 0: none, never resume
    dir: str = ""  # default: $ROSE_STATE_DIR/trainer/<durable>; one subfolder per job configuration
    keep: PositiveInt = 2  # complete checkpoints kept per job (the newest)
    ack_wait_s: PositiveSeconds = (
        15.0  # the trajectory consumer's ack deadline: held trajectories are kept alive within it; a dead trainer's come back after it
    )


class TrainerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    bus: BusConfig = msgspec.field(default_factory=BusConfig)
    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    models: PolicyModelRef = msgspec.field(default_factory=PolicyModelRef)
    grpo: GrpoSettings = msgspec.field(default_factory=GrpoSettings)
    sft: SftSettings = msgspec.field(default_factory=SftSettings)
    tasks: TasksSettings = msgspec.field(default_factory=TasksSettings)
    publish: PublishSettings = msgspec.field(default_factory=PublishSettings)
    checkpoint: CheckpointSettings = msgspec.field(default_factory=CheckpointSettings)
    emulation: EmulatedTraining = msgspec.field(default_factory=EmulatedTraining)
    max_steps: NonNegInt = 0  # GRPO steps, then exit; 0: until stopped
    initial_version: NonNegInt = 0  # the version executors start with (the weights in models.dir)
    durable: str = "trainer"  # the trajectory stream consumer
    run_id: str = ""  # prefixes task and group ids; default: the instance name
    threads: NonNegInt = 0  # torch intra-op threads; 0: torch's default
