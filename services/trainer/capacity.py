"""Whether the fleet's rollout capacity idles: the asynchronous trainer's cue to hand a step out early.

Data flow: the SLO monitor publishes each executor's headroom (slo.headroom, every
`headroom_interval_s`, dedicated executors included), whose `rollout_queue` counts the rollout
sequences waiting there for a slot. The trainer keeps the latest report of each executor
(`observe`); while a step waits for its groups, `idle(now, since)` says whether every executor
heard from lately has reported, after the trainer's last hand-out, that nothing waits there: the
fleet runs every turn it has and has room for more.

Why: with `grpo.prefetch_steps` p the trainer hands a step out only after training one, so near
the end of each step's rollout the work in flight drains to its tail and capacity idles (leased
capacity first: it takes the turns the dedicated pool cannot). Handing the next step out then,
within `grpo.max_staleness`, fills that capacity. Where capacity is full (a queue somewhere),
more work would only queue beside the older step's turns and delay them, so the trainer waits.
The verdict is the fleet's own measurement, not a tuned threshold: a queue of zero everywhere.
The simulator feeds the same class its monitor's headroom (sim/control.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from rose.contracts.slo import Headroom

GONE_AFTER_INTERVALS = 3.0  # an executor not heard from for this many of the monitor's intervals has left the verdict
DEFAULT_INTERVAL_S = 1.0  # until an executor has reported twice: the SLO monitor's default headroom_interval_s


@dataclass(frozen=True)
class Report:
    received: float  # the observer's clock
    queue: int  # rollout sequences waiting for a slot there
    interval: float  # since that executor's previous report (0: its first)


class RolloutCapacity:
    """The latest headroom of each executor, reduced to one verdict: does rollout capacity idle?"""

    def __init__(self) -> None:
        self.latest: dict[str, Report] = {}

    def observe(self, headroom: Headroom, now: float) -> None:
        previous = self.latest.get(headroom.executor_id)
        self.latest[headroom.executor_id] = Report(now, headroom.rollout_queue, now - previous.received if previous else 0.0)

    def interval(self) -> float:
        """The monitor's reporting interval as observed (the median over executors)."""
        seen = [r.interval for r in self.latest.values() if r.interval > 0]
        return statistics.median(seen) if seen else DEFAULT_INTERVAL_S

    def live(self, now: float) -> list[Report]:
        """The latest report of each executor heard from within GONE_AFTER_INTERVALS intervals."""
        horizon = now - GONE_AFTER_INTERVALS * self.interval()
        return [r for r in self.latest.values() if r.received >= horizon]

    def idle(self, now: float, since: float) -> bool:
        """Every live executor reported after ``since`` (the last hand-out: its turns have reached the
        executors' queues by then) and none has a rollout queue; False while no executor is heard from."""
        live = self.live(now)
        return bool(live) and all(r.received > since and r.queue == 0 for r in live)
