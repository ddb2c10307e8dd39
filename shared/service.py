"""The lifecycle every ROSE service shares, as one async context manager.

    async with ServiceRuntime("executor", bus=cfg.bus, runtime=cfg.runtime) as rt:
        await rt.bus.serve(GENERATE, handle, executor_id=rt.instance)
        rt.ready(endpoints={"http": url})
        await rt.wait_for_shutdown()

On entry: logging, tracing, metrics (a Prometheus endpoint, advertised as the `metrics`
endpoint), connect (with backoff), provision the registry's storage, SIGTERM/SIGINT handlers,
a heartbeat task, a "service up" event. On exit: state "draining", a "service down" event,
the heartbeat key removed, then the bus drained so in-flight replies still go out.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from rose import __version__
from rose.contracts.registry import HEARTBEAT, SERVICE_EVENT, SERVICE_REGISTRY
from rose.contracts.service import Heartbeat, ServiceEvent

from .bus import Bus, PermissionDenied
from .config import BusConfig, ConfigError, RuntimeConfig, load_config
from .metrics import MetricsServer, setup_metrics
from .metrics import flush as flush_metrics
from .provisioning import provision
from .tracing import setup_tracing

log = logging.getLogger("rose.service")

LoadFn = Callable[[], dict[str, float]]
C = TypeVar("C")


def service_main(argv: list[str], *, service: str, description: str, config_cls: type[C], run: Callable[[C], Coroutine[Any, Any, Any]]) -> int:
    """The `main(argv)` of every service: `--config FILE`, one validation pass, run until signalled.

    A bad configuration stops the service before it connects, with the field, its source
    and what is allowed (exit code 2), not a traceback.
    """
    parser = argparse.ArgumentParser(prog=f"rose run {service}", description=description)
    parser.add_argument("--config", default=None, help="TOML file (ROSE_* variables override it)")
    args = parser.parse_args(argv)
    try:
        config = load_config(config_cls, path=args.config)  # type: ignore[type-var]
    except ConfigError as exc:
        print(f"rose run {service}: {exc}", file=sys.stderr)
        return 2
    asyncio.run(run(config))
    return 0


def default_instance(service: str) -> str:
    """`<service>-<host>-<pid>`, made subject-safe."""
    raw = f"{service}-{socket.gethostname()}-{os.getpid()}"
    return re.sub(r"[^A-Za-z0-9_-]", "-", raw)[:128]


def setup_logging(level: str, service: str, instance: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {service}[{instance}] %(name)s: %(message)s",
    )


class ServiceRuntime:
    def __init__(self, service: str, *, bus: BusConfig, runtime: RuntimeConfig, load: LoadFn | None = None, handle_signals: bool = True) -> None:
        self.service = service
        # False where several services share a process (services/executor/group.py): the process's owner
        # stops each one (request_shutdown) on SIGTERM / SIGINT, since a loop has one handler per signal
        self.handle_signals = handle_signals
        self.runtime = runtime
        self.instance = runtime.instance or default_instance(service)
        self.bus = Bus(bus, service=service, instance=self.instance)
        self.endpoints: dict[str, str] = {}
        self.labels: dict[str, str] = dict(runtime.labels)
        self.state = "starting"
        self.started_at = time.time()
        self._load = load or (lambda: {})
        self._stop = asyncio.Event()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._announcing: asyncio.Task[None] | None = None
        self.metrics_server: MetricsServer | None = None

    async def __aenter__(self) -> ServiceRuntime:
        setup_logging(self.runtime.log_level, self.service, self.instance)
        setup_tracing(self.service, self.instance)
        setup_metrics(self.service, self.instance)
        if self.runtime.metrics_port >= 0:
            rt = self.runtime
            self.metrics_server = await MetricsServer.start(rt.metrics_host, rt.metrics_port, rt.metrics_public_host)
            self.endpoints["metrics"] = self.metrics_server.url
        try:
            await self.bus.connect()
        except BaseException:
            if self.metrics_server is not None:
                await self.metrics_server.stop()
            raise
        try:
            with self.bus.permission_errors(prefix="$JS.API.STREAM."):
                await provision(self.bus.js, replicas=self.bus.config.replicas)
        except PermissionDenied as exc:  # with auth on, only operators create storage
            await self.bus.close()
            raise RuntimeError(f"{exc}; JetStream storage is missing: create it first with operator credentials (`rose provision`)") from None
        await self.bus.services_api()  # every service answers $SRV.PING/INFO/STATS, endpoints or not
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT) if self.handle_signals else ():
            loop.add_signal_handler(sig, self.request_shutdown)
        await self._beat()
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
        log.info("%s %s connected to %s", self.service, self.instance, self.bus.config.display_url())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.state = "draining"
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT) if self.handle_signals else ():
            loop.remove_signal_handler(sig)
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        try:
            await self.bus.publish(
                SERVICE_EVENT,
                ServiceEvent(kind="down", service=self.service, instance=self.instance, at=time.time(), reason="shutdown"),
                kind="down",
                service=self.service,
                instance=self.instance,
            )
            await self.bus.kv_delete(SERVICE_REGISTRY, service=self.service, instance=self.instance)
        except Exception as err:  # the bus may already be gone; the heartbeat key then expires by TTL
            log.warning("could not announce shutdown: %r", err)
        await self.bus.close()
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        flush_metrics()
        log.info("%s %s stopped", self.service, self.instance)

    def ready(self, *, endpoints: dict[str, str] | None = None) -> None:
        """Mark the service ready (and say where it listens); announced with the next heartbeat."""
        self.endpoints.update(endpoints or {})
        if self.state != "ready":
            self.state = "ready"
            self._announcing = asyncio.get_running_loop().create_task(self._announce_up())  # held: tasks are weakly referenced

    async def _announce_up(self) -> None:
        await self._beat()
        await self.bus.publish(
            SERVICE_EVENT,
            ServiceEvent(kind="up", service=self.service, instance=self.instance, at=time.time()),
            kind="up",
            service=self.service,
            instance=self.instance,
        )

    def request_shutdown(self) -> None:
        log.info("shutdown requested")
        self._stop.set()

    async def wait_for_shutdown(self) -> None:
        await self._stop.wait()

    async def idle(self, seconds: float) -> None:
        """Sleep up to `seconds`, waking at once when shutdown is requested (periodic loops)."""
        try:
            await asyncio.wait_for(asyncio.shield(self._stop.wait()), timeout=seconds)
        except TimeoutError:
            pass

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            service=self.service,
            instance=self.instance,
            version=__version__,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=self.started_at,
            sent_at=time.time(),
            interval_s=self.runtime.heartbeat_interval_s,
            state=self.state,  # type: ignore[arg-type]
            load=self._load(),
            endpoints=dict(self.endpoints),
            labels=dict(self.labels),
        )

    async def _beat(self) -> None:
        beat = self.heartbeat()
        await self.bus.publish(HEARTBEAT, beat, service=self.service, instance=self.instance)
        await self.bus.kv_put(SERVICE_REGISTRY, beat, service=self.service, instance=self.instance)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.runtime.heartbeat_interval_s)
            try:
                await self._beat()
            except Exception as exc:  # reconnecting: the next beat will do
                log.warning("heartbeat failed: %r", exc)
