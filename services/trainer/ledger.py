"""The trainer's ack ledger: which trajectory messages are held, acked or redelivered.

Why: no fault may lose work. A trajectory is acked only once a checkpoint covers the step that
trained on it (without checkpoints: once that step trained); until then the ledger holds its
delivery and keeps it alive (`in_progress` within the consumer's `ack_wait`), so a trainer killed
between collecting a group and training on it gets the group redelivered after its restart.
Groups trained on are remembered (bounded, and checkpointed) so that their redeliveries are acked
and counted as `already_used`, never trained on or counted twice.

In: trajectories with their deliveries (`on_trajectory`, the consumer's handler); the groups the
trainer hands out (`open`), trains on or drops (`use`); after a checkpoint, `settle`; on resume, the
checkpoint's open and used groups (`restore`). Out: trajectories added to the shared
`GroupCollector` (the trainer takes complete groups from it); acks and `in_progress` on the
bus; what a checkpoint records (`outstanding`, `used_groups`, `settled_stats`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from rose.contracts.rollout import Trajectory
from rose.shared.bus import Delivery

from .groups import GroupCollector

log = logging.getLogger("rose.services.trainer.trainer")  # the trainer's log lines keep their logger

USED_GROUPS_KEPT = 4096  # recent groups trained on, remembered (and checkpointed) to recognise their redeliveries
TRAJECTORY_MAX_DELIVER = 1000  # held trajectories may be redelivered across many restarts; never given up on


def group_id(run_id: str, step: int, index: int) -> str:
    """The id of group `index` of a run's `step` (deterministic: a step handed out again repeats it)."""
    return f"{run_id}-s{step}-g{index}"


