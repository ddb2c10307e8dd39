"""The four fleet policies, driving the services' own decision functions.

Nothing here re-implements a decision the services make. Each policy names the real
callables it uses as class attributes (tests check them with ``is``):

- turn placement: ``rose.services.scheduler.placement.place_turn`` over the candidates of the
  scheduler's own ``Fleet`` (fed with heartbeats, headroom, leases, alerts and routes as the
  scheduler service feeds it), every policy;
- leases (rose): ``rose.services.scheduler.leases.plan_leases`` every scheduler tick and
  ``revoke_for_alert`` on every alert;
- headroom (rose): ``rose.services.slo_monitor.headroom.assess`` on window figures the
  simulator computes, with a step model from ``fit_step_model`` over the simulated
  (serving batch, rollout batch, TPOT) observations, as the monitor does;
- burst alerts (rose, elastic_baseline): ``rose.services.slo_monitor.bursts.classify`` and
  ``next_alert`` (the monitor's ``BurstDetector`` logic as pure functions);
- co-serving on a device: the executor's policy objects from
  ``rose.services.executor.policies.make_policy`` (``may_run_rollout``, ``quantum_ms``,
  ``yields_on_arrival``, ``widens_when_serving_idle``, ``shares_serving_lane``).

The policies:
- ``static``: rollout on the dedicated rollout pool only (the "resource-fixed" baseline).
- ``naive_share``: every serving instance also hosts the policy and runs rollout on the
  serving lane at equal priority (the executor's ``naive_share``), under a standing lease:
  no SLO awareness.
- ``elastic_baseline``: existing elastic RL frameworks in spirit (ROLL's shrink/expand,
  AReaL/verl elastic rollout): every ``interval_s`` it sizes the serving fleet for the recent
  peak rate at ``target_util`` of SLO capacity and lends the rest *whole*: the serving model
  is swapped out, the policy in (``switch_s``), the instance becomes a dedicated rollout
  executor. On a burst alert (the monitor's detector) or when demand rises it takes
  instances back with whole-job preemption: their in-flight turns are lost and restart
  elsewhere from scratch, and the instance serves again only after the swap back. This
  sizing rule is the baseline's own (no service implements it) and is written here.
- ``rose``: serving instances host the policy; the monitor's headroom and the scheduler's
  leases decide where and how much rollout runs; the executor's ``rose`` policy interleaves
  it with serving in bounded quanta; interrupted turns keep their tokens and resume
  elsewhere (the rollout worker's recompute path); weights go out as deltas.
"""

from __future__ import annotations

import math

from rose.contracts.lease import Lease
from rose.contracts.slo import Headroom, SloAlert
from rose.services.executor.policies import Signals, make_policy
from rose.services.scheduler.config import LeaseSettings, PlacementSettings
from rose.services.scheduler.leases import is_active, plan_leases, revoke_for_alert
from rose.services.scheduler.placement import place_turn, should_hedge
from rose.services.slo_monitor.bursts import BurstState, classify, next_alert
from rose.services.slo_monitor.config import BurstSettings, HeadroomSettings, WindowSettings
from rose.services.slo_monitor.headroom import assess, fit_step_model

POLICIES = ("static", "naive_share", "elastic_baseline", "rose")
NEVER = 1e15  # a standing lease's expiry


class FleetPolicy:
    """Hooks the engine calls; the defaults are the static policy's."""

    name = "static"
    place_turn = staticmethod(place_turn)
    should_hedge = staticmethod(should_hedge)
    executor_policy = None  # the executor's co-serving policy on serving instances, if rollout runs there
    hosts_policy_on_serving = False  # the policy's weights live on serving instances
    serving_sync_mode = "full"
    uses_monitor = False  # burst detection on serving instances

    def __init__(self, quantum_ms: float = 10.0) -> None:
        self.quantum_ms = quantum_ms

    def setup(self, sim) -> None:
        pass

    def control(self, sim, now: float) -> None:
        """Once per tick, after the serving and rollout updates."""

    def on_alert(self, sim, d: int, alert: SloAlert, now: float) -> None:
        pass


class Static(FleetPolicy):
    name = "static"


class NaiveShare(FleetPolicy):
    name = "naive_share"
    hosts_policy_on_serving = True
    serving_sync_mode = "full"

    def __init__(self, quantum_ms: float = 10.0) -> None:
        super().__init__(quantum_ms)
        self.executor_policy = make_policy("naive_share", quantum_ms=quantum_ms)

    def setup(self, sim) -> None:
        for d in range(sim.n_serv):
            eid = sim.ids[d]
            lease = Lease(lease_id=f"{eid}-naive", executor_id=eid, epoch=1, state="active", granted_at=0.0, expires_at=NEVER,
                          kv_bytes=int(max(0.0, sim.cohost_free_bytes)), compute_share=1.0, max_rollout_batch=sim.max_rollout_batch, reason="naive share: always")
            sim.fleet.on_lease(lease)
            sim.set_caps(d, lease.max_rollout_batch, lease.kv_bytes)


