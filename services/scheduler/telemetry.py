"""The scheduler's metrics: lease actions and leases held over time, routed turns, prefix-cache affinity."""

from __future__ import annotations

from rose.contracts.lease import Lease
from rose.shared.metrics import meter, metric_name


class SchedulerMetrics:
    def __init__(self) -> None:
        m = meter()
        self.leases = m.create_counter(
            metric_name("scheduler.leases"), unit="{lease}", description="Lease actions, per kind (granted, renewed, revoked, expired) and executor."
        )
        self.lease_active = m.create_gauge(
            metric_name("scheduler.lease_active"), description="1 while the executor holds an active lease from this scheduler, else 0."
        )
        self.lease_kv = m.create_gauge(
            metric_name("scheduler.lease_kv"), unit="By", description="KV bytes the executor's current lease lends to rollout (0 when none)."
        )
        self.routed = m.create_counter(
            metric_name("scheduler.routed_turns"), unit="{turn}", description="Turns placed, per executor, role and whether a hedge."
        )
        self.unroutable = m.create_counter(
            metric_name("scheduler.unroutable_turns"), unit="{turn}", description="Route requests no executor could take (the worker retries)."
        )
        self.affinity = m.create_counter(
            metric_name("scheduler.affinity"),
            unit="{turn}",
            description="Turns whose trajectory had a previous executor: placed there (hit) or elsewhere (miss), per routing policy.",
        )
        self.unroutable.add(0)  # exported at 0 from the start: a dashboard shows 0, not "No data"

    def lease(self, kind: str, lease: Lease) -> None:
        ex = {"executor": lease.executor_id}
        self.leases.add(1, {**ex, "kind": kind})
        held = kind in ("granted", "renewed") and lease.state == "active"
        self.lease_active.set(1 if held else 0, ex)
        self.lease_kv.set(lease.kv_bytes if held else 0, ex)

    def routed_turn(self, executor_id: str, role: str, hedge: bool, affinity: str, routing: str = "affinity") -> None:
        self.routed.add(1, {"executor": executor_id, "role": role, "hedge": str(hedge).lower()})
        if affinity and not hedge:
            self.affinity.add(1, {"outcome": "hit" if executor_id == affinity else "miss", "routing": routing})

    def unroutable_turn(self) -> None:
        self.unroutable.add(1)
