"""``rose bench coserve``: serving SLO vs harvested rollout throughput under four policies.

One engine configuration; a replayed serving trace (Poisson arrivals at ``serving_load``
x the serving model's measured capacity, plus short bursts at BURST_FACTOR x the rate,
seeded) and a saturating rollout backlog, run under serving_only, naive_share,
static_partition and rose. The SLO is set from serving_only's own measured latency:
``SLO_MULTIPLIER`` x its p99 TTFT and p99 TPOT (printed and stored in the JSON): each cell's from
its own serving_only (``--slo-basis cell``, the default), or once for the run (``--slo-basis run``:
at the grid's highest load, first seed, without noise), or given (``--slo-ms TTFT,TPOT``: the
contract a service really has, the same for every cell).
``dedicated_rollout_tokens_per_s`` is the policy model alone on the device (best of one
and all CPU threads for its lane; measured before and after the policies, averaged);
``harvest_ratio`` = rose rollout tokens/s / dedicated. ``reclaim_latency_ms_p99``: serving
arrival -> rollout off serving's compute, over the trace and over lull probes (see
bench/coserve_runs.py ``_reclaim_probes``), with ``reclaim_samples``.

A grid (``--loads``, ``--seeds``, ``--noise``) runs every (noise, load, seed) cell with the same
capacity and dedicated baseline (measured once, without noise): ``--noise F`` starts a co-runner
process that burns F of one core (a duty cycle over NOISE_PERIOD_S) through every policy of the
cell. Each cell, as it finishes, is appended to ``<json>.cells.jsonl`` (harvest against the
dedicated baseline measured before the cells), so that a grid stopped midway keeps them. The
JSON's ``cells`` lists each cell's per-policy SLO attainment, TTFT/TPOT p99, rollout
tokens/s and harvest; the top-level fields are the first cell's, as for a single run. The rose run
of the first cell also records the SLO guard (slo_guard.py) every GUARD_SAMPLE_S: its share, the
measured tail ratio and the setpoint, plotted beside the JSON as ``<name>-guard.png``.

The runs on one engine (the models, the trace, a policy's run, the capacity and dedicated baselines) are
bench/coserve_runs.py's; this module runs them over the grid (``CoserveOptions``) and reports the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rose.bench.options import SLO_BASES, BenchOptionsError, options_from_args
from rose.services.executor.engine import EngineConfig

from .coserve_runs import (
    BURST_EVERY_S,
    BURST_FACTOR,
    BURST_LEN_S,
    CO_BATCHED,
    MIB,
    RECLAIM_PROBES,
    BenchModels,
    Contender,
    Noise,
    bench_config,
    contenders,
    load_models,
    measure_capacity,
    measure_dedicated,
    run_policy,
    serving_trace,
)

SLO_MULTIPLIER = 2.0  # SLO = 2 x serving_only's p99 TTFT / TPOT
DEDICATED_FRACTION = 0.5  # dedicated run length as a fraction of duration (at least DEDICATED_MIN_S; --dedicated-s overrides)
DEDICATED_MIN_S = 5.0


@dataclass(frozen=True, kw_only=True)
class CoserveOptions:
    """What a `rose bench coserve` run measures (options.add_coserve_arguments says each): the policies on one trace
    (``lora``: the policy a LoRA adapter of the serving model, and rose in the co-batched mode beside the four, each row
    saying its mode), or on each cell of loads x seeds x noises, ``repeats`` rounds per cell (``_run_cell``: figures
    pooled over the rounds). ``min_requests``: each cell's trace is long enough for that many serving requests (at
    least ``duration_s``), so that the SLO target's tolerance (SLO_TOLERANCE of the requests) is finer than one
    request: 200 for 0.005, 1,000 to resolve it.

    The SLO: ``slo_ms`` (TTFT, TPOT) when given, for every cell; else basis ``cell``, each cell's own serving_only p99s
    x SLO_MULTIPLIER (a sample of that cell: a cell under noise gets a looser SLO); or basis ``run``, the p99s of
    serving_only at the grid's highest load, first seed, without noise, for every cell (run once, first, and reused as
    that cell's serving_only). One SLO per run makes cells comparable, but at a high load one seed's bursts set it:
    2026-12-02 it came out at 10x the low loads' p99 (docs/benchmarks.md)."""

    seed: int = 0
    serving_load: float = 0.3
    duration_s: float = 20.0
    device: str = "auto"
    dtype: str = "auto"
    preset: str = "tiny"
    loads: tuple[float, ...] | None = None
    seeds: tuple[int, ...] | None = None
    noises: tuple[float, ...] | None = None
    min_requests: int = 0
    slo_basis: str = "cell"
    slo_ms: tuple[float, float] | None = None
    repeats: int = 1
    reclaim_probes: int = RECLAIM_PROBES
    dedicated_s: float | None = None
    lora: bool = False

    def __post_init__(self) -> None:
        if self.slo_basis not in SLO_BASES:
            raise BenchOptionsError(f"slo_basis must be one of {SLO_BASES}, got {self.slo_basis!r}")
        if self.repeats < 1:
            raise BenchOptionsError(f"repeats must be at least 1, got {self.repeats}")
        if self.reclaim_probes < 0 or (self.dedicated_s is not None and self.dedicated_s <= 0):
            raise BenchOptionsError(f"reclaim_probes must be >= 0 and dedicated_s > 0, got {self.reclaim_probes} and {self.dedicated_s}")

    def grid(self) -> list[tuple[float, float, int]]:
        """Every (noise, load, seed) cell, in the order they run; the first one's load and seed are the report's."""
        return [
            (noise, load, s) for noise in (self.noises or [0.0]) for load in (self.loads or [self.serving_load]) for s in (self.seeds or [self.seed])
        ]

    @property
    def calibrates(self) -> bool:
        """The run's SLO is measured once, before the cells (basis ``run``, none given)."""
        return self.slo_ms is None and self.slo_basis == "run"

    @property
    def dedicated_run_s(self) -> float:
        """Seconds of each dedicated-baseline run (before and after the cells)."""
        return self.dedicated_s or max(DEDICATED_MIN_S, self.duration_s * DEDICATED_FRACTION)


