"""`rose provision`'s arguments and runner, in a module apart from provision.py: that one imports the bus (NATS, OpenTelemetry)
at the top, and `rose`'s parser, which every command builds (each service `rose up` starts among them), would pay for it.
"""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction) -> None:
    """Add `rose provision` to `rose`'s commands."""
    p = commands.add_parser("provision", help="create every stream, KV bucket and object store with N replicas (once, before services start)")
    p.add_argument("--replicas", type=int, default=None, help="replicas of each (default: ROSE_BUS__REPLICAS, else 1); 3 on a 3-node cluster")
    p.add_argument("--nats-url", default=None, help="NATS server(s), comma-separated (default: NATS_URL / ROSE_BUS__URL)")
    p.add_argument("--retry-for", type=float, default=60.0, help="seconds to retry while a JetStream cluster is still forming")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .provision import provision_command

    return provision_command(args)
