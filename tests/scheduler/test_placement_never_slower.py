"""Placement that never makes a step slower: leased capacity only when predicted sooner, the tail on
dedicated executors, revocation risk, hedging of late leased turns, and the fleet inputs they use."""

from __future__ import annotations

import dataclasses
import random
import time

import msgspec
import pytest

from rose.contracts.lease import Lease
from rose.contracts.registry import LEASE
from rose.contracts.rollout import TurnRoute, TurnRouteRequest
from rose.contracts.slo import Headroom, SloAlert
from rose.services.scheduler.config import PlacementSettings, SchedulerConfig
from rose.services.scheduler.fleet import Fleet
from rose.services.scheduler.placement import RULES, Candidate, concurrency, in_tail, place_turn, should_hedge
from rose.services.scheduler.scheduler import Scheduler
from rose.shared.bus import Delivery
from rose.testing.messages import beat
from rose.testing.messages import headroom as headroom_of

P = PlacementSettings()


def req(**kw) -> TurnRouteRequest:
    return TurnRouteRequest(**{**dict(trajectory_id="t-1", turn_index=1, prompt_tokens=10), **kw})


def ded(
    ex: str = "ded-1", *, running: int = 32, queued: int = 0, load: int | None = None, tps: float = 3200.0, slots: int = 256, capacity: int = 0
) -> Candidate:
    return Candidate(ex, "dedicated", "", 0, tps, running + queued if load is None else load, slots, running, queued, capacity, 0)


def lease(ex: str = "ser-1", *, running: int = 4, queued: int = 0, tps: float = 200.0, slots: int = 16) -> Candidate:
    return Candidate(ex, "serving", f"{ex}-e1", 1, tps, running + queued, slots, running, queued, 0, 0)


def test_a_dedicated_slot_beats_a_slower_lease():
    """The dedicated executor has room: 100 tok/s per sequence there against 50 on the lease."""
    p = place_turn(req(), [ded(running=32, capacity=64), lease()], "", P, random.Random(0))
    assert p is not None and p.role == "dedicated" and p.rule == "dedicated"


def test_a_lease_only_when_the_dedicated_queue_makes_it_sooner():
    # full (KV-bound at 32 running) with 64 queued: a turn waits 65/32 turns there, ~3x a turn; the lease's 2x turn is sooner
    p = place_turn(req(), [ded(running=32, queued=64), lease()], "", P, random.Random(0))
    assert p is not None and p.role == "serving" and p.reason.startswith("leased") and p.rule == "leased"
    # a short queue (8 ahead, 1.3 turns in all) is still sooner than a lease twice as slow per sequence
    p = place_turn(req(), [ded(running=32, queued=8), lease()], "", P, random.Random(0))
    assert p is not None and p.role == "dedicated"


def test_concurrency_is_what_ran_while_others_waited():
    assert concurrency(ded(running=32, queued=5)) == 32
    assert concurrency(ded(running=10, queued=0, capacity=40)) == 40  # the KV limit seen earlier, not the 256 compute slots
    assert concurrency(ded(running=10, queued=0)) == 256


def test_the_tail_goes_to_dedicated_even_from_a_lease_home():
    pool = [ded(running=20, capacity=64), lease(running=1)]
    # the batch's 60 unfinished fit the 64 the pool runs at once (its 20 running are among them); 70 do not
    assert in_tail(60, [pool[0]]) and not in_tail(70, [pool[0]])
    # a pool full of another batch's turns (74 there, 5 of this batch at most) has no room for this one's tail
    assert not in_tail(5, [ded(running=64, queued=10)])
    p = place_turn(req(), pool, "ser-1", P, random.Random(0), unfinished=30)
    assert p is not None and p.role == "dedicated" and p.reason.startswith("tail") and p.rule == "tail"
    # unknown batch: no tail rule
    p = place_turn(req(), [ded(running=64, queued=64), lease(running=1)], "ser-1", P, random.Random(0), unfinished=None)
    assert p is not None and p.executor_id == "ser-1" and p.rule == "home lease"


