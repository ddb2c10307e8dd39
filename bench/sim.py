"""``rose bench sim``: the paper-style table from the fleet simulator, with calibration.

Models {7B, 14B, 32B, 70B} x serving fleets {8, 16, 32, 64 GPUs} x rollout demand {1, 2, 4}
(trajectories per step as a multiple of what the dedicated pool runs at once) x dedicated-pool
ratio {0.25, 0.5} (dedicated rollout GPUs per serving GPU) x mode {sync, async} (async:
``prefetch_steps`` 1 under ``max_staleness`` 2, as the reference trainer runs it) x policies
{static, naive_share, elastic_baseline, rose}, each configuration simulated with the same seed,
trace and RL job (the same batches) for every policy (engine.py). Ratios are against the same
configuration: speedup = RL steps/hour over static's; rollout time ratio = elastic_baseline's
rollout seconds per step over the policy's (> 1: faster than the elastic baseline).
Two ceilings sit beside rose's speedup (sim/ceiling.py): ``speedup_ceiling_kv``, Amdahl's over the
fleet's rollout capacity, and ``speedup_ceiling_fleet``, static's own job simulated on its dedicated pool
grown by that capacity (extra static runs, ``--no-fleet-ceiling`` skips them; asynchronous rows get it
from ``ASYNC_FLEET_CEILING_MIN_INTERVALS`` steps counted, ``--steps``); ``targets``
reports the share of each gain rose took per model size.
``slo_violations`` counts serving instance-seconds whose p99 TTFT or TPOT passed the SLO
(``..._serving_alone``: the same trace on the same fleet without rollout). ``targets`` checks
the issue's bars (rose >= static everywhere; demand >= 2: median >= 1.3x, best >= 2x; rollout
time >= 1.2x better than elastic_baseline's in the median; no SLO-violating second for rose).

``--rollout-modes two_model co_batched`` runs every configuration in both rollout modes on the same seeds: a policy
copy on a lane of its own, and the policy a LoRA adapter of the serving model whose sequences ride serving's own
iterations (sim/co_batched.py); every row says which (``rollout_mode``), a co-batched rose row reads its steps/h over
two-model rose's (``speedup_over_two_model``), and ``targets.co_batched`` judges issue 65's bars (bench/sim_co_batched.py).

``--seeds A B C`` runs every configuration at each seed (its own trace, batches and routing) and
reports per configuration the median over seeds of the paired per-seed ratios (each seed's policy
against that seed's static run), with every seed's ratio beside it: at 5 steps one seed's ratio
moves by +-15 % (7B/8, async, demand 1x: rose 0.92-1.21x static over seeds 0-4), so a single
seed cannot tell a regression from the draw.

A note is written (and printed) for every configuration where rose's simulated gain falls
outside the paper's 1.3-3.3x, with the simulator's own evidence for why.
"""

from __future__ import annotations

import collections
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path

from rose.bench.sim_calibration import fresh_coserve, run_calibration, within_tolerance
from rose.bench.sim_co_batched import co_batched_targets
from rose.bench.sim_report import PAPER_RANGE, TWO_MODEL, plot, print_report
from rose.shared.workload import RolloutSpec
from rose.sim import MODEL_SIZES, POLICIES
from rose.sim.ceiling import fleet_ceiling, grown_pools, share_of_gain, speedup_ceiling_over
from rose.sim.engine import Infeasible, SimConfig, simulate

MODELS = MODEL_SIZES  # the default grid: every size
FLEETS = (8, 16, 32, 64)
DEMANDS = (1.0, 2.0, 4.0)
RATIOS = (0.125, 0.25, 0.5)
MODES = ("sync", "async")
QUICK_MODELS = ("7B",)
QUICK_FLEETS = (8,)
QUICK_DEMANDS = (1.0, 4.0)
QUICK_RATIOS = (0.25,)
ASYNC_PREFETCH = 1  # async mode: the reference trainer's grpo.prefetch_steps (its max_staleness stays 2)
# An asynchronous rate over 2 intervals jumps with the pipeline's phase (14B/16, demand 2, static on 6 -> 7
# instances: 28 -> 41 steps/h at 5 % more tokens/s), so two bracketing pools do not interpolate; over 5 the
# bracketing runs moved by at most 5 % against the pool's trend (7B/8, 5 seeds: docs/benchmarks.md, 2026-12-05).
ASYNC_FLEET_CEILING_MIN_INTERVALS = 5
DEFAULT_E2E = "bench-out/e2e.json"  # where `rose bench e2e` writes by default


def policy_label(cfg: SimConfig) -> str:
    return cfg.policy + "".join(f"+{w}" for w in sorted(cfg.what_if))


def _run(cfg: SimConfig) -> dict:
    try:
        out = simulate(cfg)
    except Infeasible as exc:
        out = {"model": cfg.model, "policy_model": cfg.policy_model or cfg.model, "gpus": cfg.gpus, "policy": cfg.policy, "infeasible": str(exc)}
    out["policy"] = policy_label(cfg)
    return out


