"""JetStream consumption: a durable pull consumer per `consume`, explicit acks, redelivery, dead letters at the end.

A handler's failure naks with a growing delay; its last allowed delivery is dead-lettered and
terminated. A long handler keeps its message with `keep_alive`, or takes it over with `manual_ack`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import nats
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from rose.contracts.registry import Channel

from .bus_dead_letters import BusDeadLetters
from .bus_messaging import Delivery, Handler
from .codec import PayloadError
from .config import BusConfig
from .tracing import incoming_span, traced

log = logging.getLogger("rose.bus")

CONSUME_BATCH = 16  # messages one fetch takes, unless the caller says (`batch=`)
CONSUME_FETCH_TIMEOUT_S = 1.0  # how long a fetch waits for its batch (the simulator models it: sim/config.py FETCH_WINDOW_S)


class BusConsumer(BusDeadLetters):
    """JetStream channels consumed with durable pull consumers, one loop each."""

    def __init__(self, config: BusConfig, *, service: str, instance: str) -> None:
        super().__init__(config, service=service, instance=instance)
        self._pull_subs: list[Any] = []  # JetStream pull subscriptions (consume): unsubscribed before the drain (close)

    async def consume(
        self,
        channel: Channel,
        handler: Handler,
        *,
        durable: str,
        max_deliver: int = 5,
        ack_wait_s: float = 30.0,
        deliver_new: bool = False,
        batch: int = CONSUME_BATCH,
        manual_ack: bool = False,
        keep_alive: bool = False,
        **tokens: str,
    ) -> None:
        """Consume a JetStream channel with a durable pull consumer and explicit acks.

        Success acks; a handler exception naks with a growing delay, and the last allowed
        delivery is dead-lettered and terminated, so nothing is silently dropped. Messages of
        one fetch are handled in order; for N concurrent long handlers (rollout episodes) call
        this N times with `batch=1`, so no fetched message waits out its ack deadline.

        `manual_ack=True`: a handler that returns has taken the message over; it acks it later
        with `delivery.ack()` (and keeps it with `delivery.in_progress()` within `ack_wait_s`),
        e.g. once what it computed from the message is durable. Unacked, it is redelivered.

        `keep_alive=True`: while the handler runs, the message's ack deadline is renewed (every third of
        `ack_wait_s`), so only a consumer that stopped (its process gone, its connection lost) has its
        message redelivered, however long the work takes. For handlers bounded by their own deadlines
        (a rollout episode, an agent's): without it, an episode longer than `ack_wait_s` ran twice, both
        copies to the end (15 % of the turn placements of an emulated static run, docs/benchmarks.md 2026-12-05 (evening 2)).
        """
        if channel.stream is None:
            raise TypeError(f"channel {channel.name!r} is not backed by a stream")
        filter_subject = channel.pattern(**tokens)
        self.reads.add(channel.name)
        config = ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_deliver=max_deliver,
            filter_subject=filter_subject,
            deliver_policy=DeliverPolicy.NEW if deliver_new else DeliverPolicy.ALL,
        )
        with self.permission_errors(stream=channel.stream.name):
            sub = await self.js.pull_subscribe(filter_subject, durable=durable, stream=channel.stream.name, config=config)
        self._pull_subs.append(sub)
        beat_s = ack_wait_s / 3 if keep_alive else 0.0
        loop = self._consume_loop(channel, handler, sub, max_deliver, batch, manual_ack, beat_s)
        self._tasks.append(asyncio.create_task(loop, name=f"consume:{durable}"))

    async def _consume_loop(
        self,
        channel: Channel,
        handler: Handler,
        sub: Any,
        max_deliver: int,
        batch: int = CONSUME_BATCH,
        manual_ack: bool = False,
        beat_s: float = 0.0,
    ) -> None:
        while not self._closing:
            try:
                msgs = await sub.fetch(batch, timeout=CONSUME_FETCH_TIMEOUT_S)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except nats.errors.ConnectionClosedError:
                return
            except Exception as exc:  # reconnecting, server restarting: try again shortly
                log.warning("fetch on %s failed: %r", channel.name, exc)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                await self._consume_one(channel, handler, msg, max_deliver, manual_ack, beat_s)

    @staticmethod
    async def _keep_alive(msg: Msg, beat_s: float) -> None:
        """Renew ``msg``'s ack deadline every ``beat_s`` until cancelled (a beat lost while reconnecting: the next one)."""
        while True:
            await asyncio.sleep(beat_s)
            try:
                await msg.in_progress()
            except Exception as exc:
                log.info("keeping %s alive failed: %r", msg.subject, exc)

    async def _consume_one(
        self, channel: Channel, handler: Handler, msg: Msg, max_deliver: int, manual_ack: bool = False, beat_s: float = 0.0
    ) -> None:
        headers = msg.headers or {}
        try:
            message = await self._accept(channel, msg.data, msg.subject, headers)
        except PayloadError:
            await msg.term()
            return
        attempt = msg.metadata.num_delivered
        with incoming_span("process", msg.subject, channel.template, headers, periodic=not traced(channel.name)):
            keeper = asyncio.create_task(self._keep_alive(msg, beat_s)) if beat_s > 0 else None
            try:
                delivery = Delivery(msg.subject, headers, channel.parse(msg.subject), attempt, msg if manual_ack else None)
                await handler(message, delivery)
            except Exception as exc:
                log.exception("handler for %s failed (attempt %d of %d)", msg.subject, attempt, max_deliver)
                if attempt >= max_deliver:
                    await self.dead_letter(msg.subject, "handler", f"gave up after {attempt} attempts: {exc!r}", msg.data, headers)
                    await msg.term()
                else:
                    await msg.nak(delay=min(0.2 * 2**attempt, 10.0))
                return
            finally:
                if keeper is not None:
                    keeper.cancel()
        if not manual_ack:
            await msg.ack()

    async def _unsubscribe_pulls(self) -> None:
        """Closing, before the drain: every pull subscription goes."""
        # A pull subscription that has fetched never drains: nats.py's drain waits for its pending queue's
        # join(), and the messages fetch reads (next_msg, the server's 404/408 replies included) are never
        # marked done, so each close waited out drain_timeout_s (10 s per service stop). Its consume loop
        # has stopped; a message it fetched and did not ack is redelivered after ack_wait, nothing is lost.
        for sub in self._pull_subs:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # already gone with the connection
                log.debug("unsubscribing a pull subscription: %r", exc)
        self._pull_subs.clear()
