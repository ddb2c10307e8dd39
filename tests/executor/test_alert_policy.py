"""Who yields to an SLO alert: the lease guard takes rollout back on an alert unless the executor's
co-serving policy ignores the SLO (naive_share, the `rose bench e2e` baseline; `engine.policy`)."""

from __future__ import annotations

import time

import pytest

from rose.contracts.lease import Lease
from rose.contracts.slo import SloAlert
from rose.services.executor.config import ExecutorConfig
from rose.services.executor.leases import LeaseGuard
from rose.services.executor.policies import POLICY_NAMES, make_policy
from rose.shared.config import load_config
from rose.testing.polling import until


class StubEngine:
    def __init__(self, policy: str) -> None:
        self.policy = make_policy(policy)
        self.revoked = 0
        self.parked_until_engine: float | None = None
        self.lease_id = ""

    def revoke_rollout(self) -> None:
        self.revoked += 1

    def park_rollout(self, until: float) -> None:
        self.parked_until_engine = until

    def set_rollout_lease(self, budget: int, until: float, lease_id: str) -> None:
        self.lease_id = lease_id


def test_only_naive_share_ignores_alerts():
    assert {name: make_policy(name).yields_to_alerts for name in POLICY_NAMES} == {
        "serving_only": True,
        "naive_share": False,
        "static_partition": True,
        "rose": True,
    }
    cfg = load_config(ExecutorConfig, env={"ROSE_ENGINE__POLICY": "naive_share"})
    assert cfg.engine.policy == "naive_share" and ExecutorConfig().engine.policy == "rose"


@pytest.mark.parametrize("policy", ["rose", "naive_share"])
async def test_guard_yields_on_alert_unless_the_policy_ignores_the_slo(policy):
    engine = StubEngine(policy)
    guard = LeaseGuard(engine, "ex-a", dedicated=False, rollout_kv_bytes=1 << 20)  # type: ignore[arg-type]
    now = time.time()
    lease = Lease(
        lease_id="ex-a-e1",
        executor_id="ex-a",
        epoch=1,
        state="active",
        granted_at=now,
        expires_at=now + 60,
        kv_bytes=1 << 20,
        compute_share=1.0,
        max_rollout_batch=8,
    )
    await guard._on_lease("ex-a", lease)
    assert engine.lease_id == "ex-a-e1" and guard.current is lease
    await guard._on_alert(SloAlert(executor_id="ex-a", at=now, severity="burst", reason="test"), None)  # type: ignore[arg-type]
    if policy == "naive_share":
        assert guard.current is lease and engine.revoked == 0 and engine.parked_until_engine is None
    else:  # a burst: rollout parked until the lease's expiry (a minute here)
        assert guard.current is None and guard.revoked_reason == "lease_revoked" and engine.revoked == 0
        assert guard.parked_until == lease.expires_at and engine.parked_until_engine == pytest.approx(time.monotonic() + 60, abs=1.0)
        await guard._on_alert(SloAlert(executor_id="ex-a", at=now, severity="violation", reason="test"), None)  # type: ignore[arg-type]
        assert engine.revoked == 1 and guard.parked_until is None  # a violation while parked interrupts at once
    await guard._on_lease("ex-a", None)  # a revocation from the scheduler is obeyed by every policy
    assert guard.current is None and engine.revoked >= 1


async def test_the_executor_publishes_its_own_burst_alert_at_the_arrival_that_trips_its_detector(make_engine, bus):
    """A burst of serving arrivals on a real engine: the detector trips on the growing queue of first
    tokens, and the alert for this executor arrives on the bus (executor.burst)."""
    import asyncio

    from rose.contracts.registry import EXECUTOR_BURST
    from rose.services.executor.main import publish_bursts
    from rose.services.executor.protocol import EngineSampling, GenerationRequest, WorkClass
    from rose.services.executor.telemetry import Telemetry

    engine = make_engine("rose")
    got: list[tuple[SloAlert, float]] = []
    await bus.subscribe(EXECUTOR_BURST, lambda a, _d: asyncio.sleep(0, got.append((a, time.monotonic()))), executor_id="ex-burst")
    publish_bursts(engine, bus, "ex-burst", Telemetry(engine, "ex-burst", "serving", 1.0))
    sampling = EngineSampling(temperature=0, max_tokens=4, ignore_eos=True)
    handles = [
        engine.submit(GenerationRequest(request_id=f"b{i}", work_class=WorkClass.SERVING, prompt_token_ids=tuple(range(10, 58)), sampling=sampling))
        for i in range(12)
    ]
    await asyncio.gather(*(h.result() for h in handles))
    await until(lambda: got, timeout=5, what="a burst alert on executor.burst", step=0.01)
    alert = got[0][0]
    assert alert.executor_id == "ex-burst" and alert.severity == "burst" and "queue" in alert.reason and alert.serving_queue >= 4