def test_revocation_risk_and_model_error_can_turn_a_lease_down():
    pool = [ded(running=32, queued=64), lease()]
    base = place_turn(req(), pool, "", P, random.Random(0), turn_tokens=300.0)
    assert base is not None and base.role == "serving" and base.hedge_after_s > 0 and base.predicted_s > 0
    # leases revoked every ~10 s per lease: a turn of several seconds there is likely to be interrupted
    risky = place_turn(req(), pool, "", P, random.Random(0), turn_tokens=300.0, revoke_rate=0.1)
    assert risky is not None and risky.role == "dedicated" and risky.hedge_after_s == 0.0
    # turns on leases lately took 3x what the model said: the same choice is no longer sooner
    slow = place_turn(req(), pool, "", P, random.Random(0), turn_tokens=300.0, model_error={"serving": 3.0, "dedicated": 1.0})
    assert slow is not None and slow.role == "dedicated"


def test_a_turn_on_a_live_lease_is_not_hedged_by_the_lease_rules():
    """Late against the typical turn, or in its batch's tail, with a dedicated slot free: the lease still runs the
    turn, and a duplicate would start over there (the whole context's prefill) for the 5-10 % of copies that won
    in the simulator. The group and typical-time rules still apply to it, as to any turn."""
    pool = [ded(running=10, capacity=64), lease()]
    late = req(hedge=True, exclude=["ser-1"], elapsed_s=12.0, typical_turn_s=10.0, group_size=8)
    assert should_hedge(late, 0, P, pool) == (False, "not a straggler")
    assert should_hedge(late, 0, P, pool, unfinished=20)[0] is False  # the batch's tail
    group = msgspec.structs.replace(late, elapsed_s=16.0)
    assert should_hedge(group, 0, P, pool)[0] is False
    assert should_hedge(group, 7, P, pool)[0] is True  # 7 of its 8 siblings done and the turn at 1.6x typical: the group rule
    far = msgspec.structs.replace(late, elapsed_s=45.0)
    assert should_hedge(far, 0, P, pool)[0] is True  # 4.5x typical: hedged wherever it runs
    h = place_turn(far, pool, "ser-1", P, random.Random(0))
    assert h is not None and h.executor_id == "ded-1"


def fleet_of(*executors: tuple[str, str]) -> Fleet:
    """A scheduler's fleet that heard, at t=100, a heartbeat from each (executor id, role) that keeps it alive."""
    fleet = Fleet(SchedulerConfig())
    for ex, role in executors:
        fleet.on_heartbeat(beat(ex, role, interval_s=1e9), now=100.0)
    return fleet


def active_lease(ex: str, *, expires_at: float, compute_share: float, max_rollout_batch: int) -> Lease:
    """The first lease of serving executor ``ex``, granted at t=100."""
    return Lease(
        lease_id=f"{ex}-e1",
        executor_id=ex,
        epoch=1,
        state="active",
        granted_at=100.0,
        expires_at=expires_at,
        kv_bytes=1,
        compute_share=compute_share,
        max_rollout_batch=max_rollout_batch,
    )


def headroom(ex: str, at: float, role: str, running: int, queued: int, tps: float, slots: int = 256) -> Headroom:
    return Headroom(
        executor_id=ex,
        at=at,
        kv_bytes=1 << 30,
        compute_share=1.0,
        rollout_batch_slots=slots,
        ttft_p99_ms=0.0,
        tpot_p99_ms=0.0,
        slo_ttft_ms=1000.0,
        slo_tpot_ms=100.0,
        arrival_rate_rps=0.0,
        serving_queue=0,
        role=role,
        lendable=True,  # type: ignore[arg-type]
        rollout_running=running,
        rollout_queue=queued,
        rollout_tokens_per_s=tps,
    )


