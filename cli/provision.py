"""`rose provision`: create every stream, KV bucket and object store once, with the cluster's replica count.

Services provision at start too, but on a fresh JetStream cluster the first creation races the
meta-leader election; the compose file therefore runs this once (`rose provision --replicas 3`)
before any service starts, and `rose up` calls the same code. Transient cluster errors (no meta
leader yet, a peer still catching up) are retried; a real conflict (say a stream that exists with
another replica count) stops at once with the message that says what to fix.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import msgspec
import nats.errors
from nats.js.errors import BadRequestError, ServerError, ServiceUnavailableError

from rose.shared.bus import Bus
from rose.shared.config import BusConfig, ConfigError, load_config
from rose.shared.provisioning import Provisioned, ProvisioningConflict, provision

RETRY_FOR_S = 60.0
NO_SUITABLE_PEERS = 10005  # JetStream's 400 while a forming cluster has not yet seen enough peers for R3: retried
_TRANSIENT = (ServiceUnavailableError, ServerError, nats.errors.TimeoutError, nats.errors.NoRespondersError, asyncio.TimeoutError)


class _BusSettings(msgspec.Struct, kw_only=True):
    """Only the `bus` table of a service's settings: the ROSE_BUS__* variables, NATS_URL, ROSE_CONFIG."""

    bus: BusConfig = msgspec.field(default_factory=BusConfig)


def bus_config_from_env(*, url: str | None = None, replicas: int | None = None) -> BusConfig:
    """The bus settings every service would read (credentials and TLS included), with explicit overrides."""
    config = load_config(_BusSettings).bus
    changes: dict[str, object] = {}
    if url:
        changes["url"] = url
    if replicas is not None:
        changes["replicas"] = replicas
    return msgspec.structs.replace(config, **changes) if changes else config


async def connect_bus(config: BusConfig, instance: str, *, service: str = "cli") -> Bus:
    """A connected Bus, or ConnectionError once `initial_connect_deadline_s` has passed.

    Bounded here because nats-py, told to reconnect forever, also retries an unreachable first
    connection forever; a one-shot command (a healthcheck) must answer instead. `service` names
    whose credentials these are when they are not the operator's (its inbox prefix: a service's
    user may only receive replies on its own).
    """
    bus = Bus(config, service=service, instance=instance)
    limit = config.initial_connect_deadline_s + config.connect_timeout_s
    try:
        await asyncio.wait_for(bus.connect(), timeout=limit)
    except TimeoutError:
        await bus.close()
        raise ConnectionError(f"cannot reach NATS at {config.url} within {limit:.0f}s") from None
    return bus


async def provision_storage(config: BusConfig, *, retry_for_s: float = RETRY_FOR_S) -> Provisioned:
    """Provision with `config.replicas`, retrying while a JetStream cluster is still forming."""
    deadline = time.monotonic() + retry_for_s
    bus = await connect_bus(config, f"provision-{os.getpid()}")
    try:
        while True:
            try:
                return await provision(bus.js, replicas=config.replicas)
            except (*_TRANSIENT, BadRequestError) as exc:
                if isinstance(exc, BadRequestError) and exc.err_code != NO_SUITABLE_PEERS:
                    raise
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"JetStream at {config.url} still not ready for R{config.replicas} storage after {retry_for_s:.0f}s: {exc!r}"
                    ) from exc
                await asyncio.sleep(0.5)
    finally:
        await bus.close()


def provision_command(args: argparse.Namespace) -> int:
    try:
        config = bus_config_from_env(url=args.nats_url, replicas=args.replicas)
    except (ConfigError, msgspec.ValidationError) as exc:
        print(f"rose provision: {exc}", file=sys.stderr)
        return 2
    try:
        done = asyncio.run(provision_storage(config, retry_for_s=args.retry_for))
    except ConnectionError as exc:
        print(f"rose provision: {exc}", file=sys.stderr)
        return 2
    except (ProvisioningConflict, RuntimeError) as exc:
        print(f"rose provision: {exc}", file=sys.stderr)
        return 1
    print(
        f"provisioned on {config.url} with {config.replicas} replica(s): {len(done.streams)} streams, "
        f"{len(done.kv_buckets)} KV buckets, {len(done.object_stores)} object stores; "
        f"created {', '.join(done.created) if done.created else 'nothing (all present)'}"
    )
    return 0