def _cost(cfg: SimConfig) -> float:
    """Rough relative cost, to start the slow configurations first."""
    return (
        cfg.gpus
        * {"7B": 4.0, "14B": 2.0, "32B": 1.0, "70B": 0.6}.get(cfg.policy_model or cfg.model, 1.0)
        * (1.0 + cfg.rollout.oversubscription)
        * (1.5 if cfg.prefetch_steps else 1.0)
    )


def mode_of(cfg: SimConfig) -> str:
    return "async" if cfg.prefetch_steps > 0 else "sync"


def _axes(cfg: SimConfig, out: dict) -> dict:
    """The grid's axes on a result (rows keep their fields and add these)."""
    out.update(
        serving_model=cfg.model,
        policy_model=cfg.policy_model or cfg.model,
        rollout_demand=cfg.rollout.oversubscription,
        dedicated_ratio=cfg.rollout_gpu_ratio,
        mode=mode_of(cfg),
        over_provision=cfg.over_provision,
        rollout_mode=cfg.rollout_mode,
        seed=cfg.seed,
    )
    return out


def config_key(r: dict) -> tuple:
    """One configuration of the grid: every policy of it is compared against its static and elastic runs (of the same seed)."""
    return (
        r["model"],
        r.get("policy_model", r["model"]),
        r["gpus"],
        r.get("rollout_demand"),
        r.get("dedicated_ratio"),
        r.get("mode"),
        r.get("over_provision", 0.0),
        r.get("rollout_mode", TWO_MODEL),
        r.get("seed"),
    )


def two_model_key(key: tuple) -> tuple:
    """The same configuration (``config_key``) in two-model mode: a co-batched row's comparison."""
    return (*key[:-2], TWO_MODEL, key[-1])


def run_grid(configs: list[SimConfig], jobs: int, progress=None) -> list[dict]:
    """Every configuration, slow ones first; ``progress(result)`` after each."""
    order = sorted(range(len(configs)), key=lambda i: -_cost(configs[i]))
    results: list[dict | None] = [None] * len(configs)
    if jobs <= 1:
        for i in order:
            results[i] = _axes(configs[i], _run(configs[i]))
            if progress:
                progress(results[i])
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(_run, configs[i]): i for i in order}
            for f in as_completed(futures):
                i = futures[f]
                results[i] = _axes(configs[i], f.result())
                if progress:
                    progress(results[i])
    return [r for r in results if r is not None]


def counted_intervals(cfg: SimConfig) -> int:
    """The step intervals a configuration's rate is counted over (``grid_configs``: async runs the pipeline's
    fill first, and ``steady_step_rate`` starts after it)."""
    return cfg.steps - (1 + cfg.prefetch_steps if cfg.prefetch_steps > 0 else 0)


def static_runs_to_compare(configs: list[SimConfig], results: list[dict]) -> list[tuple[SimConfig, dict, dict]]:
    """(config, static's result, rose's) for each configuration whose static job the fleet ceiling and the lane
    pool rerun on another pool. Asynchronous configurations only where their rate is counted over
    ``ASYNC_FLEET_CEILING_MIN_INTERVALS`` intervals or more: over fewer its phase jumps with the pool."""
    by = {(*config_key(r), r["policy"]): r for r in results}
    out = []
    for cfg, r in zip(configs, results):
        if r["policy"] != "static" or "infeasible" in r:
            continue
        if mode_of(cfg) == "async" and counted_intervals(cfg) < ASYNC_FLEET_CEILING_MIN_INTERVALS:
            continue
        rose = by.get((*config_key(r), "rose"))
        if rose is not None and "infeasible" not in rose:
            out.append((cfg, r, rose))
    return out


def grown_pool_configs(configs: list[SimConfig], results: list[dict]) -> list[tuple[tuple, int, SimConfig]]:
    """The fleet ceiling's runs (sim/ceiling.py): static's job (its batch) on its dedicated pool grown to each of
    ``grown_pools``' sizes: (config key, pool size, config)."""
    return [
        (config_key(static), k, replace(cfg, n_dedicated=k, trajectories=static["trajectories_per_step"]))
        for cfg, static, rose in static_runs_to_compare(configs, results)
        for k in grown_pools(static["dedicated_instances"], rose.get("rollout_capacity_ceiling_kv"))
    ]


def lane_pool_configs(configs: list[SimConfig], results: list[dict]) -> list[tuple[tuple, SimConfig]]:
    """The lane pool's runs (sim/ceiling.py): static's job (its batch) with every serving instance's lane in its
    pool: (config key, config). Two-model lanes only: a co-batched row compares with its configuration's two-model
    lane pool (``rows_of``)."""
    return [
        (config_key(static), replace(cfg, lane_pool=True, trajectories=static["trajectories_per_step"]))
        for cfg, static, _ in static_runs_to_compare(configs, results)
        if cfg.rollout_mode == TWO_MODEL
    ]


LANE_POOL_FIGURES = ("speedup_lane_pool", "speedup_over_lane_pool")  # a row's figures from the lane pool's run (``--lane-pool``)
# figures a row has only with some runs beside it (the lane pool's; co-batched rose's two-model twin): None otherwise
PAIRED_FIGURES = (*LANE_POOL_FIGURES, "speedup_over_two_model")


