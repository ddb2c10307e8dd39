"""The simulator drives the services' own decision functions, not copies of them."""

import numpy as np

from rose.services.executor import policies as executor_policies
from rose.services.scheduler import fleet as scheduler_fleet
from rose.services.scheduler import leases, placement
from rose.services.scheduler.config import LendingSettings
from rose.services.slo_monitor import bursts, headroom
from rose.sim import policies as simp
from rose.sim.engine import SimConfig, Simulation


def test_policy_callables_are_the_services_functions():
    for name in simp.POLICIES:
        p = simp.make_fleet_policy(name)
        assert p.plan_lending is leases.plan_lending
        assert p.revoke_on_alert is leases.revoke_on_alert
        assert p.place_turn is placement.place_turn
        assert p.should_hedge is placement.should_hedge
        assert p.assess is headroom.assess
        assert p.fit_step_model is headroom.fit_step_model
        assert p.classify is bursts.classify
        assert p.next_alert is bursts.next_alert
        assert isinstance(p.lending, LendingSettings) and p.lending.mode == simp.MODES[name]
    assert simp.make_fleet_policy("static").executor_policy is None
    assert isinstance(simp.make_fleet_policy("rose").executor_policy, executor_policies.Rose)
    assert isinstance(simp.make_fleet_policy("naive_share").executor_policy, executor_policies.NaiveShare)


def test_the_simulation_uses_the_schedulers_fleet_and_its_decisions():
    sim = Simulation(SimConfig(model="7B", gpus=8, policy="rose", steps=1, seed=0))
    assert type(sim.fleet) is scheduler_fleet.Fleet
    calls = {"plan": 0, "place": 0, "assess": 0, "classify": 0}
    real = {"plan": sim.policy.plan_lending, "place": sim.policy.place_turn, "assess": sim.policy.assess, "classify": sim.policy.classify}

    def counting(key):
        def f(*a, **k):
            calls[key] += 1
            return real[key](*a, **k)

        return f

    sim.policy.plan_lending, sim.policy.place_turn = counting("plan"), counting("place")
    sim.policy.assess, sim.policy.classify = counting("assess"), counting("classify")
    out = sim.run()
    assert all(v > 0 for v in calls.values()), calls
    assert out["leases"]["granted"] > 0
    # every lease the scheduler's fleet holds went through the sim's apply: same state both sides
    for d in range(sim.n_serv):
        lease = sim.fleet.info(sim.ids[d]).lease
        active = leases.is_active(lease, sim.env.now)
        assert (sim.slots[d] > 0) == active or not active


def test_classify_matches_the_monitors_detector_on_window_figures():
    """bursts.classify (the pure function the simulator calls) decides what BurstDetector decides."""
    from rose.contracts.executor import LatencySketch, MetricsSnapshot
    from rose.services.slo_monitor.config import BurstSettings, HeadroomSettings
    from rose.services.slo_monitor.windows import ExecutorWindow, stats_of

    cfg, slo = BurstSettings(), HeadroomSettings()
    window = ExecutorWindow(30.0)
    rng = np.random.default_rng(0)
    for t in range(40):
        arrivals = int(rng.poisson(5 if t < 35 else 20))
        window.add(
            MetricsSnapshot(
                executor_id="e",
                at=float(t),
                interval_s=1.0,
                serving_arrivals=arrivals,
                serving_queue=0,
                ttft_ms=LatencySketch(),
                tpot_ms=LatencySketch(),
            ),
            float(t),
        )
        found = bursts.signals(window, cfg, slo, window.stats(3.0))
        snaps = window.snapshots
        direct = bursts.classify(
            window.stats(3.0),
            stats_of(window.recent(cfg.window_s)),
            stats_of(window.older_than(cfg.window_s)),
            snaps[-1].serving_queue,
            snaps[-2].serving_queue if len(snaps) > 1 else 0,
            cfg,
            slo,
        )
        assert found == direct
    assert found is not None and found[0] == "burst"
