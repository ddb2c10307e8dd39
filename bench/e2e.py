"""`rose bench e2e`: the demo's RL job on fresh fleets under four policies, one after another.

Every policy runs `rose demo`'s job (bench/demo.py `run_job`: serving executors taking the
replayed bursty trace over HTTP, one dedicated rollout executor, the SLO monitor, the scheduler,
the weight publisher, a rollout worker and the GRPO trainer, each its own process) for the same
duration and seed, with two differences from the demo, both written in the JSON's `job`:

- devices emulated (`--pin auto`, the default): each executor process, with every process it
  starts (the rollout forward child), is pinned to a core of its own (`os.sched_setaffinity`;
  torch sizes its threads from that mask): one core is one device, the dedicated executor on the
  first, a serving executor on the next, so lending uses only the cycles a serving executor's own
  core leaves idle, as on separate GPUs; the trainer and the light services float. On two cores
  that is one serving executor (the demo has two). `--pin none` runs unpinned. `devices` holds
  each executor's CPU set as observed at the end of each run (its process tree's affinity).
- the job is rollout-dominated as agentic RL is (bench/demo.py ROLLOUT_DOMINATED_JOB: one epoch per
  batch, longer multi-turn episodes): `rollout_share_of_step` per policy, and the static one in `job`.
  `--rollout-demand K` (`demand_settings`) keeps K x the dedicated executors' batch in flight (1: the
  demo's worker concurrency; `job.rollout_demand`, `calibration.trajectories_in_flight_max`).

Only these settings differ between the policies:

| policy | serving executors | scheduler `lending.mode` | worker | load balancer |
| --- | --- | --- | --- | --- |
| `static` | (no rollout) | `none` | | |
| `naive_share` | `engine.policy = naive_share` (same lane, no SLO guard, alerts ignored) | `always` | | |
| `elastic_baseline` | | `elastic_baseline` (below) | interrupted turns start over | a lent executor leaves the serving rotation |
| `rose` | | `rose` | | |

The scheduler's `elastic_baseline` mode lends whole executors after an idle window, revokes every
loan on any alert, then cools down.

Figures per policy (under `policies`): `rl_steps_per_hour` (GRPO steps per hour from the first
TrainingStep event to the last, the warm start left out; asynchronous, from the step that trained the
last batch handed out with the first: shared/workload.py ``steady_step_rate``), `rollout_s_per_step` (median
rollout time of a step's batch of trajectories: its first turn's start to its last trajectory's
end; the trainer's own wait, step interval - train_s - publish_s, is `calibration.trainer_wait_s_per_step`:
with one step prefetched it hides rollout behind training),
`serving_slo_attainment` (every request the serving clients sent), `rollout_tokens_per_s`
(tokens of turns finished in the training window / window), `dedicated_device_busy` (the dedicated
executor's device utilization, its pinned core counting the forward child, while it had rollout work:
well under 1, rollout is bound elsewhere and more devices cannot shorten it), reward figures,
trajectories lost, and `calibration` (measured step, train, publish and turn times, and the serving executors' step
model fitted from their metrics as the SLO monitor does). Top level: `speedup_vs_static` (rose /
static steps per hour), `rollout_time_ratio_vs_elastic` (rose / elastic_baseline rollout s per
step; below 1: rose is faster) and `calibration.step_times` (decode and prefill steps of both
models measured alone on this machine, raw and fitted in the simulator's `MeasuredSteps` form).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from rose.bench.options import BenchOptionsError
from rose.contracts.registry import EXECUTOR_METRICS, HEARTBEAT, LEASE_EVENT
from rose.services.executor.config import EngineSettings
from rose.services.trainer.config import GrpoSettings
from rose.shared.bus import Bus
from rose.shared.models import init_models
from rose.shared.workload import ROLLOUT_DOMINATED_JOB, TRAINER, steady_step_rate
from rose.sim import POLICIES
from rose.sim.calibration import time_steps

from .demo import DEMO_POLICY, SPEC, JobOptions, Observed, run_job, trainer_settings
from .fleet import device_plan, usable_cpus

PIN_MODES = ("auto", "none")  # auto: one core per executor (fleet.device_plan); none: every executor floats on every core
ROLLOUT_SHARE_TARGET = 0.70  # agentic RL is rollout-bound: rollout is at least this share of a static (synchronous) step

DEDICATED_ROLLOUT_SLOTS = EngineSettings().rollout_max_batch  # turns one dedicated executor runs at once (its batch)
DEFAULT_DURATION_S = 120.0  # per policy: with start-up and drain the four runs take about 12 minutes on 2 cores
# The elastic baseline's reaction times, scaled to this trace (bursts every 15 s per executor) as
# existing elastic systems' minutes are to hour-scale traffic: lend an executor after 10 s lendable,
# nothing for 10 s after a whole-job preemption.
ELASTIC_IDLE_S = 10.0
ELASTIC_COOLDOWN_S = 10.0
POLICY_ENV: dict[str, dict[str, dict[str, str]]] = {
    "static": {"scheduler": {"ROSE_LENDING__MODE": "none"}},
    "naive_share": {"serving": {"ROSE_ENGINE__POLICY": "naive_share"}, "scheduler": {"ROSE_LENDING__MODE": "always"}},
    "elastic_baseline": {
        "scheduler": {
            "ROSE_LENDING__MODE": "elastic_baseline",
            "ROSE_LENDING__IDLE_S": str(ELASTIC_IDLE_S),
            "ROSE_LENDING__COOLDOWN_S": str(ELASTIC_COOLDOWN_S),
        },
        "worker": {"ROSE_TURNS__RESUME_INTERRUPTED": "false"},
    },
    "rose": {},
}
DRAINS_LENT = {"elastic_baseline"}  # the load balancer sends a lent executor no serving traffic (it is a rollout executor while lent)


class Extra:
    """What the bench watches beside the demo's observer: raw metrics snapshots, the worker's load, lent executors."""

    def __init__(self, drain: bool) -> None:
        self.drain = drain
        self.drained: set[str] = set()
        self.snapshots: list[dict] = []
        self.worker_load: dict[str, float] = {}

    async def subscribe(self, bus: Bus, _obs: Observed) -> None:
        async def on_lease(e, _d):
            if not self.drain or "-serving-" not in e.lease.executor_id:
                return
            if e.kind == "granted":
                self.drained.add(e.lease.executor_id)
            elif e.kind in ("revoked", "expired"):
                self.drained.discard(e.lease.executor_id)

        async def on_metrics(s, _d):
            self.snapshots.append(
                {
                    "at": s.at,
                    "executor": s.executor_id,
                    "role": s.role,
                    "serving_running": s.serving_running,
                    "rollout_running": s.rollout_running,
                    "tpot_ms": s.tpot_ms.sum / s.tpot_ms.count if s.tpot_ms.count else None,
                    "rollout_tokens_per_s": s.rollout_tokens_per_s,
                    "serving_arrivals": s.serving_arrivals,
                    "interval_s": s.interval_s,
                    "device_utilization": s.device.utilization if s.device else None,
                    "forward_lag": s.device.forward_lag if s.device else None,  # emulated devices only: the host keeping up
                }
            )

        async def on_heartbeat(b, _d):
            self.worker_load = dict(b.load)

        await bus.subscribe(LEASE_EVENT, on_lease)
        await bus.subscribe(EXECUTOR_METRICS, on_metrics)
        await bus.subscribe(HEARTBEAT, on_heartbeat, service="rollout_worker")


# ---- figures ------------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def _mean(values: list[float]) -> float | None:
    return float(statistics.fmean(values)) if values else None


def _complete_batches(trajectories: list, per_step: int) -> list[list]:
    """Each step's batch (the trainer's groups `{run}-s{step}-g{i}`) in step order, incomplete ones left out."""
    batches: dict[str, list] = {}
    for t in trajectories:
        match = re.search(r"-s(\d+)-g\d+$", t.group_id)
        if match and t.turns:
            batches.setdefault(match.group(1), []).append(t)
    return [ts for _, ts in sorted(batches.items(), key=lambda kv: int(kv[0])) if len(ts) >= per_step]


def batch_rollout_spans(trajectories: list, per_step: int) -> list[float]:
    """Rollout time of each step's batch: from the first turn of its first trajectory starting to its last
    trajectory finishing; incomplete batches left out."""
    return [max(t.finished_at for t in ts) - min(t.turns[0].started_at for t in ts) for ts in _complete_batches(trajectories, per_step)]


def batch_tails(trajectories: list, per_step: int) -> list[float]:
    """Each complete batch's tail: from the time 90 % of its trajectories had finished to its last one's finish
    (the simulator's ``tail_s_per_step``, sim/trainer_state.py ``took``): what more capacity does not shorten."""
    tails = []
    for ts in _complete_batches(trajectories, per_step):
        fins = sorted(t.finished_at for t in ts)
        tails.append(fins[-1] - fins[int(0.9 * (len(fins) - 1))])
    return tails


def later_turns(trajectories: list) -> dict[str, float | None]:
    """Of the turns after a trajectory's first (the ones a prefix cache can serve): ``prefix_hit_rate``, the share
    that found any of their prefix cached where they ran (the simulator's ``prefix_hit_rate``); ``prefix_reuse``, of
    the context the turn before computed (``reusable_context``), the share found cached where the turn ran (the
    simulator's): one minus the share prefilled again; and ``moved``, the share that ran on another executor than the
    turn before (a move re-prefills unless a cache followed it). A turn that finds only its first turn's prompt cached
    counts whole in the first and in part in the second: random placement scores such partial hits often (any earlier
    turn's executor can serve one). vLLM's and SGLang's cache hit rate (cached / prompt tokens) also counts the
    turn's new tokens, which no cache holds: its ceiling is the workload's, not placement's."""
    pairs = [(prev, turn) for t in trajectories for prev, turn in zip(t.turns, t.turns[1:])]
    if not pairs:
        return {"prefix_hit_rate": None, "prefix_reuse": None, "moved": None}
    reusable = [reusable_context(prev, turn) for prev, turn in pairs]
    cached, context = sum(min(turn.prefix_cached_tokens, r) for (_, turn), r in zip(pairs, reusable)), sum(reusable)
    return {
        "prefix_hit_rate": sum(turn.prefix_cached_tokens > 0 for _, turn in pairs) / len(pairs),
        "prefix_reuse": cached / context if context else None,
        "moved": sum(turn.executor_id != prev.executor_id for prev, turn in pairs) / len(pairs),
    }


def reusable_context(prev, turn) -> int:
    """The tokens of ``turn``'s prompt a cache could serve: what the executor retains of ``prev`` (its prompt and
    output, all but the last token, whose KV was never computed), matched by the executor's own rule."""
    from rose.services.executor.prefix_cache import reusable_tokens  # imports torch: only when a run is read

    held = (*prev.prompt_token_ids, *prev.token_ids[:-1])
    return reusable_tokens(held, 0, tuple(turn.prompt_token_ids), 0)


def max_in_flight(trajectories: list) -> int:
    """The most trajectories between their first turn's start and their end at one time (the demand the
    fleet saw: the worker's concurrency caps it)."""
    edges = sorted(edge for t in trajectories if t.turns and t.finished_at for edge in ((t.turns[0].started_at, 1), (t.finished_at, -1)))
    level = peak = 0
    for _, step in edges:  # at a tie an end (-1) sorts first: back to back is not at once
        level += step
        peak = max(peak, level)
    return peak


def trajectories_per_step(trainer: dict[str, str]) -> int:
    """A GRPO step's batch, from the trainer's settings (groups per step x group size)."""
    return int(trainer["ROSE_GRPO__GROUPS_PER_STEP"]) * int(trainer["ROSE_GRPO__GROUP_SIZE"])


def prefetch_steps(trainer: dict[str, str]) -> int:
    """Batches the trainer hands out ahead of the one it trains, from its settings (its default where unset)."""
    return int(trainer.get("ROSE_GRPO__PREFETCH_STEPS", GrpoSettings().prefetch_steps))


def step_figures(steps: list, prefetch: int = 0) -> dict:
    """Steady-state step rate (shared/workload.py ``steady_step_rate``: after the ``prefetch`` batches handed out
    with the first) and the trainer's wait for rollouts, from TrainingStep events (in step order)."""
    steps = sorted(steps, key=lambda s: s.step)
    intervals = [b.at - a.at for a, b in zip(steps, steps[1:])]
    waits = [max(0.0, dt - b.train_s - b.publish_s) for dt, b in zip(intervals, steps[1:])]
    return {
        "rl_steps_per_hour": steady_step_rate([s.at for s in steps], prefetch),
        "trainer_wait_s_per_step": _median(waits),
        "step_s": _median(intervals),
        "step_s_all": [round(x, 3) for x in intervals],
        "train_s_per_step": _mean([s.train_s for s in steps]),
        "publish_s_per_step": _mean([s.publish_s for s in steps]),
    }


def held_intervals(lease_events: list[tuple[float, str, str]], executor: str, end: float) -> list[tuple[float, float]]:
    """(from, to) of every stretch the executor held a lease, from the LeaseEvents (at, executor, kind)."""
    out, since = [], None
    for at, _e, kind in sorted(ev for ev in lease_events if ev[1] == executor):
        if kind in ("granted", "renewed") and since is None:
            since = at
        elif kind in ("revoked", "expired") and since is not None:
            out.append((since, at))
            since = None
    if since is not None:
        out.append((since, max(since, end)))
    return out


def lent_fraction(lease_events: list[tuple[float, str, str]], serving: list[str], start: float, end: float) -> float:
    """Share of (serving executors x window) under an active lease."""
    if end <= start or not serving:
        return 0.0
    held = sum(max(0.0, min(b, end) - max(a, start)) for ex in serving for a, b in held_intervals(lease_events, ex, end))
    return held / ((end - start) * len(serving))


def max_lent_at_once(lease_events: list[tuple[float, str, str]], serving: list[str], end: float) -> int:
    """The most serving executors that held a lease at the same moment."""
    edges = sorted((t, d) for ex in serving for a, b in held_intervals(lease_events, ex, end) for t, d in ((a, 1), (b, -1)))
    most = now = 0
    for _t, d in edges:  # at a tie the release (-1) comes first
        now += d
        most = max(most, now)
    return most


def serving_step_model(snapshots: list[dict]) -> dict:
    """The serving executors' decode step model fitted from their metrics, as the SLO monitor fits it."""
    from rose.services.slo_monitor.headroom import fit_step_model

    obs = [
        (float(s["serving_running"]), float(s["rollout_running"]), float(s["tpot_ms"]))
        for s in snapshots
        if s["role"] == "serving" and s["tpot_ms"] is not None
    ]
    m = fit_step_model(obs, SPEC.slo_tpot_ms)
    return {"base_ms": m.base_ms, "per_serving_ms": m.per_serving_ms, "per_rollout_ms": m.per_rollout_ms, "observations": m.observations}


def policy_figures(summary: dict, obs: Observed, extra: Extra) -> dict:
    turns = [u for t in obs.trajectories.values() for u in t.turns]
    trajectories = [t for t in obs.trajectories.values() if t.status == "completed"]
    serving = sorted({r["executor"] for r in obs.serving.requests} | {ex for ex in summary["rollout"]["tokens_by_executor"] if "-serving-" in ex})
    times = [r["t"] for r in obs.serving.requests]
    by_ex = summary["rollout"]["tokens_by_executor"]
    # the dedicated executor's snapshots while it had rollout work: its throughput, and how busy its device (the
    # pinned core: executor and forward child) was; well under 1, rollout is bound elsewhere and more devices add little
    rolling_out = [s for s in extra.snapshots if s["role"] == "dedicated" and s["rollout_running"] > 0]
    arrivals = [s["serving_arrivals"] / s["interval_s"] for s in extra.snapshots if s["role"] == "serving" and s["interval_s"] > 0]
    steps = step_figures(obs.steps, prefetch_steps(summary["job"]["trainer"]))
    per_step = trajectories_per_step(summary["job"]["trainer"])  # the settings the trainer ran with
    spans = batch_rollout_spans(list(obs.trajectories.values()), per_step)
    later = later_turns(trajectories)
    return {
        "rl_steps_per_hour": steps["rl_steps_per_hour"],
        "rollout_s_per_step": _median(spans),
        # rollout time of a step's batch / the step interval (medians): with synchronous steps the rest is training and publishing
        "rollout_share_of_step": _ratio(_median(spans), steps["step_s"]),
        "tail_s_per_step": _median(batch_tails(list(obs.trajectories.values()), per_step)),
        "serving_slo_attainment": summary["serving"]["slo_attainment"],
        "rollout_tokens_per_s": summary["rollout"]["tokens_per_s"],
        "steps": summary["training"]["steps"],
        "reward_first": summary["training"]["reward_first"],
        "reward_last": summary["training"]["reward_last"],
        "trajectories_lost": summary["trajectories"]["lost"],
        "trainer_exit": summary.get("trainer_exit", ""),  # the trainer ended the job before the window (why); "": it did not
        "trajectories_failed": summary["trajectories"]["failed"],
        "trajectories_published": summary["trajectories"]["published"],
        "serving_requests": summary["serving"]["requests"],
        "ttft_p99_ms": summary["serving"]["ttft_p99_ms"],
        "tpot_p99_ms": summary["serving"]["tpot_p99_ms"],
        "slo_alerts": summary["serving"]["slo_alerts"],
        "harvested_fraction": summary["rollout"]["harvested_fraction"],
        "dedicated_device_busy": _mean([s["device_utilization"] for s in rolling_out if s["device_utilization"] is not None]),
        "rollout_tokens_on_serving": sum(v for ex, v in by_ex.items() if "-serving-" in ex),
        "rollout_tokens_by_executor": by_ex,
        "leases_granted": summary["rollout"]["leases_granted"],
        "leases_revoked": summary["rollout"]["leases_revoked"],
        "lent_fraction": lent_fraction(obs.lease_events, serving, min(times, default=0.0), max(times, default=0.0)),
        "max_lent_at_once": max_lent_at_once(obs.lease_events, serving, max(times, default=0.0)),
        "resumed_turns": int(extra.worker_load.get("resumed", 0)),
        "discarded_tokens": int(extra.worker_load.get("discarded_tokens", 0)),
        "hedged_turns": int(extra.worker_load.get("hedges", 0)),  # duplicates started (placed with the route or asked for when late)
        "hedge_wins": int(extra.worker_load.get("hedge_wins", 0)),  # ... of which the duplicate finished first (the other copy was aborted)
        "prefix_hit_rate": later["prefix_hit_rate"],
        "prefix_reuse": later["prefix_reuse"],
        "later_turns_moved": later["moved"],
        "calibration": {
            **{k: steps[k] for k in ("step_s", "step_s_all", "trainer_wait_s_per_step", "train_s_per_step", "publish_s_per_step")},
            "rollout_s_per_batch_all": [round(x, 3) for x in spans],
            "trajectories_per_step": per_step,
            "trajectories_in_flight_max": max_in_flight(list(obs.trajectories.values())),
            "turns_per_trajectory": _mean([len(t.turns) for t in trajectories]),
            "tokens_per_turn": _mean([len(u.token_ids) for u in turns]),
            "prompt_tokens_per_turn": _mean([len(u.prompt_token_ids) for u in turns]),
            "turn_s_p50": _median([u.finished_at - u.started_at for u in turns]),
            "turn_s_p90": float(np.percentile([u.finished_at - u.started_at for u in turns], 90)) if turns else None,
            "serving_arrival_rps_per_executor": _mean(arrivals),
            "dedicated_rollout_tokens_per_s": _mean([s["rollout_tokens_per_s"] for s in rolling_out]),
            "serving_step_model": serving_step_model(extra.snapshots),
        },
    }


# ---- step times of the models alone (simulator calibration) ---------------------------------


def e2e_step_times(models: Path, reps: int = 5) -> dict:
    """Decode steps (batch x context 64) and prefill steps of both models on one CPU thread
    (sim/calibration.py ``time_steps``); least-squares fits in `MeasuredSteps` form."""
    import torch

    from rose.services.executor.model_runner import kv_shape_of
    from rose.shared.models import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict = {"threads": 1, "context_tokens": 64}
    try:
        for name in ("serving", "policy"):
            model = load_model(models / name)
            decode_s, prefill_s = time_steps(
                model, name, context=out["context_tokens"], repeats=reps, batches=(1, 2, 4, 8, 16, 32), prefills=(16, 32, 64, 128)
            )
            decode, prefill = sorted(decode_s.items()), sorted(prefill_s.items())
            d = np.polyfit([b for b, _ in decode], [s for _, s in decode], 1)
            f = np.polyfit([p for p, _ in prefill], [s for _, s in prefill], 1)
            out[name] = {
                "kv_bytes_per_token": kv_shape_of(model).bytes_per_token(),
                "decode_s": [[b, s] for b, s in decode],
                "prefill_s": [[p, s] for p, s in prefill],
                "measured_steps": {
                    "decode_base_s": max(0.0, float(d[1])),
                    "decode_per_seq_s": max(0.0, float(d[0])),
                    "prefill_base_s": max(0.0, float(f[1])),
                    "prefill_per_token_s": max(0.0, float(f[0])),
                },
            }
    finally:
        torch.set_num_threads(threads)
    return out


# ---- the run ------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def run_ratios(policies: dict[str, dict]) -> tuple[float | None, float | None]:
    """(rose's RL steps/h over static's, rose's rollout time per step over elastic_baseline's); None where
    either side did not run or measured no rate."""
    rose, static, elastic = policies.get("rose", {}), policies.get("static", {}), policies.get("elastic_baseline", {})
    return (
        _ratio(rose.get("rl_steps_per_hour"), static.get("rl_steps_per_hour")),
        _ratio(rose.get("rollout_s_per_step"), elastic.get("rollout_s_per_step")),
    )


def demand_settings(demand: int, dedicated: int) -> tuple[dict[str, str], dict[str, str]]:
    """(the worker's settings, the trainer's) for a rollout demand: the worker keeps ``demand`` x the
    trajectories the dedicated executors run at once in flight (the simulator's ``rollout_demand``),
    and a step asks for at least that many. Demand 1 is the default job exactly (worker 32, a step
    of 8 groups of 8); at demand 2 the dedicated executor has a second batch queued behind the one it
    runs, the case where lending can shorten a step (a dedicated pool that keeps up gains nothing)."""
    if demand < 1:
        raise BenchOptionsError(f"rollout demand is a multiple of the dedicated executors' batch, at least 1; got {demand}")
    in_flight = demand * dedicated * DEDICATED_ROLLOUT_SLOTS
    group_size, groups = int(TRAINER["ROSE_GRPO__GROUP_SIZE"]), int(TRAINER["ROSE_GRPO__GROUPS_PER_STEP"])
    return {"ROSE_CONCURRENCY": str(in_flight)}, {"ROSE_GRPO__GROUPS_PER_STEP": str(max(groups, math.ceil(in_flight / group_size)))}


def _with_worker(env: dict[str, dict[str, str]], worker: dict[str, str]) -> dict[str, dict[str, str]]:
    return {**env, "worker": {**env.get("worker", {}), **worker}}


def default_serving(pin: str, dedicated: int) -> int:
    """The demo's two serving executors, or, pinned, as many as the cores left after the dedicated ones allow (at least one)."""
    return 2 if pin == "none" else max(1, min(2, len(usable_cpus()) - dedicated))


@dataclass(frozen=True, kw_only=True)
class E2eOptions:
    """What a `rose bench e2e` run measures (cli/bench.py says each): the demo's job under each of ``policies``,
    ``duration_s`` of trace and training each (or until ``until_steps`` trainer steps), on ``serving`` (default: the
    demo's 2, pinned at most the cores left, ``default_serving``) and ``dedicated`` executors pinned per ``pin``, with
    ``rollout_demand`` x the dedicated executors' batch in flight (``demand_settings``)."""

    seed: int = 0
    duration_s: float = DEFAULT_DURATION_S
    policies: tuple[str, ...] = POLICIES
    serving: int | None = None
    dedicated: int = 1
    warm_start_steps: int | None = None
    pin: str = "auto"
    rollout_demand: int = 1
    until_steps: int | None = None

    def __post_init__(self) -> None:
        if self.pin not in PIN_MODES:
            raise BenchOptionsError(f"unknown pin mode {self.pin!r}; choose from {', '.join(PIN_MODES)}")
        unknown = sorted(set(self.policies) - set(POLICIES))
        if unknown:
            raise BenchOptionsError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")

    def chosen(self) -> list[str]:
        """The policies to run, in POLICIES' order."""
        return [p for p in POLICIES if p in self.policies]


def run_e2e_bench(options: E2eOptions, out_json: str, model_dir: str | None = None, console: Console | None = None) -> dict:
    """Each chosen policy's run of the demo's job on a fresh fleet, one after another; the result (also written to
    ``out_json``, plotted beside it, each run's report and logs under ``<name>-runs/``). ``model_dir``: models to
    reuse (default: built under ``<name>-runs/models``)."""
    console = console or Console()
    worker_env, demand_job = demand_settings(options.rollout_demand, options.dedicated)
    job = {**ROLLOUT_DOMINATED_JOB, **demand_job}
    serving = default_serving(options.pin, options.dedicated) if options.serving is None else options.serving
    devices = device_plan(SPEC, serving, options.dedicated) if options.pin == "auto" else None  # raises, naming the fix, if cores are short
    # SIGTERM (a test's or CI's timeout) ends the run like Ctrl-C, so the fleet is stopped, not orphaned
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    path = Path(out_json).resolve()
    root = path.parent / f"{path.stem}-runs"
    models = Path(model_dir).resolve() if model_dir else root / "models"
    if not (models / "policy" / "config.json").exists():
        console.print(f"building the models under {models} ...")
        init_models(models, 0, DEMO_POLICY)
    console.print("measuring the models' step times alone (calibration) ...")
    step_times = e2e_step_times(models)
    result = result_head(options, serving, worker_env, job, step_times, serving_prompt_tokens(models))
    for policy in options.chosen():
        run = JobOptions(
            duration_s=options.duration_s,
            seed=options.seed,
            models_dir=models,
            serving=serving,
            dedicated=options.dedicated,
            label=f"rose bench e2e · {policy}",
            env=_with_worker(POLICY_ENV[policy], worker_env),
            warm_start_steps=options.warm_start_steps,
            until_steps=options.until_steps,
            job=job,
            devices=devices,
        )
        result["policies"][policy] = run_policy_job(policy, run, root / policy, console)
        result["devices"] = result["policies"][policy]["devices"]  # observed: each executor's process tree's CPU set (the same plan for every policy)
    p = result["policies"]
    result["speedup_vs_static"], result["rollout_time_ratio_vs_elastic"] = run_ratios(p)
    share = p.get("static", {}).get("rollout_share_of_step")
    result["job"]["static_rollout_share_of_step"] = share
    result["job"]["rollout_dominated_measured"] = None if share is None else share >= ROLLOUT_SHARE_TARGET
    result["calibration"] = {"step_times": step_times}
    path.parent.mkdir(parents=True, exist_ok=True)
    result["plot"] = str(plot(result, path.with_suffix(".png")))
    path.write_text(json.dumps(result, indent=2))
    print_table(result, console)
    console.print(f"JSON: {path}; plot: {result['plot']}; per-policy reports and logs under {root}")
    return result


def serving_prompt_tokens(models: Path) -> float:
    """The serving clients' mean prompt length in the serving model's tokens."""
    from rose.shared.models import load_tokenizer

    from .fleet import PROMPTS

    tokenizer = load_tokenizer(models / "serving")
    return statistics.fmean(len(tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS)


def run_policy_job(policy: str, run: JobOptions, out: Path, console: Console) -> dict:
    """One policy's run of the job under ``out``: its figures (``policy_figures``), the executors' CPU sets, its wall time."""
    console.rule(f"[bold]{policy}[/bold]: {run.duration_s:.0f} s of the demo's RL job")
    obs, extra = Observed(), Extra(policy in DRAINS_LENT)
    started = time.monotonic()
    summary = asyncio.run(run_job(out, run, console, drained=extra.drained, on_bus=extra.subscribe, obs=obs))
    return {
        **policy_figures(summary, obs, extra),
        "devices": summary["job"]["devices"],
        "wall_s": time.monotonic() - started,
        "report": str(out),
    }


def result_head(options: E2eOptions, serving: int, worker_env: dict[str, str], job: dict[str, str], step_times: dict, prompt_tokens: float) -> dict:
    """The result's settings, before any policy runs: the fleet, the trainer, the job and what differs from the demo, the
    setup the simulator's calibration reads (sim/calibration.py e2e_setup)."""
    return {
        "seed": options.seed,
        "duration_s": options.duration_s,
        "until_steps": options.until_steps,
        "serving_executors": serving,
        "dedicated_executors": options.dedicated,
        "fleet": {
            "slo_ttft_ms": SPEC.slo_ttft_ms,
            "slo_tpot_ms": SPEC.slo_tpot_ms,
            "base_rps": SPEC.base_rps,
            "burst_factor": SPEC.burst_factor,
            "burst_every_s": SPEC.burst_every_s,
            "burst_len_s": SPEC.burst_len_s,
            "serving_max_tokens": SPEC.serving_max_tokens,
            "rollout_max_tokens": SPEC.rollout_max_tokens,
            "worker_concurrency": int(worker_env["ROSE_CONCURRENCY"]),
        },
        "trainer": {**trainer_settings(options.seed, options.warm_start_steps), **job},
        "policy_settings": POLICY_ENV,
        "elastic_drains_lent_executors": True,
        # the job: the demo's (shared/workload.py TRAINER) with these changes, so that rollout dominates a static step as in agentic RL
        "job": {
            "differs_from_demo": job,
            "rollout_dominated": True,
            # in-flight trajectories over what the dedicated executors run at once (1: they keep up)
            "rollout_demand": options.rollout_demand,
            "trajectories_per_step": trajectories_per_step({**TRAINER, **job}),
            "rollout_share_target": ROLLOUT_SHARE_TARGET,
            "serving_executors_demo": 2,
            "serving_executors": serving,
        },
        "pin": options.pin,
        "devices": {},
        # what the simulator's calibration (sim/calibration.py e2e_setup) would otherwise assume
        "setup": {
            "serving_prompt_tokens": prompt_tokens,
            "serving_output_tokens": SPEC.serving_max_tokens,
            "serving_kv_bytes": SPEC.serving_kv_mib << 20,
            "rollout_kv_bytes": SPEC.rollout_kv_mib << 20,
            "serving_kv_bytes_per_token": step_times["serving"]["kv_bytes_per_token"],
            "policy_kv_bytes_per_token": step_times["policy"]["kv_bytes_per_token"],
        },
        "policies": {},
    }


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


SATURATED = 0.9  # a dedicated device busier than this while it has rollout work is the rollout's bottleneck


def _busy_words(busy: float | None) -> str:
    """What the static run's dedicated device utilization says about lending."""
    if busy is None:
        return "the dedicated device's utilization was not reported"
    head = f"the dedicated device was busy {busy:.0%} of the time it had rollout work under static"
    if busy < SATURATED:
        return head + " (it keeps up: rollout is bound elsewhere, and lent devices add little)"
    return head + " (saturated: lent devices add capacity where rollout waits for it)"


def print_table(result: dict, console: Console) -> None:
    p = result["policies"]
    static, elastic = p.get("static", {}), p.get("elastic_baseline", {})
    table = Table(title=f"rose bench e2e: the demo's RL job, {result['duration_s']:.0f} s per policy (seed {result['seed']})")
    for col in (
        "policy",
        "RL steps/h",
        "× static",
        "rollout s/step",
        "× elastic",
        "rollout share",
        "SLO attainment",
        "rollout tok/s",
        "on serving",
        "lent",
        "leases +/-",
        "reward first→last",
        "lost",
    ):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for name, f in p.items():
        table.add_row(
            name,
            _fmt(f["rl_steps_per_hour"], ".0f"),
            _fmt(_ratio(f["rl_steps_per_hour"], static.get("rl_steps_per_hour"))),
            _fmt(f["rollout_s_per_step"]),
            _fmt(_ratio(f["rollout_s_per_step"], elastic.get("rollout_s_per_step"))),
            _fmt(f["rollout_share_of_step"], ".0%"),
            _fmt(f["serving_slo_attainment"], ".3f"),
            _fmt(f["rollout_tokens_per_s"], ".0f"),
            _fmt(f["harvested_fraction"], ".0%"),
            _fmt(f["lent_fraction"], ".0%"),
            f"{f['leases_granted']}/{f['leases_revoked']}",
            f"{_fmt(f['reward_first'])}→{_fmt(f['reward_last'])}",
            str(f["trajectories_lost"]),
        )
    console.print(table)
    devices = ", ".join(f"{ex}: CPU {cpus}" for ex, cpus in sorted(result["devices"].items()))
    console.print(
        f"executors {'pinned, one core each' if result['pin'] == 'auto' else 'unpinned'} ({devices}); the trainer and the light services float. "
        f"Static rollout share of a step: {_fmt(result['job']['static_rollout_share_of_step'], '.0%')} (rollout-dominated job: >= "
        f"{ROLLOUT_SHARE_TARGET:.0%}); {_busy_words(static.get('dedicated_device_busy'))}"
    )
    console.print(
        f"rose vs static: {_fmt(result['speedup_vs_static'])}× RL steps/h (paper: 1.3-3.3×); rose vs elastic_baseline: "
        f"{_fmt(result['rollout_time_ratio_vs_elastic'])}× rollout time per step (paper: 1/1.5-1/1.2 = 0.67-0.83)"
    )


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = result["policies"]
    names = list(p)
    colours = {"static": "tab:gray", "naive_share": "tab:red", "elastic_baseline": "tab:orange", "rose": "tab:green"}
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    panels = (
        ("rl_steps_per_hour", "RL steps per hour"),
        ("rollout_s_per_step", "rollout time of a step's batch, s"),
        ("serving_slo_attainment", "serving SLO attainment"),
        ("rollout_tokens_per_s", "rollout tokens/s"),
    )
    for ax, (key, title) in zip(axes, panels):
        values = [p[n][key] or 0.0 for n in names]
        ax.bar(names, values, color=[colours.get(n, "tab:blue") for n in names])
        if key == "rollout_tokens_per_s":  # the part harvested from serving executors
            ax.bar(
                names,
                [p[n][key] * p[n]["harvested_fraction"] for n in names],
                color="none",
                edgecolor="black",
                hatch="//",
                label="on serving executors",
            )
            ax.legend(fontsize=7)
        if key == "serving_slo_attainment":
            ax.set_ylim(0, 1.05)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelrotation=25, labelsize=8)
    fig.suptitle(
        f"rose bench e2e ({result['duration_s']:.0f} s per policy): speedup vs static {_fmt(result['speedup_vs_static'])}×, "
        f"rollout time vs elastic {_fmt(result['rollout_time_ratio_vs_elastic'])}×"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