class AckLedger:
    """The deliveries of open groups, held until trained on and checkpointed; the groups trained on."""

    def __init__(self, collector: GroupCollector, *, group_size: int, groups_per_step: int, ack_wait_s: float, over_provision: int = 0) -> None:
        self.collector = collector
        self.group_size, self.groups_per_step, self.ack_wait_s = group_size, groups_per_step, ack_wait_s
        self.over_provision = over_provision
        self.used: dict[str, None] = {}  # groups trained on, oldest first (bounded)
        self._held: dict[str, list[Delivery]] = {}  # group id -> its deliveries, unacked until a checkpoint covers the step that used them
        self._counted: dict[str, Counter] = {}  # group id -> what its deliveries added to the collector's counters
        self._settle: list[Delivery] = []  # deliveries of groups trained on, acked with the next checkpoint
        self._resumed: tuple[str, int] | None = None  # on resume: the run id and the checkpoint's task cursor (see `_ahead`)
        self._keepalive: asyncio.Task[None] | None = None

    # ---- receiving -----------------------------------------------------------------------

    async def on_trajectory(self, trajectory: Trajectory, delivery: Delivery) -> None:
        """Hold the trajectory of an open group (acked once trained on and checkpointed); ack anything else now."""
        gid = trajectory.group_id
        held = self._held.get(gid)
        stats = self.collector.stats
        if held is None and gid not in self.used and self._ahead(gid):
            held = self.open(gid)  # a resumed run's step handed out after its checkpoint: its tasks go out again later
        if held is None:
            if gid in self.used:  # redelivered after a restart (or late for a group trained on): never twice
                stats["received"] += 1
                stats["already_used"] += 1
            else:
                self.collector.add(trajectory)  # a group of no step of this run: counted, ignored
            await self.ack([delivery])
            return
        before = dict(stats)
        if gid in self.collector.groups:
            self.collector.add(trajectory)  # de-duplicated by trajectory id within the group
        else:  # its group is in the step being trained: too late for it, acked with the group
            stats["received"] += 1
            stats["late"] += 1
        held.append(delivery)
        counted = self._counted.setdefault(gid, Counter())
        for key, value in stats.items():
            if value != before.get(key, 0):
                counted[key] += value - before.get(key, 0)

    def open(self, group_id: str) -> list[Delivery]:
        """A group handed out (or to be): the collector expects it, its deliveries are held."""
        self.collector.expect(group_id, self.group_size)
        return self._held.setdefault(group_id, [])

    def _ahead(self, group_id: str) -> bool:
        """A group of this run from a step at or after the resumed checkpoint's task cursor (not handed out by this process yet)."""
        if self._resumed is None:
            return False
        run_id, emit_floor = self._resumed
        prefix = f"{run_id}-s"
        if not group_id.startswith(prefix):
            return False
        step, _, index = group_id[len(prefix) :].partition("-g")
        return step.isdigit() and index.isdigit() and int(step) >= emit_floor and int(index) < self.groups_in(int(step))

    def groups_in(self, step: int) -> int:
        """Groups handed out for ``step``: ``groups_per_step``, and the first step ``over_provision`` more
        (grpo.over_provision: N + k groups stay in flight, each step refilling the N it took)."""
        return self.groups_per_step + (self.over_provision if step == 0 else 0)

    # ---- acking --------------------------------------------------------------------------

    async def ack(self, deliveries: list[Delivery]) -> None:
        for d in deliveries:
            try:
                await d.ack()
            except Exception as exc:  # reconnecting: it is redelivered later and acked then as already used
                log.debug("ack failed (%r); the trajectory will be redelivered", exc)

    def use(self, group_ids: list[str]) -> None:
        """These groups were trained on: their deliveries await the next checkpoint, redeliveries are recognised."""
        for gid in group_ids:
            self._settle += self._held.pop(gid, [])
            self._counted.pop(gid, None)
            self.used[gid] = None
        while len(self.used) > USED_GROUPS_KEPT:
            del self.used[next(iter(self.used))]

    async def settle(self) -> None:
        """A checkpoint covers the groups trained on so far (or checkpoints are off): ack their deliveries."""
        settle, self._settle = self._settle, []
        await self.ack(settle)

    def start(self) -> None:
        self._keepalive = asyncio.create_task(self._keep_alive(), name="trainer:in-progress")

    async def _keep_alive(self) -> None:
        """Held trajectories stay unacked for a step or more: restart their ack deadline well before it passes."""
        interval = min(5.0, self.ack_wait_s / 3)
        while True:
            await asyncio.sleep(interval)
            for d in [d for held in self._held.values() for d in held] + list(self._settle):
                try:
                    await d.in_progress()
                except Exception:  # reconnecting; redelivered copies are held too
                    pass

    def stop(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()

    # ---- what a checkpoint records, and a resume restores ----------------------------------

    def outstanding(self) -> list[tuple[str, int]]:
        """Groups handed out and not trained on: (group id, size), in order."""
        return [(gid, self.collector.groups[gid].size) for gid in self._held if gid in self.collector.groups]

    def used_groups(self) -> list[str]:
        return list(self.used)

    def settled_stats(self) -> dict[str, int]:
        """The collector's counters without the open groups' trajectories (redelivered after a restart and counted then)."""
        stats = Counter(self.collector.stats)
        for gid in self._held:
            stats.subtract(self._counted.get(gid, Counter()))
        return {k: int(v) for k, v in stats.items()}

    def restore(self, run_id: str, *, outstanding: list[tuple[str, int]], used_groups: list[str], emit_from: int, emitted_steps: int) -> None:
        """Before consuming, on resume: the checkpoint's open groups, and those of the steps it may not have handed out
        (known before consuming: their redeliveries must not be taken for strangers)."""
        self.used = dict.fromkeys(used_groups)
        for gid, size in outstanding:
            self.collector.expect(gid, size)
            self._held[gid] = []
        self._resumed = (run_id, emit_from)
        for step in range(emit_from, emitted_steps):
            for i in range(self.groups_in(step)):
                self.open(group_id(run_id, step, i))

    def open_groups(self) -> int:
        return len(self._held)

    def held_trajectories(self) -> int:
        """Deliveries not acked yet: of open groups, and of groups trained on awaiting a checkpoint."""
        return sum(len(h) for h in self._held.values()) + len(self._settle)
