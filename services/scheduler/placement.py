"""Turn-wise placement as a pure function of explicit inputs, so a simulator can import it.

Each turn of a trajectory is placed on its own, so that lending never makes a step slower:
1. candidates are dedicated rollout executors and serving executors holding an active lease
   with at least `min_lease_left_s` to run, alive, not excluded by the worker;
2. every candidate gets a predicted finish time for a typical turn (``predict``): the wait for
   a batch slot (turns queued ahead / the turns it runs at once x one turn there) plus the turn
   at the per-sequence rate measured there (its rollout tokens/s over the sequences running),
   times the model's observed error for its role (observed / predicted turn times, kept by the
   scheduler's Fleet from the trajectories' turn records); a leased turn adds the chance of a
   revocation while it runs times the time to finish it on the dedicated pool instead; an
   executor other than the previous turn's adds the prefill of the turn's context there (its
   prompt at the prefill rate measured there, ``moved_prefill_s``): the prefix cache it lacks;
3. tail: once the unfinished trajectories of the turn's RL batch fit the dedicated pool's free
   slots (the request names its batch and size), the turn goes to a dedicated executor:
   leased capacity cannot make the last turns of a step faster, only slower;
4. a leased (serving) executor is chosen only when it is predicted to finish the turn sooner
   than the dedicated choice, waiting included; the prefix-cache executor of the previous turn
   (affinity) is the dedicated choice when it is dedicated, and keeps a leased turn only while
   it still beats the dedicated pool; an overloaded one (load > its concurrency x
   `overload_factor`) is not worth its cache. A dedicated prefix-cache executor with a free slot
   keeps its turn outright: a lease could only run it faster per token, and the move would
   prefill the whole context there and part of it again when a later turn comes back (with the
   executors' host tier the prefix is nearly always still home);
5. a turn placed on leased capacity carries a hedge hint: ``hedge_after_s``, the time it is
   predicted to take there; past it, the worker asks for a hedge (``should_hedge``), which the
   scheduler grants on a dedicated executor with a free slot once a burst has parked the turn
   (its lease is gone; the fleet still knows the executor's role): the first result wins.
   Refused, a leased turn asks again as its age doubles.
Without measurements (a fresh fleet), an executor counts as the median of those measured; random
routing, the baseline, picks uniformly.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from rose.contracts.executor import ExecutorRole
from rose.contracts.rollout import TurnRouteRequest

from .config import PlacementSettings

# Which rule of ``place_turn`` placed a turn (``Placement.rule``): the reason's words without its figures, so that
# the scheduler's placements and the simulator's can be counted and compared rule by rule.
RULES = (
    "random",  # the baseline routing: uniform
    "hedge",  # a duplicate of a straggling turn, on a dedicated executor when one is there
    "tail",  # the batch's unfinished trajectories fit the dedicated pool's free slots
    "home slot",  # its dedicated prefix-cache executor has a free slot
    "home lease",  # its leased prefix-cache executor still beats the dedicated choice
    "leased",  # a leased executor predicted to finish it sooner than the dedicated choice
    "home queue",  # its dedicated prefix-cache executor, no slot free yet, still the soonest
    "overloaded home",  # its prefix-cache executor is overloaded or gone: the soonest dedicated one
    "dedicated",  # no lease would be sooner
)


def rule_key(role: str, rule: str) -> str:
    """How placements are counted, by the executor's role and the rule ("serving: leased"): the simulator's
    ``placement_rules`` and a real run's (bench/e2e_emulated.py) use this one key, so the two compare."""
    return f"{role}: {rule}"


@dataclass(frozen=True)
class Candidate:
    executor_id: str
    role: ExecutorRole
    lease_id: str
    lease_epoch: int
    throughput: float  # measured rollout tokens/s (0: not measured yet)
    load: int  # turns in flight there
    slots: int  # rollout batch slots the executor can run
    running: int = 0  # rollout sequences running there (its last headroom)
    queued: int = 0  # rollout sequences waiting there for a slot (its last headroom)
    capacity: int = 0  # sequences it ran at once the last time others waited (its KV limit, measured; 0: never seen)
    recent: int = -1  # turns routed there since its last headroom (-1: no headroom yet: `load` is all there is)
    prefill_rate: float = 0.0  # prompt tokens/s a turn's prefill gets there, its lane's share counted (measured; 0: unknown)


