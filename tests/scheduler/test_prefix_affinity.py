"""Prefix-cache affinity priced by what the cache saves: an executor that ran an earlier turn of a trajectory
keeps (or wins) the next one while its predicted finish is no later than the best other finish plus the prefill
of the prefix it retains, at its measured rate; concurrency counts what runs; hedges and turns whose home is
gone prefer an executor of an earlier turn (services/scheduler/placement.py, fleet.py)."""

from __future__ import annotations

import random
import time

import msgspec

from rose.contracts.rollout import TurnRouteRequest
from rose.services.scheduler.config import PlacementSettings, SchedulerConfig
from rose.services.scheduler.fleet import MAX_RAN_ON, Fleet
from rose.services.scheduler.placement import Candidate, concurrency, place_turn, predict, prefix_saving
from rose.services.scheduler.scheduler import Scheduler
from rose.shared.bus import Delivery
from rose.testing.messages import beat
from rose.testing.messages import headroom as headroom_of

P = PlacementSettings()
TURN = 50.0  # generated tokens of a typical turn: 1/64 s at 3,200 tok/s


def req(**kw) -> TurnRouteRequest:
    return TurnRouteRequest(**{**dict(trajectory_id="t-1", turn_index=2, prompt_tokens=100), **kw})


def ded(ex: str, *, running: int, queued: int = 0, capacity: int = 64, tps: float = 3200.0) -> Candidate:
    return Candidate(ex, "dedicated", "", 0, tps, running + queued, 256, running, queued, capacity, 0)


def lease(ex: str, *, running: int, tps: float = 3200.0) -> Candidate:
    return Candidate(ex, "serving", f"{ex}-e1", 1, tps, running, 64, running, 0, 0, 0)


def test_a_home_keeps_its_turn_while_its_cache_saves_more_than_its_wait():
    """ded-1 (the previous turn's) runs 32 with 63 queued: a turn there waits 64/32 turns of 32 x 50 / 3,200 = 0.5 s,
    then runs 0.5 s: 1.5 s; ded-2 runs 16: 0.25 s. The 1.25 s between is the prefill of 125 tokens priced as the
    turn's own there (50 tokens in 0.5 s): a longer prefix keeps the turn home, a shorter one does not."""
    busy_home = [ded("ded-1", running=32, queued=63), ded("ded-2", running=16)]
    assert prefix_saving(50.0, 1 / 32, TURN, TURN / 3200.0) == 0.5  # a turn's tokens at 1/32 of the rate: the turn's 0.5 s
    kept = place_turn(req(prompt_tokens=200), busy_home, "ded-1", P, random.Random(0), turn_tokens=TURN)
    assert kept is not None and kept.executor_id == "ded-1" and kept.reason == "prefix affinity"
    # the same queue with a short prefix: its wait costs more than its cache saves
    moved = place_turn(req(prompt_tokens=100), busy_home, "ded-1", P, random.Random(0), turn_tokens=TURN)
    assert moved is not None and moved.executor_id == "ded-2" and moved.reason.startswith("affinity executor's wait exceeds")
    # a home with a short queue (15: 0.75 s) whose 40-token prefix saves 0.4 s loses the turn too
    short_queue = [ded("ded-1", running=32, queued=15), ded("ded-2", running=16)]
    p = place_turn(req(prompt_tokens=40), short_queue, "ded-1", P, random.Random(0), turn_tokens=TURN)
    assert p is not None and p.executor_id == "ded-2"
    # no typical turn yet (predictions in turn units): no saving to price; the home keeps only a tie
    p = place_turn(req(prompt_tokens=200), busy_home, "ded-1", P, random.Random(0))
    assert p is not None and p.executor_id == "ded-2"


def test_a_leased_home_keeps_its_turn_against_a_sooner_dedicated_one_by_its_saving():
    """A turn on the lease shares it 23 ways (23 x 50 / 3,200 = 0.36 s), 0.125 s behind the dedicated executor
    (15 ways: 0.23 s): the prefill of 100 tokens there (0.72 s) is worth more, of 10 (0.07 s) less."""
    pool = [lease("ser-1", running=23), ded("ded-1", running=15)]
    p = place_turn(req(prompt_tokens=100), pool, "ser-1", P, random.Random(0), turn_tokens=TURN)
    assert p is not None and p.executor_id == "ser-1" and p.reason == "prefix affinity" and p.hedge_after_s > 0
    p = place_turn(req(prompt_tokens=10), pool, "ser-1", P, random.Random(0), turn_tokens=TURN)
    assert p is not None and p.executor_id == "ded-1"
    # a lease with no prefix of this trajectory still has to be sooner than the dedicated one, whose cache counts for it
    pool = [lease("ser-2", running=10), ded("ded-1", running=15)]
    p = place_turn(req(prompt_tokens=100), pool, "ded-1", P, random.Random(0), turn_tokens=TURN)
    assert p is not None and p.executor_id == "ded-1" and p.reason == "prefix affinity"
    p = place_turn(req(prompt_tokens=100), pool, "", P, random.Random(0), turn_tokens=TURN)
    assert p is not None and p.executor_id == "ser-2"


def test_concurrency_counts_what_runs_beyond_a_stale_capacity():
    """Measured at 16 while others queued, the executor now runs 40 with none waiting: it runs 40 at once, so a
    turn there waits for one of 40 slots (a stale 16 made it wait for 25 of 16, and its prefix not worth it)."""
    grown = ded("ded-1", running=40, capacity=16)
    assert concurrency(grown) == 40
    assert predict(grown, 1.0).wait == predict(grown, 1.0).run / 40
    assert concurrency(ded("ded-1", running=10, capacity=16)) == 16  # fewer running: the KV limit seen still holds
    # 0.64 s there less 0.25 s of prefill saved, against 0.59 s on ded-2 (waiting 25/16 turns, it would be 1.35 s)
    p = place_turn(req(prompt_tokens=20), [grown, ded("ded-2", running=38, capacity=64)], "ded-1", P, random.Random(0), turn_tokens=TURN)
    assert p is not None and p.executor_id == "ded-1" and p.reason == "prefix affinity"


