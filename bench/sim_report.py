"""``rose bench sim``'s report as a person reads it: the console's table and lines, and the PNG beside the JSON.

Apart from bench/sim.py, which builds the grid and its figures, so that neither passes the size a module may have.
"""

from __future__ import annotations

from pathlib import Path

from rose.bench.sim_calibration import CALIBRATION_TOLERANCE
from rose.bench.sim_co_batched import co_batched_summary
from rose.sim import POLICIES, ROLLOUT_MODES

PAPER_RANGE = (1.3, 3.3)  # the ROSE paper's RL throughput over the resource-fixed baseline
PAPER_ROLLOUT_RANGE = (1.2, 1.5)  # the paper's rollout time of the elastic baseline over rose's
TWO_MODEL = ROLLOUT_MODES[0]  # the default rollout mode: a policy copy on a lane of its own (sim/co_batched.py has the other)


def seed_range(values: list[float | None] | None) -> str:
    """`` (lo-hi)`` of the per-seed ratios when there are several, for the console table."""
    known = [v for v in values or [] if v is not None]
    return f" ({min(known):.2f}-{max(known):.2f})" if len(known) > 1 else ""


def _over_two_model(row: dict) -> str:
    """A co-batched rose row's steps/h over two-model rose's, with the seeds' range, for the console table."""
    ratio = row.get("speedup_over_two_model")
    return "" if ratio is None else f"{ratio:.2f}x two-model" + seed_range(row.get("speedup_over_two_model_by_seed"))


