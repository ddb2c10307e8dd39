"""The `rose` command: one argparse tree, each command explained by `--help`.

Each command's module registers its own arguments (`register`) beside the code that runs them, and
imports what that code needs (torch, the bus, the services) only when it runs: every `rose` command,
each service `rose up` starts among them, builds the whole parser, so building it stays cheap.
"""

from __future__ import annotations

import argparse
import sys

from rose import __version__
from rose.shared.errors import RoseError

from . import bench, contracts, demo, events_forward_args, health, models, plan, provision_args, run, security, status_args, up_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rose",
        description="ROSE: agentic-RL rollouts on the spare capacity of a serving fleet, guarding its latency SLO.",
    )
    parser.add_argument("--version", action="version", version=f"rose {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # In the order `rose --help` lists them.
    demo.register(commands)
    up_args.register(commands)
    status_args.register(commands)
    health.register(commands)
    provision_args.register(commands)
    run.register(commands)
    contracts.register(commands)
    events_forward_args.register(commands)
    security.register(commands)
    models.register(commands)
    bench.register(commands)
    plan.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. A ``RoseError`` (a bad input, a refused configuration, a mode that cannot run) is one line on
    stderr and exit code 1, not a traceback: it says what to change; anything else is a bug and keeps its traceback."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RoseError as exc:
        print(f"rose {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
