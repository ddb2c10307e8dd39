"""The simulated RL job's bookkeeping: steps trained, batches handed out, groups waiting (trainer.py runs the job)."""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np
import simpy


class TrainerState:
    """What the trainer has done and holds: the record of every trained step (the result's
    source), and, for the asynchronous trainer (``prefetch_steps`` >= 1), the batches handed out,
    the finished trajectories its consumer has not delivered yet, the complete groups it has not
    trained on, and the rollout span of every finished batch.

    It exists so the trainer processes, the trajectories (which report to their batch's record)
    and the trajectory consumer share one record, which the result then reads.
    """

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.pipelined = False  # ``prefetch_steps`` >= 1: the asynchronous trainer
        self.effective_prefetch = 0
        # the asynchronous trainer's state (set up by ``Trainer.pipelined``)
        self.ready_groups: list[tuple[int, int, float]] = []  # (batch, group, tokens) of complete groups not trained on yet
        self.batch_info: dict[int, dict[str, Any]] = {}  # batch -> its record (handed out, first / last finish, groups left)
        self.arrived: list[tuple[dict[str, Any], int]] = []  # finished trajectories the trainer has not received yet
        self.arrival_evt: simpy.Event | None = None  # the consumer's wait for the next arrival
        self.batch_spans: list[dict] = []  # pipelined: finished batches' rollout spans
        self.batch_version: dict[int, int] = {}  # batch -> the steps trained when it was handed out (its trajectories' version)
        self.handed_out_at = float("-inf")  # the last hand-out (capacity reports before it do not count)
        self.early_hand_outs = 0  # batches handed out while a step waited, capacity idle (grpo.early_hand_out)
        # partial rollouts (``over_provision``): what was trained against what was handed out, and what went stale
        self.partial = False
        self.group_generated: dict[tuple[int, int], int] = {}  # (batch, group) -> tokens its trajectories generated
        self.handed_tokens = 0.0  # every token of every trajectory handed out (prompt, generated, tool)
        self.handed_trajectories = 0
        self.trained_tokens = 0.0
        self.trained_trajectories = 0
        self.trained_lags: list[int] = []  # per trained group: versions between its hand-out and the step that trained it
        self.stale_groups = 0  # complete groups dropped past max_staleness (GroupCollector.expire)
        # when each trained version reached the dedicated pool and the serving instances: an executor's
        # retained prefixes were computed by the version it had (a new one misses them, PrefixCache.take)
        self.versions_dedicated: list[float] = []
        self.versions_serving: list[float] = []

    def published(self, dedicated_at: float, serving_at: float) -> None:
        """A trained version reaches the dedicated pool at ``dedicated_at``, the serving instances at ``serving_at``."""
        self.versions_dedicated.append(dedicated_at)
        self.versions_serving.append(serving_at)

    def version_at(self, dedicated: bool, now: float) -> int:
        """The policy version an instance has at ``now``: the versions that reached it by then."""
        return bisect.bisect_right(self.versions_dedicated if dedicated else self.versions_serving, now)

    def trajectory_done(self, info: dict[str, Any], i: int, finish: float, fetch_s: float) -> None:
        """Row ``i`` of the batch ``info`` records finished at ``finish``; the trainer receives it at once (``fetch_s``
        0), else its consumer's open fetch learns of it (``Trainer.consumer``)."""
        info["last"] = max(info["last"], finish)
        info["finished"].append(finish)
        info["group_fins"][i // info["group_rows"]].append(finish)
        self.arrived.append((info, i))
        if fetch_s <= 0:
            self.deliver(len(self.arrived))
        elif self.arrival_evt is not None and not self.arrival_evt.triggered:
            self.arrival_evt.succeed()

    def deliver(self, k: int) -> None:
        """The trainer receives ``k`` trajectories: a group is complete once all its members are in."""
        take, self.arrived = self.arrived[:k], self.arrived[k:]
        for info, i in take:
            g = i // info["group_rows"]
            info["left"][g] -= 1
            if info["left"][g] == 0:
                self.ready_groups.append((info["batch"], g, info["group_tokens"][g]))

    def batches_done_stats(self) -> None:
        """Rollout span (first turn start to last trajectory end, as ``rose bench e2e`` measures it) of every finished batch."""
        for b, info in self.batch_info.items():
            if info.get("span") is None and info["procs"] and all(pr.triggered for pr in info["procs"]) and info["first"] is not None:
                fin = np.sort(np.asarray(info["finished"]))
                info["span"] = info["last"] - info["first"]
                p90 = float(fin[int(0.9 * (len(fin) - 1))]) if len(fin) else info["last"]
                info["tail"] = max(0.0, info["last"] - p90)
                self.batch_spans.append(dict(batch=b, rollout_s=info["span"], tail_s=info["tail"], generated=info["generated"]))

    def drop_stale(self, step: int, max_staleness: int) -> None:
        """Complete groups whose trajectories started more than ``max_staleness`` versions before ``step``: dropped whole, counted."""
        keep = [g for g in self.ready_groups if step - self.batch_version[g[0]] <= max_staleness]
        self.stale_groups += len(self.ready_groups) - len(keep)
        self.ready_groups = keep

    def took(self, taken: list[tuple[int, int, float]], start: float, now: float) -> tuple[float, float]:
        """A step took ``taken`` groups at ``now`` after starting at ``start``: (its rollout seconds, its tail:
        from the time 90 % of the trajectories it trains had finished, a carried one counting from ``start``,
        to its last one's finish). Also counts what it trains, for the length bias."""
        fins: list[float] = []
        for b, g, tokens in taken:
            info = self.batch_info.get(b)
            group = info["group_fins"][g] if info is not None else []
            fins.extend(max(start, f) for f in group)
            self.trained_tokens += tokens
            self.trained_trajectories += len(group) * (info["bundle"] if info is not None else 1)
        if not fins:
            return now - start, 0.0
        fin = np.sort(np.asarray(fins))
        return now - start, max(0.0, float(fin[-1]) - float(fin[int(0.9 * (len(fin) - 1))]))
