"""The scheduler's never-slower placement inside the simulator: the sim feeds it what the real scheduler
gets (batch, typical turn, revocations, model error), the tail stays on dedicated executors, a lease
is only taken when predicted sooner, and over a small synchronous grid rose's RL throughput is
never below static's (asynchronous RL at demand 1x is not yet: docs/simulator.md). Simulated
(deterministic) RL steps/h, not wall-clock timings."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from rose.bench.sim import (
    ASYNC_FLEET_CEILING_MIN_INTERVALS,
    combine_seeds,
    config_key,
    counted_intervals,
    grid_configs,
    grown_pool_configs,
    lane_pool_configs,
    rows_of,
    run_grid,
    targets_of,
)
from rose.services.scheduler import placement
from rose.shared.workload import RolloutSpec, sample_batch
from rose.sim.ceiling import fleet_ceiling, grown_pools, lane_value, speedup_ceiling
from rose.sim.engine import SimConfig, Simulation, simulate


def small(policy: str, demand: float, **kw) -> SimConfig:
    return SimConfig(
        model="7B", gpus=8, policy=policy, steps=1, seed=0, rollout=replace(RolloutSpec(), oversubscription=demand), rollout_gpu_ratio=0.25, **kw
    )


def test_the_sim_places_with_the_schedulers_inputs_and_keeps_the_tail_off_leases():
    sim = Simulation(small("rose", 4.0))
    seen = []
    real = sim.policy.place_turn

    def spy(req, cands, affinity, s, rng, unfinished=None, turn_tokens=0.0, revoke_rate=0.0, model_error=None):
        p = real(req, cands, affinity, s, rng, unfinished, turn_tokens, revoke_rate, model_error)
        if not req.hedge:
            pool = [c for c in cands if c.executor_id not in req.exclude]
            tail = placement.in_tail(unfinished, [c for c in pool if c.role == "dedicated"])
            seen.append((req.batch_id, req.batch_size, unfinished, turn_tokens, tail, p.role if p else None))
        return p

    sim.policy.place_turn = spy
    out = sim.run()
    assert out["complete"] and out["slo_violations"] == 0
    assert all(b.startswith("b") and size > 0 and u is not None for b, size, u, *_ in seen)  # every request names its batch
    assert any(t > 0 for *_, t, _, _ in seen)  # the typical turn is learned from finished trajectories
    tail = [role for *_, in_tail, role in seen if in_tail]
    assert tail and set(tail) == {"dedicated"}  # the step's last turns never go to a lease
    assert any(role == "serving" for *_, role in seen)  # while the dedicated pool is oversubscribed, leases are used
    assert out["rollout_tokens_on_serving_fraction"] > 0.1


@pytest.fixture(scope="module")
def grid():
    """7B on 8 GPUs (2 dedicated), demand 1x and 4x, synchronous, static / elastic_baseline / rose, one step."""
    configs = grid_configs(
        models=("7B",),
        fleets=(8,),
        demands=(1.0, 4.0),
        ratios=(0.25,),
        modes=("sync",),
        policies=("static", "elastic_baseline", "rose"),
        steps=1,
        seed=0,
    )
    return rows_of(run_grid(configs, jobs=1))


def test_rose_never_below_static_and_gains_where_rollout_is_the_bottleneck(grid):
    rose = {config_key(r): r for r in grid if r["policy"] == "rose"}
    assert len(rose) == 2
    for r in rose.values():
        assert r["speedup_vs_static"] >= 1.0, r  # the placement only takes a lease that is predicted sooner
        assert r["slo_violations"] == 0
    by_demand = {r["rollout_demand"]: r for r in rose.values()}
    assert by_demand[4.0]["speedup_vs_static"] > 1.1  # leases add capacity the 4x batch needs
    t = targets_of(grid)["sync"]
    assert t["meets"]["never_below_static"] and t["meets"]["zero_slo_violations"]
    assert t["min_speedup"] == min(r["speedup_vs_static"] for r in rose.values())


def test_rose_stays_under_the_ceiling_of_the_fleets_rollout_capacity(grid):
    """The ceiling is the dedicated pool plus every serving GPU's rollout lane at full quanta: leases
    cannot make a larger share of the tokens than that capacity gives them, and rose's speedup where
    rollout is throughput-bound (demand 4x) stays under what that capacity buys."""
    by = {(r["policy"], r["rollout_demand"]): r for r in grid}
    for demand in (1.0, 4.0):
        rose, static = by[("rose", demand)], by[("static", demand)]
        lane = rose["detail"]["lane_share_ceiling"]
        assert 0.0 < lane < 1.0
        capacity = rose["rollout_capacity_ceiling"]
        assert capacity == pytest.approx(1.0 + 8 * lane / 2)  # 8 serving GPUs, 2 dedicated (TP1 both)
        assert rose["detail"]["rollout_tokens_on_serving_fraction"] <= 1.0 - 1.0 / capacity
        assert static["rollout_capacity_ceiling"] is None and static["speedup_ceiling"] is None  # no lanes
        assert by[("elastic_baseline", demand)]["rollout_capacity_ceiling"] is None  # whole instances, not lanes
    four = by[("rose", 4.0)]
    assert 1.0 < four["speedup_vs_static"] <= four["speedup_ceiling"] < four["rollout_capacity_ceiling"]
    # priced at the lent KV's batch: a lane GPU-second is worth less than a dedicated one, so less is on offer
    value = four["detail"]["lane_value"]
    assert 0.0 < value < 1.0
    assert four["rollout_capacity_ceiling_kv"] == pytest.approx(1.0 + 8 * four["detail"]["lane_share_ceiling"] * value / 2)
    assert 1.0 < four["speedup_ceiling_kv"] < four["speedup_ceiling"]


def test_a_lane_is_priced_by_the_tokens_per_gpu_second_its_batch_makes():
    assert lane_value(64, 0.02, 1, 64, 0.02, 1) == pytest.approx(1.0)  # the same batch and step: worth a dedicated GPU
    assert lane_value(16, 0.016, 1, 128, 0.064, 1) == pytest.approx(0.5)  # 1,000 vs 2,000 tokens/s
    assert lane_value(32, 0.02, 2, 32, 0.02, 1) == pytest.approx(0.5)  # the same tokens from two GPUs
    assert lane_value(256, 0.02, 1, 32, 0.02, 1) == 1.0  # never above a dedicated GPU-second


def test_the_speedup_ceiling_is_amdahls_at_the_rollout_capacity():
    # synchronous: 100 s of training and a 50 s tail stay, the other 250 s shrink by the capacity
    assert speedup_ceiling(2.0, 400.0, 100.0, 50.0, pipelined=False) == pytest.approx(400.0 / 275.0)
    assert speedup_ceiling(1.0, 400.0, 100.0, 50.0, pipelined=False) == pytest.approx(1.0)
    # asynchronous: rollout overlaps training; a step takes at least its training
    assert speedup_ceiling(2.0, 400.0, 100.0, 50.0, pipelined=True) == pytest.approx(2.0)
    assert speedup_ceiling(8.0, 400.0, 100.0, 50.0, pipelined=True) == pytest.approx(4.0)


def test_the_fleet_ceiling_interpolates_static_on_grown_pools():
    assert grown_pools(4, 1.73) == (6, 7) and grown_pools(4, 1.2) == (5,) and grown_pools(4, 2.0) == (8,)
    assert grown_pools(4, None) == () and grown_pools(4, 1.0) == ()
    assert fleet_ceiling(10.0, 4, 1.75, {7: 14.0}) == pytest.approx(1.4)  # 4 x 1.75 = 7 instances: that run itself
    # 4 x 1.15 = 4.6 instances: 60 % of the way from the pool's own rate (4) to the 5-instance run's
    assert fleet_ceiling(10.0, 4, 1.15, {5: 15.0}) == pytest.approx((10.0 + 0.6 * 5.0) / 10.0)
    assert fleet_ceiling(10.0, 4, 1.73, {6: 12.0}) is None  # a bracketing run missing (infeasible): no figure


def test_a_latency_bound_synchronous_step_gains_less_from_capacity_than_amdahl_says():
    """14B on 16 GPUs, synchronous, demand 2: the dedicated pool runs most of the batch at once and the step
    waits on its trajectories' turns and tools in sequence, so static on a pool grown by the lanes'
    capacity gains less than Amdahl's ceiling at that capacity; and the grid runs exactly those pools."""
    configs = grid_configs(
        models=("14B",), fleets=(16,), demands=(2.0,), ratios=(0.25,), modes=("sync", "async"), policies=("static", "rose"), steps=1, seed=0
    )
    results = run_grid(configs, jobs=1)
    runs = grown_pool_configs(configs, results)
    static, lanes = (next(r for r in results if r["policy"] == p and r["mode"] == "sync") for p in ("static", "rose"))
    assert {key[5] for key, _, _ in runs} == {"sync"}  # one step: the asynchronous rate jumps with its phase, no fleet ceiling
    assert [k for _, k, _ in runs] == list(grown_pools(static["dedicated_instances"], lanes["rollout_capacity_ceiling_kv"])) != []
    assert all(c.policy == "static" and c.n_dedicated == k and c.trajectories == static["trajectories_per_step"] for _, k, c in runs)
    grown = {runs[0][0]: {k: r["rl_steps_per_hour"] for (_, k, _), r in zip(runs, run_grid([c for *_, c in runs], jobs=1))}}
    rose = next(r for r in rows_of(results, grown) if r["policy"] == "rose" and r["mode"] == "sync")
    assert 1.0 < rose["speedup_ceiling_fleet"] < rose["speedup_ceiling_kv"]


