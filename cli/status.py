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
    if args.name:
        chosen = [b for b in beats if args.name in (b.service, b.instance)]
        if not chosen:
            print(f"rose status: no live service or instance named {args.name!r} on {url}")
            return 1
        beats = chosen
    if args.json:
        rows: list[dict[str, Any]] = [msgspec.to_builtins(b) for b in beats]
        print(json.dumps({"nats_url": url, "services": rows}, indent=2))
        return 0
    if not beats:
        print(f"no live services on {url}")
        return 0
    lines = service_details(beats, time.time()) if args.name else fleet_view(beats, time.time(), endpoints=args.endpoints)
    print(f"ROSE on {url}: {len(beats)} services, {sum(b.state == 'ready' for b in beats)} ready")
    print("\n".join(lines))
    return 0


# The fleet view's columns: (title, width); one line per service within VIEW_WIDTH, whatever the fleet.
VIEW_WIDTH = 80
COLUMNS = (("SERVICE", 8), ("INSTANCE", 19), ("STATE", 5), ("ROLE", 9), ("LEASE", 6), ("SRV TOK/S", 9), ("RL TOK/S", 8), ("QUEUE", 5))
SHORT_NAMES = {"slo_monitor": "slo", "scheduler": "sched", "rollout_worker": "worker", "weight_publisher": "weights"}  # the rest fit
STATES = {"ready": "ready", "starting": "start", "draining": "drain"}
# what the fleet view says of a service that is not an executor: (label, load key), the first ones it reports
SUMMARIES = {
    "slo_monitor": (("ttft p99 ms", "ttft_p99_ms"), ("tpot p99 ms", "tpot_p99_ms"), ("executors", "executors")),
    "scheduler": (("granted", "granted"), ("routed", "routed"), ("revoked", "revoked")),
    "trainer": (("step", "steps"), ("version", "version"), ("reward", "reward_last")),
    "weight_publisher": (("published", "published"), ("queued", "queued")),
    "rollout_worker": (("episodes", "episodes"), ("failed", "failed"), ("resumed turns", "resumed_turns")),
    "gateway": (("episodes", "episodes"), ("open", "active_episodes"), ("turns", "turns")),
}


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "~"


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 or float(value).is_integer() else f"{value:.1f}"


def fleet_view(beats: list[Heartbeat], now: float, *, endpoints: bool = False) -> list[str]:
    """One line per service at most ``VIEW_WIDTH`` columns: an executor's role, lease, serving and rollout tokens/s,
    its queue (serving + rollout) and policy version; another service's state and its own figures in their place.
    ``endpoints``: each service's endpoints below it, one per line."""
    widths = [w for _, w in COLUMNS]
    lines = [" ".join(title.ljust(w) for title, w in COLUMNS).rstrip() + " VER"]
    for b in beats:
        head = [_cut(SHORT_NAMES.get(b.service, b.service), widths[0]), _cut(b.instance, widths[1]), STATES.get(b.state, b.state)[: widths[2]]]
        if b.service == "executor":
            load = b.load
            lease = "parked" if load.get("lease_parked") else "lent" if load.get("lease_held") else "-"
            role = b.labels.get("role", "-")
            queue = _number(load["serving_queue"] + load.get("rollout_queue", 0.0)) if "serving_queue" in load else "-"
            cells = [_cut(role, widths[3]), lease, _number(load.get("serving_tokens_per_s")), _number(load.get("rollout_tokens_per_s")), queue]
            line = " ".join(c.ljust(w) for c, w in zip(head + cells, widths)) + " " + _number(load.get("policy_version"))
        else:
            summary = ", ".join(f"{label} {_number(b.load[key])}" for label, key in SUMMARIES.get(b.service, ()) if key in b.load)
            line = " ".join(c.ljust(w) for c, w in zip(head, widths)) + " " + (summary or f"up {now - b.started_at:.0f}s")
        lines.append(_cut(line.rstrip(), VIEW_WIDTH))
        if endpoints:
            lines += [f"    {name} {address}" for name, address in sorted(b.endpoints.items())]
    return lines


def service_details(beats: list[Heartbeat], now: float) -> list[str]:
    """`rose status NAME`: everything one service (or each instance of it) reports: state, age, endpoints, labels, load."""
    lines: list[str] = []
    for b in beats:
        lines.append(f"{b.service} {b.instance}: {b.state}, version {b.version}, pid {b.pid} on {b.host}, up {now - b.started_at:.0f}s")
        lines += [f"  endpoint {name}: {address}" for name, address in sorted(b.endpoints.items())]
        lines += [f"  label {name}: {value}" for name, value in sorted(b.labels.items())]
        lines += [f"  load {name}: {value:g}" for name, value in sorted(b.load.items())]
    return lines
