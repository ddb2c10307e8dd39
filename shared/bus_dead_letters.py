"""Dead letters: a message the bus refuses is kept with its reason on `rose.dlq.<service>.<instance>`, never dropped.

Refused are a payload that does not decode (`_accept`), a handler failing its last delivery, and
a request whose reply subject is not a requester's inbox (the parts that receive call `dead_letter`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rose.contracts.registry import DEAD_LETTER, Channel
from rose.contracts.service import DeadLetter
from rose.shared.security import instance_token

from .bus_connection import BusConnection
from .codec import PayloadError, decode, encode
from .config import BusConfig

log = logging.getLogger("rose.bus")

DLQ_PAYLOAD_LIMIT = 1 << 20  # bytes of a refused payload its dead letter keeps (the reason says when it was cut)


class BusDeadLetters(BusConnection):
    """Dead-lettering, and decoding that dead-letters what does not decode."""

    def __init__(self, config: BusConfig, *, service: str, instance: str) -> None:
        super().__init__(config, service=service, instance=instance)
        self.dead_letters = 0

    async def dead_letter(self, subject: str, kind: str, reason: str, payload: bytes, headers: dict[str, str] | None) -> None:
        """Keep a refused message with its reason on `rose.dlq.<service>.<instance>`; never raises."""
        self.dead_letters += 1
        if len(payload) > DLQ_PAYLOAD_LIMIT:
            reason = f"{reason} (payload truncated to the first {DLQ_PAYLOAD_LIMIT} of {len(payload)} bytes)"
            payload = payload[:DLQ_PAYLOAD_LIMIT]
        letter = DeadLetter(
            service=self.service,
            instance=self.instance,
            subject=subject,
            kind=kind,  # type: ignore[arg-type]
            reason=reason,
            at=time.time(),
            payload=payload,
            headers={k: v for k, v in (headers or {}).items() if not k.lower().startswith("authorization")},
        )
        log.warning("dead letter from %s (%s): %s", subject, kind, reason[:300])
        try:
            await self.js.publish(DEAD_LETTER.subject(service=self.service, instance=instance_token(self.instance)), encode(letter))
        except Exception as exc:
            log.error("could not store dead letter for %s: %r", subject, exc)

    async def _accept(self, channel: Channel, data: bytes, subject: str, headers: dict[str, str] | None) -> Any:
        """Decode a payload, or dead-letter it and re-raise as `PayloadError`."""
        assert channel.payload is not None
        try:
            return decode(data, channel.payload, channel.encoding, channel.max_bytes)
        except PayloadError as exc:
            await self.dead_letter(subject, exc.kind, exc.reason, data, headers)
            raise
