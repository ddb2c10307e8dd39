"""Encoding and strict decoding of bus payloads, one cached encoder/decoder per type.

Decoding classifies what went wrong, so a dead letter says *why* a message was refused:
`oversized`, `decode` (not JSON/msgpack at all), `schema_version`, or `validation`
(a field missing or out of range).
"""

from __future__ import annotations

from functools import cache
from typing import Any, TypeVar

import msgspec

from rose.contracts.registry import Encoding
from rose.shared.errors import RoseError

T = TypeVar("T")


class PayloadError(RoseError, ValueError):
    """A payload could not be accepted; `kind` is the dead-letter category."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


@cache
def _decoder(t: type, encoding: Encoding) -> Any:
    if encoding is Encoding.MSGPACK:
        return msgspec.msgpack.Decoder(t)
    return msgspec.json.Decoder(t)


_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()


def encode(message: Any, encoding: Encoding = Encoding.JSON) -> bytes:
    if encoding is Encoding.MSGPACK:
        return _msgpack_encoder.encode(message)
    if encoding is Encoding.BYTES:
        return bytes(message)
    return _json_encoder.encode(message)


def decode(data: bytes, t: type[T], encoding: Encoding = Encoding.JSON, max_bytes: int | None = None) -> T:
    """Decode and validate, or raise `PayloadError` with a kind and a reason that says what to fix."""
    if max_bytes is not None and len(data) > max_bytes:
        raise PayloadError("oversized", f"payload of {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        target: type = t  # as a plain class: the cache keys on it
        return _decoder(target, encoding).decode(data)
    except msgspec.ValidationError as exc:
        text = str(exc)
        kind = "schema_version" if "schema_version" in text else "validation"
        raise PayloadError(kind, f"{t.__name__}: {text}") from exc
    except msgspec.DecodeError as exc:
        raise PayloadError("decode", f"not valid {encoding.value} for {t.__name__}: {exc}") from exc
    except RecursionError as exc:  # msgspec skips an unknown field's value recursively: a deep enough one overflows
        raise PayloadError("decode", f"{t.__name__}: nested too deeply to decode ({exc})") from exc
