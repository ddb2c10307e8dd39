"""The errors a bus operation raises, and how an error reply carries one (its headers and JSON body).

A responder refuses with `RequestRefused` (a 4xx answer); the requester gets `RemoteError`, built
from the reply by `remote_error`. The others are this side's: a lost compare-and-set (`KvConflict`),
a bus used unconnected (`BusClosed`), the server refusing this connection's credentials an
operation (`PermissionDenied`).
"""

from __future__ import annotations

import json
from typing import Any

from rose.shared.errors import RoseError

ERROR_HEADER = "Nats-Service-Error"
ERROR_CODE_HEADER = "Nats-Service-Error-Code"
ERROR_REASON_HEADER = "Rose-Error-Reason"  # RequestRefused.reason; the error reply's body holds its data as JSON


class RemoteError(RoseError):
    """The other side answered a request with an error (4xx: the request; 5xx: the service).

    `code` is the HTTP-like status; `reason` a stable identifier a caller may branch on (empty when
    the responder gave none) and `data` its machine-readable details: code reads those, never the
    English `description` (as nats.py's `APIError` carries `code` and `err_code`).
    """

    def __init__(self, code: str, description: str, reason: str = "", data: dict[str, Any] | None = None) -> None:
        super().__init__(f"{code}: {description}")
        self.code = code
        self.description = description
        self.reason = reason
        self.data = data or {}


class RequestRefused(RoseError, ValueError):
    """Raised by a request handler to refuse a well-formed request: answered with `code` (4xx), not dead-lettered.

    `reason` and `data` reach the requester as `RemoteError.reason` / `.data` (a header and a JSON body).
    """

    def __init__(self, message: str, code: str = "400", *, reason: str = "", data: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.data = data or {}


def remote_error(headers: dict[str, str], body: bytes) -> RemoteError:
    """The RemoteError an error reply stands for (its data: the body as JSON, when it is a JSON object)."""
    data: dict[str, Any] = {}
    if body:
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        data = parsed if isinstance(parsed, dict) else {}
    return RemoteError(headers.get(ERROR_CODE_HEADER, "500"), headers[ERROR_HEADER], headers.get(ERROR_REASON_HEADER, ""), data)


class KvConflict(RoseError, RuntimeError):
    """A compare-and-set write lost: the key is no longer at the revision the writer read."""

    def __init__(self, key: str, revision: int) -> None:
        super().__init__(f"KV key {key!r} changed since revision {revision}")
        self.key, self.revision = key, revision


class BusClosed(RoseError, RuntimeError):
    """The bus is not connected (not yet, or no longer)."""


class PermissionDenied(RoseError, PermissionError):
    """The server refused this connection's credentials an operation; nothing was published or subscribed."""

    def __init__(self, service: str, operation: str, subject: str) -> None:
        super().__init__(
            f"NATS refused {operation} to {subject!r} for service {service!r}: its credentials do not allow it "
            "(the rights each service has: `rose security permissions`)"
        )
        self.service = service
        self.operation = operation
        self.subject = subject
