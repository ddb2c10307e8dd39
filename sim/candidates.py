"""The simulated scheduler's placement candidates, refreshed once per tick (engine.py)."""

from __future__ import annotations

import dataclasses

from rose.services.scheduler.fleet import Fleet
from rose.services.scheduler.placement import Candidate


class CandidateCache:
    """The scheduler's ``Fleet.candidates`` and ``Fleet.revoke_rate``, as of one clock tick.

    It exists because ``Fleet.candidates`` walks every in-flight trajectory, which makes a call per
    route quadratic in the batch: the simulator refreshes them once per tick, and between refreshes
    a placement adds one trajectory (``bundle`` sequences) to the chosen executor's load, as its
    in-flight count would.
    """

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.tick = -1  # the tick of the last refresh
        self.revoke_rate = 0.0
        self.cands: list[Candidate] = []
        self.pos: dict[str, int] = {}  # executor id -> its index in cands

    def get(self, now: float, tick_no: int, bundle: int) -> list[Candidate]:
        if self.tick != tick_no:
            self.tick = tick_no
            self.revoke_rate = self.fleet.revoke_rate(now)
            # the fleet counts simulated trajectories in flight; each stands for ``bundle`` sequences (as headroom counts them)
            self.cands = [
                dataclasses.replace(
                    c,
                    load=max(c.running + c.queued, len(self.fleet.info(c.executor_id).inflight) * bundle),
                    recent=c.recent * bundle if c.recent > 0 else c.recent,
                )
                for c in self.fleet.candidates(now)
            ]
            self.pos = {c.executor_id: j for j, c in enumerate(self.cands)}
        return self.cands

    def placed(self, executor_id: str, bundle: int) -> None:
        j = self.pos.get(executor_id)
        if j is not None:
            c = self.cands[j]
            self.cands[j] = dataclasses.replace(c, load=c.load + bundle, recent=max(0, c.recent) + bundle)