def test_the_fleet_learns_capacity_batches_model_error_and_revocations():
    fleet = fleet_of(("d0", "dedicated"), ("d1", "dedicated"), ("s0", "serving"))
    fleet.on_headroom(headroom("d0", 100.0, "dedicated", 40, 5, 4000.0))
    fleet.on_headroom(headroom("d1", 100.0, "dedicated", 10, 0, 1000.0))
    cands = {c.executor_id: c for c in fleet.candidates(100.0)}
    assert cands["d0"].capacity == 40 and cands["d1"].capacity == 40  # d1 never queued: its pool's median
    # batch progress: two trajectories of a batch of three, one finished
    for t in ("a", "b"):
        fleet.on_route(t, "d0", 101.0, batch_id="v3", batch_size=3)
    assert fleet.unfinished("v3") == 3 and fleet.unfinished("v9") is None
    fleet.on_trajectory("a", "g", [100, 300])
    fleet.on_trajectory("a", "g", [100, 300])  # a duplicate delivery counts once
    assert fleet.unfinished("v3") == 2 and fleet.turn_tokens > 0
    # a turn that took twice its prediction (scaled to its tokens) raises its role's model error above 1
    fleet.on_prediction("b", 0, "dedicated", 10.0)
    fleet.on_turn_result("b", 0, int(fleet.turn_tokens), 20.0)
    assert fleet.model_error["dedicated"] > 1.5
    # a revoked lease is a revocation; re-sending the revoked record is not another one
    active = active_lease("s0", expires_at=110.0, compute_share=0.1, max_rollout_batch=4)
    fleet.on_lease(active, 100.0)
    revoked = msgspec.structs.replace(active, state="revoked")
    fleet.on_lease(revoked, 105.0)
    fleet.on_lease(revoked, 105.0)
    assert len(fleet.revocations) == 1 and fleet.revoke_rate(106.0) > 0 and fleet.revoke_rate(106.0 + 1000.0) == 0.0


def test_a_short_turn_behind_a_queue_is_not_read_as_a_model_many_times_off():
    """The wait for a slot is the same for a short turn as for a long one: only the run scales to the turn's tokens.
    A tenth of a typical turn that waited as predicted and ran as predicted is the model exactly right."""
    fleet = fleet_of(("d0", "dedicated"))
    fleet.on_trajectory("x", "g", [300])  # a typical turn: 300 tokens
    typical = fleet.turn_tokens
    fleet.on_prediction("short", 0, "dedicated", 10.0, wait_s=8.0)  # 8 s waiting, then 2 s for a typical turn
    fleet.on_turn_result("short", 0, int(typical / 10), 8.0 + 0.2)
    assert fleet.model_error["dedicated"] == pytest.approx(1.0, rel=0.05)
    fleet.on_prediction("late", 0, "dedicated", 10.0, wait_s=8.0)  # a typical turn that took twice the whole prediction
    fleet.on_turn_result("late", 0, int(typical), 20.0)
    assert fleet.model_error["dedicated"] > 1.0
    assert place_turn(req(), [lease(tps=800.0)], "", P, random.Random(0), turn_tokens=300.0).model_wait_s == 0.0  # a free slot: no wait


def test_route_messages_evolve_with_defaults():
    """A worker built before the batch fields and a reader of the hedge hint both still work (msgspec schema evolution)."""
    old = msgspec.json.encode({"trajectory_id": "t-1", "turn_index": 0, "prompt_tokens": 5})
    r = msgspec.json.decode(old, type=TurnRouteRequest)
    assert r.batch_id == "" and r.batch_size == 0
    reply = msgspec.json.decode(msgspec.json.encode({"trajectory_id": "t-1", "turn_index": 0, "executor_id": "ser-1"}), type=TurnRoute)
    assert reply.hedge_after_s == 0.0


