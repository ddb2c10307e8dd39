"""The simulated rollout worker's own state (engine.py runs its trajectories and turns)."""

from __future__ import annotations

import statistics
from collections import deque

import simpy

# rollout worker defaults (shared/turns/settings.py, runner.py)
HEDGE_MIN_S = 2.0
HEDGE_FACTOR = 1.5
TYPICAL_WINDOW = 64


class RolloutWorker:
    """The rollout worker (services/rollout_worker): its episode slots (``worker_concurrency``
    trajectories at a time, first handed out first; None: unbounded) and its window of recent
    turn times behind the straggler timer.

    It exists because both carry over from turn to turn and batch to batch, while everything
    else a trajectory needs is its own (its process's locals) or the scheduler's.
    """

    def __init__(self) -> None:
        self.episodes: simpy.Resource | None = None
        self.durations: deque[float] = deque(maxlen=TYPICAL_WINDOW)

    def size(self, env: simpy.Environment, concurrency: int | None, bundle: int) -> None:
        """Episode slots for ``concurrency`` trajectories, of which each simulated one is ``bundle``."""
        self.episodes = simpy.Resource(env, capacity=max(1, concurrency // max(1, bundle))) if concurrency else None

    def typical(self) -> float:
        """The rollout worker's typical turn time: the median of its last 64 turns (4 at least)."""
        return statistics.median(self.durations) if len(self.durations) >= 4 else 0.0

    def hedge_at(self, now: float, typical: float, leased: bool = False) -> float | None:
        """When a turn started ``now`` becomes a straggler: max(2 s, 1.5 x the typical turn); before any is known,
        2 s for a turn on leased capacity (a burst may park it) and None for one on a dedicated executor."""
        if typical > 0 or leased:
            return now + max(HEDGE_MIN_S, HEDGE_FACTOR * typical)
        return None
