"""`rose models init`: tiny local models in Hugging Face format.

Its arguments beside the code that runs it; rose.shared.models (torch, transformers) loads only when it runs.
"""

from __future__ import annotations

import argparse

from rose.bench.options import MODEL_PRESET_NAMES


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
    m.set_defaults(func=init)


def init(args: argparse.Namespace) -> int:
    from rose.shared.models import init_models

    paths = init_models(args.dir, seed=args.seed, preset=args.preset)
    print(f"serving model: {paths.serving}\npolicy model:  {paths.policy}")
    return 0
