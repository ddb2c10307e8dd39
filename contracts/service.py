"""Messages every service emits about itself: heartbeats, lifecycle events, dead letters."""

from __future__ import annotations

from typing import Literal

import msgspec

from .base import Identifier, Message, NonNegFloat, UnixSeconds

ServiceState = Literal["starting", "ready", "draining"]


class Heartbeat(Message):
    """Periodic proof of life with identity, version, load and where to reach the service."""

    service: Identifier
    instance: Identifier
    version: str
    host: str
    pid: int
    started_at: UnixSeconds
    sent_at: UnixSeconds
    interval_s: NonNegFloat
    state: ServiceState = "ready"
    load: dict[str, float] = msgspec.field(default_factory=dict)
    endpoints: dict[str, str] = msgspec.field(default_factory=dict)
    labels: dict[str, str] = msgspec.field(default_factory=dict)


class ServiceEvent(Message):
    """A service came up or went down (cleanly, or declared lost by a watcher)."""

    kind: Literal["up", "down"]
    service: Identifier
    instance: Identifier
    at: UnixSeconds
    reason: str = ""


DeadLetterKind = Literal["decode", "schema_version", "validation", "oversized", "handler", "unauthorised"]


class DeadLetter(Message):
    """A message a service could not accept, with the reason and the original bytes."""

    service: Identifier
    instance: Identifier
    subject: str
    kind: DeadLetterKind
    reason: str
    at: UnixSeconds
    payload: bytes = b""
    headers: dict[str, str] = msgspec.field(default_factory=dict)
