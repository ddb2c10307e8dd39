"""The rollout lease as an engine holds it: one object, one set of rules, for every backend.

Why one object: the home engine (engine.py) and the SGLang backend (sglang_backend.py) each kept
their own copy of the lease and of why it ended, and the two copies disagreed: a parked lease
that ran out was ``lease_revoked`` in one and ``lease_expired`` in the other. Here a lease is
granted, resized, parked, revoked and expired by the same methods, and the reason a rollout
request is refused comes from one place (``check_admits``).

Who writes and who reads: the executor's lease guard (leases.py) writes on the event loop
(``grant``, ``resize``, ``park``, ``revoke``); the engine's lanes read ``current`` between
quanta and call ``expire_if_due`` and ``take_reclaim_start`` there. Every write replaces the
frozen ``EngineLease`` whole, so a reader on another thread sees one lease or the other, never
half of each.
"""

from __future__ import annotations

import math
import time

from rose.contracts.executor import RejectReason

from .protocol import EngineLease, RolloutRejected


class LeaseState:
    """The lease held now (``current``), why the last one ended (``ended``), and when rollout's compute was
    last taken back (the start of a reclaim sample, read once by whoever sees rollout stop)."""

    def __init__(self) -> None:
        self.current: EngineLease | None = None
        self.ended: RejectReason = "no_lease"
        self._reclaim_from: float | None = None  # monotonic: a revoke or park whose reclaim is not yet sampled

    # ---- the lease guard's side (the event loop)
    def grant(self, budget_bytes: int, expires_at_monotonic: float, lease_id: str = "") -> EngineLease:
        """Grant or renew: rollout may use up to ``budget_bytes`` of KV until the expiry (monotonic seconds)."""
        lease = EngineLease(max(0, int(budget_bytes)), expires_at_monotonic, lease_id)
        self.current = lease
        return lease

    def resize(self, budget_bytes: int) -> EngineLease | None:
        """The current lease with another KV budget (None: no lease, nothing to resize)."""
        lease = self.current
        return None if lease is None else self.grant(budget_bytes, lease.expires_at, lease.lease_id)

    def revoke(self) -> bool:
        """Take the lease back now; True if one was held (its compute is reclaimed from now)."""
        held = self.current is not None
        if held:
            self._reclaim_from = time.monotonic()
        self.current, self.ended = None, "lease_revoked"
        return held

    def park(self, until_monotonic: float) -> EngineLease | None:
        """Revoked on a burst: rollout runs and takes nothing, the requests held keep their KV until a new
        grant resumes them or ``until_monotonic`` ends the lease (then it ended as revoked, not expired:
        the revocation is why it is gone). None: no lease to park."""
        lease = self.current
        if lease is None:
            return None
        if lease.admits:
            self._reclaim_from = time.monotonic()  # its compute stops at the next boundary: a reclaim sample
        self.current, self.ended = lease.parked(until_monotonic), "lease_revoked"
        return self.current

    # ---- the engine's side (a lane between quanta, or a backend's timer)
    def expire_if_due(self, now: float | None = None) -> bool:
        """End the lease if its time is up; True if it just ended. A lease that still admitted ends as
        ``lease_expired`` (its compute is reclaimed now); a parked one as ``lease_revoked``."""
        lease = self.current
        now = time.monotonic() if now is None else now
        if lease is None or now < lease.expires_at:
            return False
        self.current, self.ended = None, "lease_expired" if lease.admits else "lease_revoked"
        if lease.admits and self._reclaim_from is None:
            self._reclaim_from = now
        return True

    def take_reclaim_start(self) -> float | None:
        """When rollout's compute was taken back, once rollout has stopped computing (no admitting lease
        now): the caller records the reclaim latency from it. None: nothing to sample."""
        lease = self.current
        if self._reclaim_from is None or (lease is not None and lease.admits):
            return None
        start, self._reclaim_from = self._reclaim_from, None
        return start

    # ---- read-outs
    @property
    def admits(self) -> bool:
        """A lease is held and rollout may run and take requests under it now."""
        lease = self.current
        return lease is not None and lease.admits_now()

    @property
    def parked(self) -> bool:
        lease = self.current
        return lease is not None and not lease.admits

    @property
    def budget_bytes(self) -> int:
        lease = self.current
        return lease.budget_bytes if lease is not None else 0

    @property
    def lease_id(self) -> str:
        lease = self.current
        return lease.lease_id if lease is not None else ""

    @property
    def standing(self) -> bool:
        """The lease never expires (a dedicated executor's own)."""
        lease = self.current
        return lease is not None and math.isinf(lease.expires_at)

    def check_admits(self, admits_rollout: bool, policy_name: str) -> None:
        """Raise ``RolloutRejected`` unless a rollout request may be taken now, with the reason a caller acts on."""
        if not admits_rollout:
            raise RolloutRejected("no_lease", f"policy {policy_name} runs no rollout")
        lease = self.current
        if lease is None:
            raise RolloutRejected(self.ended, "no valid rollout lease on this executor")
        if not lease.admits:
            raise RolloutRejected("lease_revoked", "the rollout lease was revoked on a burst: the turns here are parked, no new one is taken")
        if time.monotonic() >= lease.expires_at:
            raise RolloutRejected("lease_expired", "the rollout lease has expired")
