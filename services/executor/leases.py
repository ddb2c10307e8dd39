"""The executor's local lease guard: safety that does not depend on the scheduler being reachable.

It watches this executor's key in the leases KV bucket and mirrors it into the engine, which
enforces expiry on its own within one quantum. An SLO alert for this executor revokes rollout
at once, before the scheduler reacts: a violation interrupts the running turns; a burst parks
them (no compute, KV kept) until a new lease resumes them or the lease's expiry interrupts
them (`Lease.park_until`). A rollout request must name the current lease id and epoch; anything
else is rejected with a reason the caller can act on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from rose.contracts.executor import GenerateRequest, RejectReason
from rose.contracts.lease import Lease
from rose.contracts.registry import LEASE, SLO_ALERT
from rose.contracts.slo import SloAlert
from rose.shared.bus import Bus, Delivery

from .backend import CoServingEngine

log = logging.getLogger("rose.executor.leases")

DEDICATED_LEASE_ID = "dedicated"


class LeaseGuard:
    def __init__(self, engine: CoServingEngine, executor_id: str, *, dedicated: bool, rollout_kv_bytes: int) -> None:
        self.engine = engine
        self.executor_id = executor_id
        self.dedicated = dedicated
        self.rollout_kv_bytes = rollout_kv_bytes
        self.current: Lease | None = None
        self.revoked_reason: RejectReason = "no_lease"
        # called with the reason when rollout is taken back (revoked, alert, expired), so
        # in-flight turns can be interrupted and resumed elsewhere at once
        self.on_revoke: list[Callable[[RejectReason], None]] = []
        self._expiry: asyncio.TimerHandle | None = None  # the lease's expiry, or a park's end
        self.parked_until: float | None = None  # Unix s: revoked on a burst, the turns are parked until then

    def _revoke(self, reason: RejectReason) -> None:
        self.current, self.parked_until = None, None
        self.revoked_reason = reason
        self.engine.revoke_rollout()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        for listener in self.on_revoke:
            listener(reason)

    async def start(self, bus: Bus) -> None:
        if self.dedicated:  # a dedicated rollout executor lends itself to rollout for good
            self.engine.set_rollout_lease(self.rollout_kv_bytes, math.inf, DEDICATED_LEASE_ID)
            return
        await bus.kv_watch(LEASE, self._on_lease, executor_id=self.executor_id)
        await bus.subscribe(SLO_ALERT, self._on_alert, executor_id=self.executor_id)

    def _park(self, until: float, why: str) -> None:
        """Rollout runs and takes nothing from now; the turns here keep their KV until a new lease
        (``_on_lease``) resumes them or ``until`` (Unix s) interrupts them (``_revoke``)."""
        remaining = until - time.time()
        if remaining <= 0 or (self.current is None and self.parked_until is None):
            self._revoke("lease_revoked")
            return
        self.current, self.revoked_reason = None, "lease_revoked"
        if self.parked_until is not None and self.parked_until <= until:
            return  # already parked, to an earlier end
        self.parked_until = until
        self.engine.park_rollout(time.monotonic() + remaining)
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().call_later(remaining, self._end_park, until)
        log.info("lease revoked (%s): turns parked for at most %.1fs (a new lease resumes them)", why, remaining)

    def _end_park(self, until: float) -> None:
        if self.parked_until == until:
            self._expiry = None
            self._revoke("lease_revoked")

    async def _on_lease(self, _key: str, lease: Lease | None) -> None:
        if lease is not None and lease.state == "revoked" and lease.park_until > 0:
            self._park(lease.park_until, lease.reason)
            return
        if lease is None or lease.state != "active":
            self._revoke("lease_revoked")
            log.info("lease revoked%s", f": {lease.reason}" if lease else "")
            return
        remaining = lease.expires_at - time.time()
        if remaining <= 0:
            self._revoke("lease_expired")
            return
        budget = min(lease.kv_bytes, self.rollout_kv_bytes)
        self.engine.set_rollout_lease(budget, time.monotonic() + remaining, lease.lease_id)
        self.current, self.parked_until = lease, None
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().call_later(remaining, self._expire, lease.lease_id, lease.expires_at)
        log.info("lease %s epoch %d: %d KV bytes for %.1fs", lease.lease_id, lease.epoch, budget, remaining)

    async def _on_alert(self, alert: SloAlert, _d: Delivery) -> None:
        """Before the scheduler's revocation arrives: a violation interrupts rollout here now (parked
        turns too); a burst parks it to the lease's expiry, as the scheduler's revocation will
        (scheduler/leases.py)."""
        if alert.severity not in ("burst", "violation") or not self.engine.policy.yields_to_alerts:
            return
        if alert.severity == "burst" and self.current is not None:
            log.warning("SLO alert (burst): %s; rollout parked now", alert.reason)
            self._park(self.current.expires_at, f"burst: {alert.reason}")
        elif alert.severity == "violation" and (self.current is not None or self.parked_until is not None):
            log.warning("SLO alert (violation): %s; rollout stops now", alert.reason)
            self._revoke("lease_revoked")

    def _expire(self, lease_id: str, expires_at: float) -> None:
        lease = self.current
        if lease is not None and lease.lease_id == lease_id and lease.expires_at == expires_at:
            self._expiry = None
            self._revoke("lease_expired")

    def admission_error(self, request: GenerateRequest) -> tuple[RejectReason, str] | None:
        """(reason, detail) when the request does not run under the current lease, else None."""
        if self.dedicated:
            return None
        lease = self.current
        if lease is None:
            return self.revoked_reason, "this executor holds no rollout lease"
        if time.time() >= lease.expires_at:
            return "lease_expired", f"lease {lease.lease_id} expired"
        if request.lease_id != lease.lease_id:
            return "no_lease", f"request names lease {request.lease_id!r}, the current one is {lease.lease_id!r}"
        if request.lease_epoch != lease.epoch:
            return "stale_lease_epoch", f"request has epoch {request.lease_epoch}, the lease is at {lease.epoch}"
        return None