def test_the_lane_pool_adds_each_serving_lane_to_statics_pool_at_roses_lane_share():
    """The lane pool (sim/ceiling.py): static's job with one more pool instance per serving instance, on serving
    GPUs (their step model), at the share of each second rose's executor leaves a lane at full quanta, with the KV
    a lease lends; placed on as the pool is, while the serving instances themselves lend nothing."""
    rose = Simulation(small("rose", 4.0))
    lanes = Simulation(replace(small("static", 4.0), lane_pool=True))
    n_serv, n_ded, ids, memory = lanes.sized.shape.n_serv, lanes.sized.shape.n_ded, lanes.inst.ids, lanes.sized.memory
    lane = np.arange(n_serv + n_ded, n_serv + n_ded + n_serv)
    assert [ids[d] for d in lane] == [f"l{k}" for k in range(n_serv)] and len(ids) == lanes.inst.D
    assert np.array_equal(lanes.rollout.lane_pool_share, rose.serving.lane_ceiling)  # one definition of a lane's share
    assert all(lanes.router.fleet.role_of(ids[d]) == "dedicated" for d in lane)
    assert all(lanes.rollout.policy_steps(int(d)) is lanes.sized.shape.pperf_s for d in lane)  # a serving instance's TP
    assert (lanes.inst.kvcap[lane] == memory.cohost_free_bytes).all() and memory.cohost_free_bytes < memory.dedicated_kv
    out = lanes.run()
    assert out["complete"] and out["lane_pool_instances"] == n_serv
    assert out["rollout_tokens_on_lane_pool_fraction"] > 0.0 and out["rollout_tokens_on_serving_fraction"] == 0.0


