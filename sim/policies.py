"""The four fleet policies, driving the services' own decision functions.

Nothing here re-implements a decision the services make. Each policy names the real callables
it uses as class attributes (tests check them with ``is``):

- lending: ``rose.services.scheduler.leases.plan_lending`` every scheduler tick and
  ``revoke_on_alert`` on every alert, under the scheduler's ``LendingSettings.mode`` of the
  policy (``none`` / ``always`` / ``elastic_baseline`` / ``rose``; see
  services/scheduler/config.py for the rules of each);
- turn placement: ``rose.services.scheduler.placement.place_turn`` (and ``should_hedge``) over
  the candidates of the scheduler's own ``Fleet``, fed with heartbeats, headroom, leases,
  alerts and routes as the scheduler service feeds it;
- headroom: ``rose.services.slo_monitor.headroom.assess`` on window figures the simulator
  computes, with a step model from ``fit_step_model`` over the simulated (serving batch,
  rollout batch, TPOT) observations, as the monitor does;
- burst alerts: ``rose.services.slo_monitor.bursts.classify`` and ``next_alert`` (the
  monitor's ``BurstDetector`` as pure functions);
- co-serving on a device: the executor's policy objects from
  ``rose.services.executor.policies.make_policy`` (``may_run_rollout``, ``quantum_ms``,
  ``yields_on_arrival``, ``widens_when_serving_idle``).

The policies, as ``rose bench e2e`` runs them:
- ``static``: lending ``none``: rollout on the dedicated pool only (the resource-fixed baseline);
- ``naive_share``: lending ``always`` (a whole lease on every serving executor, never revoked)
  with the executor's ``naive_share`` policy (rollout on the serving lane at equal priority);
- ``elastic_baseline``: lending ``elastic_baseline``: whole executors after a long lendable
  window, every lease taken back on any alert (whole-job preemption: interrupted turns start
  over), a fleet-wide cooldown after that; a lent executor leaves the serving rotation (its
  share of traffic goes to the others) and rollout has the whole device;
- ``rose``: lending ``rose`` (leases sized by the monitor's headroom, revoked on the executor's
  own alerts, which its lease guard also acts on at once: ``yields_to_alerts``) with the
  executor's ``rose`` policy;
  interrupted turns resume elsewhere with their tokens; weights go out as deltas.

GPU-scale settings (the shipped defaults size a CPU executor): the monitor's
``max_rollout_slots`` and the lending's ``whole_batch`` are 256 sequences (vLLM's default
``max_num_seqs``); ``max_lend_kv_bytes`` and ``whole_kv_mib`` are the instance's free HBM,
which its rollout pool holds (``serving_snapshot``). Everything else is the services' default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rose.contracts.executor import DeviceTelemetry, MetricsSnapshot, PoolUsage, RolloutMode
from rose.contracts.slo import SloAlert
from rose.services.executor.policies import Signals, make_policy
from rose.services.scheduler.config import LeaseSettings, LendingSettings
from rose.services.scheduler.leases import is_active, plan_lending, revoke_on_alert
from rose.services.scheduler.placement import place_turn, should_hedge
from rose.services.slo_monitor.bursts import classify, next_alert
from rose.services.slo_monitor.config import HeadroomSettings, WindowSettings
from rose.services.slo_monitor.headroom import assess, fit_step_model
from rose.shared.bursts import BurstSettings

from . import POLICIES
from .coserve import MAX_SERVING_BATCH

if TYPE_CHECKING:
    from .control import ControlPlane

MODES = {"static": "none", "naive_share": "always", "elastic_baseline": "elastic_baseline", "rose": "rose"}


class FleetPolicy:
    """One policy: the scheduler's lending mode, the executor's co-serving policy, the worker's resume rule."""

    place_turn = staticmethod(place_turn)
    should_hedge = staticmethod(should_hedge)
    plan_lending = staticmethod(plan_lending)
    revoke_on_alert = staticmethod(revoke_on_alert)
    assess = staticmethod(assess)
    fit_step_model = staticmethod(fit_step_model)
    classify = staticmethod(classify)
    next_alert = staticmethod(next_alert)
    is_active = staticmethod(is_active)

    def __init__(self, name: str, quantum_ms: float = 10.0, whole_batch: int = 256, whole_kv_bytes: float = 0.0) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown fleet policy {name!r}; choose one of {', '.join(POLICIES)}")
        self.name = name
        self.mode = MODES[name]
        self.lease_settings = LeaseSettings()
        self.lending = LendingSettings(mode=self.mode, whole_batch=whole_batch, whole_kv_mib=max(1.0, whole_kv_bytes / (1 << 20)))  # type: ignore[arg-type]
        # the executor's co-serving policy on serving instances (None: rollout never runs there)
        self.executor_policy = make_policy("naive_share" if name == "naive_share" else "rose", quantum_ms=quantum_ms) if name != "static" else None
        self.hosts_policy_on_serving = name != "static"
        self.serving_sync_mode = "delta" if name == "rose" else "full"
        self.uses_monitor = name in ("rose", "elastic_baseline")  # `always` and `none` never look at headroom or alerts
        # while no rollout runs (training), rose's leases only matter once the next batch starts: its
        # monitor may rest until its windows must refill (elastic's whole leases drain serving
        # executors even when idle, so its monitor and alerts keep running)
        self.monitor_idle_skippable = name == "rose"
        self.keep_tokens = name != "elastic_baseline"  # elastic: interrupted turns start over
        self.drains_lent = name == "elastic_baseline"  # a lent executor leaves the serving rotation
        # the executor's lease guard takes rollout back at once on its own alert, unless its policy ignores alerts
        self.parks_on_burst = name == "rose"  # a burst parks the turns (Lease.park_until); elastic preempts
        self.guard_acts_on_alerts = self.executor_policy is not None and getattr(self.executor_policy, "yields_to_alerts", name != "naive_share")

    def control(self, plane: ControlPlane, now: float) -> None:
        """The scheduler's tick: every lease action due now."""
        for action in self.plan_lending(now, plane.fleet.views(now), self.lease_settings, self.lending):
            plane.apply_lease(action.kind, action.lease, action.reason)

    def on_alert(self, plane: ControlPlane, d: int, alert: SloAlert, now: float) -> None:
        """An alert reaches the scheduler (and the executor's guard)."""
        if alert.severity != "recovered":
            plane.fleet.on_alert(alert.executor_id, now)
        for action in self.revoke_on_alert(plane.fleet.views(now), alert, now, self.lending):
            plane.apply_lease(action.kind, action.lease, action.reason)
        if self.guard_acts_on_alerts and alert.severity != "recovered" and plane.inst.slots[d] > 0:
            lease = plane.fleet.info(alert.executor_id).lease
            if alert.severity == "burst" and self.parks_on_burst and lease is not None and lease.expires_at > now:
                plane.park_device(d, lease.expires_at)  # the executor's guard: as the scheduler's burst revocation will
            else:
                plane.revoke_device(d, f"{alert.severity}: guard", keep_tokens=self.keep_tokens)