def rows_of(results: list[dict], grown: dict[tuple, dict[int, float]] | None = None, lanes: dict[tuple, float] | None = None) -> list[dict]:
    """One row per result, its ratios against its configuration's static and elastic runs; ``grown``
    (config key -> dedicated pool size -> static's steps/h there) adds the fleet ceiling, ``lanes`` (config
    key -> static's steps/h on the lane pool) the lane pool's speedup."""
    grown, lanes = grown or {}, lanes or {}
    by = {(*config_key(r), r["policy"]): r for r in results}
    rows = []
    for r in results:
        key = config_key(r)
        static, elastic = by.get((*key, "static")), by.get((*key, "elastic_baseline"))
        row = {
            "model": r["model"],
            "serving_model": r.get("serving_model", r["model"]),
            "policy_model": r.get("policy_model", r["model"]),
            "gpus": r["gpus"],
            "policy": r["policy"],
            "rollout_demand": r.get("rollout_demand"),
            "dedicated_ratio": r.get("dedicated_ratio"),
            "mode": r.get("mode"),
            "over_provision": r.get("over_provision", 0.0),
            "rollout_mode": r.get("rollout_mode", TWO_MODEL),
            "seed": r.get("seed"),
        }
        if "infeasible" in r:
            row.update(
                infeasible=r["infeasible"], rl_steps_per_hour=None, speedup_vs_static=None, rollout_time_ratio_vs_elastic=None, slo_violations=None
            )
            rows.append(row)
            continue
        static_rate = static["rl_steps_per_hour"] if static is not None and "infeasible" not in static else 0.0
        capacity, capacity_kv = r.get("rollout_capacity_ceiling"), r.get("rollout_capacity_ceiling_kv")
        elastic_rollout_s = elastic["rollout_s_per_step"] if elastic is not None and "infeasible" not in elastic else 0.0
        # a co-batched row beside its configuration's two-model one: rose there, and the two-model lane pool
        twin = by.get((*two_model_key(key), r["policy"])) if row["rollout_mode"] != TWO_MODEL else None
        lane_key = two_model_key(key)
        row.update(
            rl_steps_per_hour=r["rl_steps_per_hour"],
            speedup_vs_static=r["rl_steps_per_hour"] / static_rate if static_rate > 0 else None,
            rollout_time_ratio_vs_elastic=elastic_rollout_s / r["rollout_s_per_step"]
            if elastic_rollout_s > 0 and r["rollout_s_per_step"] > 0
            else None,
            slo_violations=r["slo_violations"],
            rollout_capacity_ceiling=capacity,
            rollout_capacity_ceiling_kv=capacity_kv,
            speedup_ceiling=speedup_ceiling_over(static, capacity, r.get("mode") == "async") if static is not None else None,
            speedup_ceiling_kv=speedup_ceiling_over(static, capacity_kv, r.get("mode") == "async") if static is not None else None,
            speedup_ceiling_fleet=fleet_ceiling(static_rate, static["dedicated_instances"], capacity_kv, grown[key])
            if static is not None and key in grown
            else None,
            speedup_lane_pool=lanes[key] / static_rate if key in lanes and static_rate > 0 else None,
            # rose's steps/h over the lane pool's, paired within the seed (None for the other policies)
            speedup_over_lane_pool=r["rl_steps_per_hour"] / lanes[lane_key] if r["policy"] == "rose" and lanes.get(lane_key) else None,
            # co-batched rose's steps/h over two-model rose's, paired within the seed (None elsewhere)
            speedup_over_two_model=r["rl_steps_per_hour"] / twin["rl_steps_per_hour"]
            if r["policy"] == "rose" and twin is not None and twin.get("rl_steps_per_hour")
            else None,
            slo_violations_serving_alone=r["slo_violations_serving_alone"],
            serving_slo_attainment=r["serving_slo_attainment"],
            rollout_s_per_step=r["rollout_s_per_step"],
            train_s_per_step=r["train_s_per_step"],
            rollout_tokens_per_s=r["rollout_tokens_per_s"],
            complete=r["complete"],
            detail={
                k: r[k]
                for k in (
                    "serving_instances",
                    "serving_tp",
                    "dedicated_instances",
                    "rollout_tp",
                    "trainer_gpus",
                    "trajectories_per_step",
                    "bundle",
                    "cohost_free_gb",
                    "lent_instance_fraction",
                    "rollout_tokens_on_serving_fraction",
                    "lane_share_ceiling",
                    "lane_value",
                    "tail_fraction",
                    "leases",
                    "alerts",
                    "interrupted_turns",
                    "parked_leases",
                    "aborted_turns",
                    "hedges",
                    "hedge_wins",
                    "prefix_hit_rate",
                    "prefix_reuse",
                    "prefix_host_share",
                    "reprefill_share",
                    "reprefill_moved_share",
                    "unlendable_reasons",
                    "sync_serving_s",
                    "serving_capacity_rps_per_instance",
                    "simulated_s",
                    "staleness_mean",
                    "staleness_max",
                    "stale_groups_dropped",
                    "length_bias",
                    "tail_s_per_step",
                    "early_hand_outs",
                    "trainer_wait_s_per_step",
                    "placement_rules",
                )
                if k in r
            },
        )
        rows.append(row)
    return rows


