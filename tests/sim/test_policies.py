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
    assert type(sim.router.fleet) is scheduler_fleet.Fleet
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
    for d in range(sim.inst.n_serv):
        lease = sim.router.fleet.info(sim.inst.ids[d]).lease
        active = leases.is_active(lease, sim.env.now)
        assert (sim.inst.slots[d] > 0) == active or not active


def test_classify_matches_the_monitors_detector_on_window_figures():
    """bursts.classify (the pure function the simulator calls) decides what BurstDetector decides."""
    from rose.contracts.executor import LatencySketch, MetricsSnapshot
    from rose.services.slo_monitor.config import HeadroomSettings
    from rose.services.slo_monitor.windows import ExecutorWindow, stats_of
    from rose.shared.bursts import BurstSettings, rate_windows

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
            [stats_of(window.recent(s)) for s in rate_windows(cfg)],
            stats_of(window.older_than(rate_windows(cfg)[-1])),
            snaps[-1].serving_queue,
            snaps[-2].serving_queue if len(snaps) > 1 else 0,
            cfg,
            slo,
        )
        assert found == direct
    assert found is not None and found[0] == "burst"


def test_a_burst_parks_the_turns_of_the_lease_until_a_new_lease_or_its_expiry():
    """rose's burst revocation in the simulator (Lease.park_until): the instance runs nothing while its
    turns are parked (serving gets it as under a plain revocation), nothing new goes there, and the
    parked turns are interrupted only at the park's end; a new lease resumes them in place."""
    sim = Simulation(SimConfig(model="7B", gpus=8, policy="rose", steps=2, seed=0, rollout_gpu_ratio=0.25))
    t = sim.turns
    parks: list[dict] = []
    real_park, real_revoke, real_tick = sim.control.park_device, sim.control.revoke_device, sim.rollout.tick

    def park(d, until):
        held = np.flatnonzero((t.dev == d) & (t.state > 0))
        real_park(d, until)
        parks.append(dict(d=d, until=until, held=set(held.tolist()), ended=None, tokens=0.0))

    def revoke(d, reason, keep_tokens):
        for x in parks:
            if x["d"] == d and x["ended"] is None:
                x["ended"], x["left"], x["reason"] = sim.env.now, set(np.flatnonzero((t.dev == d) & (t.state > 0)).tolist()), reason
        real_revoke(d, reason, keep_tokens)

    def tick(now, dt, share, co_plan):
        out = real_tick(now, dt, share, co_plan)
        for x in parks:
            if x["ended"] is None and sim.inst.park_until[x["d"]] == 0:  # a new lease resumed the parked turns
                x["ended"], x["left"], x["reason"] = now, set(), "granted"
            if x["ended"] is None:
                on = set(np.flatnonzero((t.dev == x["d"]) & (t.state > 0)).tolist())
                assert on <= x["held"], ("a turn went to a parked instance", x["d"], on - x["held"])
                assert share[x["d"]] == 0.0 and out[x["d"]] == 0.0, "a parked instance ran rollout"
        return out

    sim.control.park_device, sim.control.revoke_device, sim.rollout.tick = park, revoke, tick
    out = sim.run()
    busy = [x for x in parks if x["held"]]
    assert out["parked_leases"] == len(parks) and busy, "no burst found a lease with turns on it"
    assert any(x["reason"] == "granted" for x in busy), "no parked turn was resumed by a new lease"
    for x in busy:
        if x["ended"] is not None and x["left"]:  # interrupted with turns left: only at the park's end
            assert x["ended"] >= x["until"] - 1e-6 and x["reason"] == "park ended", x
