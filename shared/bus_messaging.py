"""Typed messages: publish and request, serve (answered through the NATS services API) and subscribe.

Every payload is a registry channel's msgspec Struct; a handler gets it decoded with a `Delivery`.
A request is answered only on a reply subject under the inbox of a service allowed to ask
(`_refuse_reply`, docs/security.md), the `$SRV` PING / INFO / STATS answers too (`_RepliesChecked`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.aio.msg import Msg
from nats.micro import ServiceConfig as MicroConfig
from nats.micro.request import Request as MicroRequest
from nats.micro.service import EndpointConfig
from nats.micro.service import Service as MicroService

from rose import __version__
from rose.contracts.registry import Channel, Kind
from rose.shared.metrics import meter, metric_name
from rose.shared.security import SRV_REQUESTERS, reply_prefixes, requesters

from .bus_dead_letters import BusDeadLetters
from .bus_errors import ERROR_HEADER, ERROR_REASON_HEADER, RequestRefused, remote_error
from .codec import PayloadError, decode, encode
from .config import BusConfig
from .tracing import incoming_span, outgoing_span, traced

log = logging.getLogger("rose.bus")

MAX_CONCURRENT_REQUESTS = 256
NO_RESPONDERS_FIRST_RETRY_S = 0.02
MAX_ACCEPTED_SUBJECTS = 4096  # remembered core subjects (per-entity subjects are many but bounded)
ANY_INBOX = ("_INBOX.", "_INBOX_")  # without credentials a reply may go to any inbox, never to a service's or the server's subjects
REPLIES_REFUSED = meter().create_counter(
    metric_name("bus.replies_refused"),
    unit="{request}",
    description="Requests not answered because their reply subject is not an inbox of a requester of the channel (confused deputy), per service "
    "and channel.",
)


@dataclass(frozen=True)
class Delivery:
    """What a handler knows about the message besides its payload."""

    subject: str
    headers: dict[str, str] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)
    attempt: int = 1
    msg: Any = field(default=None, repr=False, compare=False)  # the JetStream message, for `consume(manual_ack=True)`

    async def ack(self) -> None:
        """Acknowledge a message consumed with `manual_ack=True` (the handler took it over)."""
        if self.msg is not None:
            await self.msg.ack()

    async def in_progress(self) -> None:
        """Tell the server the message is still being worked on: its ack deadline starts again."""
        if self.msg is not None:
            await self.msg.in_progress()


Handler = Callable[[Any, Delivery], Awaitable[Any]]


class BusMessaging(BusDeadLetters):
    """Publish, request, serve and subscribe over the connection, and this service in the NATS services API."""

    def __init__(self, config: BusConfig, *, service: str, instance: str) -> None:
        super().__init__(config, service=service, instance=instance)
        self._micro: MicroService | None = None
        self._requests: set[asyncio.Task[None]] = set()  # requests being answered: close waits for them
        self.replies_refused = 0  # requests left unanswered: their reply subject was not a requester's inbox
        # core subjects the server has accepted a publish to: permissions are fixed per connection,
        # so only the first publish to a subject waits for the server's verdict
        self._accepted: set[str] = set()

    async def publish(self, channel: Channel, message: Any, *, msg_id: str | None = None, **tokens: str) -> None:
        """Publish an event; channels backed by a stream are published with a JetStream ack.

        `msg_id` (streams only) sets `Nats-Msg-Id`: the stream drops a second publish with the
        same id inside its duplicate window, which makes at-least-once publishers idempotent.
        """
        subject = channel.subject(**tokens)
        headers: dict[str, str] = {}
        with outgoing_span("send", subject, channel.template, headers, periodic=not traced(channel.name)):
            data = encode(message, channel.encoding)
            with self.permission_errors(subject):
                if channel.kind is Kind.STREAM:
                    if msg_id:
                        headers["Nats-Msg-Id"] = msg_id
                    await self.js.publish(subject, data, headers=headers)
                else:
                    await self.nc.publish(subject, data, headers=headers)
                    if self._secured and subject not in self._accepted:  # a refusal raises here, not just in a log line
                        await self._processed()
                        if len(self._accepted) >= MAX_ACCEPTED_SUBJECTS:
                            self._accepted.clear()
                        self._accepted.add(subject)

    async def request(self, channel: Channel, message: Any, *, timeout: float | None = None, **tokens: str) -> Any:
        """Send a request and return the decoded reply; an error reply raises `RemoteError`."""
        if channel.reply is None:
            raise TypeError(f"channel {channel.name!r} is not a request channel")
        subject = channel.subject(**tokens)
        headers: dict[str, str] = {}
        timeout = timeout or self.config.request_timeout_s
        deadline = time.monotonic() + timeout
        delay = NO_RESPONDERS_FIRST_RETRY_S
        with outgoing_span("request", subject, channel.template, headers, periodic=not traced(channel.name)):
            data = encode(message, channel.encoding)
            while True:  # nobody listening yet (a service still starting): retry until the deadline
                try:
                    with self.permission_errors(subject):
                        reply = await self.nc.request(subject, data, timeout=max(0.001, deadline - time.monotonic()), headers=headers)
                    break
                except nats.errors.NoRespondersError:
                    if time.monotonic() + delay >= deadline:
                        raise
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.5)
        if reply.headers and ERROR_HEADER in reply.headers:
            raise remote_error(reply.headers, reply.data)
        return decode(reply.data, channel.reply, channel.encoding)

    async def serve(self, channel: Channel, handler: Handler, *, queue: str | None = None, **tokens: str) -> None:
        """Answer requests on a channel: decode, call `handler(message, delivery)`, reply.

        A payload that fails to decode is answered with a 400 error that says what to fix and
        dead-lettered; a handler exception is answered with 500 and dead-lettered too.
        Requests are answered concurrently (a NATS subscription delivers one message at a time,
        so a long handler, e.g. a rollout turn, would otherwise serialise every caller), up to
        `MAX_CONCURRENT_REQUESTS` at once per endpoint; `close` waits for those in flight.
        """
        if channel.kind is not Kind.REQUEST:
            raise TypeError(f"channel {channel.name!r} is not a request channel")
        subject = channel.subject(**tokens) if len(tokens) == len(channel.tokens) else channel.pattern(**tokens)
        micro = await self.services_api()
        self.reads.add(channel.name)

        slots = asyncio.Semaphore(MAX_CONCURRENT_REQUESTS)
        allowed = self._reply_prefixes(requesters(channel))

        async def on_request(req: MicroRequest) -> None:
            arrived = time.perf_counter()
            await slots.acquire()
            reply = req._msg.reply  # nats.micro answers on it; refuse before the handler runs
            if not reply.startswith(allowed) or not _plain_subject(reply):
                task = asyncio.create_task(self._refuse_reply(channel.name, allowed, req.subject, reply, req.data, req.headers))
            else:
                task = asyncio.create_task(answer(req, arrived))
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)
            task.add_done_callback(lambda _: slots.release())

        async def answer(req: MicroRequest, arrived: float) -> None:
            headers = req.headers or {}
            try:
                message = await self._accept(channel, req.data, req.subject, headers)
            except PayloadError as exc:
                await req.respond_error("400", exc.reason[:1024])
                return
            with incoming_span("reply", req.subject, channel.template, headers) as span:
                # message read to handler running (a free slot, the event loop): the gap no child span explains
                span.set_attribute("rose.loop_wait_ms", (time.perf_counter() - arrived) * 1000.0)
                wall, cpu = time.perf_counter(), time.thread_time()
                try:
                    result = await handler(message, Delivery(req.subject, headers, channel.parse(req.subject)))
                except RequestRefused as exc:
                    log.info("refused %s: %s", req.subject, exc)
                    await req.respond_error(
                        exc.code,
                        str(exc)[:1024],
                        data=json.dumps(exc.data).encode() if exc.data else b"",
                        headers={ERROR_REASON_HEADER: exc.reason} if exc.reason else None,
                    )
                    return
                except Exception as exc:
                    log.exception("handler for %s failed", req.subject)
                    await self.dead_letter(req.subject, "handler", repr(exc), req.data, headers)
                    await req.respond_error("500", f"{type(exc).__name__}: {exc}"[:1024])
                    return
                # the handler's wall time against the CPU this thread had meanwhile: far more wall than CPU with
                # no await in between is a process waiting for a core (or other tasks run), not the handler's work
                span.set_attributes(
                    {"rose.handler_ms": (time.perf_counter() - wall) * 1000.0, "rose.handler_cpu_ms": (time.thread_time() - cpu) * 1000.0}
                )
                await req.respond(encode(result, channel.encoding))

        with self.permission_errors(subject):
            await micro.add_endpoint(
                EndpointConfig(
                    name=channel.name.replace(".", "_"),
                    subject=subject,
                    handler=on_request,
                    queue_group=queue,
                    metadata={
                        "payload": channel.payload.__name__ if channel.payload else "",
                        "reply": channel.reply.__name__ if channel.reply else "",
                    },
                )
            )
            await self._processed()  # the server knows the endpoint (or refused it) before anyone is told it exists

    async def subscribe(self, channel: Channel, handler: Handler, *, queue: str = "", **tokens: str) -> None:
        """Receive events (core pub/sub). Tokens not given match anything."""

        async def on_msg(msg: Msg) -> None:
            headers = msg.headers or {}
            try:
                message = await self._accept(channel, msg.data, msg.subject, headers)
            except PayloadError:
                return
            with incoming_span("process", msg.subject, channel.template, headers, periodic=not traced(channel.name)):
                try:
                    await handler(message, Delivery(msg.subject, headers, channel.parse(msg.subject)))
                except Exception as exc:
                    log.exception("handler for %s failed", msg.subject)
                    await self.dead_letter(msg.subject, "handler", repr(exc), msg.data, headers)

        pattern = channel.pattern(**tokens)
        self.reads.add(channel.name)
        with self.permission_errors(pattern):
            await self.nc.subscribe(pattern, queue=queue, cb=on_msg)
            await self._processed()

    def _reply_prefixes(self, services: tuple[str, ...]) -> tuple[str, ...]:
        """Where answers may go: with credentials, the inboxes of `services` (the server lets their
        users alone read there, rose.shared.security); without, any inbox (nobody's identity is known)."""
        return reply_prefixes(services) if self._secured else ANY_INBOX

    async def _refuse_reply(self, what: str, allowed: tuple[str, ...], subject: str, reply: str, data: bytes, headers: dict[str, str] | None) -> None:
        """A request whose reply subject is not a requester's inbox: never answered, counted, dead-lettered.

        Answering it would make this service publish its answer (an error included) wherever the
        sender chose: `$JS.API.STREAM.DELETE.<stream>`, a KV key, another service's subject or inbox.
        """
        self.replies_refused += 1
        REPLIES_REFUSED.add(1, {"service": self.service, "channel": what})
        reason = (
            f"reply subject {reply[:256]!r} of a {what} request is not under {' or '.join(allowed)} (the inboxes of those who may ask): not answered"
        )
        await self.dead_letter(subject, "unauthorised", reason, data, headers)

    async def services_api(self) -> MicroService:
        """This service in the NATS services API ($SRV.PING / INFO / STATS), created once."""
        if self._micro is None:
            micro = _RepliesChecked(
                self.nc,
                MicroConfig(
                    name=f"rose_{self.service}",
                    version=__version__,
                    description=f"ROSE {self.service.replace('_', ' ')}",
                    metadata={"instance": self.instance},
                ),
            )
            micro.check(self._reply_prefixes(SRV_REQUESTERS), self._refuse_reply)
            await micro.start()
            self._micro = micro
        return self._micro

    async def _stop_endpoints(self) -> None:
        """Stop answering (the service endpoints go), then let the requests in flight answer."""
        if self._micro is not None:
            try:
                await self._micro.stop()
            except Exception as exc:  # a closed connection cannot unsubscribe; nothing to lose
                log.debug("stopping service endpoints: %r", exc)
            self._micro = None
        if self._requests:  # let requests in flight answer before the connection drains
            await asyncio.wait(set(self._requests), timeout=self.config.drain_timeout_s)


def _plain_subject(subject: str) -> bool:
    """A concrete subject (no wildcard, no empty token, no whitespace): a reply cannot be a pattern."""
    return bool(subject) and not any(t in ("", "*", ">") for t in subject.split(".")) and not any(c.isspace() for c in subject)


class _RepliesChecked(MicroService):
    """nats.micro's service, whose `$SRV` PING / INFO / STATS answers go only to an allowed inbox (see Bus._refuse_reply)."""

    def check(self, allowed: tuple[str, ...], refuse: Callable[..., Awaitable[None]]) -> None:
        self._allowed_replies, self._refuse = allowed, refuse

    async def _allowed(self, msg: Msg) -> bool:
        if msg.reply.startswith(self._allowed_replies) and _plain_subject(msg.reply):
            return True
        await self._refuse("$SRV", self._allowed_replies, msg.subject, msg.reply, msg.data, msg.headers)
        return False

    async def _handle_ping_request(self, msg: Msg) -> None:
        if await self._allowed(msg):
            await super()._handle_ping_request(msg)

    async def _handle_info_request(self, msg: Msg) -> None:
        if await self._allowed(msg):
            await super()._handle_info_request(msg)

    async def _handle_stats_request(self, msg: Msg) -> None:
        if await self._allowed(msg):
            await super()._handle_stats_request(msg)
