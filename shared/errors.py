"""The project's exception base, and the one weight failure the store and the sync share.

Every exception class ROSE defines derives from ``RoseError`` (tests/test_errors.py checks it), so a
caller can tell the project's own refusals from a library's crash with one ``except``. A subclass
also keeps the builtin it refines (``ValueError``, ``RuntimeError``, ...) as a second base, so an
``except ValueError`` written before the base existed still catches it. Machine-readable fields
(``kind``, ``code``, ``reason``) carry what callers branch on, never the English message (as nats.py's
``APIError`` carries ``code`` and ``err_code``).
"""

from __future__ import annotations

from rose.contracts.weights import FailureKind


class RoseError(Exception):
    """Base of every exception the project defines."""


class WeightError(RoseError):
    """A weight version, or an object of one, that cannot be stored, fetched or taken.

    ``kind`` is the ``WeightFailed.kind`` an executor reports for it (contracts/weights.py); the object
    store raises it (``missing``, ``corrupt``, ``oversized``) and the sync re-raises it per shard and adds
    its own (``digest``, ``stale``, ``apply``, ...).
    """

    def __init__(self, kind: FailureKind, reason: str) -> None:
        super().__init__(reason)
        self.kind: FailureKind = kind
        self.reason = reason
