"""`rose status`'s arguments and runner, in a module apart from status.py: that one imports the bus (NATS, OpenTelemetry)
at the top, and `rose`'s parser, which every command builds (each service `rose up` starts among them), would pay for it.
"""

from __future__ import annotations

import argparse
import asyncio


def register(commands: argparse._SubParsersAction) -> None:
    """Add `rose status` to `rose`'s commands."""
    p = commands.add_parser(
        "status", help="the live fleet from its heartbeats: one line per service (an executor's role, lease, tokens/s, queue, version)"
    )
    p.add_argument("name", nargs="?", default=None, help="one service or instance: everything it reports (endpoints, labels, load)")
    p.add_argument("--endpoints", action="store_true", help="each service's endpoints below its line")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--nats-url", default=None, help="NATS to ask (default: NATS_URL, else the one `rose up` started)")
    p.add_argument("--state-dir", default=None, help="state dir of the `rose up` to ask (default: $ROSE_STATE_DIR or ./.rose)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .status import status

    return asyncio.run(status(args))
