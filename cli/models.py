"""`rose models init`: tiny local models in Hugging Face format.

Its arguments beside the code that runs it; rose.shared.models (torch, transformers) loads only when it runs.
With `--lora` the policy is a LoRA adapter of the serving model (shared/lora.py), and with `--warm-start-steps N`
the serving model is first made a trained model by the reference trainer's own warm start (services/trainer/sft.py
``warm_start_base``): a production serving model is a trained model, and a LoRA of a random network has nothing to
refine.
"""

from __future__ import annotations

import argparse

from rose.bench.options import MODEL_PRESET_NAMES
from rose.shared.lora import ALL_LINEAR, DEFAULT_LORA, LoraShape
from rose.shared.workload import TRAINER

# `--preset demo --lora` warm-starts its serving model by default, as long as the demo's trainer warm-starts its own
# policy (shared/workload.py TRAINER); `rose bench lora` measured LoRA GRPO from a base warmed this long.
DEMO_WARM_START_STEPS = int(TRAINER["ROSE_SFT__STEPS"])


def register(commands: argparse._SubParsersAction) -> None:
    """Add `rose models` and its actions to `rose`'s commands."""
    p = commands.add_parser("models", help="local models in Hugging Face format")
    actions = p.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    m = actions.add_parser("init", help="build a tiny serving model and a tiny policy model (Qwen2, real tokenizer) in DIR")
    m.add_argument("dir", help="output directory (gets serving/ and policy/)")
    m.add_argument("--seed", type=int, default=0, help="random seed of weights and tokenizer corpus")
    m.add_argument(
        "--preset",
        choices=MODEL_PRESET_NAMES,
        default="tiny",
        help="sizes: tiny (CPU, the default), demo (tiny's serving model, `rose demo`'s 0.4M-parameter policy: GRPO steps in "
        "seconds on a CPU) or qwen2.5 (Qwen2.5-0.5B / 1.5B layer shapes in bfloat16, for GPU nodes)",
    )
    m.add_argument(
        "--lora",
        action="store_true",
        help="policy/ is a LoRA adapter of serving/ (peft's format; version 0 equals the base) instead of a model of its own; "
        "with --preset demo the serving model takes the demo policy's shape",
    )
    m.add_argument("--lora-rank", type=int, default=DEFAULT_LORA.rank, help=f"the adapter's rank (default {DEFAULT_LORA.rank})")
    m.add_argument("--lora-alpha", type=float, default=DEFAULT_LORA.alpha, help=f"the adapter's alpha (default {DEFAULT_LORA.alpha:g})")
    m.add_argument(
        "--lora-targets", nargs="+", choices=ALL_LINEAR, default=list(ALL_LINEAR), metavar="MODULE", help="the linear layers adapted (default: all)"
    )
    m.add_argument(
        "--warm-start-steps",
        type=int,
        default=None,
        help="with --lora: first warm-start the serving model this many SFT steps on the environments' expert traces, with the "
        f"trainer's warm start (default {DEMO_WARM_START_STEPS} with --preset demo, the demo job's; else 0)",
    )
    m.set_defaults(func=init)


def init(args: argparse.Namespace) -> int:
    targets = tuple(t for t in ALL_LINEAR if t in args.lora_targets)
    lora = LoraShape(rank=args.lora_rank, alpha=args.lora_alpha, targets=targets) if args.lora else None
    warm = args.warm_start_steps
    if warm is not None and (lora is None or warm < 0):
        raise SystemExit("rose models init: --warm-start-steps N (N >= 0) goes with --lora: it warm-starts the serving model the adapter adapts")
    from rose.shared.models import init_models

    paths = init_models(args.dir, seed=args.seed, preset=args.preset, lora=lora)
    if lora is not None:
        warm = (DEMO_WARM_START_STEPS if args.preset == "demo" else 0) if warm is None else warm
        if warm:
            report = _warm_start(paths, lora, warm, args.preset, args.seed)
            print(f"serving model warm-started: {warm} steps, expert NLL/token {report.nll_before:.3f} -> {report.nll_after:.3f}")
    print(f"serving model: {paths.serving}\npolicy {'adapter' if lora else 'model'}: {paths.policy}")
    return 0


def _warm_start(paths, lora: LoraShape, steps: int, preset: str, seed: int):
    """The trainer's warm start on the serving model, with the demo job's tasks and SFT settings for --preset demo
    (shared/workload.py TRAINER) and the trainer's defaults otherwise; then the adapter rebuilt over the warm base."""
    import msgspec

    from rose.services.trainer.config import TrainerConfig
    from rose.services.trainer.main import tool_envs
    from rose.services.trainer.sft import warm_start_base
    from rose.shared.config import load_config

    config = load_config(TrainerConfig, env=TRAINER if preset == "demo" else {})
    return warm_start_base(paths, tool_envs(config.tasks), msgspec.structs.replace(config.sft, steps=steps), lora, seed=seed)