def test_a_revoked_lease_s_turn_is_still_a_lease_s_turn():
    """Its executor is no longer a candidate (a burst revoked the lease and parked the turn), but the turn is still a
    lease's turn: past its typical time, or in its batch's tail, a free dedicated slot takes a duplicate."""
    pool = [ded(running=10, capacity=64)]  # the serving executor's lease was revoked: only the dedicated one is a candidate
    late = req(hedge=True, exclude=["ser-1"], elapsed_s=1.2, typical_turn_s=1.0, group_size=8)
    assert should_hedge(late, 0, P, pool)[0] is False  # role unknown: the group and typical-time rules alone
    assert should_hedge(late, 0, P, pool, primary_role="serving")[0] is True
    assert should_hedge(late, 0, P, pool, primary_role="dedicated")[0] is False
    assert should_hedge(late, 0, P, [ded(running=64, queued=3)], primary_role="serving")[0] is False  # no free slot
    early = msgspec.structs.replace(late, elapsed_s=0.3)  # not late: a new lease may resume it in place
    assert should_hedge(early, 0, P, pool, primary_role="serving")[0] is False
    assert should_hedge(early, 0, P, pool, unfinished=5, primary_role="serving")[0] is True  # but the batch waits on it


def test_a_hedge_may_go_to_the_previous_turn_s_executor():
    """The worker names the previous turn's executor (its prefix cache) and excludes the primary: the hedge
    goes to that dedicated executor, not nowhere (it was excluded as if it were the primary)."""
    hedge = req(hedge=True, turn_index=2, previous_executor="ded-1", exclude=["ser-1"], elapsed_s=1.0, typical_turn_s=0.5)
    h = place_turn(hedge, [ded(running=10, capacity=64)], "ded-1", P, random.Random(0))
    assert h is not None and h.executor_id == "ded-1" and h.reason == "hedge on dedicated" and h.rule == "hedge"


async def test_a_turn_parked_by_a_burst_gets_a_dedicated_duplicate(bus):
    """The scheduler's route, on the real bus: a burst revokes the lease (its turns park until a new lease or the
    park's end); a second turn stuck there past its typical time, whose first turn ran on the dedicated executor, is
    duplicated there, as the worker asks (shared/turns/runner.py: previous turn's executor, primary excluded)."""
    await bus.kv_delete(LEASE, executor_id="ex-pk-serving")
    s = Scheduler(SchedulerConfig(), bus)
    d = Delivery("test")
    await s.on_heartbeat(beat("ex-pk-serving", "serving"), d)
    await s.on_heartbeat(beat("ex-pk-dedicated", "dedicated"), d)
    await s.on_headroom(headroom_of(time.time(), ex="ex-pk-serving"), d)
    await s.tick()
    assert s.counts["granted"] == 1
    early = req(trajectory_id="tr-pk", previous_executor="ex-pk-dedicated", exclude=["ex-pk-serving"], hedge=True, elapsed_s=0.3, typical_turn_s=1.0)
    early = msgspec.structs.replace(early, group_id="g-pk", group_size=8)
    late = msgspec.structs.replace(early, elapsed_s=1.2)
    await s.on_alert(SloAlert(executor_id="ex-pk-serving", at=time.time(), severity="burst", reason="test"), d)
    revoked = await bus.kv_get(LEASE, executor_id="ex-pk-serving")
    assert revoked is not None and revoked.state == "revoked" and revoked.park_until > time.time()  # parked, not interrupted
    assert (await s.route(early, d)).executor_id == ""  # not late yet: a new lease may resume it in place
    route = await s.route(late, d)
    assert route.executor_id == "ex-pk-dedicated" and route.role == "dedicated"
    # a primary the scheduler never heard of: judged by the group and typical-time rules alone (1.2x is not a straggler)
    unknown = msgspec.structs.replace(late, trajectory_id="tr-pk-2", exclude=["ex-pk-unknown"])
    assert (await s.route(unknown, d)).executor_id == ""