@dataclass(frozen=True)
class Placement:
    executor_id: str
    lease_id: str
    lease_epoch: int
    role: ExecutorRole
    reason: str
    predicted_s: float = 0.0  # a typical turn's predicted seconds there, the model's error corrected (0: no prediction)
    hedge_after_s: float = 0.0  # ask for a hedge if the turn still runs after this long (0: no hint)
    model_s: float = 0.0  # the same before the correction: what the observed turn is compared with (``Fleet.on_turn_result``)
    model_wait_s: float = 0.0  # of ``model_s``, the wait for a slot (which a turn's tokens do not lengthen)
    rule: str = ""  # which of RULES placed it


@dataclass(frozen=True)
class Prediction:
    """A typical turn on one executor, in seconds once a typical turn's tokens are known, else in turn units."""

    wait: float  # until a slot frees
    run: float  # the turn itself at the per-sequence rate there

    @property
    def finish(self) -> float:
        return self.wait + self.run


def weights(candidates: list[Candidate]) -> dict[str, float]:
    """Relative throughput; an executor not yet measured counts as the median of those that are."""
    measured = sorted(c.throughput for c in candidates if c.throughput > 0)
    default = measured[len(measured) // 2] if measured else 1.0
    return {c.executor_id: (c.throughput if c.throughput > 0 else default) / default for c in candidates}


def concurrency(c: Candidate) -> int:
    """Turns the executor runs at once: what runs while others queue (its KV is full), else what ran the
    last time some queued, else its slots (the monitor counts compute only, not the KV that holds them)."""
    if c.queued > 0 and c.running > 0:
        return c.running
    return max(1, min(c.slots, c.capacity) if c.capacity > 0 else c.slots)


def sequence_rate(c: Candidate, weight: float) -> float:
    """Relative tokens/s one more sequence gets there: the measured throughput shared by the turns it
    will run beside (those running, or its slots' worth while it has none to measure by)."""
    sharing = max(1, min(concurrency(c), occupancy(c) + 1) if c.running <= 0 else c.running)
    return weight / sharing


def predict(c: Candidate, weight: float, turn_tokens: float = 1.0) -> Prediction:
    """A typical turn of `turn_tokens` there: the wait behind the turns queued ahead, then the turn.

    Slots free at `concurrency` turns per turn time, so k turns ahead wait k / concurrency turns.
    """
    run = turn_tokens / max(1e-12, sequence_rate(c, weight))
    ahead = max(0, occupancy(c) + 1 - concurrency(c))
    return Prediction(ahead / concurrency(c) * run, run)


def occupancy(c: Candidate) -> int:
    """Sequences there now: what it last reported running and queued plus the turns routed there since.
    (`load` also counts trajectories between turns, running a tool, which hold no slot.)"""
    return c.load if c.recent < 0 else c.running + c.queued + c.recent


def has_room(c: Candidate) -> bool:
    return occupancy(c) < concurrency(c)


def in_tail(unfinished: int | None, dedicated: list[Candidate]) -> bool:
    """The batch's unfinished trajectories fit the dedicated pool's slots left free by other work: what the pool
    runs at once less what it runs that is not this batch's (at most its occupancy beyond `unfinished`)."""
    if unfinished is None or not dedicated:
        return False
    other = max(0, sum(occupancy(c) for c in dedicated) - unfinished)
    return unfinished <= sum(concurrency(c) for c in dedicated) - other


def _least_loaded(candidates: list[Candidate]) -> Candidate:
    w = weights(candidates)
    return min(candidates, key=lambda c: ((c.load + 1) / w[c.executor_id], c.executor_id))


def _placed(c: Candidate, rule: str, reason: str, p: Prediction | None = None, turn_s: float = 0.0, raw: Prediction | None = None) -> Placement:
    """``p`` (corrected) and ``raw`` (the model's) in seconds when ``turn_s`` > 0 (else in turn units: no figure to hand out)."""
    assert rule in RULES, rule
    predicted = p.finish if p is not None and turn_s > 0 else 0.0
    hedge_after = predicted if c.role != "dedicated" else 0.0
    model = raw.finish if raw is not None and turn_s > 0 else 0.0
    wait = raw.wait if raw is not None and turn_s > 0 else 0.0
    return Placement(c.executor_id, c.lease_id, c.lease_epoch, c.role, reason, predicted, hedge_after, model, wait, rule)


def moved_prefill_s(c: Candidate, prompt_tokens: int, affinity: str) -> float:
    """What moving a turn to ``c`` costs, in seconds of its prediction there, against its previous turn's executor
    (``affinity``, which keeps its prefix cached; 0 there or where the rate is unknown): ``c`` prefills the whole
    context at its measured rate, and every sequence there waits that long too, the turn itself and those it
    holds (its occupancy): an executor's prefill budget per forward is shared, and a context of thousands of
    tokens takes it for tens of forwards. Priced as the turn's own prefill alone, a move looked nearly free and
    the simulator's 7B/8-GPU grid moved by at most 4 %; priced as here, it kept turns home and both static and rose
    ran faster (docs/benchmarks.md, 2026-12-05 (late night))."""
    if c.executor_id == affinity or c.prefill_rate <= 0:
        return 0.0
    return prompt_tokens / c.prefill_rate * (occupancy(c) + 1)


def leased_finish(p: Prediction, revoke_rate: float, fallback: float) -> float:
    """A leased turn's expected finish (``p`` in seconds): its prediction, plus, with the chance that its
    lease is revoked while it runs (``revoke_rate`` per lease-second), the time to finish it on the
    dedicated choice instead (``fallback``)."""
    if revoke_rate <= 0 or fallback == float("inf"):
        return p.finish
    return p.finish + (1.0 - math.exp(-revoke_rate * p.finish)) * fallback


def place_turn(
    req: TurnRouteRequest,
    candidates: list[Candidate],
    affinity: str,
    s: PlacementSettings,
    rng: random.Random,
    unfinished: int | None = None,
    turn_tokens: float = 0.0,
    revoke_rate: float = 0.0,
    model_error: dict[str, float] | None = None,
) -> Placement | None:
    """Where this turn runs, or None when no executor can take it.

    ``unfinished``: trajectories of the turn's batch not finished yet (None: unknown, no tail rule);
    ``turn_tokens``: generated tokens of a typical turn (0: unknown: predictions in turn units, no hedge hint);
    ``revoke_rate``: revocations per lease-second lately (a leased turn's risk of being interrupted);
    ``model_error``: per role, observed turn time / predicted lately (the model's bias, 1 when unknown).
    """
    pool = [c for c in candidates if c.executor_id not in req.exclude]
    if not pool:
        return None
    if req.hedge:  # the primary is in req.exclude; the previous turn's executor is not (it may be the least loaded)
        # the previous turn's executor for its prefix, and the soonest by prediction with the move priced, were tried
        # and left out: neutral over 28 simulated configurations (docs/benchmarks.md, 2026-12-06 (session 5))
        dedicated = [c for c in pool if c.role == "dedicated"]
        choice = dedicated or pool
        return _placed(_least_loaded(choice), "hedge", "hedge on dedicated" if dedicated else "hedge")
    if req.routing == "random":
        return _placed(rng.choice(sorted(pool, key=lambda c: c.executor_id)), "random", "random")
    w = weights(pool)
    measured = sorted(c.throughput for c in pool if c.throughput > 0)
    turn_s = turn_tokens / measured[len(measured) // 2] if measured and turn_tokens > 0 else 0.0  # a typical turn at weight 1
    unit = turn_s if turn_s > 0 else 1.0
    raw = {c.executor_id: predict(c, w[c.executor_id], unit) for c in pool}  # seconds once a typical turn is known
    err = model_error or {}
    pred = {c.executor_id: Prediction(raw[c.executor_id].wait * err.get(c.role, 1.0), raw[c.executor_id].run * err.get(c.role, 1.0)) for c in pool}
    if affinity and turn_s > 0:  # elsewhere, the turn first prefills the context its previous executor keeps cached
        for c in pool:
            extra = moved_prefill_s(c, req.prompt_tokens, affinity)
            if extra > 0:
                pred[c.executor_id] = Prediction(pred[c.executor_id].wait + extra, pred[c.executor_id].run)
    dedicated = [c for c in pool if c.role == "dedicated"]
    leased = [c for c in pool if c.role != "dedicated"]
    home = next((c for c in pool if c.executor_id == affinity), None) if affinity else None
    if home is not None and home.load > concurrency(home) * s.overload_factor:
        home = None  # overloaded: its prefix cache is not worth the wait
    # the dedicated choice: the prefix-cache executor when it is one, else the soonest predicted
    ded = (
        home
        if home is not None and home.role == "dedicated"
        else (min(dedicated, key=lambda c: (pred[c.executor_id].finish, c.executor_id)) if dedicated else None)
    )
    if ded is not None and in_tail(unfinished, dedicated):
        why = f"tail: {unfinished} unfinished fit the dedicated pool's free slots"
        return _placed(ded, "tail", why, pred[ded.executor_id], turn_s, raw[ded.executor_id])
    if ded is not None and ded is home and has_room(home):
        # its prefix is there and a slot is free: a lease could only run the turn faster per token, and the move
        # would prefill the whole context there (and again, in part, when a later turn comes back)
        return _placed(home, "home slot", "prefix affinity: a free slot at home", pred[home.executor_id], turn_s, raw[home.executor_id])
    ded_finish = pred[ded.executor_id].finish if ded is not None else float("inf")
    risky = {c.executor_id: leased_finish(pred[c.executor_id], revoke_rate if turn_s > 0 else 0.0, ded_finish) for c in leased}
    put = lambda c, rule, why: _placed(c, rule, why, pred[c.executor_id], turn_s, raw[c.executor_id])  # noqa: E731
    # the prefix-cache executor keeps its turn on a tie: its cache saves the prefill the prediction leaves out
    lease = (
        home
        if home is not None and home.role != "dedicated" and risky[home.executor_id] <= ded_finish
        else (min(leased, key=lambda c: (risky[c.executor_id], c.executor_id)) if leased else None)
    )
    if lease is not None and lease is home:
        return put(lease, "home lease", "prefix affinity")
    if lease is not None and risky[lease.executor_id] < ded_finish:
        lead = "no dedicated executor" if ded is None else f"predicted {risky[lease.executor_id]:.2f} vs {ded_finish:.2f} on dedicated"
        return put(lease, "leased", f"leased: {lead}")
    assert ded is not None  # pool is not empty: without a leased choice there is a dedicated one
    if ded is home:
        return put(ded, "home queue", "prefix affinity")
    if affinity and home is None:
        return put(ded, "overloaded home", "affinity executor overloaded or unavailable; dedicated")
    return put(ded, "dedicated", "dedicated: sooner than any lease" if leased else "dedicated")


def hedge_primary(req: TurnRouteRequest) -> str:
    """The executor running the turn a hedge request is for: the first it excludes, else the one it names."""
    return req.exclude[0] if req.exclude else req.previous_executor


def should_hedge(
    req: TurnRouteRequest,
    group_done: int,
    s: PlacementSettings,
    candidates: list[Candidate] | None = None,
    unfinished: int | None = None,
    primary_role: str = "",
) -> tuple[bool, str]:
    """Is this straggling turn worth a duplicate? (first result wins)

    A turn whose lease a burst revoked (its executor, the first of ``req.exclude`` or
    ``req.previous_executor``, is a serving one no longer a candidate: ``primary_role`` is its role
    as the fleet knows it) is parked until a new lease or the park's end; it is hedged as soon as a
    dedicated executor has a free slot and the turn is past its hint (the worker asks then) or its
    batch is in its tail. Judged by the group and typical-time rules alone, such turns held a
    synchronous step for the park's seconds (`rose bench e2e`, 2026-12-04: batches of 4-7 s against
    1 s). Not hedged at once: a new lease before the park's end resumes them in place.

    A turn on a live lease is not hedged by these rules: it runs, at about a dedicated slot's
    per-sequence speed, and a duplicate starts over, prefilling the whole context (the simulator's
    7B/8-GPU grid: 5-10 % of such hedges won, and the dedicated pool ran the copies instead of
    its own turns; without them rose was faster in 12 of 12 configurations). Otherwise, the group
    and typical-time rules below, for any executor.
    """
    if candidates is not None:
        primary = next((c for c in candidates if c.executor_id == hedge_primary(req)), None)
        role = primary.role if primary is not None else primary_role
        dedicated = [c for c in candidates if c.role == "dedicated" and c.executor_id not in req.exclude]
        free = [c for c in dedicated if has_room(c)]
        if primary is None and role not in ("", "dedicated") and free:  # parked: its lease is gone
            if in_tail(unfinished, dedicated):
                return True, "parked leased turn in the batch's tail; a dedicated slot is free"
            if req.elapsed_s > 0 and req.typical_turn_s > 0 and req.elapsed_s >= req.typical_turn_s:
                return True, f"parked leased turn late ({req.elapsed_s:.1f} s); a dedicated slot is free"
    typical = req.typical_turn_s
    if typical <= 0:
        return False, "no typical turn time yet"
    late = req.elapsed_s / typical
    if late >= s.hedge_always_after_typical:
        return True, f"turn at {late:.1f}x the typical time"
    if req.group_size > 1 and group_done / req.group_size >= s.hedge_group_done and late >= s.hedge_after_typical:
        return True, f"{group_done}/{req.group_size} of the group done, turn at {late:.1f}x typical"
    return False, "not a straggler"
