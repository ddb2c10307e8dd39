"""`rose plan`: how much rollout a serving fleet can lend, from a trace.

Its arguments beside the code that runs it; the simulator loads only when it runs.
"""

from __future__ import annotations

import argparse
import sys

from rose.sim import MODEL_SIZES, ROLLOUT_MODES


def register(commands: argparse._SubParsersAction) -> None:
    """Add `rose plan` to `rose`'s commands."""
    p = commands.add_parser(
        "plan", help="how much rollout a serving fleet can lend, hour by hour, at what SLO risk and in which rollout mode (from a trace)"
    )
    p.add_argument("--trace", required=True, help="CSV in the Azure LLM inference trace format: TIMESTAMP,ContextTokens,GeneratedTokens")
    p.add_argument("--fleet", required=True, help="COUNTxKIND, e.g. 64xH100 (KIND: A100, H100, H200)")
    p.add_argument("--model", required=True, choices=MODEL_SIZES, help="size of the serving model (and of the RL policy, unless --policy-model)")
    p.add_argument(
        "--policy-model",
        default=None,
        choices=MODEL_SIZES,
        help="size of the RL policy trained beside it (default: --model's); the serving fleet runs a product model, not the policy",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="serving p99 TTFT SLO")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="serving p99 TPOT SLO")
    p.add_argument("--scale", default="auto", help="multiply the trace's request rate (auto: its busiest hour at 45%% of the fleet's SLO capacity)")
    p.add_argument(
        "--demand",
        nargs="*",
        type=float,
        default=[1.0, 2.0, 4.0],
        help="rollout demand levels to simulate (static vs rose) for the expected speedup (none: skip the simulation)",
    )
    p.add_argument("--dedicated-ratio", type=float, default=0.25, help="dedicated rollout GPUs per serving GPU in that simulation")
    p.add_argument(
        "--rollout-modes",
        nargs="+",
        choices=ROLLOUT_MODES,
        default=None,
        help="how rollout shares a serving instance: two_model (a policy copy on a lane of its own) and co_batched (the policy a "
        "LoRA adapter of the serving model, its sequences rows in serving's own iterations); the plan says per demand which pays "
        "(default: both where the policy is the serving model's size, else two_model)",
    )
    p.add_argument("--json", default="bench-out/plan.json", help="where to write the JSON result (the PNG goes beside it)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rose.sim.plan import run_plan
    from rose.sim.traces import TraceError

    try:
        run_plan(
            trace=args.trace,
            fleet=args.fleet,
            model=args.model,
            policy_model=args.policy_model,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
            scale=args.scale,
            out_json=args.json,
            console=Console(),
            demands=tuple(args.demand),
            dedicated_ratio=args.dedicated_ratio,
            rollout_modes=tuple(args.rollout_modes) if args.rollout_modes else None,
        )
    except (TraceError, ValueError) as exc:
        print(f"rose plan: {exc}", file=sys.stderr)
        return 2
    return 0
