"""`rose bench trl`: Hugging Face TRL's GRPOTrainer through ROSE against ROSE's own trainer and against TRL alone, on the
demo's job, in one run.

For each seed, three arms, each from the same start on the same job:

- `rose`: the demo's RL job (bench/demo.py `run_job`: serving executors taking the replayed bursty trace, a dedicated
  rollout executor, the SLO monitor, the scheduler, the weight publisher and a rollout worker, each its own process,
  auth on) on a fresh fleet with the reference trainer;
- `trl`: the same on a fresh fleet with TRL's GRPOTrainer and rose.integrations.trl's `rollout_func` as the trainer
  (bench/trl_trainer.py);
- `alone`: TRL's GRPOTrainer generating by itself (`use_vllm=False`, the trainer's own `model.generate`), no fleet
  (bench/trl_alone.py): what a TRL user has without ROSE.

The same start and the same job: the policy is warm-started once (the reference trainer's warm start with the demo's
settings) and every arm starts from it (the reference trainer's own warm start off); the same problems (the
reference trainer's task seeds), group size, groups per step, turns, tokens per turn, lr and epochs, all synchronous
(the demo's `prefetch_steps` 0; TRL's GRPOTrainer is synchronous), one torch thread each; the two TRL arms run the
example's own arguments and `GRPOConfig` and the same seed. Each run ends after `until_steps` steps (at most
`duration_s`).

Figures per seed and arm (`runs`): `rl_steps_per_hour` (shared/workload.py `steady_step_rate` over the steps' ends: the
TrainingStep events both fleet trainers publish, as `rose bench e2e` counts them, and TRL alone's batches), the
median step, `train_s_per_step` (the trainer's own training of a batch), `training_share` (of the step: where time
goes) and `around_training_s_per_step` (the rest of a step: publishing, rolling the next batch out or generating it,
handing it over), the reward of every step, `reward_first` / `reward_last` (mean of the first and last fifth of the
steps) and their `reward_gain`; for the fleet arms serving SLO attainment and trajectories lost. Per seed, the two
ratios of steps per hour: `steps_per_hour_ratio` (trl / rose: the issue's "the integration costs at most 10 % of
steps per hour against ROSE's own trainer", which TRL's own training time decides) and `trl_over_alone_ratio`
(trl / alone: what generating through ROSE is worth to a TRL user, its training the same on both sides); over the
seeds each one's median, least and most against `TARGET_RATIO` (`meets_target`, `alone_meets_target`), and each
arm's reward gains and training shares. What differs between TRL and the reference trainer beyond the trainer itself:
TRL's loss is its `grpo` loss (a sequence's token mean, then the batch's, as the reference trainer's; its advantage
is normalised by the group's std + 1e-4 where the reference trainer's adds 1e-6) and TRL samples the batch's problems
at random from the 16 where the reference trainer cycles through them.
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rose.shared.models import init_models
from rose.shared.workload import TRAINER, steady_step_rate

from .demo import DEFAULT_DURATION_S, DEMO_POLICY, JobOptions, Observed, reward_ends, run_job, trainer_settings
from .trl_trainer import run_trl_alone, warm_start_policy

TRAINERS = ("rose", "trl")  # the arms that run the demo's job on a fleet
ARMS = (*TRAINERS, "alone")  # and TRL generating by itself (bench/trl_alone.py)
# the issue's target: the integration costs at most 10 % of steps per hour; held to both baselines
TARGET_RATIO = 0.9
RATIOS = {"meets_target": "steps_per_hour_ratio", "alone_meets_target": "trl_over_alone_ratio"}  # target met -> the ratio
RATIO_NAMES = {"steps_per_hour_ratio": "steps/h trl / rose (the issue's)", "trl_over_alone_ratio": "steps/h trl / alone (the integration's worth)"}
DEFAULT_UNTIL_STEPS = 20


def step_figures(at: list[float], train_s: list[float], rewards: list[float]) -> dict:
    """A run's step figures from each step's end (`at`), its training (`train_s`) and its mean reward, in step order."""
    first, last = reward_ends(rewards)
    intervals = [b - a for a, b in zip(at, at[1:])]
    # a step's interval less the trainer's own training: publishing, waiting for the batch's rollouts, handing out
    around = [d - t for d, t in zip(intervals, train_s[1:])]
    step_s = statistics.median(intervals) if intervals else None
    train = statistics.median(train_s[1:]) if len(train_s) > 1 else None
    return {
        "steps": len(at),
        "rl_steps_per_hour": steady_step_rate(at, 0),
        "step_s": step_s,
        "train_s_per_step": train,
        "training_share": train / step_s if train is not None and step_s else None,  # where a step's time goes
        "around_training_s_per_step": statistics.median(around) if around else None,
        "rewards": [round(r, 4) for r in rewards],
        "reward_first": first,
        "reward_last": last,
        "reward_gain": None if first is None or last is None else last - first,
    }


def run_figures(summary: dict, obs: Observed) -> dict:
    """One fleet run's figures from its report and the TrainingStep events it observed (in step order)."""
    steps = sorted(obs.steps, key=lambda s: s.step)
    return {
        **step_figures([s.at for s in steps], [s.train_s for s in steps], [s.reward_mean for s in steps]),
        "publish_s_per_step": statistics.fmean(s.publish_s for s in steps) if steps else None,
        "serving_slo_attainment": summary["serving"]["slo_attainment"],
        "rollout_tokens_per_s": summary["rollout"]["tokens_per_s"],
        "harvested_fraction": summary["rollout"]["harvested_fraction"],
        "trajectories_lost": summary["trajectories"]["lost"],
        "trajectories": summary["trajectories"]["published"],
        "trainer_exit": summary.get("trainer_exit", ""),
    }


