"""`rose up`'s arguments and runner, in a module apart from up.py: that one imports the bus (NATS, OpenTelemetry)
at the top, and `rose`'s parser, which every command builds (each service `rose up` starts among them), would pay for it.
"""

from __future__ import annotations

import argparse

from .service_table import ON_DEMAND_SERVICES, SERVICE_MODULES


def register(commands: argparse._SubParsersAction) -> None:
    """Add `rose up` to `rose`'s commands."""
    p = commands.add_parser("up", help="start NATS (unless NATS_URL is set) and every service, supervised; Ctrl-C stops all")
    p.add_argument("--state-dir", default=None, help="where the NATS store, logs and models live (default: $ROSE_STATE_DIR or ./.rose)")
    p.add_argument(
        "--services", nargs="*", default=None, help=f"which services to start (default: {sorted(set(SERVICE_MODULES) - set(ON_DEMAND_SERVICES))})"
    )
    p.add_argument(
        "--emulate",
        default=None,
        metavar="COUNTxKIND:MODEL[+POLICY]",
        help="a dry run on emulated GPUs (services/executor/emulated.py): e.g. 8xH100:7B, serving executors and a dedicated pool beside them",
    )
    p.add_argument("--dedicated-ratio", type=float, default=0.25, help="with --emulate: dedicated rollout GPUs per serving GPU")
    p.add_argument("--time-scale", type=float, default=1.0, help="with --emulate: wall seconds per emulated second (shared/clock.py)")
    p.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for every service to report ready")
    p.add_argument(
        "--nats-cluster",
        type=int,
        default=1,
        metavar="N",
        help="NATS nodes to start: 1 (default) one embedded server; 3 the docker compose topology, a JetStream cluster whose streams and buckets "
        "get N replicas",
    )
    p.add_argument(
        "--no-auth", action="store_true", help="start the embedded NATS without authentication (default: per-service NKeys and permissions)"
    )
    p.add_argument("--tls", action="store_true", help="the embedded NATS requires TLS (a CA and server certificate made under the state dir)")
    p.add_argument(
        "--credentials",
        default=None,
        metavar="DIR",
        help="the credentials directory (`rose security init DIR`; default: STATE_DIR/security, made and reused); with NATS_URL, the server's",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .up import up

    return up(args)