def test_where_serving_has_no_memory_to_lend_the_lane_pool_is_static_itself():
    full = {"serving_pool_tokens": 1e9}  # a serving pool that leaves no memory for a policy copy
    static = simulate(replace(small("static", 4.0), memory=full))
    lanes = simulate(replace(small("static", 4.0), memory=full, lane_pool=True))
    assert lanes["lane_pool_instances"] == 0 and lanes["rl_steps_per_hour"] == static["rl_steps_per_hour"]
    with pytest.raises(ValueError, match="lane pool, not 'rose'"):
        Simulation(replace(small("rose", 4.0), lane_pool=True))


def test_the_grid_reruns_statics_job_on_the_lane_pool_and_divides_rose_by_it():
    configs = grid_configs(models=("7B",), fleets=(8,), demands=(4.0,), ratios=(0.25,), modes=("sync",), policies=("static", "rose"), steps=1, seed=0)
    results = run_grid(configs, jobs=1)
    static, rose = (next(r for r in results if r["policy"] == p) for p in ("static", "rose"))
    ((key, cfg),) = lane_pool_configs(configs, results)
    assert cfg.lane_pool and cfg.policy == "static" and cfg.trajectories == static["trajectories_per_step"] and key == config_key(static)
    lanes = {key: run_grid([cfg], jobs=1)[0]["rl_steps_per_hour"]}
    rows = {r["policy"]: r for r in combine_seeds(rows_of(results, lanes=lanes))}
    assert rows["rose"]["speedup_lane_pool"] == rows["static"]["speedup_lane_pool"] == pytest.approx(lanes[key] / static["rl_steps_per_hour"])
    assert rows["rose"]["speedup_over_lane_pool"] == pytest.approx(rose["rl_steps_per_hour"] / lanes[key])
    assert rows["static"]["speedup_over_lane_pool"] is None
    share = targets_of(list(rows.values()))["sync"]["per_model"]["7B"]
    assert share["median_over_lane_pool"] == pytest.approx(rows["rose"]["speedup_over_lane_pool"])
    without = {r["policy"]: r for r in combine_seeds(rows_of(results))}  # no lane pool ran: the figures stay None, no seed lists
    assert without["rose"]["speedup_lane_pool"] is None and "speedup_lane_pool_by_seed" not in without["rose"]


