"""The rollout worker's configuration (TOML + ROSE_*, see shared/config.py)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from rose.shared.agentic.sandbox import BackendChoice
from rose.shared.config import BusConfig, PositiveSeconds, RuntimeConfig
from rose.shared.models import PolicyModelRef
from rose.shared.turns.settings import TurnSettings

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class SandboxSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The code environment's sandbox (docs/sandbox.md). "auto": docker when an engine answers, else
    kernel namespaces ("subprocess"); neither: the code env refuses episodes, saying what to enable.
    "unsafe" runs model-written code WITHOUT isolation: development machines only."""

    backend: BackendChoice = "auto"


class RolloutWorkerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    bus: BusConfig = msgspec.field(default_factory=BusConfig)
    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    models: PolicyModelRef = msgspec.field(default_factory=PolicyModelRef)
    turns: TurnSettings = msgspec.field(default_factory=TurnSettings)
    sandbox: SandboxSettings = msgspec.field(default_factory=SandboxSettings)  # ROSE_SANDBOX__BACKEND
    concurrency: PositiveInt = 8  # episodes in flight per worker process
    durable: str = "rollout_workers"  # the shared work-queue consumer
    ack_wait_s: PositiveSeconds = 30.0  # a worker that stopped renewing its episode this long ago is taken as dead: redelivered
    max_deliver: Annotated[int, msgspec.Meta(ge=2)] = 20  # the last delivery publishes a failed trajectory
