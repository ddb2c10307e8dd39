"""`rose bench trl`: Hugging Face TRL's GRPOTrainer through ROSE against ROSE's own trainer, on the demo's job, in one run.

For each seed, the demo's RL job (bench/demo.py `run_job`: serving executors taking the replayed
bursty trace, a dedicated rollout executor, the SLO monitor, the scheduler, the weight publisher and
a rollout worker, each its own process, auth on) runs twice on fresh fleets: with the reference
trainer (`rose`), then with TRL's GRPOTrainer and rose.integrations.trl's `rollout_func` (`trl`,
bench/trl_trainer.py). The same start and the same job: the policy is warm-started once (the
reference trainer's warm start with the demo's settings) and both trainers start from it (the
reference trainer's own warm start off); the same problems (the reference trainer's task seeds),
group size, groups per step, turns, tokens per turn, lr and epochs, both synchronous (the demo's
`prefetch_steps` 0; TRL's GRPOTrainer is synchronous), one torch thread each. Each run ends after
`until_steps` steps (at most `duration_s`).

Figures per seed and trainer (`runs`): `rl_steps_per_hour` (shared/workload.py `steady_step_rate`
over the TrainingStep events both trainers publish, as `rose bench e2e` counts them), the median
step, `train_s_per_step` (the trainer's own training of a batch) and `around_training_s_per_step`
(the rest of a step: publishing, rolling the next batch out, handing it over), the reward of every
step, `reward_first` / `reward_last` (mean of the first and last fifth of the steps) and their
`reward_gain`, serving SLO attainment and trajectories lost. Per seed, `steps_per_hour_ratio`
(trl / rose) and `integration_steps_per_hour_ratio` (the same had TRL trained a batch in ROSE's
trainer's time: what the integration costs, TRL's own training speed apart); over the seeds, each
one's median, least and most, and each trainer's reward gains (`meets_target` /
`integration_meets_target`: the median ratio is at least `TARGET_RATIO`, the issue's "at most 10 %
of steps per hour"). What differs between the two trainers beyond the trainer itself: TRL's loss is its `grpo`
loss (a sequence's token mean, then the batch's, as the reference trainer's; its advantage is
normalised by the group's std + 1e-4 where the reference trainer's adds 1e-6) and TRL samples the
batch's problems at random from the 16 where the reference trainer cycles through them.
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rose.shared.models import init_models
from rose.shared.workload import TRAINER, steady_step_rate

from .demo import DEFAULT_DURATION_S, DEMO_POLICY, Observed, reward_ends, run_job
from .trl_trainer import warm_start_policy

TRAINERS = ("rose", "trl")
TARGET_RATIO = 0.9  # the issue's target: the integration costs at most 10 % of ROSE's own trainer's steps per hour
DEFAULT_UNTIL_STEPS = 20


def run_figures(summary: dict, obs: Observed) -> dict:
    """One run's figures from its report and the TrainingStep events it observed (in step order)."""
    steps = sorted(obs.steps, key=lambda s: s.step)
    rewards = [s.reward_mean for s in steps]
    first, last = reward_ends(rewards)
    # a step's interval less the trainer's own training: publishing, waiting for the batch's rollouts, handing out
    around = [b.at - a.at - b.train_s for a, b in zip(steps, steps[1:])]
    return {
        "steps": len(steps),
        "rl_steps_per_hour": steady_step_rate([s.at for s in steps], 0),
        "step_s": statistics.median([b.at - a.at for a, b in zip(steps, steps[1:])]) if len(steps) > 1 else None,
        "around_training_s_per_step": statistics.median(around) if around else None,
        "rewards": [round(r, 4) for r in rewards],
        "reward_first": first,
        "reward_last": last,
        "reward_gain": None if first is None or last is None else last - first,
        "train_s_per_step": statistics.median(s.train_s for s in steps[1:]) if len(steps) > 1 else None,
        "publish_s_per_step": statistics.fmean(s.publish_s for s in steps) if steps else None,
        "serving_slo_attainment": summary["serving"]["slo_attainment"],
        "rollout_tokens_per_s": summary["rollout"]["tokens_per_s"],
        "harvested_fraction": summary["rollout"]["harvested_fraction"],
        "trajectories_lost": summary["trajectories"]["lost"],
        "trajectories": summary["trajectories"]["published"],
        "trainer_exit": summary.get("trainer_exit", ""),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def run_trl_bench(
    *,
    out_json: str,
    seeds: list[int],
    duration_s: float | None = None,
    until_steps: int = DEFAULT_UNTIL_STEPS,
    serving: int = 2,
    dedicated: int = 1,
    warm_start_steps: int | None = None,
    model_dir: str | None = None,
    console: Console | None = None,
) -> dict:
    console = console or Console()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a timeout ends the run like Ctrl-C: the fleet is stopped
    path = Path(out_json).resolve()
    root = path.parent / f"{path.stem}-runs"
    models = Path(model_dir).resolve() if model_dir else root / "models"
    if not (models / "policy" / "config.json").exists():
        console.print(f"building the models under {models} ...")
        init_models(models, 0, DEMO_POLICY)
    sft_steps = int(TRAINER["ROSE_SFT__STEPS"]) if warm_start_steps is None else warm_start_steps
    console.print(f"warm-starting the policy once for both trainers ({sft_steps} supervised steps) ...")
    warm = warm_start_policy(models / "policy", TRAINER, sft_steps) if sft_steps else None
    duration = duration_s or DEFAULT_DURATION_S * 3  # room for `until_steps` steps on a busy box; the steps end the run
    result: dict = {
        "seeds": seeds,
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
                    duration,
                    seed,
                    models,
                    serving,
                    dedicated,
                    console,
                    label=f"rose bench trl · seed {seed} · {trainer}",
                    obs=obs,
                    warm_start_steps=0,  # both start from the policy warm-started above
                    until_steps=until_steps,
                    trl=trainer == "trl",
                )
            )
            runs[trainer] = {**run_figures(summary, obs), "wall_s": time.monotonic() - started, "report": str(root / f"seed{seed}-{trainer}")}
        runs["steps_per_hour_ratio"] = _ratio(runs["trl"]["rl_steps_per_hour"], runs["rose"]["rl_steps_per_hour"])
        runs["integration_steps_per_hour_ratio"] = integration_ratio(runs["rose"], runs["trl"])
    summarize(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print_table(result, console)
    console.print(f"JSON: {path}; each run's report and logs under {root}")
    return result


def integration_ratio(rose: dict, trl: dict) -> float | None:
    """TRL-through-ROSE's steps per hour over ROSE's had TRL trained a batch as fast as ROSE's trainer: ROSE's step
    over ROSE's training plus what TRL's step spent around its training (publishing, rolling out through ROSE),
    i.e. what the integration costs, apart from TRL's own training speed."""
    parts = (rose["train_s_per_step"], rose["around_training_s_per_step"], trl["around_training_s_per_step"])
    if any(p is None for p in parts):
        return None
    rose_train, rose_around, trl_around = parts
    return (rose_train + rose_around) / (rose_train + trl_around)


def summarize(result: dict) -> None:
    """Over the seeds: the steps-per-hour ratio's median and spread, each trainer's reward gains, and the target."""
    runs = result["runs"].values()
    for key in ("steps_per_hour_ratio", "integration_steps_per_hour_ratio"):
        ratios = [r[key] for r in runs if r[key] is not None]
        result[key] = {"median": statistics.median(ratios) if ratios else None, "least": min(ratios, default=None), "most": max(ratios, default=None)}
    for trainer in TRAINERS:
        gains = [r[trainer]["reward_gain"] for r in runs if r[trainer]["reward_gain"] is not None]
        result[f"{trainer}_reward_gain"] = {"median": statistics.median(gains) if gains else None, "each": gains}
    result["trajectories_lost"] = sum(r[t]["trajectories_lost"] for r in runs for t in TRAINERS)
    for key, target in (("meets_target", "steps_per_hour_ratio"), ("integration_meets_target", "integration_steps_per_hour_ratio")):
        median = result[target]["median"]
        result[key] = median is not None and median >= TARGET_RATIO


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(result: dict, console: Console) -> None:
    """One row per seed, the two trainers side by side (fits an 80-column terminal)."""
    table = Table(title="rose bench trl: TRL through ROSE (trl) vs ROSE's trainer (rose), steps per hour and reward")
    # steps/h of each; their ratio; the ratio had TRL trained a batch in rose's time; reward, first fifth > last fifth
    for col in ("seed", "rose/h", "trl/h", "ratio", "same train", "rose reward", "trl reward", "lost"):
        table.add_column(col, justify="left" if col == "seed" else "right", no_wrap=True)
    for seed, runs in result["runs"].items():
        rose, trl = runs["rose"], runs["trl"]
        table.add_row(
            seed,
            _fmt(rose["rl_steps_per_hour"], ".0f"),
            _fmt(trl["rl_steps_per_hour"], ".0f"),
            _fmt(runs["steps_per_hour_ratio"], ".2f"),
            _fmt(runs["integration_steps_per_hour_ratio"], ".2f"),
            f"{_fmt(rose['reward_first'], '.2f')}>{_fmt(rose['reward_last'], '.2f')}",
            f"{_fmt(trl['reward_first'], '.2f')}>{_fmt(trl['reward_last'], '.2f')}",
            str(rose["trajectories_lost"] + trl["trajectories_lost"]),
        )
    console.print(table)
    for seed, runs in result["runs"].items():
        rose, trl = runs["rose"], runs["trl"]
        console.print(
            f"seed {seed}: a batch's training {_fmt(rose['train_s_per_step'], '.2f')} s rose, {_fmt(trl['train_s_per_step'], '.2f')} s trl; "
            f"the rest of a step {_fmt(rose['around_training_s_per_step'], '.2f')} s rose, {_fmt(trl['around_training_s_per_step'], '.2f')} s trl"
        )
    for key, met, what in (
        ("steps_per_hour_ratio", "meets_target", "steps/h trl / rose"),
        ("integration_steps_per_hour_ratio", "integration_meets_target", "the same at ROSE's training time per batch (the integration's cost)"),
    ):
        ratio = result[key]
        console.print(
            f"{what}: median {_fmt(ratio['median'], '.2f')} (least {_fmt(ratio['least'], '.2f')}, most {_fmt(ratio['most'], '.2f')}); "
            f"target >= {TARGET_RATIO}: {'met' if result[met] else 'missed'}"
        )
    console.print(f"reward gain median: rose {_fmt(result['rose_reward_gain']['median'])}, trl {_fmt(result['trl_reward_gain']['median'])}")
    for seed, runs in result["runs"].items():
        pairs = list(zip(runs["rose"]["rewards"], runs["trl"]["rewards"]))
        console.print(f"seed {seed} reward per step (rose / trl): " + "  ".join(f"{a:.2f}/{b:.2f}" for a, b in pairs))