def test_an_asynchronous_configuration_gets_a_fleet_ceiling_once_its_rate_is_counted_over_enough_steps():
    """Which configurations the fleet ceiling's runs are for: both modes, but an asynchronous one only where its
    rate spans ASYNC_FLEET_CEILING_MIN_INTERVALS step intervals (over fewer it jumps with the pipeline's phase)."""

    def grid(steps: int) -> list[SimConfig]:
        return grid_configs(
            models=("7B",), fleets=(8,), demands=(4.0,), ratios=(0.25,), modes=("sync", "async"), policies=("static", "rose"), steps=steps, seed=0
        )

    def results(configs: list[SimConfig]) -> list[dict]:  # what run_grid returns for them, reduced to what the selection reads
        mode = {False: "sync", True: "async"}
        return [
            dict(
                model="7B",
                gpus=8,
                policy=c.policy,
                rollout_demand=4.0,
                dedicated_ratio=0.25,
                mode=mode[c.prefetch_steps > 0],
                seed=0,
                dedicated_instances=2,
                trajectories_per_step=128,
                rollout_capacity_ceiling_kv=1.9 if c.policy == "rose" else None,
            )
            for c in configs
        ]

    few, enough = grid(ASYNC_FLEET_CEILING_MIN_INTERVALS - 1), grid(ASYNC_FLEET_CEILING_MIN_INTERVALS)
    assert {counted_intervals(c) for c in few} == {ASYNC_FLEET_CEILING_MIN_INTERVALS - 1}  # async's pipeline fill not counted
    assert {key[5] for key, _, _ in grown_pool_configs(few, results(few))} == {"sync"}
    runs = grown_pool_configs(enough, results(enough))
    assert sorted((key[5], k) for key, k, _ in runs) == [("async", 3), ("async", 4), ("sync", 3), ("sync", 4)]  # 2 x 1.9 = 3.8 instances
    assert all(c.policy == "static" and c.n_dedicated == k and c.trajectories == 128 for _, k, c in runs)
    assert all(c.prefetch_steps > 0 for key, _, c in runs if key[5] == "async")  # the grown pool runs the same pipeline


