"""`rose run SERVICE`: one service in the foreground, the process `rose up` and docker compose start.

Its arguments beside the code that runs it; the service's module loads only when it runs.
"""

from __future__ import annotations

import argparse
import importlib

from .service_table import EMULATED_EXECUTORS_MODULE, SERVICE_MODULES


def register(commands: argparse._SubParsersAction) -> None:
    """Add `rose run` to `rose`'s commands."""
    p = commands.add_parser("run", help="run one service in the foreground (what `rose up` and docker compose start)")
    p.add_argument("service", choices=sorted(SERVICE_MODULES) or ["(none yet)"], help="the service to run")
    p.add_argument("service_args", nargs=argparse.REMAINDER, help="arguments for the service, e.g. --config FILE")
    p.set_defaults(func=run_service)


def run_service(args: argparse.Namespace) -> int:
    name = SERVICE_MODULES[args.service]
    if args.service == "executor" and any(a == "--emulate" or a.startswith("--emulate=") for a in args.service_args):
        name = EMULATED_EXECUTORS_MODULE  # a group of emulated executors in this one process
    return importlib.import_module(name).main(args.service_args)
