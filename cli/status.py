"""`rose status`: the live services, read from their heartbeats in the `rose_services` KV bucket."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import msgspec
from nats.js.errors import BucketNotFoundError
from rich.console import Console
from rich.table import Table

from rose.contracts.registry import SERVICE_REGISTRY
from rose.contracts.service import Heartbeat
from rose.shared.bus import Bus
from rose.shared.config import DEFAULT_NATS_URL, BusConfig, ConfigError
from rose.shared.nats_server import state_dir

STALE_AFTER_BEATS = 3.0
UP_FILE = "up.json"


def resolve_nats_url(explicit: str | None, state: str | None) -> str:
    """--nats-url, else NATS_URL, else the server a `rose up` in this state dir started, else the default."""
    if explicit:
        return explicit
    if os.environ.get("NATS_URL"):
        return os.environ["NATS_URL"]
    up_file = (Path(state).resolve() if state else state_dir()) / UP_FILE
    if up_file.exists():
        return json.loads(up_file.read_text())["nats_url"]
    return DEFAULT_NATS_URL


def operator_config(url: str, state: str | None = None) -> BusConfig:
    """Bus settings for an operator command: the environment's credentials, else those of the `rose up` that started `url`.

    `rose up` keeps the operator's NKey seed (and, with --tls, the CA) in its state dir and names
    them in up.json, so `rose status` and `rose health` work against it without any variable.
    """
    from .provision import bus_config_from_env

    config = msgspec.structs.replace(bus_config_from_env(url=url), initial_connect_deadline_s=3.0)
    if config.creds_file or config.nkey_seed_file or config.user:
        return config
    up_file = (Path(state).resolve() if state else state_dir()) / UP_FILE
    up = json.loads(up_file.read_text()) if up_file.exists() else {}
    if up.get("nats_url") != url or not up.get("operator_seed_file"):
        return config
    return msgspec.structs.replace(config, nkey_seed_file=up["operator_seed_file"], tls_ca_file=up.get("tls_ca_file", "") or config.tls_ca_file)


async def live_services(url: str, config: BusConfig | None = None) -> list[Heartbeat]:
    config = config or BusConfig(url=url, initial_connect_deadline_s=3.0)
    async with Bus(config, service="cli", instance=f"cli-{os.getpid()}") as bus:
        try:
            beats: list[Heartbeat] = await bus.kv_values(SERVICE_REGISTRY)
        except BucketNotFoundError:  # nothing has started on this server yet
            return []
    now = time.time()
    fresh = [b for b in beats if now - b.sent_at <= STALE_AFTER_BEATS * max(b.interval_s, 0.5)]
    return sorted(fresh, key=lambda b: (b.service, b.instance))


async def status(args: argparse.Namespace) -> int:
    url = resolve_nats_url(args.nats_url, args.state_dir)
    try:
        beats = await live_services(url, operator_config(url, args.state_dir))
    except (ConnectionError, ConfigError) as exc:
        print(f"rose status: {exc}")
        return 2
    if args.json:
        rows: list[dict[str, Any]] = [msgspec.to_builtins(b) for b in beats]
        print(json.dumps({"nats_url": url, "services": rows}, indent=2))
        return 0
    table = Table(title=f"ROSE services on {url}")
    for col in ("service", "instance", "state", "version", "age", "endpoints", "load"):
        table.add_column(col)
    now = time.time()
    for b in beats:
        table.add_row(
            b.service,
            b.instance,
            b.state,
            b.version,
            f"{now - b.started_at:.0f}s",
            " ".join(f"{k}={v}" for k, v in b.endpoints.items()),
            " ".join(f"{k}={v:g}" for k, v in sorted(b.load.items())),
        )
    Console().print(table if beats else f"no live services on {url}")
    return 0
