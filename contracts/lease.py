"""Leases: the scheduler lends part of a serving executor to rollout, and takes it back."""

from __future__ import annotations

from typing import Literal

from .base import Fraction, Identifier, Message, NonNegInt, UnixSeconds


class Lease(Message):
    """The value kept per executor in the leases KV bucket.

    The executor enforces `expires_at` and `state` on its own, so safety never depends on
    the scheduler being reachable; `epoch` grows with every grant, so a stale lease id is
    told apart from the current one.

    A lease revoked on a burst alert carries `park_until` > 0: the executor takes no new turn
    and runs none, but the turns it holds keep their place and their KV (parked) until a new
    lease resumes them there or that moment comes, when they are interrupted and continue
    elsewhere as after any revocation. Serving gets the device exactly as with a plain
    revocation; what is saved is the recompute of every turn's prefix on the dedicated pool
    when the burst passes before the lease would have expired. 0: interrupt at once.
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
    park_until: UnixSeconds = 0.0


class LeaseEvent(Message):
    """A lease was granted, renewed, revoked or let expire."""

    kind: Literal["granted", "renewed", "revoked", "expired"]
    lease: Lease
    at: UnixSeconds
    reason: str = ""