def plot(path: Path, rows: list[dict]) -> None:
    """One point per configuration and policy: speedup over static and rollout time against elastic by
    rollout demand (x), dedicated ratio (colour) and mode (marker); SLO-violating seconds per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r.get("infeasible")]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    markers = {"sync": "o", "async": "s", None: "o"}
    ratios = sorted({r["dedicated_ratio"] for r in ok if r.get("dedicated_ratio") is not None}) or [None]
    colours = {q: f"C{i}" for i, q in enumerate(ratios)}
    offset = {p: (k - 1.5) * 0.08 for k, p in enumerate(POLICIES)}
    for r in ok:
        if r["policy"] not in ("rose", "elastic_baseline"):
            continue
        x = (r.get("rollout_demand") or 2.0) * (1.0 + offset[r["policy"]] if r["policy"] in offset else 1.0)
        style = dict(
            marker=markers.get(r.get("mode"), "o"),
            color=colours.get(r.get("dedicated_ratio"), "C0"),
            alpha=1.0 if r["policy"] == "rose" else 0.25,
            s=25 if r["policy"] == "rose" else 12,
        )
        if r.get("speedup_vs_static") is not None:
            axes[0].scatter(x, r["speedup_vs_static"], **style)
        if r["policy"] == "rose" and r.get("rollout_time_ratio_vs_elastic") is not None:
            axes[1].scatter(x, r["rollout_time_ratio_vs_elastic"], **style)
    for q in ratios:
        for mode in ("sync", "async"):
            axes[0].scatter([], [], marker=markers[mode], color=colours[q], label=f"rose, dedicated {q}, {mode}")
    axes[0].axhspan(*PAPER_RANGE, color="green", alpha=0.1, label="paper 1.3-3.3x")
    axes[0].axhline(1.0, color="black", lw=0.8)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("rollout demand (x what the dedicated pool runs at once); faint: elastic_baseline")
    axes[0].set_ylabel("RL steps/h vs static")
    axes[0].legend(fontsize=7)
    axes[1].axhspan(*PAPER_ROLLOUT_RANGE, color="green", alpha=0.1, label="paper 1.2-1.5x")
    axes[1].axhline(1.0, color="black", lw=0.8)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("rollout demand")
    axes[1].set_ylabel("rose rollout time: elastic / rose")
    axes[1].legend(fontsize=7)
    totals = [sum(r.get("slo_violations") or 0.0 for r in ok if r["policy"] == p) for p in POLICIES]
    axes[2].bar(list(POLICIES), [max(0.5, t) for t in totals], color=[f"C{i}" for i in range(len(POLICIES))])
    axes[2].set_yscale("log")
    axes[2].set_ylabel("SLO-violating instance-s over the grid (0 shown as 0.5)")
    fig.suptitle("rose bench sim (simulated fleet; roofline step times; the services' decision functions)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_report(console, report: dict, out: Path) -> None:
    """The console's view of a written report: the rows' table, the targets, the per-model shares, the notes, the calibration."""
    from rich.table import Table

    rows, targets, notes, settings = report["rows"], report["targets"], report["notes"], report["settings"]
    device, load, slo_ttft_ms, slo_tpot_ms = settings["device"], settings["load"], settings["slo_ttft_ms"], settings["slo_tpot_ms"]
    summary, grid_s = report["summary"], report["grid_seconds"]
    cal = {k: report[k] for k in ("calibration", "calibration_slo_attainment", "calibration_detail")}
    table = Table(title=f"rose bench sim ({device}, load {load:g} of SLO capacity, SLO TTFT {slo_ttft_ms:g} ms / TPOT {slo_tpot_ms:g} ms)")
    for col in (
        "model",
        "GPUs",
        "demand",
        "ded.",
        "mode",
        "policy",
        "RL steps/h",
        "vs static",
        "ceiling: kv / fleet",
        "lane pool",
        "rollout vs elastic",
        "SLO-viol inst-s",
        "SLO attain",
        "lent",
        "notes",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        co_batched = r.get("rollout_mode", TWO_MODEL) != TWO_MODEL  # the mode column says which: "sync/co-b"
        axes = (f"{r['rollout_demand']:g}x", f"{r['dedicated_ratio']:g}", r["mode"] + ("/co-b" if co_batched else ""))
        if r.get("infeasible"):
            table.add_row(r["model"], str(r["gpus"]), *axes, r["policy"], "-", "-", "-", "-", "-", "-", "-", "-", "infeasible")
            continue
        f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
        table.add_row(
            r["model"],
            str(r["gpus"]),
            *axes,
            r["policy"],
            f(r["rl_steps_per_hour"], ".2f"),
            f(r["speedup_vs_static"], ".2f") + "x" + seed_range(r.get("speedup_vs_static_by_seed")),
            f"{f(r.get('speedup_ceiling_kv'), '.2f')} / {f(r.get('speedup_ceiling_fleet'), '.2f')}",
            f(r.get("speedup_lane_pool"), ".2f"),
            f(r["rollout_time_ratio_vs_elastic"], ".2f") + "x",
            f(r["slo_violations"], ".0f"),
            f(r["serving_slo_attainment"], ".4f"),
            f"{r['detail']['lent_instance_fraction']:.0%}",
            ("" if r["complete"] else "incomplete ") + _over_two_model(r),
        )
    console.print(table)
    console.print(summary)
    for mode, t in targets.items():
        if mode == "co_batched":
            console.print(co_batched_summary(t))
            continue
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        console.print(
            f"targets ({mode}, {t['configurations']} configurations): rose/static min {fmt(t['min_speedup'])} ({t['min_at']}), "
            f"demand >= 2 median {fmt(t['median_speedup_demand_ge_2'])} best {fmt(t['best_speedup_demand_ge_2'])} "
            f"(ceiling best {fmt(t['best_speedup_ceiling_demand_ge_2'])}, "
            f"{fmt(t['best_speedup_ceiling_kv_demand_ge_2'])} at the lent KV's batch; "
            f"median gain {fmt(t['median_gain_of_ceiling_demand_ge_2'])} of it), "
            "rollout vs elastic median "
            f"{fmt(t['median_rollout_time_ratio_vs_elastic'])}, SLO-violating s {t['rose_slo_violation_instance_s']:.0f}; met: "
            + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in t["meets"].items())
        )
    for label, e in (targets.get("all") or {}).get("per_model", {}).items():
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        console.print(
            f"share of the priced gain, {label} (demand >= 2, {e['rows']} rows): median {fmt(e['median_share'])}, "
            f"least {fmt(e['min_share'])}; of the fleet ceiling's gain: median {fmt(e['median_fleet_share'])}, least "
            f"{fmt(e['min_fleet_share'])}; "
            + (
                f"rose over the lane pool: median {fmt(e['median_over_lane_pool'])}, least {fmt(e['min_over_lane_pool'])}; "
                if e.get("median_over_lane_pool") is not None
                else ""
            )
            + f"rose/static median {fmt(e['median_speedup'])}; prefill redone by prefix-cache "
            f"misses at most {fmt(e['max_reprefill_share'])} of rollout's device time"
        )
    for n in notes:
        console.print(f"- {n}")
    if cal["calibration"]:
        pct = lambda v: "-" if v is None else f"{v:.0%}"  # noqa: E731
        slo = cal.get("calibration_slo_attainment", {})
        console.print(
            "calibration (relative error, "
            + cal["calibration_detail"]["against"]
            + "; RL steps/h, SLO attainment): "
            + ", ".join(f"{k} {pct(v)}, {pct(slo.get(k))}" for k, v in cal["calibration"].items())
            + f"; all within ±{CALIBRATION_TOLERANCE:.0%}: {report['calibration_within_15pct']}"
        )
    else:
        console.print("calibration: " + cal["calibration_detail"]["source"] + "; " + cal["calibration_detail"]["next"])
    console.print(f"grid {grid_s:.1f} s; wrote {out} and {out.with_suffix('.png')}")