def test_a_move_pays_the_prefill_of_the_context_its_home_keeps_cached():
    """A queue at home against a free lease: the lease wins while prefilling the 30,000-token context there (at the
    prefill rate it measured, for the turn and the 4 sequences there that wait for it) costs less than the wait at
    home, and loses once it costs more."""
    home = ded(running=32, queued=16, tps=3200.0)  # a typical 300-token turn: 3 s there after 1.6 s of wait
    long_context = req(prompt_tokens=30_000)
    fast = place_turn(
        long_context, [home, dataclasses.replace(lease(tps=800.0), prefill_rate=60_000.0)], "ded-1", P, random.Random(0), turn_tokens=300.0
    )
    assert fast is not None and fast.role == "serving"  # 1.5 s there, 0.5 s of prefill x 5 sequences: 4.0 s against 4.6 s
    slow = place_turn(
        long_context, [home, dataclasses.replace(lease(tps=800.0), prefill_rate=3_000.0)], "ded-1", P, random.Random(0), turn_tokens=300.0
    )
    assert slow is not None and slow.executor_id == "ded-1" and slow.reason == "prefix affinity"  # 10 s of prefill x 5
    assert slow.rule == "home queue"  # its home has no free slot: it waits there
    # the first turn has no home: every executor prefills the prompt alike, so the rate does not count
    first = place_turn(
        msgspec.structs.replace(long_context, turn_index=0),
        [home, dataclasses.replace(lease(tps=800.0), prefill_rate=3_000.0)],
        "",
        P,
        random.Random(0),
        turn_tokens=300.0,
    )
    assert first is not None and first.role == "serving"
    # unknown rate (an SGLang backend, or nothing prefilled there yet): no price, as before
    unknown = place_turn(long_context, [home, lease(tps=800.0)], "ded-1", P, random.Random(0), turn_tokens=300.0)
    assert unknown is not None and unknown.role == "serving"


def test_the_fleet_prices_a_lane_s_prefill_at_the_rate_measured_there():
    """An executor reports its rollout forwards' prefill rate by the wall clock, the serving forwards its rollout
    yielded to included: the fleet takes it as it is, whatever share of the device the lease names."""
    fleet = fleet_of(("d0", "dedicated"), ("s0", "serving"))
    fleet.on_headroom(msgspec.structs.replace(headroom("d0", 100.0, "dedicated", 40, 0, 4000.0), rollout_prefill_tokens_per_s=20_000.0))
    lane = headroom("s0", 100.0, "serving", 4, 0, 400.0, slots=16)
    fleet.on_headroom(msgspec.structs.replace(lane, compute_share=0.25, rollout_prefill_tokens_per_s=8_000.0))
    fleet.on_lease(active_lease("s0", expires_at=160.0, compute_share=0.25, max_rollout_batch=16), 100.0)
    assert {c.executor_id: c.prefill_rate for c in fleet.candidates(100.0)} == {"d0": 20_000.0, "s0": 8_000.0}


def test_each_placement_names_the_rule_that_made_it():
    """``Placement.rule``: the reason without its figures, one of RULES, so placements count by rule (the simulator's
    ``placement_rules``, the scheduler's PlacementEvent.rule)."""
    rng = random.Random(0)
    assert place_turn(req(routing="random"), [ded(), lease()], "", P, rng).rule == "random"
    assert place_turn(req(turn_index=1), [ded(running=10, capacity=64), lease()], "ded-1", P, rng).rule == "home slot"
    # home overloaded (its load far past what it runs at once): the soonest dedicated one, not its cache
    overloaded = dataclasses.replace(ded(running=32, queued=64), load=1000)
    p = place_turn(req(turn_index=1), [overloaded, lease(running=64, queued=64, tps=10.0)], "ded-1", P, rng)
    assert p.rule == "overloaded home" and "overloaded" in p.reason
    assert {"random", "home slot", "overloaded home"} <= set(RULES)
