"""The scheduler's pure decisions: leases (grant, renew, hysteresis, revoke, expire) and placement."""

from __future__ import annotations

import random

import msgspec

from rose.contracts.lease import Lease
from rose.contracts.rollout import TurnRouteRequest
from rose.contracts.slo import Headroom, SloAlert
from rose.services.scheduler.config import LeaseSettings, PlacementSettings
from rose.services.scheduler.leases import ExecutorView, plan_leases, plan_one, revoke_for_alert
from rose.services.scheduler.placement import Candidate, place_turn, should_hedge, weights
from rose.testing.messages import headroom

S = LeaseSettings(ttl_s=10.0, renew_before_s=4.0, keep_fraction=0.8, cooldown_s=5.0, headroom_max_age_s=3.0)
P = PlacementSettings()


def view(
    now: float, *, lease: Lease | None = None, h: Headroom | None = None, alive: bool = True, alert_at: float = 0.0, role: str = "serving"
) -> ExecutorView:
    return ExecutorView("ex-1", role, alive, h if h is not None else headroom(now), lease, alert_at)


def test_grant_then_renew_then_hysteresis_then_revoke():
    now = 1000.0
    grant = plan_one(view(now), now, S)
    assert grant is not None and grant.kind == "granted"
    lease = grant.lease
    assert lease.epoch == 1 and lease.state == "active" and lease.expires_at == now + S.ttl_s and lease.max_rollout_batch == 8
    # healthy and not near expiry: nothing to do
    assert plan_one(view(now + 1, lease=lease), now + 1, S) is None
    # near expiry and healthy: renewed, same id and epoch
    renew = plan_one(view(now + 7, lease=lease), now + 7, S)
    assert renew is not None and renew.kind == "renewed" and renew.lease.lease_id == lease.lease_id and renew.lease.epoch == 1
    assert renew.lease.expires_at == now + 7 + S.ttl_s
    # between grant (lendable) and keep (0.8 x SLO): a held lease is kept although no new one would be granted
    warm = headroom(now + 8, ttft=350.0, lendable=False)
    assert plan_one(view(now + 8, lease=renew.lease, h=warm), now + 8, S) is None
    assert plan_one(view(now + 8, h=warm), now + 8, S) is None
    # past keep_fraction: revoked
    hot = headroom(now + 9, ttft=450.0, lendable=False)
    revoke = plan_one(view(now + 9, lease=renew.lease, h=hot), now + 9, S)
    assert revoke is not None and revoke.kind == "revoked" and revoke.lease.state == "revoked" and "ttft" in revoke.reason


def test_epoch_grows_with_every_grant_and_cooldown_after_alert():
    now = 2000.0
    old = Lease(
        lease_id="ex-1-e3",
        executor_id="ex-1",
        epoch=3,
        state="revoked",
        granted_at=now - 50,
        expires_at=now - 40,
        kv_bytes=1,
        compute_share=0.1,
        max_rollout_batch=1,
    )
    assert plan_one(view(now, lease=old, alert_at=now - 1), now, S) is None  # cooling down
    grant = plan_one(view(now, lease=old, alert_at=now - 6), now, S)
    assert grant is not None and grant.lease.epoch == 4 and grant.lease.lease_id != old.lease_id


def test_alert_revokes_at_once_and_recovered_does_not():
    now = 3000.0
    lease = plan_one(view(now), now, S).lease  # type: ignore[union-attr]
    alert = SloAlert(executor_id="ex-1", at=now, severity="burst", reason="arrival rate")
    action = revoke_for_alert(view(now, lease=lease), alert, now)
    assert action is not None and action.kind == "revoked" and "burst" in action.lease.reason
    # a burst parks the turns until the lease's own expiry; a violation interrupts them now
    assert action.lease.park_until == lease.expires_at > now
    stop = revoke_for_alert(view(now, lease=lease), msgspec.structs.replace(alert, severity="violation"), now)
    assert stop is not None and stop.lease.state == "revoked" and stop.lease.park_until == 0
    assert revoke_for_alert(view(now, lease=lease), msgspec.structs.replace(alert, severity="recovered"), now) is None
    assert revoke_for_alert(view(now, lease=None), alert, now) is None


def test_stale_headroom_neither_grants_nor_renews_and_lease_then_expires():
    now = 4000.0
    lease = plan_one(view(now), now, S).lease  # type: ignore[union-attr]
    stale = headroom(now - 10)
    assert plan_one(view(now + 8, lease=lease, h=stale), now + 8, S) is None
    expired = plan_one(view(now + 11, lease=lease, h=stale), now + 11, S)
    assert expired is not None and expired.kind == "expired" and expired.lease.state == "revoked"
    assert plan_one(view(now, h=stale), now, S) is None


def test_gone_executor_loses_its_lease_and_dedicated_needs_none():
    now = 5000.0
    lease = plan_one(view(now), now, S).lease  # type: ignore[union-attr]
    gone = plan_one(view(now + 1, lease=lease, alive=False), now + 1, S)
    assert gone is not None and gone.kind == "revoked"
    assert plan_leases(now, [view(now, role="dedicated")], S) == []


def req(**kw) -> TurnRouteRequest:
    base = dict(trajectory_id="t-1", turn_index=1, prompt_tokens=10)
    return TurnRouteRequest(**{**base, **kw})


