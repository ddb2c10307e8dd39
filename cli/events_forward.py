"""`rose events forward`: a webhook bridge from ROSE's JetStream events to any HTTP endpoint.

    rose events forward --to https://example.org/hooks/rose --subjects rose.events.lease.*.* rose.rollout.trajectories.*

For systems that do not speak NATS. Each subject filter must lie inside one stream (see
docs/events.md); per stream one JetStream *durable* pull consumer is created (or reused), so
nothing is lost while the bridge is down: it resumes where it stopped. Each event is POSTed as
a CloudEvents 1.0 structured JSON body (`id` = `<stream>-<stream sequence>`, stable across
redeliveries, for de-duplication; `subject`; `type` = `rose.<Message>`; `time`; `data` = the
event's JSON) with `Content-Type: application/cloudevents+json`, `X-Rose-Subject` and the
event's `traceparent`.

A 2xx acknowledges the event. A connection error, a timeout, 408, 425, 429 or a 5xx is retried
with exponential backoff (honouring `Retry-After`) up to `--max-attempts`; any other 4xx is a
refusal that no retry will change. An event refused or still failing after its attempts is
appended to the dead-letter file (one JSON object per line, with the reason and the whole
envelope) and acknowledged, so one bad event never blocks the ones behind it. Events of one
stream are sent one at a time, in order.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hashlib
import json
import logging
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
import nats
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from rose.contracts.registry import CHANNELS, STREAMS, Retention, StreamSpec
from rose.shared.bus import Bus
from rose.shared.config import BusConfig
from rose.shared.errors import RoseError
from rose.shared.nats_server import state_dir

# The command's arguments and runner: events_forward_args.py, kept light for every `rose` command.

log = logging.getLogger("rose.events.forward")

RETRYABLE_STATUS = {408, 425, 429}
FETCH_TIMEOUT_S = 1.0
ACK_WAIT_S = 60.0  # renewed with `in_progress` while an event is being retried
INTEGRATIONS = "integrations"


class ForwardError(RoseError, ValueError):
    """Bad forwarder settings; the message says what to change."""


def public_event_subjects() -> list[str]:
    """The subscription pattern of every channel meant for integrations (the default --subjects)."""
    return [c.pattern() for c in CHANNELS if INTEGRATIONS in c.consumers and c.stream is not None]


def _covers(pattern: str, subject: str) -> bool:
    """Does stream subject `pattern` capture every subject that filter `subject` matches?"""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or s[i] == ">":
            return False
        if token != "*" and token != s[i]:
            return False
    return len(p) == len(s)


def _check_filter(subject: str) -> None:
    tokens = subject.split(".")
    if not subject or any(not t for t in tokens) or any(c in subject for c in " \t\r\n"):
        raise ForwardError(f"subject {subject!r} is not a valid NATS subject: tokens separated by '.', no spaces, none empty")
    if ">" in tokens[:-1] or any(len(t) > 1 and (">" in t or "*" in t) for t in tokens):
        raise ForwardError(f"subject {subject!r}: '*' and '>' must be whole tokens, and '>' only the last one")


def plan_consumers(subjects: list[str]) -> dict[str, list[str]]:
    """Stream name -> the subject filters it serves; every filter must lie inside exactly one stream."""
    plan: dict[str, list[str]] = {}
    for subject in subjects:
        _check_filter(subject)
        owners: list[StreamSpec] = [s for s in STREAMS if any(_covers(p, subject) for p in s.subjects)]
        if not owners:
            hints = ", ".join(f"{p} ({s.name})" for s in STREAMS if s.retention is not Retention.WORK_QUEUE for p in s.subjects)
            raise ForwardError(f"subject {subject!r} is not inside one ROSE stream; filters must narrow one of: {hints}")
        stream = owners[0]
        if stream.retention is Retention.WORK_QUEUE:
            raise ForwardError(f"subject {subject!r} is in the work queue {stream.name}: consuming it would take the work away from its workers")
        filters = plan.setdefault(stream.name, [])
        if any(_covers(f, subject) for f in filters):
            continue  # already forwarded by a wider filter (a consumer's filters may not overlap)
        filters[:] = [f for f in filters if not _covers(subject, f)] + [subject]
    return plan


def event_type(subject: str) -> str:
    """`rose.<Message>` for a subject of a known channel, else `rose.event`."""
    for channel in CHANNELS:
        if channel.stream is None or channel.payload is None:
            continue
        try:
            channel.parse(subject)
        except ValueError:
            continue
        return f"rose.{channel.payload.__name__}"
    return "rose.event"


@dataclass
class ForwardSettings:
    url: str
    subjects: list[str]
    durable: str
    dead_letter: Path
    max_attempts: int = 5
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    timeout_s: float = 10.0
    deliver: str = "new"  # where a new consumer starts: "new" events only, or "all" the stream holds
    headers: dict[str, str] = field(default_factory=dict)

    def validate(self) -> dict[str, list[str]]:
        """Check every setting; returns the consumer plan (stream -> filters)."""
        parsed = urlparse(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ForwardError(f"--to {self.url!r} is not an http(s) URL with a host, e.g. https://example.org/hooks/rose")
        if not self.subjects:
            raise ForwardError("--subjects needs at least one subject")
        if self.max_attempts < 1:
            raise ForwardError(f"--max-attempts must be at least 1, got {self.max_attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ForwardError(f"--backoff ({self.backoff_s}) must be >= 0 and <= --max-backoff ({self.max_backoff_s})")
        if self.timeout_s <= 0:
            raise ForwardError(f"--timeout must be > 0, got {self.timeout_s}")
        if self.deliver not in ("new", "all"):
            raise ForwardError(f"--deliver must be 'new' or 'all', got {self.deliver!r}")
        if not self.durable or any(c in self.durable for c in " .*>\t/\\"):
            raise ForwardError(f"--durable {self.durable!r} must be a non-empty name without spaces, '.', '*', '>' or slashes")
        return plan_consumers(self.subjects)


@dataclass
class Outcome:
    ok: bool
    attempts: int
    status: int | None
    error: str


class Forwarder:
    """Consumes the planned streams durably and POSTs each event; `run` until `stop()`."""

    def __init__(self, settings: ForwardSettings, bus_config: BusConfig) -> None:
        self.settings = settings
        self.plan = settings.validate()
        self.bus = Bus(bus_config, service="events_forward", instance=settings.durable)
        self.forwarded = 0
        self.dead_lettered = 0
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout_s)
        await self.bus.connect()
        subs: dict[str, Any] = {}
        try:
            async with aiohttp.ClientSession(timeout=timeout) as http:
                for stream, filters in self.plan.items():
                    subs[stream] = await self._subscribe(stream, filters)
                self.ready.set()
                log.info("forwarding %s to %s (durable %s)", ", ".join(self.settings.subjects), self.settings.url, self.settings.durable)
                await asyncio.gather(*(self._loop(stream, sub, http) for stream, sub in subs.items()))
        finally:
            for sub in subs.values():  # a pull subscription left to the drain holds it until its timeout
                try:
                    await sub.unsubscribe()
                except Exception:
                    pass
            await self.bus.close()

    async def _subscribe(self, stream: str, filters: list[str]) -> Any:
        """Create the durable consumer, or bring an existing one's filters up to date (its position is kept)."""
        js, durable = self.bus.js, self.settings.durable
        deliver = DeliverPolicy.NEW if self.settings.deliver == "new" else DeliverPolicy.ALL
        try:
            info = await js.consumer_info(stream, durable)
            deliver = info.config.deliver_policy or deliver  # fixed at creation
        except NotFoundError:
            info = None
        config = ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ACK_WAIT_S,
            max_deliver=-1,  # attempts are counted here, per HTTP delivery
            max_ack_pending=1,  # one event in flight per stream: order is kept
            deliver_policy=deliver,
            filter_subject=filters[0] if len(filters) == 1 else None,
            filter_subjects=filters if len(filters) > 1 else None,
            description=f"rose events forward to {self.settings.url}",
        )
        if info is None:
            await js.add_consumer(stream, config)
        elif sorted(info.config.filter_subjects or [info.config.filter_subject or ""]) != sorted(filters):
            log.info("consumer %s on %s: filters changed to %s", durable, stream, filters)
            await js.add_consumer(stream, config)  # the server updates a durable's filters in place
        return await js.pull_subscribe_bind(durable=durable, stream=stream)

    async def _loop(self, stream: str, sub: Any, http: aiohttp.ClientSession) -> None:
        while not self._stop.is_set():
            try:
                msgs = await sub.fetch(1, timeout=FETCH_TIMEOUT_S)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except nats.errors.ConnectionClosedError:
                return
            except Exception as exc:  # reconnecting: try again shortly
                log.warning("fetch on %s failed: %r", stream, exc)
                await self._sleep(0.5)
                continue
            for msg in msgs:
                await self._handle(stream, msg, http)

    async def _handle(self, stream: str, msg: Msg, http: aiohttp.ClientSession) -> None:
        envelope = self.envelope(stream, msg)
        outcome = await self._deliver(envelope, msg, http)
        if outcome is None:
            return  # stopping mid-retry: not acked, redelivered after a restart
        if outcome.ok:
            self.forwarded += 1
        else:
            self._write_dead_letter(envelope, outcome)
        await msg.ack()

    def envelope(self, stream: str, msg: Msg) -> dict[str, Any]:
        """The CloudEvents 1.0 structured body for one event."""
        meta = msg.metadata
        body: dict[str, Any] = {
            "specversion": "1.0",
            "id": f"{stream}-{meta.sequence.stream}",
            "source": f"rose/{stream}",
            "type": event_type(msg.subject),
            "subject": msg.subject,
            "time": (meta.timestamp or dt.datetime.now(dt.UTC)).isoformat().replace("+00:00", "Z"),
            "datacontenttype": "application/json",
        }
        try:
            body["data"] = json.loads(msg.data)
        except (UnicodeDecodeError, json.JSONDecodeError):  # not JSON (should not happen on public subjects)
            import base64

            body["data_base64"] = base64.b64encode(msg.data).decode()
        return body

    async def _deliver(self, envelope: dict[str, Any], msg: Msg, http: aiohttp.ClientSession) -> Outcome | None:
        s = self.settings
        headers = {"Content-Type": "application/cloudevents+json", "X-Rose-Subject": msg.subject, **s.headers}
        if msg.headers and "traceparent" in msg.headers:
            headers["traceparent"] = msg.headers["traceparent"]
        data = json.dumps(envelope).encode()
        status: int | None = None
        error = ""
        for attempt in range(1, s.max_attempts + 1):
            retry_after: float | None = None
            try:
                async with http.post(s.url, data=data, headers=headers) as response:
                    status = response.status
                    if 200 <= status < 300:
                        return Outcome(True, attempt, status, "")
                    error = f"HTTP {status}: {(await response.text())[:300]}"
                    retry_after = _retry_after(response.headers.get("Retry-After"))
                    if status < 500 and status not in RETRYABLE_STATUS:
                        return Outcome(False, attempt, status, f"refused: {error}")
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                status, error = None, f"{type(exc).__name__}: {exc}"
            if attempt == s.max_attempts:
                break
            delay = min(s.max_backoff_s, retry_after if retry_after is not None else s.backoff_s * 2 ** (attempt - 1) * (1 + random.random() / 4))
            log.info("%s: attempt %d failed (%s); retrying in %.2fs", msg.subject, attempt, error, delay)
            try:
                await msg.in_progress()  # keep the event ours while we wait
            except Exception:
                pass
            if await self._sleep(delay):
                return None
        return Outcome(False, s.max_attempts, status, f"gave up after {s.max_attempts} attempts: {error}")

    async def _sleep(self, seconds: float) -> bool:
        """Sleep, waking early on stop; True when stopping."""
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
            return True
        except TimeoutError:
            return False

    def _write_dead_letter(self, envelope: dict[str, Any], outcome: Outcome) -> None:
        self.dead_lettered += 1
        record = {
            "at": dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z"),
            "url": self.settings.url,
            "subject": envelope["subject"],
            "id": envelope["id"],
            "attempts": outcome.attempts,
            "status": outcome.status,
            "reason": outcome.error,
            "event": envelope,
        }
        path = self.settings.dead_letter
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())  # written before the event is acked
        log.warning("dead-lettered %s (%s) to %s: %s", envelope["id"], envelope["subject"], path, outcome.error)


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def _parse_headers(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            raise ForwardError(f"--header {item!r} must look like 'Name: value'")
        out[name.strip()] = value.strip()
    return out


def default_durable(url: str) -> str:
    """One consumer per destination URL, so a restart with the same --to resumes."""
    return f"rose_forward_{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def settings_from_args(args: argparse.Namespace) -> ForwardSettings:
    durable = args.durable or default_durable(args.to)
    dead_letter = Path(args.dead_letter) if args.dead_letter else state_dir() / "forward" / f"{durable}.dead-letters.jsonl"
    return ForwardSettings(
        url=args.to,
        subjects=list(args.subjects) if args.subjects else public_event_subjects(),
        durable=durable,
        dead_letter=dead_letter,
        max_attempts=args.max_attempts,
        backoff_s=args.backoff,
        max_backoff_s=args.max_backoff,
        timeout_s=args.timeout,
        deliver=args.deliver,
        headers=_parse_headers(args.header or []),
    )


def forward(args: argparse.Namespace) -> int:
    """The `rose events forward` command: validate, then run until SIGINT/SIGTERM."""
    from .status import resolve_nats_url

    try:
        settings = settings_from_args(args)
        settings.validate()
    except ForwardError as exc:
        print(f"rose events forward: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    url = resolve_nats_url(args.nats_url, args.state_dir)
    forwarder = Forwarder(settings, BusConfig(url=url, initial_connect_deadline_s=10.0))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, forwarder.stop)
        started = time.monotonic()
        await forwarder.run()
        log.info("stopped after %.0fs: %d forwarded, %d dead-lettered", time.monotonic() - started, forwarder.forwarded, forwarder.dead_lettered)

    try:
        asyncio.run(main())
    except ConnectionError as exc:
        print(f"rose events forward: {exc}", file=sys.stderr)
        return 1
    return 0
