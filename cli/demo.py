"""`rose demo`: a real RL job on co-elastic capacity, or with `--emulate` a dry run on emulated GPUs.

Its arguments beside the code that runs it; the bench's modules (torch, the services) load only when it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

EMULATED_DEMO_S = 60.0  # emulated seconds of `rose demo --emulate`


def register(commands: argparse._SubParsersAction) -> None:
    """Add `rose demo` to `rose`'s commands."""
    p = commands.add_parser(
        "demo", help="a real RL job on co-elastic capacity: the whole fleet, a live table, report/summary.json and plots (~5 min)"
    )
    p.add_argument(
        "--duration",
        dest="duration_s",
        metavar="DURATION",
        type=float,
        default=None,
        help="seconds of the GRPO window after the warm start (default: the demo's own, 140; with start-up, warm start and "
        "drain the whole demo takes about 5 minutes)",
    )
    p.add_argument("--seed", type=int, default=0, help="serving trace and task seed")
    p.add_argument("--out", default="report", help="where summary.json, the plots, logs and the models go")
    p.add_argument(
        "--models", dest="models_dir", metavar="MODELS", type=Path, default=None, help="a models directory to reuse (default: build them under --out)"
    )
    p.add_argument("--serving", type=int, default=2, help="serving executors (each takes a replayed trace with bursts)")
    p.add_argument("--dedicated", type=int, default=1, help="dedicated rollout executors")
    p.add_argument(
        "--warm-start-steps", type=int, default=None, metavar="N", help="the trainer's SFT warm-start steps before GRPO (default: the demo's 200)"
    )
    p.add_argument(
        "--until-steps", type=int, default=None, metavar="N", help="end the run once the trainer has taken N GRPO steps (at most --duration)"
    )
    p.add_argument(
        "--agent",
        type=Path,
        default=None,
        metavar="PATH",
        help="run the job's episodes with this agent script through the rollout gateway (e.g. examples/agents/openai_loop.py) "
        "instead of the built-in environment",
    )
    p.add_argument(
        "--trainer",
        choices=("rose", "trl"),
        default="rose",
        help="the job's trainer: ROSE's reference GRPO trainer, or Hugging Face TRL's GRPOTrainer through rose.integrations.trl (docs/trl.md)",
    )
    p.add_argument(
        "--lora",
        action="store_true",
        help="the policy a LoRA adapter of the serving model (built as `rose models init --preset demo --lora`: the serving model "
        "warm-started, --warm-start-steps N), every executor co-batching its rollout rows into serving's own batches",
    )
    g = p.add_argument_group("a dry run on emulated GPUs (bench/emulated.py): the real services, the simulator beside")
    g.add_argument("--emulate", default=None, metavar="COUNTxKIND:MODEL[+POLICY]", help="e.g. 8xH100:7B (the demo's window: 60 emulated seconds)")
    g.add_argument("--trace", default=None, metavar="CSV", help="replay this Azure-format serving trace (as `rose plan` takes)")
    g.add_argument("--dedicated-ratio", type=float, default=0.25, help="dedicated rollout GPUs per serving GPU")
    g.add_argument("--time-scale", type=float, default=2.0, help="wall seconds per emulated second (shared/clock.py)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.emulate:
        return _run_emulated(args)
    from rose.bench.demo import JobOptions, run_demo
    from rose.bench.options import options_from_args

    summary = run_demo(options_from_args(JobOptions, args, trl=args.trainer == "trl"), args.out)
    return 0 if summary["trajectories"]["lost"] == 0 else 1


def _run_emulated(args: argparse.Namespace) -> int:
    """`rose demo --emulate 8xH100:7B [--trace CSV]`: a dry run of ROSE on emulated GPUs, rose only, the simulator beside."""
    from rich.console import Console

    from rose.bench.e2e_emulated import run_emulated_e2e
    from rose.bench.emulated import EmulatedJob
    from rose.services.executor.group import EmulatedFleet

    fleet = EmulatedFleet.parse(args.emulate)
    job = EmulatedJob(
        gpus=fleet.gpus,
        device=fleet.device,
        model=fleet.serving_model,
        policy_model=fleet.policy_model,
        dedicated_ratio=args.dedicated_ratio,
        seed=args.seed,
        time_scale=args.time_scale,
        trace=args.trace or "",
    )
    result = run_emulated_e2e(
        out_json=str(Path(args.out) / "summary.json"),
        job=job,
        policies=["rose"],
        duration_s=args.duration_s or EMULATED_DEMO_S,
        until_steps=args.until_steps,
        model_dir=str(args.models_dir) if args.models_dir else None,
        console=Console(),
    )
    return 0 if result["policies"]["rose"]["trajectories_lost"] == 0 else 1