def cands() -> list[Candidate]:
    return [
        Candidate("ser-1", "serving", "ser-1-e1", 1, 100.0, 2, 8),
        Candidate("ser-2", "serving", "ser-2-e4", 4, 100.0, 0, 8),
        Candidate("ded-1", "dedicated", "", 0, 300.0, 3, 32),
    ]


def test_affinity_wins_unless_overloaded_slower_or_excluded():
    rng = random.Random(0)
    idle_home = [Candidate("ser-1", "serving", "ser-1-e1", 1, 100.0, 0, 8), *cands()[1:]]
    p = place_turn(req(), idle_home, "ser-1", P, rng)
    # an idle lease as fast per sequence as the dedicated executor's share beats its queue: the cache keeps the turn there
    assert p is not None and p.executor_id == "ser-1" and p.lease_id == "ser-1-e1" and p.lease_epoch == 1 and p.reason.startswith("prefix affinity")
    # the same home with two turns already: a turn there shares it three ways (1/3 of 100 tok/s) and the dedicated
    # executor (300 tok/s over 4) is sooner, so the cache is not worth it; the idle lease is sooner still
    p = place_turn(req(), cands(), "ser-1", P, rng)
    assert p is not None and p.executor_id == "ser-2"
    busy = [Candidate("ser-1", "serving", "ser-1-e1", 1, 100.0, 50, 8), *cands()[1:]]
    p = place_turn(req(), busy, "ser-1", P, rng)
    assert p is not None and p.executor_id != "ser-1"
    p = place_turn(req(exclude=["ser-1"]), idle_home, "ser-1", P, rng)
    assert p is not None and p.executor_id == "ser-2"  # excluded: the next soonest
    assert place_turn(req(exclude=["ser-1", "ser-2"]), idle_home, "ser-1", P, rng).reason.startswith("affinity executor overloaded or unavailable")  # type: ignore[union-attr]
    assert place_turn(req(exclude=["ser-1", "ser-2", "ded-1"]), cands(), "", P, rng) is None
    # a dedicated home keeps its turn while it is not overloaded
    p = place_turn(req(exclude=["ser-2"]), cands(), "ded-1", P, rng)
    assert p is not None and p.executor_id == "ded-1" and p.reason.startswith("prefix affinity")


def test_a_dedicated_home_with_a_free_slot_keeps_its_turn_from_a_faster_lease():
    """An idle lease gives a sequence 100 tok/s against the dedicated home's 300 / 4: sooner, but only per token,
    and the move would prefill the whole context there. With a slot free at home the turn stays; with the home
    full (32 running, 8 queued), the lease saves the wait and takes it."""
    rng = random.Random(0)
    p = place_turn(req(), cands(), "ded-1", P, rng)
    assert p is not None and p.executor_id == "ded-1" and p.reason == "prefix affinity: a free slot at home"
    assert place_turn(req(), cands(), "", P, rng).executor_id == "ser-2"  # type: ignore[union-attr]  # a first turn: no prefix to keep
    full = [*cands()[:2], Candidate("ded-1", "dedicated", "", 0, 300.0, 40, 32, running=32, queued=8, recent=0)]
    p = place_turn(req(), full, "ded-1", P, rng)
    assert p is not None and p.executor_id == "ser-2" and p.reason.startswith("leased")


def test_weighted_by_measured_throughput():
    w = weights(cands())
    assert w["ded-1"] == 3.0 and w["ser-1"] == 1.0
    # per sequence: ded-1 gives 300 / (3 + 1) = 75 tok/s, ser-2 (idle) 100, ser-1 100 / 3: ser-2 is sooner
    p = place_turn(req(), cands(), "", P, random.Random(0))
    assert p is not None and p.executor_id == "ser-2"
    p = place_turn(req(exclude=["ser-2"]), cands(), "", P, random.Random(0))
    assert p is not None and p.executor_id == "ded-1"
    unmeasured = [Candidate("new", "serving", "new-e1", 1, 0.0, 0, 8), *cands()]
    assert weights(unmeasured)["new"] == 1.0  # counts as the median until measured


def test_random_routing_spreads_and_hedge_prefers_dedicated():
    rng = random.Random(1)
    picks = {place_turn(req(routing="random"), cands(), "ser-1", P, rng).executor_id for _ in range(60)}  # type: ignore[union-attr]
    assert picks == {"ser-1", "ser-2", "ded-1"}
    h = place_turn(req(hedge=True, exclude=["ser-1"]), cands(), "ser-1", P, rng)
    assert h is not None and h.executor_id == "ded-1" and h.role == "dedicated"


def test_hedge_only_for_stragglers():
    assert should_hedge(req(hedge=True, elapsed_s=1.0, typical_turn_s=0.0), 0, P)[0] is False
    assert should_hedge(req(hedge=True, elapsed_s=2.0, typical_turn_s=1.0, group_size=8), 2, P)[0] is False
    assert should_hedge(req(hedge=True, elapsed_s=2.0, typical_turn_s=1.0, group_size=8), 7, P)[0] is True
    assert should_hedge(req(hedge=True, elapsed_s=5.0, typical_turn_s=1.0, group_size=8), 0, P)[0] is True
