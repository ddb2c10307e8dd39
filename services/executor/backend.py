"""What the executor's services need from an engine: the co-serving surface, as a Protocol.

Why: the executor can run on our own engine (``engine.Engine``) or front real SGLang servers
(``sglang_backend.SGLangBackend``); main.py, the OpenAI API, the rollout bus endpoint, the
lease guard, telemetry and policy updates are written once against this surface, and never ask
which engine they have. The lease is one object both hold (``lease_state.LeaseState``). The
SGLang-compatible admin API (sglang_api.py) needs more: rollout control and read-outs of the
rollout batch, which an engine offers by being an ``sglang_api.SGLangServable`` (our own engine
is; the SGLang backend is not: its servers answer those calls themselves). The values an
engine hands back are in ``outputs.py``.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from rose.shared.bursts import BurstTrip

from .lease_state import LeaseState
from .metrics import EngineMetrics
from .outputs import EngineStats, RequestHandle
from .protocol import GenerationRequest, WorkClass


class DeviceInfo(Protocol):
    """Where the work runs, as telemetry sees it (``device.CpuDevice`` / ``CudaDevice``)."""

    @property
    def kind(self) -> str: ...

    @property
    def torch_device(self) -> torch.device: ...  # where this process keeps its tensors for the device

    def telemetry(self) -> Any: ...  # a dataclass with contracts.executor.DeviceTelemetry's fields

    def weight_transfer_s(self) -> float: ...  # an emulated device's priced weight arrival (emulated.py); 0 elsewhere

    @property
    def emulates(self) -> str | None: ...  # what an emulated device stands for ("1xH100 emulated (7B+7B)"); None on real hardware


class CoServingPolicy(Protocol):
    """The bits of a co-serving policy (``policies.py``) the services read."""

    @property
    def name(self) -> str: ...

    @property
    def admits_rollout(self) -> bool: ...

    @property
    def yields_to_alerts(self) -> bool: ...


@runtime_checkable
class CoServingEngine(Protocol):
    """Serving first, rollout only under a lease, policy weights swapped in by version."""

    policy_version: int  # the live policy version (rollout results carry it)
    metrics: EngineMetrics  # lane failures for /health (the SGLang backend's lanes are remote: its servers report their own)
    lease: LeaseState  # the rollout lease held now and why the last one ended (written through set_/park_/revoke_rollout)
    on_burst: list[Callable[[BurstTrip], None]]  # called on the event loop when the engine's own burst detector trips

    @property
    def device(self) -> DeviceInfo: ...

    @property
    def policy(self) -> CoServingPolicy: ...

    @property
    def lendable_kv_bytes(self) -> int:
        """The most KV a rollout lease can grant here (what the lease guard caps a lease's budget at)."""

    async def __aenter__(self) -> CoServingEngine:
        """Start working (it may take seconds: a rollout forward process, the servers' first answers)."""

    async def __aexit__(self, *exc: object) -> None:
        """Stop; unfinished requests finish with finish_reason "abort"."""

    async def stop(self) -> None:
        """Stop; unfinished requests finish with finish_reason "abort"."""

    def tokenizer_for(self, work_class: WorkClass) -> Any: ...

    def max_positions(self, work_class: WorkClass) -> int: ...

    def submit(self, request: GenerationRequest, *, require_lease: bool = True) -> RequestHandle:
        """Validate and queue (raises InvalidRequest / RolloutRejected); from the event loop."""

    def set_rollout_lease(self, budget_bytes: int, expires_at_monotonic: float, lease_id: str = "") -> None: ...

    def set_rollout_budget(self, budget_bytes: int) -> None: ...

    def park_rollout(self, until_monotonic: float) -> None:
        """Revoked on a burst: no rollout runs or is taken; those accepted keep their KV until then."""

    def revoke_rollout(self) -> None: ...

    def set_slo(self, ttft_ms: float | None, tpot_ms: float | None) -> None: ...

    def apply_policy_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> concurrent.futures.Future:
        """Raises WeightUpdateError at once for a state that does not fit; the future gives the pause in ms."""

    def policy_state_dict(self) -> dict[str, torch.Tensor]: ...

    def stats(self) -> EngineStats:
        """The interval since the previous call; must not block the event loop."""