@dataclass(frozen=True)
class Baselines:
    """What every cell is measured against, measured before the cells: the serving capacity (its rounds; the median
    sets the cells' rates), the policy model alone's rollout tokens/s by threads, and the run's SLO (None: each cell
    its own) with, on the ``run`` basis, the serving_only run that set it (reused as that cell's) and its cell."""

    capacity_rounds: list[float]
    dedicated_before: dict[int, float]
    slo: tuple[float, float] | None
    calibration: dict | None
    calibration_cell: tuple[float, float, int]

    @property
    def capacity(self) -> float:
        return float(np.median(self.capacity_rounds))


@dataclass(frozen=True)
class CellRun:
    """One cell's runs: its trace's arrivals, each policy's pooled run and the SLO it was judged against."""

    noise: float
    load: float
    seed: int
    arrivals: list[float]
    runs: dict[str, dict]
    slo: tuple[float, float]


def _device_name(device: str) -> str:
    from rose.services.executor.device import select_device

    dev = select_device(device)
    return torch.cuda.get_device_name(dev.torch_device) if dev.kind == "cuda" else f"cpu x{os.cpu_count()}"


def _model_summary(model) -> dict:
    cfg = model.config
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "attention_heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "vocab_size": cfg.vocab_size,
    }


def _setpoint() -> float:
    from rose.services.executor.slo_guard import SETPOINT

    return SETPOINT


def _p(values, q) -> float:
    """Percentile (0 for no samples)."""
    if not values:
        return 0.0
    return float(np.percentile(values, q))