def combine_seeds(rows: list[dict]) -> list[dict]:
    """One row per configuration and policy over its seeds: the ratios and RL steps/h are the medians over
    seeds (each ratio paired within its seed), SLO-violating seconds the sum; ``seeds`` and the
    ``*_by_seed`` lists keep every seed's figure; ``detail`` is the median seed's."""
    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    for row in rows:
        groups[(*config_key(row)[:-1], row["policy"])].append(row)
    out = []
    for group in groups.values():
        group = sorted(group, key=lambda r: r.get("seed") or 0)
        ok = [r for r in group if not r.get("infeasible")]
        ranked = sorted(ok, key=lambda r: r["speedup_vs_static"] if r["speedup_vs_static"] is not None else 0.0)
        median_seed = ranked[len(ranked) // 2] if ok else group[0]
        base = {k: v for k, v in median_seed.items() if k != "seed"}  # the median seed's figures and detail ...
        base["seeds"] = [r.get("seed") for r in group]
        if ok:
            for key in ("speedup_vs_static", "rollout_time_ratio_vs_elastic", *PAIRED_FIGURES):
                values = [r[key] for r in ok]
                if key in PAIRED_FIGURES and all(v is None for v in values):
                    continue  # no run beside it (``--lane-pool``, ``--rollout-modes``): the row keeps its None
                base[f"{key}_by_seed"] = values
                known = [v for v in values if v is not None]
                base[key] = _median(known) if known else None  # ... and the medians over seeds
            base["rl_steps_per_hour"] = _median([r["rl_steps_per_hour"] for r in ok])
            base["slo_violations"] = sum(r["slo_violations"] or 0.0 for r in ok)
            base["complete"] = all(r["complete"] for r in ok)
        out.append(base)
    return out


def notes_of(rows: list[dict]) -> list[str]:
    """Where rose's simulated gain leaves the paper's range, and the simulator's evidence why."""
    lo, hi = PAPER_RANGE
    notes = []
    for row in rows:
        if row["policy"] != "rose":
            continue
        where = f"{row['model']} on {row['gpus']} GPUs ({_axes_label(row)})"
        if row.get("infeasible"):
            notes.append(f"{where}: not simulated: {row['infeasible']}")
            continue
        s = row["speedup_vs_static"]
        if s is None or lo <= s <= hi:
            continue
        d = row["detail"]
        why = []
        if d["lent_instance_fraction"] < 0.05:
            reasons = ", ".join(d.get("unlendable_reasons", {})) or "no lease granted"
            why.append(
                f"serving instances held a lease {d['lent_instance_fraction']:.0%} of the time (the monitor's verdict: {reasons}; "
                f"a lease needs p99 latency under its grant fraction of the SLO)"
            )
        elif row.get("rollout_mode", TWO_MODEL) != TWO_MODEL:
            why.append(
                f"serving instances held leases {d['lent_instance_fraction']:.0%} of the time and produced "
                f"{d['rollout_tokens_on_serving_fraction']:.0%} of the rollout tokens as rows of serving's decode iterations "
                f"(as many as the guard's threshold and the rollout pool of {d['cohost_free_gb']:.0f} GB left after the serving "
                "model, its pool and the adapter hold; none in iterations that carry serving's prefill)"
            )
        else:
            why.append(
                f"serving instances held leases {d['lent_instance_fraction']:.0%} of the time but produced only "
                f"{d['rollout_tokens_on_serving_fraction']:.0%} of the rollout tokens: a busy serving instance gives its rollout lane "
                f"(1 - prefill share) x quantum / (iteration + quantum) of its time, and a lease holds at most the rollout pool of "
                f"{d['cohost_free_gb']:.0f} GB left after both models and the serving pool"
            )
        if row.get("speedup_ceiling") is not None:
            why.append(
                f"the fleet's rollout capacity (the dedicated pool plus every lane at full quanta, "
                f"{d['lane_share_ceiling']:.0%} of a serving GPU) allows at most {row['speedup_ceiling']:.2f}x, "
                f"with leases making at most {1.0 - 1.0 / row['rollout_capacity_ceiling']:.0%} of the tokens"
                + (
                    f"; priced at the lent KV's batch (a lane GPU-second worth {d['lane_value']:.2f} of a dedicated one) "
                    f"{row['speedup_ceiling_kv']:.2f}x"
                    if row.get("speedup_ceiling_kv") is not None
                    else ""
                )
            )
        if d["tail_fraction"] > 0.25:
            why.append(
                f"{d['tail_fraction']:.0%} of the rollout phase is the tail after 90 % of trajectories finished, which more capacity does not shorten"
            )
        if d["interrupted_turns"]:
            why.append(
                f"{d['leases']['revoked']} lease revocations (burst alerts) interrupted {d['interrupted_turns']} turns, "
                "resumed elsewhere by recompute; "
                "turn affinity then keeps those trajectories where they resumed"
            )
        notes.append(f"{where}: rose {s:.2f}x static, {'below' if s < lo else 'above'} the paper's {lo}-{hi}x: " + "; ".join(why))
    return notes


def _axes_label(row: dict) -> str:
    if row.get("rollout_demand") is None:
        return ""
    co_batched = row.get("rollout_mode", TWO_MODEL) != TWO_MODEL
    return f"demand {row['rollout_demand']:g}x, dedicated {row['dedicated_ratio']:g}, {row['mode']}" + (", co-batched" if co_batched else "")


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else 0.5 * (xs[mid - 1] + xs[mid])


def priced_shares(rose_rows: list[dict]) -> dict:
    """Per (serving, policy) model pair, over rose's rows with demand >= 2: the median and least share of the priced gain."""
    out: dict = {}
    for r in rose_rows:
        if (r.get("rollout_demand") or 0) < 2:
            continue
        label = r["model"] if r.get("policy_model", r["model"]) == r["model"] else f"{r['model']} serving / {r['policy_model']} policy"
        label += f", over-provision {r['over_provision']:g}" if r.get("over_provision") else ""
        entry = out.setdefault(label, dict(rows=0, shares=[], fleet_shares=[], over_lanes=[], speedups=[], reprefill=[], no_gain_to_take=0))
        entry["rows"] += 1
        entry["speedups"].append(r["speedup_vs_static"])
        entry["reprefill"].append(r.get("detail", {}).get("reprefill_share", 0.0))
        share = share_of_gain(r["speedup_vs_static"], r.get("speedup_ceiling_kv"))
        if share is None:
            entry["no_gain_to_take"] += 1
        else:
            entry["shares"].append(share)
        fleet = share_of_gain(r["speedup_vs_static"], r.get("speedup_ceiling_fleet"))
        if fleet is not None:
            entry["fleet_shares"].append(fleet)
        if r.get("speedup_over_lane_pool") is not None:
            entry["over_lanes"].append(r["speedup_over_lane_pool"])
    for entry in out.values():
        shares, fleet = entry.pop("shares"), entry.pop("fleet_shares")
        entry["median_share"] = _median(shares)
        entry["min_share"] = min(shares) if shares else None
        entry["median_fleet_share"] = _median(fleet)  # of the fleet ceiling's gain (sim/ceiling.py)
        entry["min_fleet_share"] = min(fleet) if fleet else None
        over_lanes = entry.pop("over_lanes")  # rose's steps/h over the lane pool's (sim/ceiling.py)
        entry["median_over_lane_pool"] = _median(over_lanes)
        entry["min_over_lane_pool"] = min(over_lanes) if over_lanes else None
        entry["median_speedup"] = _median(entry.pop("speedups"))
        # the prefill that prefix-cache misses redid, as a share of rollout's device time (sim/counters.py)
        entry["max_reprefill_share"] = max(entry.pop("reprefill"), default=None)
    return out


def targets_of(rows: list[dict]) -> dict:
    """The issue's bars over rose's two-model rows, per mode and overall, with the figures they are judged on, and the
    co-batched mode's (bench/sim_co_batched.py) under ``co_batched`` where the grid ran it."""
    out: dict = {}
    rose = [r for r in rows if r["policy"] == "rose" and r.get("speedup_vs_static") is not None and r.get("rollout_mode", TWO_MODEL) == TWO_MODEL]
    for mode in ("sync", "async", "all"):
        rs = [r for r in rose if mode == "all" or r.get("mode") == mode]
        if not rs:
            continue
        demanding = [r["speedup_vs_static"] for r in rs if (r.get("rollout_demand") or 0) >= 2]
        ceilings = [r for r in rs if (r.get("rollout_demand") or 0) >= 2 and r.get("speedup_ceiling") is not None]
        rollout = [r["rollout_time_ratio_vs_elastic"] for r in rs if r.get("rollout_time_ratio_vs_elastic") is not None]
        worst = min(rs, key=lambda r: r["speedup_vs_static"])
        fig = dict(
            configurations=len(rs),
            min_speedup=worst["speedup_vs_static"],
            min_at=f"{worst['model']}/{worst['gpus']} {_axes_label(worst)}",
            median_speedup_demand_ge_2=_median(demanding),
            best_speedup_demand_ge_2=max(demanding) if demanding else None,
            # what the fleet's rollout capacity allows (speedup_ceiling), and the share of that gain rose took
            best_speedup_ceiling_demand_ge_2=max(r["speedup_ceiling"] for r in ceilings) if ceilings else None,
            best_speedup_ceiling_kv_demand_ge_2=max((r["speedup_ceiling_kv"] for r in ceilings if r.get("speedup_ceiling_kv")), default=None),
            median_gain_of_ceiling_demand_ge_2=_median(
                [(r["speedup_vs_static"] - 1.0) / (r["speedup_ceiling"] - 1.0) for r in ceilings if r["speedup_ceiling"] > 1.0]
            ),
            median_rollout_time_ratio_vs_elastic=_median(rollout),
            rose_slo_violation_instance_s=sum(r["slo_violations"] or 0.0 for r in rs),
            per_model=priced_shares(rs),
            small_pool_at_high_ceiling=[
                dict(at=f"{r['model']}/{r['gpus']} {_axes_label(r)}", rose=r["speedup_vs_static"], ceiling_kv=r["speedup_ceiling_kv"])
                for r in rs
                if r.get("dedicated_ratio") == 0.125 and (r.get("speedup_ceiling_kv") or 0.0) >= 2.4
            ],
        )
        fig["meets"] = dict(
            never_below_static=fig["min_speedup"] >= 1.0 - 1e-9,
            median_demand_ge_2_at_least_1_3=fig["median_speedup_demand_ge_2"] is not None and fig["median_speedup_demand_ge_2"] >= 1.3,
            best_demand_ge_2_at_least_2=fig["best_speedup_demand_ge_2"] is not None and fig["best_speedup_demand_ge_2"] >= 2.0,
            rollout_vs_elastic_at_least_1_2=fig["median_rollout_time_ratio_vs_elastic"] is not None
            and fig["median_rollout_time_ratio_vs_elastic"] >= 1.2,
            zero_slo_violations=fig["rose_slo_violation_instance_s"] == 0,
            priced_share_median_at_least_0_7=all((e["median_share"] or 0.0) >= 0.7 for e in fig["per_model"].values()),
            priced_share_never_below_0_4=all((e["min_share"] if e["min_share"] is not None else 1.0) >= 0.4 for e in fig["per_model"].values()),
            fleet_share_median_at_least_0_7=all((e["median_fleet_share"] or 0.0) >= 0.7 for e in fig["per_model"].values()),
            fleet_share_never_below_0_4=all(
                (e["min_fleet_share"] if e["min_fleet_share"] is not None else 1.0) >= 0.4 for e in fig["per_model"].values()
            ),
            small_pool_at_least_2_where_ceiling_2_4=all(x["rose"] >= 2.0 for x in fig["small_pool_at_high_ceiling"]),
        )
        out[mode] = fig
    co_batched = co_batched_targets(rows)
    if co_batched is not None:
        out["co_batched"] = co_batched
    return out


def model_pairs(models, serving_models=(), policy_models=()) -> list[tuple[str, str]]:
    """(serving model, policy) sizes: every serving model with every policy when either list is given
    (the other defaults to ``models``), else each of ``models`` as both."""
    if serving_models or policy_models:
        return [(s, p) for s in (serving_models or models) for p in (policy_models or models)]
    return [(m, m) for m in models]


def grid_configs(
    *,
    models,
    fleets,
    demands,
    ratios,
    modes,
    policies,
    steps: int,
    serving_models=(),
    policy_models=(),
    over_provision=(0.0,),
    rollout_modes=(TWO_MODEL,),
    **common,
) -> list[SimConfig]:
    """The grid's configurations, each in every rollout mode (sim.ROLLOUT_MODES); async runs 1 + ASYNC_PREFETCH steps
    more: its rate is measured between training steps, from the one that trained the last batch handed out with the
    first (shared/workload.py ``steady_step_rate``), so that ``steps`` intervals count in both modes."""
    out = []
    for m, pm in model_pairs(models, serving_models, policy_models):
        for g, op in [(g, op) for g in fleets for op in over_provision]:
            for d, q, mode, rollout_mode in [(d, q, mode, rm) for d in demands for q in ratios for mode in modes for rm in rollout_modes]:
                for p in policies:
                    out.append(
                        SimConfig(
                            model=m,
                            policy_model=pm,
                            over_provision=op,
                            gpus=g,
                            policy=p,
                            rollout=replace(RolloutSpec(), oversubscription=d),
                            rollout_gpu_ratio=q,
                            prefetch_steps=ASYNC_PREFETCH if mode == "async" else 0,
                            steps=steps + (1 + ASYNC_PREFETCH if mode == "async" else 0),
                            rollout_mode=rollout_mode,
                            **common,
                        )
                    )
    return out


def _config_line(key: tuple, done: dict[str, dict], many_seeds: bool) -> str:
    """One configuration's console line once its policies are all in: rose against static and elastic, the ceilings."""
    rose, static, elastic = done.get("rose"), done.get("static"), done.get("elastic_baseline")
    serving, policy, gpus, demand, ratio, mode, over, rollout_mode, seed = key
    models = serving if policy == serving else f"{serving} serving, {policy} policy,"
    label = (
        f"{models:>4} {gpus:>3} GPUs, demand {demand:g}x, dedicated {ratio:g}, {mode:<5}"
        + (f", over-provision {over:g}" if over else "")
        + (f", {rollout_mode.replace('_', '-')}" if rollout_mode != TWO_MODEL else "")
        + (f", seed {seed}" if many_seeds else "")
    )
    if rose is None or "infeasible" in rose or static is None or "infeasible" in static:
        return f"{label}: infeasible" if rose is not None and "infeasible" in rose else f"{label}: done"
    sp = rose["rl_steps_per_hour"] / static["rl_steps_per_hour"] if static["rl_steps_per_hour"] > 0 else float("nan")
    el = (
        f", rollout {elastic['rollout_s_per_step'] / rose['rollout_s_per_step']:.2f}x faster than elastic"
        if elastic and "infeasible" not in elastic
        else ""
    )
    capacity = rose.get("rollout_capacity_ceiling")
    most = speedup_ceiling_over(static, capacity, mode == "async")
    priced = speedup_ceiling_over(static, rose.get("rollout_capacity_ceiling_kv"), mode == "async")
    ceiling = f" (ceiling {most:.2f}x; {priced:.2f}x at the lent KV's batch)" if most is not None and priced is not None else ""
    on_leases = f" of at most {1.0 - 1.0 / capacity:.0%}" if capacity is not None else ""
    return (
        f"{label}: rose {sp:.2f}x static{ceiling}{el}, {rose['rollout_tokens_on_serving_fraction']:.0%}{on_leases} of rollout tokens on leases, "
        f"{rose['slo_violations']:.0f} SLO-violating s"
    )


@dataclass(frozen=True, kw_only=True)
class SimOptions:
    """What a `rose bench sim` grid covers (cli/bench.py says each). An axis left None takes the full grid's values
    (``quick``: the small grid's, ``QUICK_*``); ``oversubscription`` is one ``demands`` value (old scripts' word).
    ``seeds``: every configuration at each (default: ``seed`` alone). ``e2e`` / ``coserve``: real runs to calibrate
    against (``calibrate``: a short `rose bench coserve` now); ``fleet_ceilings`` and ``lane_pool``: the static runs
    beside the grid (sim/ceiling.py)."""

    seed: int = 0
    seeds: tuple[int, ...] = ()
    quick: bool = False
    models: tuple[str, ...] | None = None
    serving_models: tuple[str, ...] = ()
    policy_models: tuple[str, ...] = ()
    over_provision: tuple[float, ...] = (0.0,)
    host_kv_ratio: float | None = None
    fleets: tuple[int, ...] | None = None
    demands: tuple[float, ...] | None = None
    oversubscription: float | None = None
    ratios: tuple[float, ...] | None = None
    modes: tuple[str, ...] = MODES
    policies: tuple[str, ...] = POLICIES
    steps: int | None = None
    jobs: int | None = None
    device: str = "H100"
    load: float = 0.35
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 100.0
    quantum_ms: float = 10.0
    what_if: tuple[str, ...] = ()
    e2e: str | None = None
    coserve: str | None = None
    calibrate: bool = False
    measure_steps: bool = True
    fleet_ceilings: bool = True
    lane_pool: bool = False
    rollout_modes: tuple[str, ...] = (TWO_MODEL,)

    @property
    def grid_models(self) -> tuple[str, ...]:
        return self.models or (QUICK_MODELS if self.quick else MODELS)

    @property
    def grid_fleets(self) -> tuple[int, ...]:
        return self.fleets or (QUICK_FLEETS if self.quick else FLEETS)

    @property
    def grid_demands(self) -> tuple[float, ...]:
        return self.demands or ((self.oversubscription,) if self.oversubscription else (QUICK_DEMANDS if self.quick else DEMANDS))

    @property
    def grid_ratios(self) -> tuple[float, ...]:
        return self.ratios or (QUICK_RATIOS if self.quick else RATIOS)

    @property
    def grid_steps(self) -> int:
        return self.steps or (1 if self.quick else 2)

    @property
    def grid_seeds(self) -> tuple[int, ...]:
        return self.seeds or (self.seed,)

    @property
    def workers(self) -> int:
        """Worker processes (default: 2, at most the cores)."""
        return self.jobs if self.jobs is not None else min(2, os.cpu_count() or 1)


def sim_configs(options: SimOptions) -> list[SimConfig]:
    """Every configuration of the grid at every seed, and rose again with the what-if inputs (engine.SimConfig.what_if)
    as extra rows."""
    host = {} if options.host_kv_ratio is None else {"host_kv_ratio": options.host_kv_ratio}  # default: SimConfig's, the executor's
    configs = [
        c
        for s in options.grid_seeds
        for c in grid_configs(
            models=options.grid_models,
            serving_models=options.serving_models,
            policy_models=options.policy_models,
            over_provision=options.over_provision,
            fleets=options.grid_fleets,
            demands=options.grid_demands,
            ratios=options.grid_ratios,
            modes=options.modes,
            policies=options.policies,
            steps=options.grid_steps,
            device=options.device,
            seed=s,
            load=options.load,
            slo_ttft_ms=options.slo_ttft_ms,
            slo_tpot_ms=options.slo_tpot_ms,
            quantum_ms=options.quantum_ms,
            rollout_modes=options.rollout_modes,
            **host,
        )
    ]
    if options.what_if:
        configs += [replace(c, what_if=frozenset(options.what_if)) for c in configs if c.policy == "rose"]
    return configs


def run_sim_bench(options: SimOptions, out_json: str, console=None) -> dict:
    """`rose bench sim`: the grid simulated (and the static runs beside it), calibrated against real runs, reported (the
    JSON at ``out_json``, its plot beside it; printed when there is a ``console``)."""
    started = time.perf_counter()
    configs = sim_configs(options)
    results, grown, lanes = simulate_grid(options, configs, console)
    grid_s = time.perf_counter() - started
    e2e, coserve = options.e2e, options.coserve
    if not (e2e or coserve) and Path(DEFAULT_E2E).exists():
        e2e = DEFAULT_E2E  # the last real `rose bench e2e` run
    if options.calibrate and not (e2e or coserve):
        coserve = fresh_coserve(out_json, options.seed, console)
    cal = run_calibration(e2e=e2e, coserve=coserve, measure=options.measure_steps and bool(coserve), seed=options.seed, console=console)
    rows = combine_seeds(rows_of(results, grown, lanes))
    report = sim_report(options, configs, rows, cal, grid_s)
    out = Path(out_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=float))
    plot(out.with_suffix(".png"), rows)

    if console is not None:
        print_report(console, report, out)
    return report


