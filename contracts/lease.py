"""Leases: the scheduler lends part of a serving executor to rollout, and takes it back."""

from __future__ import annotations

from typing import Literal

from .base import Fraction, Identifier, Message, NonNegInt, UnixSeconds


class Lease(Message):
    """The value kept per executor in the leases KV bucket.

    The executor enforces `expires_at` and `state` on its own, so safety never depends on
    the scheduler being reachable; `epoch` grows with every grant, so a stale lease id is
    told apart from the current one.
    """

    lease_id: Identifier
    executor_id: Identifier
    epoch: NonNegInt
    state: Literal["active", "revoked"]
    granted_at: UnixSeconds
    expires_at: UnixSeconds
    kv_bytes: NonNegInt
    compute_share: Fraction
    max_rollout_batch: NonNegInt
    reason: str = ""


class LeaseEvent(Message):
    """A lease was granted, renewed, revoked or let expire."""

    kind: Literal["granted", "renewed", "revoked", "expired"]
    lease: Lease
    at: UnixSeconds
    reason: str = ""
