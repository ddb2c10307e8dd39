"""The fleet simulator: deterministic, and the policies behave as the design says on a bursty trace."""

import pytest

from rose.shared.devices import SyncSpec, sync_seconds
from rose.sim.engine import Infeasible, SimConfig, simulate
from rose.sim.traces import DiurnalBursty

BURSTY = DiurnalBursty(amplitude=0.3, burst_every_s=120.0, burst_factor=1.8, burst_len_s=30.0)


@pytest.fixture(scope="module")
def small_run():
    """7B on 8 H100s, one RL step, a bursty trace: the four policies, the same seed."""
    return {
        p: simulate(SimConfig(model="7B", gpus=8, policy=p, steps=1, seed=3, trace_shape=BURSTY))
        for p in ("static", "naive_share", "elastic_baseline", "rose")
    }


def test_deterministic_given_seed():
    a = simulate(SimConfig(model="70B", gpus=16, policy="rose", steps=1, seed=5))
    b = simulate(SimConfig(model="70B", gpus=16, policy="rose", steps=1, seed=5))
    c = simulate(SimConfig(model="70B", gpus=16, policy="rose", steps=1, seed=6))
    assert a == b
    assert a["rl_steps_per_hour"] != c["rl_steps_per_hour"] or a["slo_violations"] != c["slo_violations"] or a["alerts"] != c["alerts"]


def test_rose_without_slo_violations_harvests_serving_gpus(small_run):
    static, rose = small_run["static"], small_run["rose"]
    assert static["complete"] and rose["complete"]
    assert static["slo_violations_serving_alone"] == 0  # the trace itself fits the fleet
    assert rose["slo_violations"] == 0 and rose["serving_slo_attainment"] == 1.0
    assert rose["leases"]["granted"] > 0 and rose["rollout_tokens_on_serving_fraction"] > 0


def test_rose_at_least_static_where_the_pool_is_short():
    """On a lightly loaded bursty fleet whose RL batch oversubscribes the dedicated pool 4x, rose's
    RL throughput is at least static's on average over seeds, with no SLO violation.

    Not a general property: one step's throughput varies with the sampled tail, and at the bench's
    defaults (load 0.45, 2x) rose is within about +-15 % of static, some seeds below it (see the
    notes of `rose bench sim`)."""
    from dataclasses import replace

    from rose.shared.workload import RolloutSpec

    spec = replace(RolloutSpec(), oversubscription=4.0)
    ratios = []
    for seed in (0, 1, 2):
        r = {
            p: simulate(SimConfig(model="7B", gpus=8, policy=p, steps=1, seed=seed, trace_shape=BURSTY, load=0.25, rollout=spec))
            for p in ("static", "rose")
        }
        assert r["rose"]["slo_violations"] == 0 == r["static"]["slo_violations_serving_alone"]
        ratios.append(r["rose"]["rl_steps_per_hour"] / r["static"]["rl_steps_per_hour"])
    assert sum(ratios) / len(ratios) >= 1.0, ratios


def test_placements_count_by_role_and_the_rule_that_made_them(small_run):
    """Each simulated placement went through the scheduler's place_turn and is counted under "role: rule"
    (placement.py RULES), as the scheduler's PlacementEvents name them; static never places on a serving executor."""
    from rose.services.scheduler.placement import RULES

    for name, run in small_run.items():
        rules = run["placement_rules"]
        assert rules and all(n > 0 for n in rules.values()), name
        for key in rules:
            role, rule = key.split(": ")
            assert role in ("dedicated", "serving") and rule in RULES, key
    assert not any(k.startswith("serving: ") for k in small_run["static"]["placement_rules"])
    assert any(k.startswith("serving: ") for k in small_run["rose"]["placement_rules"])  # it lent, and turns went there


def test_naive_share_breaks_the_slo(small_run):
    """It lends every serving instance and its lanes make rollout tokens, at the SLO's cost. (Whether that beats
    static in one step is the step's tail: 1.02x static's tokens/s with the 1.25 x mean-batch serving pool, 0.99x
    with the pool holding its p99.9, whose lanes have 8 % less KV.)"""
    naive = small_run["naive_share"]
    assert naive["slo_violations"] > 0 and naive["serving_slo_attainment"] < 0.9
    assert naive["lent_instance_fraction"] > 0.9 and naive["rollout_tokens_on_serving_fraction"] > 0.2


def test_elastic_baseline_preempts_whole_jobs(small_run):
    el = small_run["elastic_baseline"]
    assert el["leases"]["granted"] > 0 and el["leases"]["revoked"] > 0
    assert el["interrupted_turns"] == 0  # whole-job preemption: turns start over, nothing resumes
    assert el["aborted_turns"] >= 0


def test_infeasible_configuration_says_why():
    with pytest.raises(Infeasible, match="TP8"):
        simulate(SimConfig(model="70B", gpus=4, policy="static", steps=1))


def test_delta_sync_beats_full_over_the_inter_cluster_link():
    w = 141e9
    full, delta = sync_seconds(w, "full", SyncSpec(), cross_cluster=True), sync_seconds(w, "delta", SyncSpec(), cross_cluster=True)
    assert full == pytest.approx(w * 8 / 100e9 + w * 8 / 400e9)
    assert delta < full / 1.5
    with pytest.raises(ValueError):
        sync_seconds(w, "zip", SyncSpec(), cross_cluster=True)
