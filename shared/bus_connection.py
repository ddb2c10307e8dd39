"""The bus's connection: connecting with backoff, reconnecting, and the server's refusals of its credentials.

`BusConnection` is the base every part of `rose.shared.bus.Bus` builds on: it holds the nats-py
client and its JetStream context, turns the server's asynchronous permission violations into
`PermissionDenied` raised in the operation that caused them (`permission_errors`), and works around
the nats-py bug a cancelled flush triggers (`_survive_cancelled_flushes`: tests/test_bus.py pins the
private method it patches, constraints.txt pins nats-py). The parts built on it (consumers, KV
watches) keep their background tasks here, so that closing stops them before the connection drains.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import ssl
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import nats
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from rose.shared.security import inbox_prefix

from .bus_errors import BusClosed, PermissionDenied
from .config import BusConfig
from .tracing import ensure_tracing

log = logging.getLogger("rose.bus")

# nats-py reports a refusal as `nats: permissions violation for publish to "x"` (or `subscription to "x" using
# queue "q"`), lowercased: subjects are therefore compared without case.
_VIOLATION_RE = re.compile(r'permissions violation for (publish|subscription) to "([^"]+)"', re.IGNORECASE)


def _about_stream(stream: str) -> Callable[[str], bool]:
    """Matches a stream's (lowercased) JetStream API and ack subjects, and for a KV bucket or object store its data subjects."""
    data = f"$kv.{stream[3:]}." if stream.startswith("KV_") else f"$o.{stream[4:]}." if stream.startswith("OBJ_") else None
    name = stream.lower()
    return lambda subject: name in subject.split(".") or (data is not None and subject.startswith(data.lower()))


def _tls_context(config: BusConfig) -> ssl.SSLContext | None:
    if not (config.tls_ca_file or config.tls_cert_file):
        return None
    ctx = ssl.create_default_context(cafile=config.tls_ca_file or None)
    if config.tls_cert_file:
        ctx.load_cert_chain(config.tls_cert_file, config.tls_key_file or None)
    return ctx


def _survive_cancelled_flushes(nc: NatsClient) -> None:
    """Work around nats-py 2.16: a PONG answering a `flush()` whose waiter was cancelled raises
    InvalidStateError inside the read loop, which then stops for good (every later reply times out).

    Cancelling an awaiting task is how a permission refusal, a shutdown or a timeout interrupts a
    bus operation, so the connection must survive it: resolve the PING's future only if still pending.
    """

    async def process_pong() -> None:
        if nc._pongs:
            future = nc._pongs.pop(0)
            if not future.done():
                future.set_result(True)
            nc._pongs_received += 1
            nc._pings_outstanding = 0

    nc._process_pong = process_pong  # type: ignore[method-assign]


