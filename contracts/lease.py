"""Leases: the scheduler lends part of a serving executor to rollout, and takes it back."""

from __future__ import annotations

from typing import Literal

from .base import Fraction, Identifier, Message, NonNegInt, UnixSeconds

LeaseState = Literal["active", "revoked"]
LeaseEventKind = Literal["granted", "renewed", "revoked", "expired"]
# Why a lease ended before (or at) its time, for code to branch on (``reason`` is the words for people): the executor
# stopped reporting; its headroom went (unhealthy); an SLO alert (burst: parked; violation: interrupted); lending was
# turned off; elastic_baseline's whole-job preemption; it ran out without renewal.
RevokeCause = Literal["executor_gone", "unhealthy", "burst", "violation", "lending_off", "preemption", "expired"]


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
    state: LeaseState
    granted_at: UnixSeconds
    expires_at: UnixSeconds
    kv_bytes: NonNegInt
    compute_share: Fraction
    max_rollout_batch: NonNegInt
    reason: str = ""
    park_until: UnixSeconds = 0.0
    cause: RevokeCause | None = None  # a revoked lease's (None while active, and in leases written before this field)


class LeaseEvent(Message):
    """A lease was granted, renewed, revoked or let expire."""

    kind: LeaseEventKind
    lease: Lease
    at: UnixSeconds
    reason: str = ""
