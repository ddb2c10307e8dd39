"""``rose bench sim --rollout-modes two_model co_batched``: the co-batched mode's bars, judged beside the two-model mode.

Issue 65's simulator targets for rose with its policy a LoRA adapter of the serving model, its sequences rows in
serving's own iterations (sim/co_batched.py), over the rows of one grid that ran both modes on the same
configurations and seeds:
- at least ``SYNC_DEMAND_2_AT_LEAST`` x static in every synchronous demand-2 row;
- at least ``ASYNC_DEMAND_4_AT_LEAST`` x static at asynchronous demand 4 with dedicated ratio 0.25;
- never below the two-model mode by more than noise: a configuration is below when every seed's co-batched rose
  made fewer RL steps/h than its two-model rose (a sign test: with 5 seeds and no difference, all 5 below happens
  once in 32), and its median over seeds is under 1;
- no SLO-violating instance-second.
Apart from bench/sim.py, which builds and reports the grid, so that neither passes the size a module may have.
"""

from __future__ import annotations

from rose.sim import ROLLOUT_MODES

CO_BATCHED = ROLLOUT_MODES[1]
SYNC_DEMAND_2_AT_LEAST = 1.3  # issue 65: co-batched rose >= 1.3x static in every synchronous demand-2 row
ASYNC_DEMAND_4_AT_LEAST = 2.0  # issue 65: >= 2x at asynchronous demand 4, dedicated ratio 0.25
ASYNC_DEMAND_4_RATIO = 0.25


def _label(r: dict) -> str:
    return f"{r['model']}/{r['gpus']} demand {r['rollout_demand']:g}x, dedicated {r['dedicated_ratio']:g}, {r['mode']}"


def co_batched_targets(rows: list[dict]) -> dict | None:
    """The bars over co-batched rose's rows (combined over seeds), with the figures each is judged on; None without
    co-batched rows."""
    rose = [r for r in rows if r["policy"] == "rose" and r.get("rollout_mode") == CO_BATCHED and r.get("speedup_vs_static") is not None]
    if not rose:
        return None
    per_row = [
        dict(
            at=_label(r),
            speedup_vs_static=r["speedup_vs_static"],
            speedup_vs_static_by_seed=r.get("speedup_vs_static_by_seed"),
            over_two_model=r.get("speedup_over_two_model"),
            over_two_model_by_seed=r.get("speedup_over_two_model_by_seed"),
            over_lane_pool=r.get("speedup_over_lane_pool"),
            slo_violations=r["slo_violations"],
        )
        for r in rose
    ]
    sync_2 = [r for r in rose if r.get("mode") == "sync" and r.get("rollout_demand") == 2.0]
    async_4 = [r for r in rose if r.get("mode") == "async" and r.get("rollout_demand") == 4.0 and r.get("dedicated_ratio") == ASYNC_DEMAND_4_RATIO]
    below = [p["at"] for p in per_row if _below_by_more_than_noise(p)]
    violations = sum(r["slo_violations"] or 0.0 for r in rose)
    return dict(
        rows=per_row,
        sync_demand_2_min=min((r["speedup_vs_static"] for r in sync_2), default=None),
        async_demand_4_min=min((r["speedup_vs_static"] for r in async_4), default=None),
        below_two_model=below,
        slo_violation_instance_s=violations,
        meets=dict(
            sync_demand_2_at_least_1_3=bool(sync_2) and all(r["speedup_vs_static"] >= SYNC_DEMAND_2_AT_LEAST for r in sync_2),
            async_demand_4_at_least_2=bool(async_4) and all(r["speedup_vs_static"] >= ASYNC_DEMAND_4_AT_LEAST for r in async_4),
            never_below_two_model_by_more_than_noise=not below,
            zero_slo_violations=violations == 0,
        ),
    )


def _below_by_more_than_noise(row: dict) -> bool:
    """Every seed below its two-model twin, and the median too (module doc)."""
    seeds = [v for v in row.get("over_two_model_by_seed") or [] if v is not None]
    median = row.get("over_two_model")
    return bool(seeds) and all(v < 1.0 for v in seeds) and median is not None and median < 1.0


def co_batched_summary(t: dict) -> str:
    """The console's line for ``co_batched_targets``."""
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    return (
        f"co-batched targets: sync demand 2 least {fmt(t['sync_demand_2_min'])}x static (bar {SYNC_DEMAND_2_AT_LEAST}), "
        f"async demand 4 at dedicated {ASYNC_DEMAND_4_RATIO:g} least {fmt(t['async_demand_4_min'])}x (bar {ASYNC_DEMAND_4_AT_LEAST}), "
        f"below two-model in every seed: {', '.join(t['below_two_model']) or 'none'}, SLO-violating s {t['slo_violation_instance_s']:.0f}; met: "
        + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in t["meets"].items())
    )