class Rose(FleetPolicy):
    name = "rose"
    hosts_policy_on_serving = True
    serving_sync_mode = "delta"
    uses_monitor = True
    plan_leases = staticmethod(plan_leases)
    revoke_for_alert = staticmethod(revoke_for_alert)
    assess = staticmethod(assess)
    fit_step_model = staticmethod(fit_step_model)
    classify = staticmethod(classify)
    next_alert = staticmethod(next_alert)
    is_active = staticmethod(is_active)

    def __init__(self, quantum_ms: float = 10.0) -> None:
        super().__init__(quantum_ms)
        self.executor_policy = make_policy("rose", quantum_ms=quantum_ms)
        self.lease_settings = LeaseSettings()

    def control(self, sim, now: float) -> None:
        for action in self.plan_leases(now, sim.fleet.views(now), self.lease_settings):
            sim.apply_lease(action.kind, action.lease, action.reason)
        # the executor enforces expiry on its own, whether or not the scheduler says so
        for d in range(sim.n_serv):
            if sim.slots[d] > 0 and not self.is_active(sim.fleet.info(sim.ids[d]).lease, now):
                sim.revoke_device(d, "lease expired", keep_tokens=True)

    def on_alert(self, sim, d: int, alert: SloAlert, now: float) -> None:
        eid = sim.ids[d]
        action = self.revoke_for_alert(sim.fleet.view(eid, now), alert, now)
        if action is not None:
            sim.apply_lease(action.kind, action.lease, action.reason)
        elif sim.slots[d] > 0 and alert.severity != "recovered":
            sim.revoke_device(d, "alert", keep_tokens=True)  # the executor's guard acts on the alert too


class ElasticBaseline(FleetPolicy):
    name = "elastic_baseline"
    serving_sync_mode = "full"
    uses_monitor = True
    classify = staticmethod(classify)
    next_alert = staticmethod(next_alert)

    def __init__(self, quantum_ms: float = 10.0, interval_s: float = 30.0, target_util: float = 0.7, lookback_s: float = 60.0) -> None:
        super().__init__(quantum_ms)
        self.interval_s, self.target_util, self.lookback_s = interval_s, target_util, lookback_s
        self.next_decision = 0.0

    def needed(self, sim, rate_rps: float) -> int:
        return max(1, math.ceil(rate_rps / (self.target_util * sim.cap_rps)))

    def control(self, sim, now: float) -> None:
        if now < self.next_decision:
            return
        self.next_decision = now + self.interval_s
        peak = sim.recent_fleet_rate_peak(self.lookback_s)
        need = self.needed(sim, peak)
        serving = sim.elastic_serving_count()  # serving now or switching back to serving
        if need > serving:
            sim.elastic_reclaim(need - serving, now, "demand rose")
        elif need < serving:
            sim.elastic_lend(serving - need, now)

    def on_alert(self, sim, d: int, alert: SloAlert, now: float) -> None:
        if alert.severity == "recovered":
            return
        # whole-job preemption: enough instances back for the burst, at once
        need = self.needed(sim, sim.current_fleet_rate() * 1.0)
        serving = sim.elastic_serving_count()
        sim.elastic_reclaim(max(1, need - serving), now, f"{alert.severity}: {alert.reason}")
        self.next_decision = now + self.interval_s


def make_fleet_policy(name: str, quantum_ms: float = 10.0, elastic_interval_s: float = 30.0, elastic_target_util: float = 0.7) -> FleetPolicy:
    if name == "static":
        return Static(quantum_ms)
    if name == "naive_share":
        return NaiveShare(quantum_ms)
    if name == "elastic_baseline":
        return ElasticBaseline(quantum_ms, elastic_interval_s, elastic_target_util)
    if name == "rose":
        return Rose(quantum_ms)
    raise ValueError(f"unknown fleet policy {name!r}; choose one of {', '.join(POLICIES)}")


def monitor_settings(slo_ttft_ms: float, slo_tpot_ms: float, max_rollout_slots: int, max_lend_kv_bytes: int) -> tuple[WindowSettings, BurstSettings, HeadroomSettings]:
    """The monitor's settings as shipped, with the SLO and two GPU-scale caps: the defaults
    (32 slots, 256 MiB) size a CPU executor; a GPU instance's rollout engine runs hundreds
    of sequences in tens of GB."""
    return WindowSettings(), BurstSettings(), HeadroomSettings(
        slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, max_rollout_slots=max_rollout_slots, max_lend_kv_bytes=max_lend_kv_bytes
    )


def executor_signals(now: float, serving_running: float, serving_iteration_ms: float, slo_tpot_ms: float) -> Signals:
    """The engine's Signals at a quantum boundary, in the steady state of one simulated second
    (no prefill pending: yields to pending prefills are accounted for by the caller)."""
    return Signals(now, 0, int(round(serving_running)), serving_iteration_ms, slo_tpot_ms)


__all__ = [
    "POLICIES", "FleetPolicy", "Static", "NaiveShare", "ElasticBaseline", "Rose", "make_fleet_policy", "monitor_settings", "executor_signals",
    "Headroom", "SloAlert", "BurstState", "PlacementSettings",
]
