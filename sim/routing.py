"""The simulated scheduler's route and hedge handlers, over the scheduler's own ``Fleet`` (worker.py's turns call them)."""

from __future__ import annotations

import collections
import random

from rose.contracts.rollout import TurnRouteRequest
from rose.contracts.service import Heartbeat
from rose.services.scheduler.config import SchedulerConfig
from rose.services.scheduler.fleet import Fleet
from rose.services.scheduler.placement import Candidate, rule_key

from .candidates import CandidateCache
from .instances import Instances
from .policies import FleetPolicy
from .turns import TurnTable


class Router:
    """The scheduler's side of turn placement: its ``Fleet`` (every executor's role, leases, headroom,
    the trajectories in flight and their turn records), its placement candidates as of the current
    tick, its placement settings and the random stream random routing draws from.

    It exists because routing and hedging need the scheduler's state and nothing of the rollout
    model's but the instance index and the turn table's ``bundle`` (each simulated trajectory stands
    for ``bundle`` sequences), while the lease hooks, the monitor and the trajectories only report
    to the same ``fleet``.
    """

    def __init__(self, policy: FleetPolicy, inst: Instances, turns: TurnTable, group_size: int, seed: int) -> None:
        self.policy = policy
        self.index = inst.index
        self.turns = turns
        self.group_size = group_size
        self.rng = random.Random(seed)
        # the scheduler's own fleet view (leases live there), and its placement candidates as of a tick
        self.fleet = Fleet(SchedulerConfig())
        for d, eid in enumerate(inst.ids):
            role = "dedicated" if inst.is_ded[d] else "serving"
            self.fleet.on_heartbeat(
                Heartbeat(
                    service="executor",
                    instance=eid,
                    version="sim",
                    host="sim",
                    pid=0,
                    started_at=0.0,
                    sent_at=0.0,
                    interval_s=1e12,
                    labels={"role": role},
                ),
                now=0.0,
            )
        self.settings = self.fleet.config.placement
        self.cands = CandidateCache(self.fleet)
        # placements by the executor's role and the rule that placed them ("serving: leased"), as the scheduler's
        # PlacementEvents count them (bench/e2e_emulated.py)
        self.rules: collections.Counter[str] = collections.Counter()

    def route(
        self,
        now: float,
        tick_no: int,
        tid: str,
        gid: str,
        k: int,
        prompt_tokens: float,
        prev: str,
        exclude: list[str],
        batch: tuple[str, int] = ("", 0),
    ) -> tuple[int, float] | None:
        """The scheduler's route handler without its I/O: affinity from the request or the fleet,
        then place_turn over the fleet's candidates (with the batch's unfinished trajectories for the
        tail rule); the fleet records the route. Returns (device, hedge hint s) or None."""
        req = TurnRouteRequest(
            trajectory_id=tid,
            turn_index=k,
            prompt_tokens=int(prompt_tokens),
            previous_executor=prev,
            group_id=gid,
            group_size=self.group_size,
            exclude=exclude,
            batch_id=batch[0],
            batch_size=batch[1],
        )
        affinity = req.previous_executor or self.fleet.affinity.get(tid, "")
        cands = self.candidates(now, tick_no)
        placement = self.policy.place_turn(
            req,
            cands,
            affinity,
            self.settings,
            self.rng,
            self.unfinished(req.batch_id, req.batch_size),
            self.fleet.turn_tokens,
            self.cands.revoke_rate,
            self.fleet.model_error,
        )
        if placement is None:
            return None
        self.rules[rule_key(placement.role, placement.rule)] += 1
        self.fleet.on_route(tid, placement.executor_id, now, batch_id=req.batch_id, batch_size=req.batch_size)
        self.fleet.on_prediction(tid, k, placement.role, placement.model_s, placement.model_wait_s)
        self.placed(placement.executor_id)
        return self.index[placement.executor_id], placement.hedge_after_s

    def hedge(
        self,
        now: float,
        tick_no: int,
        tid: str,
        gid: str,
        k: int,
        prompt_tokens: float,
        primary: str,
        previous: str,
        elapsed: float,
        typical: float,
        bid: tuple[str, int] = ("", 0),
    ) -> int | None:
        """The scheduler's hedge path: should_hedge, then place_turn with hedge=True (prefers dedicated). The request
        is the worker's: the previous turn's executor (its prefix cache; "" for a first turn) and the primary excluded."""
        req = TurnRouteRequest(
            trajectory_id=tid,
            turn_index=k,
            prompt_tokens=int(prompt_tokens),
            previous_executor=previous,
            group_id=gid,
            group_size=self.group_size,
            exclude=[primary],
            hedge=True,
            elapsed_s=elapsed,
            typical_turn_s=typical,
            batch_id=bid[0],
            batch_size=bid[1],
        )
        candidates, role = self.candidates(now, tick_no), self.fleet.role_of(primary)
        worth, _why = self.policy.should_hedge(
            req, self.fleet.group_done.get(gid, 0), self.settings, candidates, self.unfinished(bid[0], bid[1]), role
        )
        if not worth:
            return None
        affinity = req.previous_executor or self.fleet.affinity.get(tid, "")
        placement = self.policy.place_turn(req, candidates, affinity, self.settings, self.rng)
        if placement is None:
            return None
        self.rules[rule_key(placement.role, placement.rule)] += 1
        self.fleet.on_route(tid, placement.executor_id, now, hedge=True)
        self.placed(placement.executor_id)
        return self.index[placement.executor_id]

    def unfinished(self, batch_id: str, batch_size: int = 0) -> int | None:
        """The fleet's count is of simulated trajectories; each stands for ``bundle`` (as slots and load do)."""
        n = self.fleet.unfinished(batch_id, batch_size)
        return None if n is None else n * self.turns.bundle

    def candidates(self, now: float, tick_no: int) -> list[Candidate]:
        """The scheduler's ``Fleet.candidates``, refreshed once per tick (``CandidateCache``)."""
        return self.cands.get(now, tick_no, self.turns.bundle)

    def placed(self, executor_id: str) -> None:
        self.cands.placed(executor_id, self.turns.bundle)
