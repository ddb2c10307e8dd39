"""`rose health`: exit 0 when a service is really up, for container healthchecks and scripts.

"Up" means what the rest of ROSE relies on: a fresh heartbeat in the `rose_services` KV bucket
with state `ready` (the same data `rose status` lists), optionally from this host only (inside a
container: this container), and optionally a 2xx from an HTTP endpoint such as the executor's
`/health` or nats-server's `/healthz`. Exit 1 says why it is not healthy; 2 is a usage error.

Credentials: the environment's (`ROSE_BUS__NKEY_SEED_FILE`, ...) when set, else the operator's of
the `rose up` whose state dir is `--state-dir` (default `ROSE_STATE_DIR`, else `./.rose`), found in
its `up.json` when that `rose up` started the server being checked. In a container that is the service's own seed, so the check connects as that
service (its inbox) and uses only what every service may do: read the registry bucket without a
consumer (stream info, then a get per key) and, while JetStream cannot answer, listen for its own
heartbeats on core NATS (a right in `rose.shared.security.EXTRA_RIGHTS`); on an executor instance's
own seed (`executor@NAME.nk`) only that instance's, so its check names it: `--instance NAME`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import time
from typing import TYPE_CHECKING

from .service_table import SERVICE_MODULES

if TYPE_CHECKING:
    from rose.contracts.service import Heartbeat

# The bus (nats-py, the contracts) is imported only for a heartbeat check: a container healthcheck
# runs this every few seconds, and `--http` alone (a NATS node's) needs none of it.


async def _heartbeats(url: str, timeout: float, service: str, instance: str | None = None, state_dir: str | None = None) -> list[Heartbeat]:
    """The registry's heartbeats; while JetStream cannot answer (a cluster electing a new leader),
    the live heartbeats of `service` on core NATS, which need no stream."""
    import msgspec
    import nats.errors
    from nats.js.errors import BucketNotFoundError

    from rose.contracts.registry import SERVICE_REGISTRY

    from .provision import connect_bus
    from .status import operator_config

    config = msgspec.structs.replace(operator_config(url, state_dir), initial_connect_deadline_s=timeout, connect_timeout_s=timeout)
    # As `service`: with its own seed (a container's healthcheck) only its inbox prefix receives replies.
    bus = await connect_bus(config, instance or f"health-{os.getpid()}", service=service)  # an instance's seed reads replies under its name only
    try:
        try:
            return await bus.kv_values(SERVICE_REGISTRY)
        except BucketNotFoundError:  # nothing has ever started on this server
            return []
        except (TimeoutError, nats.errors.Error):
            return await _live_heartbeats(bus, service, timeout, instance)
    finally:
        await bus.close()


async def _live_heartbeats(bus, service: str, timeout: float, instance: str | None = None) -> list[Heartbeat]:
    from rose.contracts.registry import HEARTBEAT

    beats: list[Heartbeat] = []
    heard = asyncio.Event()

    async def on_beat(beat: Heartbeat, _delivery) -> None:
        beats.append(beat)
        heard.set()

    await bus.subscribe(HEARTBEAT, on_beat, service=service, **({"instance": instance} if instance else {}))
    try:
        await asyncio.wait_for(heard.wait(), timeout)
    except TimeoutError:
        pass
    return beats


def _heartbeat_problem(beats: list[Heartbeat], service: str, instance: str | None, host: str | None) -> str | None:
    """None when a matching, fresh, ready heartbeat exists; otherwise what is missing."""
    from .status import STALE_AFTER_BEATS

    now = time.time()
    mine = [b for b in beats if b.service == service and (instance is None or b.instance == instance) and (host is None or b.host == host)]
    who = service + (f" instance {instance}" if instance else "") + (f" on host {host}" if host else "")
    if not mine:
        return f"no heartbeat from {who}"
    fresh = [b for b in mine if now - b.sent_at <= STALE_AFTER_BEATS * max(b.interval_s, 0.5)]
    if not fresh:
        newest = max(mine, key=lambda b: b.sent_at)
        return f"heartbeat of {who} is stale ({now - newest.sent_at:.0f}s old)"
    if not any(b.state == "ready" for b in fresh):
        return f"{who} is {', '.join(sorted({b.state for b in fresh}))}, not ready"
    return None


async def _http_problem(url: str, timeout: float) -> str | None:
    import urllib.error  # here, not at the top: `rose`'s parser imports this module for every command
    import urllib.request

    def get() -> str | None:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as reply:  # noqa: S310 - the URL the operator gave
                return None if 200 <= reply.status < 300 else f"{url} answered {reply.status}: {reply.read(200)!r}"
        except urllib.error.HTTPError as exc:
            return f"{url} answered {exc.code}: {exc.read(200).decode(errors='replace')}"
        except (TimeoutError, urllib.error.URLError, OSError) as exc:
            return f"{url} unreachable: {exc!r}"

    return await asyncio.to_thread(get)


async def check(args: argparse.Namespace) -> str | None:
    """The first problem found, or None when healthy."""
    if args.http:
        problem = await _http_problem(args.http, args.timeout)
        if problem:
            return problem
    if args.service:
        from rose.shared.config import ConfigError

        from .status import resolve_nats_url

        url = resolve_nats_url(args.nats_url, args.state_dir)
        try:
            beats = await _heartbeats(url, args.timeout, args.service, args.instance, args.state_dir)
        except (ConnectionError, ConfigError, PermissionError) as exc:  # PermissionDenied: these credentials may not read heartbeats
            return str(exc)
        host = socket.gethostname() if args.local else None
        return _heartbeat_problem(beats, args.service, args.instance, host)
    return None


def register(commands: argparse._SubParsersAction) -> None:
    """Add `rose health` to `rose`'s commands."""
    p = commands.add_parser("health", help="exit 0 when a service has a fresh 'ready' heartbeat (and --http answers 2xx): container healthchecks")
    p.add_argument("service", nargs="?", choices=sorted(SERVICE_MODULES), help="the service whose heartbeat must be fresh and ready")
    p.add_argument("--instance", default=None, help="only this instance id")
    p.add_argument("--local", action="store_true", help="only heartbeats from this host (in a container: this container)")
    p.add_argument("--http", default=None, metavar="URL", help="also require a 2xx from this URL (e.g. the executor's /health)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds for connecting and for the HTTP check")
    p.add_argument("--nats-url", default=None, help="NATS to ask (default: NATS_URL, else the one `rose up` started)")
    p.add_argument("--state-dir", default=None, help="state dir of the `rose up` to ask (default: $ROSE_STATE_DIR or ./.rose)")
    p.set_defaults(func=health_command)


def health_command(args: argparse.Namespace) -> int:
    if not args.service and not args.http:
        print("rose health: name a SERVICE (heartbeat check) and/or give --http URL", file=sys.stderr)
        return 2
    problem = asyncio.run(check(args))
    if problem:
        print(f"unhealthy: {problem}")
        return 1
    print("healthy")
    return 0