def test_a_hedge_prefers_a_free_executor_of_an_earlier_turn():
    """The home (a lease) was revoked and its turn parked: the duplicate goes to the dedicated executor that ran
    the trajectory's first turn (its retained prefix), though another free one is less loaded."""
    pool = [ded("ded-1", running=20), ded("ded-2", running=4)]
    hedge = req(hedge=True, previous_executor="ser-1", exclude=["ser-1"], elapsed_s=2.0, typical_turn_s=1.0)
    h = place_turn(hedge, pool, "ser-1", P, random.Random(0), prefixes={"ded-1": 60, "ser-1": 90})
    assert h is not None and h.executor_id == "ded-1" and h.reason == "hedge on dedicated: prefix of an earlier turn"
    # unknown to the trajectory: the least loaded
    h = place_turn(hedge, pool, "ser-1", P, random.Random(0))
    assert h is not None and h.executor_id == "ded-2" and h.reason == "hedge on dedicated"
    # the executor of an earlier turn has no free slot: the duplicate would wait there, the least loaded starts it now
    h = place_turn(hedge, [ded("ded-1", running=64, queued=3), ded("ded-2", running=4)], "ser-1", P, random.Random(0), prefixes={"ded-1": 60})
    assert h is not None and h.executor_id == "ded-2"


def test_a_turn_whose_home_is_gone_goes_back_to_an_earlier_turn_s_executor():
    """Turn 2's home (ser-1, turn 1's) lost its lease; ded-1 ran turn 0 (prompt 900, output ~50: 950 tokens,
    19 turns' worth) and is 1/64 s behind ded-2: it takes the turn."""
    pool = [ded("ded-1", running=17), ded("ded-2", running=16)]
    p = place_turn(req(prompt_tokens=1500), pool, "ser-1", P, random.Random(0), turn_tokens=TURN, prefixes={"ded-1": 900, "ser-1": 1200})
    assert p is not None and p.executor_id == "ded-1" and p.reason == "affinity executor unavailable; dedicated; prefix of an earlier turn"
    p = place_turn(req(prompt_tokens=1500), pool, "ser-1", P, random.Random(0), turn_tokens=TURN)
    assert p is not None and p.executor_id == "ded-2"


def test_the_fleet_remembers_where_a_trajectory_ran_bounded():
    fleet = Fleet(SchedulerConfig())
    fleet.on_route("tr-1", "ded-1", 1.0, prompt_tokens=100)
    fleet.on_route("tr-1", "ser-1", 2.0, prompt_tokens=300)
    fleet.on_route("tr-1", "ded-2", 3.0, hedge=True, prompt_tokens=300)  # a hedge computes the prefix there too
    assert fleet.prefixes("tr-1") == {"ded-1": 100, "ser-1": 300, "ded-2": 300}
    fleet.on_route("tr-1", "ded-1", 4.0, prompt_tokens=500)  # latest first to be kept: it moves to the end
    assert list(fleet.prefixes("tr-1").items())[-1] == ("ded-1", 500)
    for n in range(MAX_RAN_ON + 3):
        fleet.on_route("tr-1", f"ex-{n}", 5.0 + n, prompt_tokens=600 + n)
    assert len(fleet.prefixes("tr-1")) == MAX_RAN_ON and "ded-1" not in fleet.prefixes("tr-1")
    fleet.on_trajectory("tr-1", "")
    assert fleet.prefixes("tr-1") == {}
    fleet.on_route("tr-1", "ded-1", 9.0, prompt_tokens=100)  # a late route of a finished trajectory is not remembered
    assert fleet.prefixes("tr-1") == {}


async def test_the_scheduler_routes_a_turn_whose_home_is_gone_to_its_earlier_executor(bus):
    """On the real bus: turn 0 ran on ex-pa-d1; turn 1's executor is gone (never heard of again); turn 2 goes back
    to ex-pa-d1, a little busier than ex-pa-d2, for the prefix it retains."""
    s = Scheduler(SchedulerConfig(), bus)
    d = Delivery("test")
    for ex in ("ex-pa-d1", "ex-pa-d2"):
        await s.on_heartbeat(beat(ex, "dedicated"), d)
    first = TurnRouteRequest(trajectory_id="tr-pa", turn_index=0, prompt_tokens=900)
    route = await s.route(first, d)
    assert route.executor_id == "ex-pa-d1"  # both idle and unmeasured: the first by id
    now = time.time()
    s.fleet.on_trajectory("tr-other", "", [int(TURN)])  # a typical turn's tokens, from a finished trajectory
    for ex, running in (("ex-pa-d1", 17), ("ex-pa-d2", 16)):
        h = msgspec.structs.replace(
            headroom_of(now, ex=ex), role="dedicated", rollout_running=running, rollout_tokens_per_s=3200.0, rollout_batch_slots=256
        )
        await s.on_headroom(h, d)
    third = TurnRouteRequest(trajectory_id="tr-pa", turn_index=2, prompt_tokens=1500, previous_executor="ex-pa-gone")
    route = await s.route(third, d)
    assert route.executor_id == "ex-pa-d1" and "prefix of an earlier turn" in route.reason