def test_seeds_combine_into_medians_of_paired_ratios():
    """--seeds: each seed's policy is compared with that seed's static run, then the median is taken;
    every seed's ratio stays in the row, SLO-violating seconds add up."""

    def row(policy, seed, rate, violations=0.0):
        return {
            "model": "7B", "gpus": 8, "policy": policy, "rollout_demand": 1.0, "dedicated_ratio": 0.25, "mode": "async", "seed": seed,
            "rl_steps_per_hour": rate, "rollout_s_per_step": 100.0, "slo_violations": violations, "slo_violations_serving_alone": 0.0,
            "serving_slo_attainment": 1.0, "train_s_per_step": 1.0, "rollout_tokens_per_s": 1.0, "complete": True,
            "serving_instances": 1, "serving_tp": 1, "dedicated_instances": 1, "rollout_tp": 1, "trainer_gpus": 1,
        }  # fmt: skip

    results = [row("static", 0, 20.0), row("rose", 0, 18.0), row("static", 1, 10.0), row("rose", 1, 12.0, 3.0)]
    results += [row("static", 2, 30.0), row("rose", 2, 33.0)]
    combined = {r["policy"]: r for r in combine_seeds(rows_of(results))}
    rose = combined["rose"]
    assert rose["seeds"] == [0, 1, 2] and "seed" not in rose
    assert rose["speedup_vs_static_by_seed"] == pytest.approx([0.9, 1.2, 1.1])  # paired within each seed, not medians of rates
    assert rose["speedup_vs_static"] == pytest.approx(1.1)
    assert rose["rl_steps_per_hour"] == pytest.approx(18.0) and rose["slo_violations"] == 3.0
    assert combined["static"]["speedup_vs_static"] == 1.0
    one_seed = combine_seeds(rows_of(results[:2]))
    assert {r["policy"]: r["speedup_vs_static"] for r in one_seed} == {"static": 1.0, "rose": pytest.approx(0.9)}


def test_no_capacity_makes_a_synchronous_rollout_shorter_than_its_slowest_trajectory():
    # 250 s of rollout would shrink to 125 s at twice the capacity, but its slowest trajectory needs 200 s alone
    assert speedup_ceiling(2.0, 400.0, 100.0, 50.0, pipelined=False, rollout_s=300.0, critical_s=200.0) == pytest.approx(400.0 / 300.0)
    # a latency bound under what the capacity allows changes nothing
    assert speedup_ceiling(2.0, 400.0, 100.0, 50.0, pipelined=False, rollout_s=300.0, critical_s=100.0) == pytest.approx(400.0 / 275.0)
    sim = Simulation(small("static", 1.0))
    batch = sample_batch(sim.cfg.rollout, 16, np.random.default_rng(0), 1)
    paths = sim.trainer.critical_paths(batch)
    tools = [float(batch.tool_s[i, : int(batch.turns[i]) - 1].sum()) for i in range(batch.n)]
    assert all(p > t for p, t in zip(paths, tools))  # every turn takes time beside its tools


def test_the_grid_gives_the_serving_model_and_the_policy_their_own_sizes():
    from rose.bench.sim import model_pairs

    assert model_pairs(("7B", "70B")) == [("7B", "7B"), ("70B", "70B")]  # --models: each as both
    assert model_pairs(("7B",), serving_models=("70B",), policy_models=("7B", "14B")) == [("70B", "7B"), ("70B", "14B")]
    configs = grid_configs(
        models=("7B",), serving_models=("70B",), fleets=(32,), demands=(2.0,), ratios=(0.125,), modes=("sync",), policies=("rose",), steps=1
    )
    (cfg,) = configs
    assert (cfg.model, cfg.policy_model, cfg.rollout_gpu_ratio, cfg.over_provision) == ("70B", "7B", 0.125, 0.0)
    sim = Simulation(cfg)  # a serving instance holds the 70B serving model and a 7B policy copy (156 GB: TP4), the pool is sized for the 7B
    shape = sim.sized.shape
    assert (shape.tp_s, shape.tp_r, shape.n_ded) == (4, 1, 4)