def _plot(path: Path, runs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    qs = [50, 90, 95, 99]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        width = 0.2
        for i, (name, run) in enumerate(runs.items()):
            ax.bar([x + i * width for x in range(len(qs))], [_p(run[key], q) for q in qs], width, label=name)
        ax.set_xticks([x + 1.5 * width for x in range(len(qs))], [f"p{q}" for q in qs])
        ax.set_yscale("log")
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_guard(path: Path, run: dict, slo: tuple[float, float]) -> None:
    """Rollout's share under the SLO guard through the trace, with the measured tail and the bursts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = run["guard_trace"]
    if not trace:
        return
    from rose.services.executor.slo_guard import SETPOINT

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 5.5), sharex=True)
    t = [x[0] for x in trace]
    ax.plot(t, [x[1] for x in trace], lw=1.0, c="tab:green", label="rollout share (SLO guard)")
    ax.set_ylabel("rollout share")
    ax.set_ylim(-0.05, 1.05)
    ax2.plot(t, [x[2] for x in trace], lw=0.8, c="tab:purple", label="tail ratio: window p99 (and live) / SLO")
    ax2.axhline(SETPOINT, c="tab:red", ls="--", lw=1, label=f"setpoint {SETPOINT:g} x SLO")
    first_round = run.get("run_sizes", [len(run["ttft_ms"])])[0]  # the guard trace and arrivals are the first round's (``_pooled``)
    ttft_ratio = [min(3.0, r / slo[0]) for r in run["ttft_ms"][:first_round]]
    ax2.scatter(run["arrivals_s"][: len(ttft_ratio)], ttft_ratio, s=4, c="tab:blue", label="request TTFT / SLO (at its arrival)")
    ax2.set_ylabel("x SLO")
    ax2.set_ylim(0, 3.05)
    for a in (ax, ax2):
        start = BURST_EVERY_S - BURST_LEN_S
        while start < t[-1]:
            a.axvspan(start, start + BURST_LEN_S, color="tab:orange", alpha=0.2)
            start += BURST_EVERY_S
        a.legend(loc="upper right", fontsize=7)
    ax2.set_xlabel(f"seconds (orange: serving bursts at {BURST_FACTOR:g}x the rate)")
    fig.suptitle("rose: rollout's share follows serving's tails (the executor's SLO guard)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cell_duration_s(duration_s: float, min_requests: int, rate_rps: float) -> float:
    """A cell's trace: ``duration_s``, or longer where that holds fewer than ``min_requests`` at its rate."""
    return max(duration_s, min_requests / max(1e-9, rate_rps))


SLO_TOLERANCE = 0.005  # issue 24's target: rose's attainment within this of serving_only's in the same cell


def _cell(runs: dict, slo: tuple[float, float], dedicated_by_threads: dict[int, float], load: float, seed: int, noise: float, rate: float) -> dict:
    """One grid cell's figures per policy: SLO attainment, TTFT/TPOT p99, rollout tokens/s, harvest
    (over the dedicated baseline, the best of its thread counts) and harvest over the one-thread
    baseline (what the rollout lane has of its own; two threads' gain over one moved 1.22-1.38x
    between runs on the 2-vCPU VM, docs/benchmarks.md 2026-12-02 evening)."""
    dedicated = max(dedicated_by_threads.values())
    one_thread = dedicated_by_threads.get(1, dedicated)
    requests = len(runs["serving_only"]["ttft_ms"])  # over all its rounds (``_pooled``)
    repeats = len(runs["serving_only"].get("run_sizes", [requests]))  # each policy ran this many times on the cell's trace
    out: dict[str, Any] = {
        "load": load,
        "seed": seed,
        "noise": noise,
        "rate_rps": rate,
        "repeats": repeats,
        "serving_requests": requests,
        "slo": {"ttft_ms": slo[0], "tpot_ms": slo[1]},
        "policies": {},
    }
    for name, run in runs.items():
        p = _policy_figures(run, slo)
        out["policies"][name] = {
            k: p[k] for k in ("slo_attainment", "slo_attainment_runs", "ttft_p99_ms", "tpot_p99_ms", "rollout_tokens_per_s", "aborted_requests")
        }
        out["policies"][name]["mode"] = run.get("mode", "two_model")
        out["policies"][name]["harvest"] = p["rollout_tokens_per_s"] / max(1e-9, dedicated)
        out["policies"][name]["harvest_vs_one_thread"] = p["rollout_tokens_per_s"] / max(1e-9, one_thread)
        out["policies"][name]["slo_misses"] = round((1.0 - p["slo_attainment"]) * len(run["ttft_ms"]))
    base = out["policies"]["serving_only"]

    def meets(name: str) -> bool:
        p = out["policies"][name]
        return p["slo_attainment"] >= 0.99 and p["slo_attainment"] >= base["slo_attainment"] - SLO_TOLERANCE

    rose = out["policies"]["rose"]
    out["rose_meets_slo_target"] = meets("rose")
    out["rose_extra_misses"] = rose["slo_misses"] - base["slo_misses"]
    out["tolerated_extra_misses"] = SLO_TOLERANCE * requests  # below 1, one request decides the cell: too few to resolve the tolerance
    out["rose_reclaim_ms_p99"] = _p(runs["rose"]["reclaim_ms"], 99)
    if CO_BATCHED in runs:  # issue 65's CPU target: >= 2x two-model rose's harvest, >= 1.5x static partition's, at the SLO target
        co = out["policies"][CO_BATCHED]
        out["co_batched"] = {
            "over_two_model_rose": co["rollout_tokens_per_s"] / max(1e-9, rose["rollout_tokens_per_s"]),
            "over_static_partition": co["rollout_tokens_per_s"] / max(1e-9, out["policies"]["static_partition"]["rollout_tokens_per_s"]),
            "meets_slo_target": meets(CO_BATCHED),
            "extra_misses": co["slo_misses"] - base["slo_misses"],
            "iterations_with_both": runs[CO_BATCHED].get("co_batched_iterations", 0),
        }
    return out


def _slo_words(slo: dict) -> str:
    """How the run's SLO was set, for the console."""
    if slo["basis"] == "given":
        return "given"
    if slo["basis"] == "cell":
        return f"each cell: {SLO_MULTIPLIER:g} x its serving_only p99; the first cell's"
    c = slo["calibration"]
    return f"every cell: {SLO_MULTIPLIER:g} x serving_only p99 at load {c['load']:g}, seed {c['seed']}, no noise"


def _resolution_note(cell: dict) -> str:
    """`` (+k of n)`` where the cell holds too few requests for its tolerance to be finer than one request."""
    if cell["tolerated_extra_misses"] >= 1.0:
        return ""
    return f" (+{cell['rose_extra_misses']} of {cell['serving_requests']})"


def _policy_figures(run: dict, slo: tuple[float, float]) -> dict:
    slo_ttft, slo_tpot = slo
    met = [not lost and a <= slo_ttft and b <= slo_tpot for a, b, lost in zip(run["ttft_ms"], run["tpot_ms"], run["aborted"])]
    sizes, per_run, start = run.get("run_sizes", [len(met)]), [], 0
    for size in sizes:
        per_run.append(sum(met[start : start + size]) / max(1, size))
        start += size
    return {
        "slo_attainment": sum(met) / max(1, len(met)),
        "slo_attainment_runs": per_run,
        "ttft_p99_ms": _p(run["ttft_ms"], 99),
        "tpot_p99_ms": _p(run["tpot_ms"], 99),
        "serving_tokens_per_s": run["serving_tokens_per_s"],
        "rollout_tokens_per_s": run["rollout_tokens_per_s"],
        "aborted_requests": sum(run["aborted"]),
        "lane_failures": run["lane_failures"],
        **({"cuda_graphs": run["cuda_graphs"]} if run["cuda_graphs"] else {}),
    }


def _slo_from(serving_only: dict) -> tuple[float, float]:
    """SLO_MULTIPLIER x serving_only's p99 TTFT and TPOT."""
    return SLO_MULTIPLIER * _p(serving_only["ttft_ms"], 99), SLO_MULTIPLIER * _p(serving_only["tpot_ms"], 99)


def _run_cell(
    models,
    config: EngineConfig,
    arrivals: list[float],
    seed: int,
    noise: float,
    on_policy,
    slo=None,
    done=None,
    repeats: int = 1,
    reclaim_probes: int = RECLAIM_PROBES,
) -> tuple[dict, tuple[float, float]]:
    """The four policies on one trace, under the noise co-runner, ``repeats`` times in turn (each round
    runs every policy once, so a policy's runs and its comparison's sit minutes apart at most); each
    policy's runs pooled (``_pooled``). ``slo``: the run's SLO; None: this cell's own (from its first
    serving_only run, the ``cell`` basis). ``done``: policies already run on this very trace and noise
    (the run-wide calibration's serving_only), reused as their first round, not run again."""
    rows = contenders(models.adapter is not None)
    runs: dict[str, list[dict]] = {c.label: [] for c in rows}
    with Noise(noise):
        for round_ in range(repeats):
            for c in rows:
                on_policy(c.label)
                if round_ == 0 and done and c.label in done:
                    runs[c.label].append(done[c.label])
                else:
                    runs[c.label].append(asyncio.run(run_policy(c, models, config, arrivals, seed, slo, reclaim_probes=reclaim_probes)))
                if c.label == "serving_only" and slo is None:
                    slo = _slo_from(runs[c.label][0])
    assert slo is not None
    return {label: _pooled(r) for label, r in runs.items()}, slo


def _pooled(runs: list[dict]) -> dict:
    """Several runs of one policy on one trace as one: their requests together (``run_sizes`` keeps
    where each run begins), throughputs averaged, the first run's traces (guard, arrivals).
    Why pool: on the 2-vCPU VM one run of a cell moved by more than the SLO target's tolerance from
    the next run of the same policy (serving_only 0.918, then 0.717: docs/benchmarks.md)."""
    first = runs[0]
    return {
        **first,
        "ttft_ms": [x for r in runs for x in r["ttft_ms"]],
        "tpot_ms": [x for r in runs for x in r["tpot_ms"]],
        "aborted": [x for r in runs for x in r["aborted"]],
        "reclaim_ms": [x for r in runs for x in r["reclaim_ms"]],
        "serving_tokens_per_s": float(np.mean([r["serving_tokens_per_s"] for r in runs])),
        "rollout_tokens_per_s": float(np.mean([r["rollout_tokens_per_s"] for r in runs])),
        "rss_bytes": max(r["rss_bytes"] for r in runs),
        "lane_failures": sum(r["lane_failures"] for r in runs),
        "run_sizes": [len(r["ttft_ms"]) for r in runs],
    }


def run_coserve_bench(options: CoserveOptions, out_json: str, model_dir: str | None = None, console=None) -> dict:
    """`rose bench coserve`: the baselines, every cell of the grid, the dedicated baseline again, then the report
    (written to ``out_json``, plotted beside it, printed). ``model_dir``: models to reuse (default: built on the spot)."""
    from rich.console import Console
    from rich.progress import Progress

    console = console or Console()
    torch.set_num_threads(1)
    config = bench_config(options.device, options.dtype)
    cells = options.grid()
    seed = cells[0][2]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("loading models", total=len(contenders(options.lora)) * len(cells) * options.repeats + 3 + options.calibrates)
        models = load_models(model_dir, seed, config.dtype, options.preset, options.lora)
        base = _baselines(options, models, config, progress, task)
        cell_runs = _run_cells(options, models, config, base, Path(out_json).with_suffix(".cells.jsonl"), progress, task)
        progress.update(task, description="dedicated rollout (after)")
        dedicated_after = asyncio.run(measure_dedicated(models, config, options.dedicated_run_s, seed))
        progress.advance(task)
    report = _report(options, config, models, base, cell_runs, dedicated_after, out_json)
    out = Path(out_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    first = cell_runs[0]
    _plot(out.with_suffix(".png"), first.runs)
    _plot_guard(out.with_name(out.stem + "-guard.png"), first.runs["rose"], first.slo)
    _print_report(console, report, out)
    return report


def _baselines(options: CoserveOptions, models: BenchModels, config: EngineConfig, progress, task) -> Baselines:
    """The serving capacity, the dedicated rollout before the cells and, on the ``run`` basis, the run's SLO: serving_only
    at the grid's highest load, first seed, without noise."""
    cells = options.grid()
    seed = cells[0][2]
    progress.update(task, description="measuring serving capacity")
    capacity_rounds = asyncio.run(measure_capacity(models, config, seed))
    capacity = float(np.median(capacity_rounds))
    progress.advance(task)
    progress.update(task, description="dedicated rollout (before)")
    dedicated_before = asyncio.run(measure_dedicated(models, config, options.dedicated_run_s, seed))
    calibration_cell = (0.0, max(load for _, load, _ in cells), seed)
    if not options.calibrates:
        return Baselines(capacity_rounds, dedicated_before, options.slo_ms, None, calibration_cell)
    _, load, c_seed = calibration_cell
    progress.update(task, description=f"SLO: serving_only at load {load:g} seed {c_seed} without noise")
    trace = serving_trace(load * capacity, cell_duration_s(options.duration_s, options.min_requests, load * capacity), c_seed)
    calibration = asyncio.run(run_policy(Contender("serving_only", "serving_only"), models, config, trace, c_seed, None))
    progress.advance(task)
    return Baselines(capacity_rounds, dedicated_before, _slo_from(calibration), calibration, calibration_cell)


def _run_cells(options: CoserveOptions, models: BenchModels, config: EngineConfig, base: Baselines, partial: Path, progress, task) -> list[CellRun]:
    """Every cell of the grid in turn; each, as it finishes, appended to ``partial`` (a killed grid keeps the cells it
    finished) with its harvest against the dedicated baseline measured so far (the final JSON's: before and after)."""
    cell_runs = []
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text("")
    for noise, load, seed in options.grid():
        rate = load * base.capacity
        arrivals = serving_trace(rate, cell_duration_s(options.duration_s, options.min_requests, rate), seed)
        n_arrivals = len(arrivals)
        done = {"serving_only": base.calibration} if base.calibration is not None and (noise, load, seed) == base.calibration_cell else None

        def on_policy(name, noise=noise, load=load, seed=seed, n=n_arrivals):
            progress.update(task, description=f"load {load:g} seed {seed} noise {noise:g}: policy {name} ({n} serving requests)")
            progress.advance(task)

        runs, slo = _run_cell(models, config, arrivals, seed, noise, on_policy, base.slo, done, options.repeats, options.reclaim_probes)
        cell_runs.append(CellRun(noise, load, seed, arrivals, runs, slo))
        row = _cell(runs, slo, base.dedicated_before, load, seed, noise, rate)
        with partial.open("a") as f:
            f.write(json.dumps({**row, "harvest_baseline": "dedicated_before"}) + "\n")
    return cell_runs


def _report(
    options: CoserveOptions,
    config: EngineConfig,
    models: BenchModels,
    base: Baselines,
    cell_runs: list[CellRun],
    dedicated_after: dict[int, float],
    out_json: str,
) -> dict:
    """The JSON: the first cell's figures at the top (as for a single run), every cell's under ``cells``."""
    first = cell_runs[0]
    runs, (slo_ttft, slo_tpot) = first.runs, first.slo
    # measured before and after the policies, averaged: this machine's speed drifts over a run
    dedicated_by_threads = {n: (base.dedicated_before[n] + dedicated_after[n]) / 2 for n in dedicated_after}
    dedicated = max(dedicated_by_threads.values())
    policies = {name: _policy_figures(run, first.slo) for name, run in runs.items()}
    cells = [_cell(c.runs, c.slo, dedicated_by_threads, c.load, c.seed, c.noise, c.load * base.capacity) for c in cell_runs]
    rose_reclaim = runs["rose"]["reclaim_ms"]
    return {
        "policies": policies,
        "dedicated_rollout_tokens_per_s": dedicated,
        "dedicated_by_threads": {str(n): v for n, v in sorted(dedicated_by_threads.items())},
        "dedicated_runs": [{str(n): v for n, v in sorted(d.items())} for d in (base.dedicated_before, dedicated_after)],
        "harvest_ratio_vs_one_thread": policies["rose"]["rollout_tokens_per_s"] / max(1e-9, dedicated_by_threads.get(1, dedicated)),
        "harvest_ratio": policies["rose"]["rollout_tokens_per_s"] / max(1e-9, dedicated),
        "reclaim_latency_ms_p99": _p(rose_reclaim, 99),
        "repeats": options.repeats,  # rounds per cell; every policy figure pools its rounds' requests
        "executor_rss_mb": max(r["rss_bytes"] for r in runs.values()) / MIB,
        "device_memory_peak_mb": torch.cuda.max_memory_allocated() / MIB if torch.cuda.is_available() and config.device != "cpu" else None,
        "slo": {
            "ttft_ms": slo_ttft,
            "tpot_ms": slo_tpot,
            "multiplier": SLO_MULTIPLIER,
            "basis": "given" if options.slo_ms is not None else options.slo_basis,  # run: one SLO for every cell; cell: each its own
            **({"calibration": dict(zip(("noise", "load", "seed"), base.calibration_cell))} if options.calibrates else {}),
        },
        "serving_load": first.load,
        "serving_capacity_rps": base.capacity,
        "serving_capacity_rounds_rps": base.capacity_rounds,
        "serving_requests": len(first.arrivals),
        "duration_s": options.duration_s,
        "min_requests": options.min_requests,
        "seed": first.seed,
        "device": _device_name(config.device),
        "dtype": str(config.dtype).removeprefix("torch."),
        "models": {name: _model_summary(model) for name, (model, _) in (("serving", models.serving), ("policy", models.policy))},
        "lora": {"rank": models.adapter.shape.rank, "alpha": models.adapter.shape.alpha} if models.adapter is not None else None,
        "co_batched": _co_batched_summary(cells),
        "quantum_ms": config.quantum_ms,
        "reclaim_samples": len(rose_reclaim),
        "noise": first.noise,
        "cells": cells,
        "grid": {
            "loads": sorted({c["load"] for c in cells}),
            "seeds": sorted({c["seed"] for c in cells}),
            "noise": sorted({c["noise"] for c in cells}),
        },
        "rose_slo_guard": {"setpoint": _setpoint(), "guard_png": str(Path(out_json).with_name(Path(out_json).stem + "-guard.png"))},
    }


def _co_batched_summary(cells: list[dict]) -> dict | None:
    """Across the cells: co-batched rose's harvest over two-model rose's and static partition's (least and median), and
    the cells where it met the SLO target (None without ``--lora``)."""
    rows = [c["co_batched"] for c in cells if "co_batched" in c]
    if not rows:
        return None
    over_rose, over_static = [r["over_two_model_rose"] for r in rows], [r["over_static_partition"] for r in rows]
    return {
        "over_two_model_rose": {"min": min(over_rose), "median": float(np.median(over_rose))},
        "over_static_partition": {"min": min(over_static), "median": float(np.median(over_static))},
        "cells_meeting_slo_target": sum(r["meets_slo_target"] for r in rows),
        "cells": len(rows),
    }


def _print_report(console, report: dict, out: Path) -> None:
    """The console's view of a written report: the models, the SLO, the policies' table, the cells' table, the harvest."""
    from rich.table import Table

    policies, cells, dedicated = report["policies"], report["cells"], report["dedicated_rollout_tokens_per_s"]
    slo_ttft, slo_tpot = report["slo"]["ttft_ms"], report["slo"]["tpot_ms"]
    capacity, serving_load = report["serving_capacity_rps"], report["serving_load"]
    rate, n_requests = serving_load * capacity, report["serving_requests"]
    one_thread = report["dedicated_by_threads"].get("1", dedicated)
    console.print(
        f"{report['device']}, {report['dtype']}: serving model {report['models']['serving']['parameters'] / 1e6:.0f}M parameters, "
        f"policy {report['models']['policy']['parameters'] / 1e6:.0f}M"
    )
    console.print(
        f"SLO ({_slo_words(report['slo'])}): TTFT {slo_ttft:.1f} ms, TPOT {slo_tpot:.2f} ms  "
        f"(capacity {capacity:.1f} req/s, load {serving_load:g} -> {rate:.1f} req/s, {n_requests} requests)"
    )
    table = Table(title="rose bench coserve")
    for col in ("policy", "mode", "SLO attain", "TTFT p99 ms", "TPOT p99 ms", "aborted", "serving tok/s", "rollout tok/s", "vs dedicated"):
        table.add_column(col, justify="right")
    modes = report["cells"][0]["policies"]
    for name, p in policies.items():
        table.add_row(
            name,
            modes[name]["mode"],
            f"{p['slo_attainment']:.4f}",
            f"{p['ttft_p99_ms']:.1f}",
            f"{p['tpot_p99_ms']:.2f}",
            str(p["aborted_requests"]),
            f"{p['serving_tokens_per_s']:.0f}",
            f"{p['rollout_tokens_per_s']:.0f}",
            f"{p['rollout_tokens_per_s'] / max(1e-9, dedicated):.2f}",
        )
    console.print(table)
    if len(cells) > 1:
        grid_table = Table(title="rose bench coserve: cells (rose vs serving_only)")
        for col in (
            "noise",
            "load",
            "seed",
            "rose SLO",
            "serving_only SLO",
            "rose TTFT p99",
            "rose TPOT p99",
            "rose tok/s",
            "harvest",
            "vs 1 thread",
            "target",
        ):
            grid_table.add_column(col, justify="right")
        for c in cells:
            r, b = c["policies"]["rose"], c["policies"]["serving_only"]
            grid_table.add_row(
                f"{c['noise']:g}",
                f"{c['load']:g}",
                str(c["seed"]),
                f"{r['slo_attainment']:.4f}",
                f"{b['slo_attainment']:.4f}",
                f"{r['ttft_p99_ms']:.1f}",
                f"{r['tpot_p99_ms']:.2f}",
                f"{r['rollout_tokens_per_s']:.0f}",
                f"{r['harvest']:.2f}",
                f"{r['harvest_vs_one_thread']:.2f}",
                ("ok" if c["rose_meets_slo_target"] else "MISS") + _resolution_note(c),
            )
        console.print(grid_table)
    if (co := report.get("co_batched")) is not None:
        console.print(
            f"co-batched rose (LoRA rank {report['lora']['rank']}): rollout tokens over two-model rose x{co['over_two_model_rose']['median']:.2f} "
            f"(least x{co['over_two_model_rose']['min']:.2f}), over static partition x{co['over_static_partition']['median']:.2f} "
            f"(least x{co['over_static_partition']['min']:.2f}); SLO target met in {co['cells_meeting_slo_target']} of {co['cells']} cells"
        )
    console.print(
        f"dedicated rollout {dedicated:.0f} tok/s (one thread {one_thread:.0f}), harvest ratio "
        f"{report['harvest_ratio']:.2f} (vs one thread {report['harvest_ratio_vs_one_thread']:.2f}), "
        f"reclaim p99 {report['reclaim_latency_ms_p99']:.1f} ms, RSS {report['executor_rss_mb']:.0f} MiB; "
        f"wrote {out} and {out.with_suffix('.png')}"
    )


def _slo_pair(values: list[float] | None) -> tuple[float, float] | None:
    if values is None:
        return None
    if len(values) != 2 or min(values) <= 0:
        raise SystemExit(f"--slo-ms takes two positive numbers, TTFT,TPOT in ms (e.g. 60,8), got {values}")
    return values[0], values[1]


def command(args: argparse.Namespace) -> int:
    """`rose bench coserve` with parsed options (see options.add_coserve_arguments)."""
    run_coserve_bench(options_from_args(CoserveOptions, args, slo_ms=_slo_pair(args.slo_ms)), args.json, args.models)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m rose.bench.coserve``: ``rose bench coserve`` without building the whole CLI, whose
    other commands import the bus's packages (NATS, OpenTelemetry), which a bare GPU image lacks."""
    from rose.bench.options import add_coserve_arguments

    parser = argparse.ArgumentParser(prog="rose bench coserve", description=__doc__.split("\n\n")[0])
    add_coserve_arguments(parser)
    return command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