class BusConnection:
    """One service's NATS connection, and what every bus operation needs of it."""

    def __init__(self, config: BusConfig, *, service: str, instance: str) -> None:
        self.config = config
        self.service = service
        self.instance = instance
        self._nc: NatsClient | None = None
        self._js: JetStreamContext | None = None
        self._tasks: list[asyncio.Task[None]] = []  # consume loops and KV watches: cancelled when the bus closes
        self._closing = False
        self.drain_timeouts = 0  # closes whose drain ran out its timeout (each one is a stop that waited drain_timeout_s)
        # Operations in flight that a permissions violation on a matching subject should fail (see permission_errors).
        self._guards: dict[asyncio.Task[Any], tuple[str | None, Callable[[str], bool]]] = {}
        self._refused: dict[asyncio.Task[Any], tuple[str, str]] = {}
        self._secured = bool(config.creds_file or config.nkey_seed_file or config.user)
        # names of the registry channels this connection has read (subscribed, consumed, served, watched, got):
        # who really consumes what, checked against the registry's consumer lists (tests/observability)
        self.reads: set[str] = set()

    async def connect(self) -> None:
        """Connect with exponential backoff until `initial_connect_deadline_s`; then nats-py reconnects forever."""
        ensure_tracing(self.service, self.instance)  # a framework's own Bus starts its traces too (rose.shared.tracing)
        cfg = self.config
        deadline = time.monotonic() + cfg.initial_connect_deadline_s
        delay = 0.1
        options: dict[str, Any] = dict(
            servers=cfg.servers(),
            name=f"rose-{self.service}:{self.instance}",
            connect_timeout=cfg.connect_timeout_s,
            reconnect_time_wait=cfg.reconnect_wait_s,
            max_reconnect_attempts=cfg.max_reconnect_attempts,
            drain_timeout=int(cfg.drain_timeout_s),
            allow_reconnect=True,
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnect,
            reconnected_cb=self._on_reconnect,
            inbox_prefix=inbox_prefix(self.service, self.instance),  # replies reach this service (instance) only: rose.shared.security
        )
        if cfg.creds_file:
            options["user_credentials"] = cfg.creds_file
        if cfg.nkey_seed_file:
            options["nkeys_seed"] = cfg.nkey_seed_file
        if cfg.user:
            options["user"], options["password"] = cfg.user, cfg.password
        tls = _tls_context(cfg)
        if tls is not None:
            options["tls"] = tls
        url = cfg.display_url()
        while True:
            try:
                # bounded: with reconnect-forever, nats-py's first connect to an unreachable server never returns
                with self.permission_errors("connect"):  # refused credentials: say so at once
                    self._nc = await asyncio.wait_for(nats.connect(**options), timeout=max(0.5, deadline - time.monotonic()))
                break
            except PermissionDenied:
                given = (
                    "an NKey seed"
                    if cfg.nkey_seed_file
                    else "a .creds file"
                    if cfg.creds_file
                    else "a user and password"
                    if cfg.user
                    else "no credentials"
                )
                raise ConnectionError(
                    f"NATS at {url} refused the credentials of {self.service} ({given}); set ROSE_BUS__NKEY_SEED_FILE "
                    "to this service's seed (`rose security init DIR` makes one per service)"
                ) from None
            except (TimeoutError, OSError, nats.errors.Error) as exc:
                if time.monotonic() + delay > deadline:
                    raise ConnectionError(f"cannot reach NATS at {url}: {exc!r}") from exc
                log.warning("NATS at %s not reachable (%r); retrying in %.1fs", url, exc, delay)
                await asyncio.sleep(delay * (1 + random.random() / 4))
                delay = min(delay * 2, 5.0)
        _survive_cancelled_flushes(self._nc)
        self._js = self._nc.jetstream()

    async def _stop_tasks(self) -> None:
        """Cancel the background tasks (consume loops, KV watches) and wait for them, at most drain_timeout_s."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:  # bounded: a fetch in flight across a reconnect may swallow the cancel
            await asyncio.wait(self._tasks, timeout=self.config.drain_timeout_s)
        self._tasks.clear()

    async def _drain(self) -> None:
        """Drain the connection so that replies in flight go out; closed outright if the drain fails."""
        if self._nc is not None and not self._nc.is_closed:
            try:
                await self._nc.drain()
            except Exception as exc:
                log.debug("drain: %r", exc)
                await self._nc.close()
        self._nc = None

    async def _on_error(self, exc: Exception) -> None:
        text = str(exc)
        violation = _VIOLATION_RE.search(text)
        if violation or isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in text.lower():
            operation, subject = (violation.group(1).lower(), violation.group(2)) if violation else ("connect", "connect")
            if not self._refuse(operation, subject):
                log.error("NATS refused %s to %r for service %s: not allowed by its credentials", operation, subject, self.service)
            return
        # While closing, a drain that runs past its timeout is reported here; the connection closes anyway.
        if isinstance(exc, nats.errors.DrainTimeoutError):
            self.drain_timeouts += 1
        log.log(logging.DEBUG if self._closing else logging.WARNING, "NATS error: %r", exc)

    def _refuse(self, operation: str, reported: str) -> bool:
        """Fail the operations in flight that wait on the (lowercased) subject; False when none does."""
        hit = False
        for task, (subject, matches) in list(self._guards.items()):
            if matches(reported) and task not in self._refused:
                named = subject if subject is not None and subject.lower() == reported else reported
                self._refused[task] = (operation, named)
                task.cancel()
                hit = True
        return hit

    @contextmanager
    def permission_errors(self, subject: str | None = None, *, stream: str | None = None, prefix: str | None = None) -> Iterator[None]:
        """Raise `PermissionDenied` here when the server refuses `subject` (any API call on `stream`, any subject under `prefix`) meanwhile.

        The server reports a refused publish or subscribe asynchronously (the publish is simply
        dropped, so an awaited ack or reply would only time out); the error callback cancels this
        task instead, and the cancellation becomes PermissionDenied naming the subject. (A
        cancellation that races a completing wait may be swallowed by `asyncio.wait_for`: the
        refusal is checked on every way out.) Every bus helper runs under it; code that calls
        nats-py directly (the weight store) may wrap itself.
        """
        task = asyncio.current_task()
        assert task is not None
        wanted = subject.lower() if subject is not None else None
        about = _about_stream(stream) if stream is not None else None
        under = prefix.lower() if prefix is not None else None
        outer = self._guards.get(task)  # nested: the inner one decides, then the outer one is back
        self._guards[task] = (subject, lambda s: s == wanted or (about is not None and about(s)) or (under is not None and s.startswith(under)))
        try:
            yield
        except BaseException:
            refused = self._refused.pop(task, None)
            if refused is None:
                raise
            task.uncancel()
            raise PermissionDenied(self.service, *refused) from None
        else:
            refused = self._refused.pop(task, None)
            if refused is not None:
                task.uncancel()
                raise PermissionDenied(self.service, *refused)
        finally:
            self._refused.pop(task, None)
            if outer is None:
                self._guards.pop(task, None)
            else:
                self._guards[task] = outer

    async def _on_disconnect(self) -> None:
        if not self._closing:
            log.warning("disconnected from NATS; reconnecting")

    async def _on_reconnect(self) -> None:
        url = self.nc.connected_url
        log.info("reconnected to NATS at %s", f"{url.hostname}:{url.port}" if url else "?")  # netloc may hold a password

    async def _processed(self) -> None:
        """Return once the server has processed everything sent so far, refusals reported included.

        nats-py writes a flush's PING ahead of commands still queued for its flusher task, so the
        first PONG may overtake them; by the second round trip they have been written.
        """
        await self.nc.flush()
        await self.nc.flush()

    @property
    def nc(self) -> NatsClient:
        if self._nc is None:
            raise BusClosed("the bus is not connected")
        return self._nc

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            raise BusClosed("the bus is not connected")
        return self._js