def simulate_grid(options: SimOptions, configs: list[SimConfig], console) -> tuple[list[dict], dict[tuple, dict[int, float]], dict[tuple, float]]:
    """The grid's results, then the fleet ceiling's (config key -> grown pool size -> static's steps/h) and the lane
    pool's (config key -> static's steps/h) runs; a line per configuration as its policies are all in."""
    from rich.progress import Progress

    jobs, many_seeds = options.workers, len(options.grid_seeds) > 1
    per_config: collections.defaultdict[tuple, dict[str, dict]] = collections.defaultdict(dict)  # config_key -> policy -> result
    wanted = len(set(options.policies))

    def progress_line(result: dict) -> None:
        """As each configuration's policies are all in: one line with rose's figures against static and elastic."""
        key = config_key(result)
        per_config[key][result["policy"]] = result
        if console is not None and len(per_config[key]) >= wanted:
            console.print(_config_line(key, per_config[key], many_seeds=many_seeds))

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"simulating {len(configs)} runs ({jobs} processes)", total=len(configs))

        def advance(result: dict) -> None:
            progress.advance(task)
            progress_line(result)

        results = run_grid(configs, jobs, advance)
        grown_runs = grown_pool_configs(configs, results) if options.fleet_ceilings else []
        grown: dict[tuple, dict[int, float]] = collections.defaultdict(dict)
        if grown_runs:
            task = progress.add_task(f"the fleet ceiling: static on grown pools, {len(grown_runs)} runs", total=len(grown_runs))
            for (key, k, _), r in zip(grown_runs, run_grid([c for _, _, c in grown_runs], jobs, lambda _: progress.advance(task))):
                if "infeasible" not in r:
                    grown[key][k] = r["rl_steps_per_hour"]
        lane_runs = lane_pool_configs(configs, results) if options.lane_pool else []
        lanes: dict[tuple, float] = {}
        if lane_runs:
            task = progress.add_task(f"the lane pool: static with the serving lanes in its pool, {len(lane_runs)} runs", total=len(lane_runs))
            for (key, _), r in zip(lane_runs, run_grid([c for _, c in lane_runs], jobs, lambda _: progress.advance(task))):
                if "infeasible" not in r:
                    lanes[key] = r["rl_steps_per_hour"]
    return results, grown, lanes


