"""Lease decisions as a pure function of explicit inputs, so a simulator can import them.

`plan_leases(now, views, settings)` returns the actions to take; `revoke_for_alert` the
immediate revocation an SLO alert calls for. Rules:
- grant when the executor is alive, serving, holds no active lease, its fresh headroom says
  `lendable` (p99 latency under the monitor's grant fraction of the SLO) and no alert came in
  the last `cooldown_s`; the epoch grows by one with every grant;
- renew (same id and epoch, new expiry, lent amounts refreshed) while p99 TTFT and TPOT stay
  under `keep_fraction` x SLO (> the grant fraction: hysteresis) and the model leaves a slot;
- revoke when latency creeps past `keep_fraction`, when the executor is gone, or at once on
  an alert (on a burst, the turns there are parked until the lease's expiry); let a lease
  expire when headroom goes stale (the executor enforces expiry itself).

The baselines (`LendingSettings.mode`, for `rose bench e2e` and the simulator):
`plan_lending(now, views, leases, lending)` and `revoke_on_alert(views, alert, now, lending)`
dispatch to the rules above (`rose`) or to the baselines' own: `none` lends nothing,
`always` keeps a whole lease on every live serving executor whatever the latency, and
`elastic_baseline` lends whole executors after a long lendable window and takes every lease
back at once on any alert (see config.LendingSettings).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from rose.contracts.lease import Lease, LeaseEventKind, RevokeCause
from rose.contracts.slo import Headroom, SloAlert

from .config import LeaseSettings, LendingSettings

PREEMPTION = "whole-job preemption"  # the words of an elastic_baseline revocation's reason (its cause is "preemption")


@dataclass(frozen=True)
class ExecutorView:
    """What the scheduler knows of one executor at `now`."""

    executor_id: str
    role: str  # "serving" | "dedicated"
    alive: bool
    headroom: Headroom | None
    lease: Lease | None  # the value in the leases bucket (active or revoked)
    last_alert_at: float = 0.0
    lendable_since: float = 0.0  # headroom has said `lendable` without a break since then (0: it does not now)


@dataclass(frozen=True)
class LeaseAction:
    kind: LeaseEventKind
    lease: Lease
    reason: str


def is_active(lease: Lease | None, now: float) -> bool:
    return lease is not None and lease.state == "active" and lease.expires_at > now


def _fresh(view: ExecutorView, now: float, s: LeaseSettings) -> Headroom | None:
    h = view.headroom
    return h if h is not None and now - h.at <= s.headroom_max_age_s else None


def _healthy(h: Headroom, s: LeaseSettings) -> tuple[bool, str]:
    if h.ttft_p99_ms > s.keep_fraction * h.slo_ttft_ms:
        return False, f"ttft p99 {h.ttft_p99_ms:.0f} ms above {s.keep_fraction:.0%} of the SLO"
    if h.tpot_p99_ms > s.keep_fraction * h.slo_tpot_ms:
        return False, f"tpot p99 {h.tpot_p99_ms:.1f} ms above {s.keep_fraction:.0%} of the SLO"
    if h.rollout_batch_slots < s.min_slots:
        return False, "no rollout slot left in the headroom model"
    return True, ""


def _grant(view: ExecutorView, h: Headroom, now: float, s: LeaseSettings) -> Lease:
    epoch = (view.lease.epoch if view.lease else 0) + 1
    return Lease(
        lease_id=f"{view.executor_id}-e{epoch}",
        executor_id=view.executor_id,
        epoch=epoch,
        state="active",
        granted_at=now,
        expires_at=now + s.ttl_s,
        kv_bytes=h.kv_bytes,
        compute_share=h.compute_share,
        max_rollout_batch=h.rollout_batch_slots,
        reason=h.reason,
    )


def _revoked(lease: Lease, cause: RevokeCause, reason: str) -> Lease:
    return msgspec.structs.replace(lease, state="revoked", cause=cause, reason=reason)


def plan_one(view: ExecutorView, now: float, s: LeaseSettings) -> LeaseAction | None:
    if view.role != "serving":
        return None  # dedicated executors hold a standing lease of their own
    lease, h = view.lease, _fresh(view, now, s)
    if is_active(lease, now):
        assert lease is not None
        if not view.alive:
            return LeaseAction("revoked", _revoked(lease, "executor_gone", "executor gone"), "executor gone")
        if h is None:
            return None  # no fresh measurement: neither renew nor revoke; expiry ends it
        ok, why = _healthy(h, s)
        if not ok:
            return LeaseAction("revoked", _revoked(lease, "unhealthy", why), why)
        if lease.expires_at - now <= s.renew_before_s:
            renewed = msgspec.structs.replace(
                lease, expires_at=now + s.ttl_s, kv_bytes=h.kv_bytes, compute_share=h.compute_share, max_rollout_batch=h.rollout_batch_slots
            )
            return LeaseAction("renewed", renewed, "healthy")
        return None
    if lease is not None and lease.state == "active":  # past its expiry, never renewed
        return LeaseAction("expired", _revoked(lease, "expired", "expired"), "expired without renewal")
    if not view.alive or h is None or not h.lendable:
        return None
    if now - view.last_alert_at < s.cooldown_s:
        return None
    if h.rollout_batch_slots < s.min_slots or h.kv_bytes <= 0:
        return None
    return LeaseAction("granted", _grant(view, h, now, s), h.reason)


def plan_leases(now: float, views: list[ExecutorView], s: LeaseSettings) -> list[LeaseAction]:
    """Every lease action due now, one per executor at most."""
    return [a for a in (plan_one(v, now, s) for v in views) if a is not None]


def revoke_for_alert(view: ExecutorView, alert: SloAlert, now: float) -> LeaseAction | None:
    """An SLO alert takes an active lease back at once: no turn is routed there any more.

    A violation interrupts the turns there now. A burst parks them until the lease's own expiry
    (`Lease.park_until`): they run no more than under a plain revocation, but keep their KV, so
    a new lease after the burst resumes them where they are instead of each recomputing its
    prefix elsewhere.
    """
    if alert.severity == "recovered" or not is_active(view.lease, now):
        return None
    assert view.lease is not None
    why = f"{alert.severity}: {alert.reason}"
    revoked = _revoked(view.lease, "burst" if alert.severity == "burst" else "violation", why)
    if alert.severity == "burst":
        revoked = msgspec.structs.replace(revoked, park_until=view.lease.expires_at)
    return LeaseAction("revoked", revoked, why)


# ---- the baselines (LendingSettings.mode) -------------------------------------------------


def _whole(view: ExecutorView, now: float, s: LeaseSettings, lending: LendingSettings, reason: str) -> Lease:
    """A lease on the whole executor: every slot and its whole rollout pool (the executor clamps the KV)."""
    epoch = (view.lease.epoch if view.lease else 0) + 1
    return Lease(
        lease_id=f"{view.executor_id}-e{epoch}",
        executor_id=view.executor_id,
        epoch=epoch,
        state="active",
        granted_at=now,
        expires_at=now + s.ttl_s,
        kv_bytes=int(lending.whole_kv_mib * (1 << 20)),
        compute_share=1.0,
        max_rollout_batch=lending.whole_batch,
        reason=reason,
    )


def _keep_whole(view: ExecutorView, now: float, s: LeaseSettings) -> LeaseAction | None:
    """A held whole lease: revoked when the executor is gone, renewed near expiry whatever the latency."""
    lease = view.lease
    if is_active(lease, now):
        assert lease is not None
        if not view.alive:
            return LeaseAction("revoked", _revoked(lease, "executor_gone", "executor gone"), "executor gone")
        if lease.expires_at - now <= s.renew_before_s:
            return LeaseAction("renewed", msgspec.structs.replace(lease, expires_at=now + s.ttl_s), "held whole")
        return None
    if lease is not None and lease.state == "active":
        return LeaseAction("expired", _revoked(lease, "expired", "expired"), "expired without renewal")
    return None


def plan_lending(now: float, views: list[ExecutorView], s: LeaseSettings, lending: LendingSettings) -> list[LeaseAction]:
    """Every lease action due now under `lending.mode`, one per executor at most."""
    if lending.mode == "rose":
        return plan_leases(now, views, s)
    serving = [v for v in views if v.role == "serving"]
    actions: list[LeaseAction] = []
    if lending.mode == "none":
        for v in serving:  # nothing is lent: a lease left over from another mode goes
            if is_active(v.lease, now):
                assert v.lease is not None
                actions.append(LeaseAction("revoked", _revoked(v.lease, "lending_off", "lending off"), "lending off"))
        return actions
    held = set()
    for v in serving:
        action = _keep_whole(v, now, s)
        if action is not None:
            actions.append(action)
        if is_active(v.lease, now) and (action is None or action.kind == "renewed"):
            held.add(v.executor_id)
    free = [v for v in serving if v.alive and v.executor_id not in held and not any(a.lease.executor_id == v.executor_id for a in actions)]
    if lending.mode == "always":
        return actions + [LeaseAction("granted", _whole(v, now, s, lending, "naive share: always"), "naive share: always") for v in free]
    # elastic_baseline: whole executors, after a long lendable window, never within the fleet-wide cooldown
    if now - last_preemption(serving) < lending.cooldown_s:
        return actions
    unlent = len([v for v in serving if v.alive]) - len(held)
    for v in sorted(free, key=lambda v: v.lendable_since or now):
        if unlent <= lending.min_serving:
            break
        h = _fresh(v, now, s)
        if h is None or not h.lendable or not v.lendable_since or now - v.lendable_since < lending.idle_s:
            continue
        why = f"lendable for {now - v.lendable_since:.0f} s"
        actions.append(LeaseAction("granted", _whole(v, now, s, lending, why), why))
        unlent -= 1
    return actions


def last_preemption(views: list[ExecutorView]) -> float:
    """When the last whole-job preemption happened (its revoked leases end at that moment), 0 if never."""
    return max(
        (v.lease.expires_at for v in views if v.lease is not None and v.lease.state == "revoked" and v.lease.cause == "preemption"), default=0.0
    )


def revoke_on_alert(views: list[ExecutorView], alert: SloAlert, now: float, lending: LendingSettings) -> list[LeaseAction]:
    """What an SLO alert takes back under `lending.mode`: `rose` the alerting executor's lease,
    `elastic_baseline` every serving lease at once (whole-job preemption), the others nothing."""
    if lending.mode == "rose":
        view = next((v for v in views if v.executor_id == alert.executor_id), None)
        action = revoke_for_alert(view, alert, now) if view is not None else None
        return [action] if action is not None else []
    if lending.mode != "elastic_baseline" or alert.severity == "recovered":
        return []
    why = f"{alert.severity} on {alert.executor_id}: {alert.reason}; {PREEMPTION}"
    return [
        LeaseAction("revoked", msgspec.structs.replace(_revoked(v.lease, "preemption", why), expires_at=now), why)
        for v in views
        if v.role == "serving" and is_active(v.lease, now) and v.lease is not None
    ]
