"""The rollout worker's configuration (TOML + ROSE_*, see shared/config.py)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from rose.shared.config import BusConfig, PositiveSeconds, RuntimeConfig
from rose.shared.models import PolicyModelRef

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Positive = Annotated[float, msgspec.Meta(gt=0.0)]


class TurnSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_tokens: PositiveInt = 24  # per turn, unless the task's env_args say otherwise
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    route_timeout_s: PositiveSeconds = 2.0
    generate_timeout_s: PositiveSeconds = 60.0  # one attempt on one executor
    turn_deadline_s: PositiveSeconds = 600.0  # all attempts of a turn together
    retry_backoff_s: PositiveSeconds = 0.2
    hedge: bool = True  # duplicate straggling turns (the scheduler decides if it is worth it, or says so with its route)
    hedge_min_s: PositiveSeconds = 2.0  # never hedge a turn younger than this
    hedge_factor: Positive = 1.5  # ask for a hedge past this x the typical turn time
    # an interrupted turn (its executor lost the lease) resumes elsewhere with the tokens it has;
    # false: they are thrown away and the turn starts over (the elastic baseline's whole-job preemption)
    resume_interrupted: bool = True


class SandboxSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The code environment's sandbox (docs/sandbox.md). "auto": docker when an engine answers, else
    kernel namespaces ("subprocess"); neither: the code env refuses episodes, saying what to enable.
    "unsafe" runs model-written code WITHOUT isolation: development machines only."""

    backend: Literal["auto", "docker", "subprocess", "unsafe"] = "auto"


class RolloutWorkerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    bus: BusConfig = msgspec.field(default_factory=BusConfig)
    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    models: PolicyModelRef = msgspec.field(default_factory=PolicyModelRef)
    turns: TurnSettings = msgspec.field(default_factory=TurnSettings)
    sandbox: SandboxSettings = msgspec.field(default_factory=SandboxSettings)  # ROSE_SANDBOX__BACKEND
    concurrency: PositiveInt = 8  # episodes in flight per worker process
    durable: str = "rollout_workers"  # the shared work-queue consumer
    ack_wait_s: PositiveSeconds = 30.0  # an episode unacked this long is redelivered (a dead worker)
    max_deliver: Annotated[int, msgspec.Meta(ge=2)] = 20  # the last delivery publishes a failed trajectory