def alone_figures(batches: list[dict]) -> dict:
    """TRL alone's figures from its batches (bench/trl_alone.py `Batch`): the same step figures, and its generation."""
    figures = step_figures([b["at"] for b in batches], [b["train_s"] for b in batches], [b["reward_mean"] for b in batches])
    rollout = [b["rollout_s"] for b in batches[1:]]
    return {**figures, "generate_s_per_step": statistics.median(rollout) if rollout else None, "trajectories_lost": 0}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


@dataclass(frozen=True, kw_only=True)
class TrlOptions:
    """What a `rose bench trl` run compares: every arm at each of ``seeds``, each run ending after ``until_steps`` steps
    (at most ``duration_s``, default 3x the demo's window), the fleet arms on ``serving`` + ``dedicated`` executors, all
    from one warm start of ``warm_start_steps`` supervised steps (default: the demo's)."""

    seeds: tuple[int, ...] = (0,)
    until_steps: int = DEFAULT_UNTIL_STEPS
    duration_s: float | None = None
    serving: int = 2
    dedicated: int = 1
    warm_start_steps: int | None = None


def run_trl_bench(options: TrlOptions, out_json: str, model_dir: str | None = None, console: Console | None = None) -> dict:
    """Every arm at every seed; the result (also written to ``out_json``, each run's report and logs under
    ``<name>-runs/``). ``model_dir``: models to reuse (their policy is warm-started in place, once)."""
    console = console or Console()
    seeds, until_steps, duration_s = options.seeds, options.until_steps, options.duration_s
    serving, dedicated, warm_start_steps = options.serving, options.dedicated, options.warm_start_steps
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a timeout ends the run like Ctrl-C: the fleet is stopped
    path = Path(out_json).resolve()
    root = path.parent / f"{path.stem}-runs"
    models = Path(model_dir).resolve() if model_dir else root / "models"
    if not (models / "policy" / "config.json").exists():
        console.print(f"building the models under {models} ...")
        init_models(models, 0, DEMO_POLICY)
    sft_steps = int(TRAINER["ROSE_SFT__STEPS"]) if warm_start_steps is None else warm_start_steps
    console.print(f"warm-starting the policy once for every arm ({sft_steps} supervised steps) ...")
    warm = warm_start_policy(models / "policy", TRAINER, sft_steps) if sft_steps else None
    duration = duration_s or DEFAULT_DURATION_S * 3  # room for `until_steps` steps on a busy box; the steps end the run
    result: dict = {
        "seeds": list(seeds),
        "until_steps": until_steps,
        "duration_s": duration,
        "serving_executors": serving,
        "dedicated_executors": dedicated,
        "job": {**TRAINER, "ROSE_SFT__STEPS": "0"},
        "warm_start": warm,
        "target_ratio": TARGET_RATIO,
        "runs": {},
    }
    for seed in seeds:
        runs: dict[str, Any] = {}
        result["runs"][str(seed)] = runs
        for trainer in TRAINERS:
            console.rule(f"[bold]seed {seed} · {trainer}[/bold]: the demo's RL job, until {until_steps} steps")
            obs, started = Observed(), time.monotonic()
            summary = asyncio.run(
                run_job(
                    root / f"seed{seed}-{trainer}",
                    JobOptions(
                        duration_s=duration,
                        seed=seed,
                        models_dir=models,
                        serving=serving,
                        dedicated=dedicated,
                        label=f"rose bench trl · seed {seed} · {trainer}",
                        warm_start_steps=0,  # every arm starts from the policy warm-started above
                        until_steps=until_steps,
                        trl=trainer == "trl",
                    ),
                    console,
                    obs=obs,
                )
            )
            runs[trainer] = {**run_figures(summary, obs), "wall_s": time.monotonic() - started, "report": str(root / f"seed{seed}-{trainer}")}
        console.rule(f"[bold]seed {seed} · alone[/bold]: TRL generating by itself, no fleet, {until_steps} steps")
        started, out = time.monotonic(), root / f"seed{seed}-alone"
        batches = run_trl_alone(trainer_settings(seed, 0), models / "policy", out, until_steps, duration)
        runs["alone"] = {**alone_figures(batches), "wall_s": time.monotonic() - started, "report": str(out)}
        arm_ratios(runs)
    summarize(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print_table(result, console)
    console.print(f"JSON: {path}; each run's report and logs under {root}")
    return result


def arm_ratios(runs: dict[str, Any]) -> None:
    """A seed's two ratios of steps per hour: the issue's (TRL through ROSE over ROSE's own trainer) and the
    integration's worth to a TRL user (TRL through ROSE over TRL generating by itself)."""
    trl = runs["trl"]["rl_steps_per_hour"]
    runs["steps_per_hour_ratio"] = _ratio(trl, runs["rose"]["rl_steps_per_hour"])
    runs["trl_over_alone_ratio"] = _ratio(trl, runs["alone"]["rl_steps_per_hour"])


def summarize(result: dict) -> None:
    """Over the seeds: each ratio's median and spread, each arm's reward gains and training share, and the targets."""
    runs = result["runs"].values()
    for key in RATIOS.values():
        ratios = [r[key] for r in runs if r[key] is not None]
        result[key] = {"median": statistics.median(ratios) if ratios else None, "least": min(ratios, default=None), "most": max(ratios, default=None)}
    for arm in ARMS:
        for figure in ("reward_gain", "training_share"):
            values = [r[arm][figure] for r in runs if r[arm][figure] is not None]
            result[f"{arm}_{figure}"] = {"median": statistics.median(values) if values else None, "each": values}
    result["trajectories_lost"] = sum(r[t]["trajectories_lost"] for r in runs for t in TRAINERS)
    for key, ratio in RATIOS.items():
        median = result[ratio]["median"]
        result[key] = median is not None and median >= TARGET_RATIO


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(result: dict, console: Console) -> None:
    """One row per seed, the three arms side by side (fits an 80-column terminal), then where each step's time goes."""
    table = Table(title="rose bench trl: steps per hour of TRL through ROSE (trl), ROSE's trainer (rose), TRL alone")
    for col in ("seed", "rose/h", "trl/h", "alone/h", "trl/rose", "trl/alone", "lost"):
        table.add_column(col, justify="left" if col == "seed" else "right", no_wrap=True)
    for seed, runs in result["runs"].items():
        rose, trl, alone = runs["rose"], runs["trl"], runs["alone"]
        table.add_row(
            seed,
            *(_fmt(arm["rl_steps_per_hour"], ".0f") for arm in (rose, trl, alone)),
            _fmt(runs["steps_per_hour_ratio"], ".2f"),
            _fmt(runs["trl_over_alone_ratio"], ".2f"),
            str(rose["trajectories_lost"] + trl["trajectories_lost"]),
        )
    console.print(table)
    for seed, runs in result["runs"].items():
        for arm in ARMS:
            r = runs[arm]
            console.print(
                f"seed {seed} {arm:>5}: a step {_fmt(r['step_s'], '.1f')} s, training {_fmt(r['train_s_per_step'], '.1f')} s "
                f"({_fmt(r['training_share'], '.0%')}), the rest {_fmt(r['around_training_s_per_step'], '.1f')} s; "
                f"reward {_fmt(r['reward_first'], '.2f')} > {_fmt(r['reward_last'], '.2f')}"
            )
    for key, ratio in RATIOS.items():
        r = result[ratio]
        console.print(
            f"{RATIO_NAMES[ratio]}: median {_fmt(r['median'], '.2f')} (least {_fmt(r['least'], '.2f')}, most {_fmt(r['most'], '.2f')}); "
            f"target >= {TARGET_RATIO}: {'met' if result[key] else 'missed'}"
        )
    gains = ", ".join(f"{arm} {_fmt(result[f'{arm}_reward_gain']['median'])}" for arm in ARMS)
    console.print(f"reward gain median: {gains}")