def sim_report(options: SimOptions, configs: list[SimConfig], rows: list[dict], cal: dict, grid_s: float) -> dict:
    """The JSON: the rows, the issue's targets, the calibration, the notes and the grid's settings."""
    rose = [r["speedup_vs_static"] for r in rows if r["policy"] == "rose" and r.get("speedup_vs_static")]
    summary = (
        f"rose vs static: {min(rose):.2f}-{max(rose):.2f}x over {len(rose)} configurations (paper: {PAPER_RANGE[0]}-{PAPER_RANGE[1]}x)"
        if rose
        else "no rose result"
    )
    seeds, models = options.grid_seeds, options.grid_models
    return {
        "rows": rows,
        "targets": targets_of(rows),
        "calibration": cal["calibration"],
        "calibration_slo_attainment": cal.get("calibration_slo_attainment", {}),
        "calibration_within_15pct": within_tolerance(cal),
        "calibration_detail": cal["calibration_detail"],
        "notes": notes_of(rows),
        "summary": summary,
        "settings": {
            "seed": seeds[0],
            "seeds": list(seeds),
            "steps": options.grid_steps,
            "device": options.device,
            "load": options.load,
            "slo_ttft_ms": options.slo_ttft_ms,
            "slo_tpot_ms": options.slo_tpot_ms,
            "quantum_ms": options.quantum_ms,
            "models": list(models),
            "model_pairs": [list(p) for p in model_pairs(models, options.serving_models, options.policy_models)],
            "over_provision": list(options.over_provision),
            "host_kv_ratio": configs[0].host_kv_ratio if configs else options.host_kv_ratio,
            "fleets": list(options.grid_fleets),
            "rollout_demands": list(options.grid_demands),
            "dedicated_ratios": list(options.grid_ratios),
            "modes": list(options.modes),
            "async_prefetch_steps": ASYNC_PREFETCH,
            "what_if": list(options.what_if),
            "lane_pool": options.lane_pool,
            "rollout_modes": list(options.rollout_modes),
            "trainer_gpu_ratio": configs[0].trainer_gpu_ratio if configs else None,
            "jobs": options.workers,
        },
        "grid_seconds": grid_s,
        "note": (
            "simulated, not measured: step times from a roofline of public spec sheets (shared/devices.py); decisions by the services' own functions"
        ),
    }