def make_fleet_policy(name: str, quantum_ms: float = 10.0, whole_batch: int = 256, whole_kv_bytes: float = 0.0) -> FleetPolicy:
    return FleetPolicy(name, quantum_ms, whole_batch, whole_kv_bytes)


def monitor_settings(
    slo_ttft_ms: float, slo_tpot_ms: float, max_rollout_slots: int, max_lend_kv_bytes: int
) -> tuple[WindowSettings, BurstSettings, HeadroomSettings]:
    """The monitor's settings as shipped, with the SLO and the two GPU-scale caps (module doc)."""
    return (
        WindowSettings(),
        BurstSettings(),
        HeadroomSettings(
            slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, max_rollout_slots=max_rollout_slots, max_lend_kv_bytes=max(0, max_lend_kv_bytes)
        ),
    )


def serving_snapshot(
    device_name: str, total_bytes: float, rollout_pool_bytes: float, kv_bytes_per_token: float, rollout_mode: RolloutMode = "two_model"
) -> MetricsSnapshot:
    """The memory figures a co-hosting serving executor reports: its device, and the rollout pool it preallocated
    (what the monitor lends, services/slo_monitor/headroom.py ``lendable_kv_bytes``); the device's memory all
    taken by the engine's weights, pools and margins, as an engine that preallocates reports it. Its rollout mode:
    the monitor judges a co-batched executor's TPOT against its guard's setpoint."""
    block = max(1, int(kv_bytes_per_token))
    pool = max(0.0, rollout_pool_bytes)
    return MetricsSnapshot(
        executor_id="s0",
        at=0.0,
        interval_s=1.0,
        rollout_pool=PoolUsage(block_bytes=block, total_blocks=int(pool // block), used_blocks=0),
        device=DeviceTelemetry(kind="cuda", name=device_name, memory_total_bytes=int(total_bytes), memory_used_bytes=int(total_bytes)),
        rollout_mode=rollout_mode,
    )


def executor_signals(
    now: float,
    serving_running: float,
    serving_iteration_ms: float,
    slo_tpot_ms: float,
    serving_max_batch: int = MAX_SERVING_BATCH,
    *,
    gpu_engine: bool = True,
) -> Signals:
    """The engine's Signals at a quantum boundary, in the steady state of one simulated second
    (no prefill pending: yields to pending prefills are accounted for by the caller).

    The engine described is the one the emulated fleet runs (services/executor/device.py
    ``EmulatedDevice``, a GPU engine with CUDA graphs): serving's stream outranks rollout's
    (``priority_streams``), rollout decodes by graph replay (``rollout_decode_graphs``) and its
    forwards do not share the serving lane's interpreter (``shares_interpreter`` False: the
    interpreter-lock slowdown of a CPU executor does not apply). ``gpu_engine`` False: the CPU
    executor's engine, as ``rose bench coserve`` runs it (calibration.py)."""
    return Signals(
        now=now,
        serving_prefill_pending=0,
        serving_running=int(round(serving_running)),
        serving_iteration_ms=serving_iteration_ms,
        slo_tpot_ms=slo_tpot_ms,
        serving_max_batch=serving_max_batch,
        priority_streams=gpu_engine,
        rollout_decode_graphs=gpu_engine,
        shares_interpreter=not gpu_engine,
    )
