"""GRPO groups handed out to ROSE for TRL, until every member has a usable trajectory.

TRL needs exactly one completion per prompt it asked for (`rollout_func`) and a whole group to
compute advantages (the async worker), so a member is never dropped: where ROSE's reference
trainer trains a group without its failed or lost members (services/trainer/groups.py), a
member here is handed out again as a new task (same problem, a new task id) until a usable
trajectory comes back:

* failed (an environment failure, or the worker gave up after its own redeliveries): again at once;
* stale (its oldest token older than the group's `min_version`, the synchronous seam's on-policy bound:
  TRL's GRPOTrainer without vLLM never corrects for the sampling policy): again at once;
* lost (no trajectory `member_timeout_s` after it went out; a killed worker's task is redelivered by
  the work queue well before that): again, and whichever attempt comes back first fills the member.

A member that needs more than `max_attempts` tasks fails its group with every reason it was given:
that is a broken environment or a fleet that never serves the version, not chance.

Everything here runs on the bus's event loop (bridge.py); a group's waiter wakes when it is complete.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from rose.contracts.rollout import RolloutTask, Trajectory
from rose.shared.errors import RoseError

from .sequences import oldest_version
from .tasks import TaskSpec

# The reference trainer's grpo.group_timeout_s: how long ROSE waits for a group's members before calling the missing lost.
MEMBER_TIMEOUT_S = 300.0
# Tasks one member may take. Each already had the worker's own redeliveries (rollout_worker max_deliver, 20) behind it,
# so a member whose fourth task also fails is failing for a reason (the environment, a fleet that never applies the
# version), which the error then names; an occasional executor fault or stale first turn costs one more task.
MAX_ATTEMPTS = 4


class RolloutFailed(RoseError, RuntimeError):
    """A group member could not get a usable trajectory within `max_attempts` tasks."""


class Group:
    """One GRPO group in flight: `size` members of one problem."""

    def __init__(self, group_id: str, spec: TaskSpec, size: int, *, min_version: int | None, batch_id: str, batch_size: int) -> None:
        self.group_id, self.spec, self.size = group_id, spec, size
        self.min_version, self.batch_id, self.batch_size = min_version, batch_id, batch_size
        self.members: list[Trajectory | None] = [None] * size
        self.current: list[str] = [""] * size  # the task id of each member's newest attempt
        self.attempts = [0] * size
        self.sent_at = [0.0] * size
        self.reasons: list[list[str]] = [[] for _ in range(size)]
        self.error: RolloutFailed | None = None
        self.finished = asyncio.Event()

    def complete(self) -> bool:
        return all(m is not None for m in self.members)

    async def wait(self) -> list[Trajectory]:
        """The members' trajectories, in member order, once every one is usable (or the group's `RolloutFailed`)."""
        await self.finished.wait()
        if self.error is not None:
            raise self.error
        return [m for m in self.members if m is not None]


class GroupBook:
    """Every group in flight by task id: hands members out, fills them from trajectories, hands them out again."""

    def __init__(
        self,
        publish: Callable[[RolloutTask], Awaitable[None]],
        *,
        max_turns: int,
        max_tokens: int,
        member_timeout_s: float = MEMBER_TIMEOUT_S,
        max_attempts: int = MAX_ATTEMPTS,
    ) -> None:
        self.publish = publish
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.member_timeout_s, self.max_attempts = member_timeout_s, max_attempts
        self.tasks: dict[str, tuple[Group, int]] = {}  # task id -> (its group, member)
        self.stats: Counter[str] = Counter()

    async def open(self, spec: TaskSpec, size: int, *, group_id: str, batch_id: str, batch_size: int, min_version: int | None = None) -> Group:
        """Hand out a group: `size` tasks of `spec`; `min_version`: the oldest policy version a usable trajectory may hold."""
        group = Group(group_id, spec, size, min_version=min_version, batch_id=batch_id, batch_size=batch_size)
        self.stats["groups"] += 1
        for member in range(size):
            await self._send(group, member)
        return group

    def close(self, group: Group) -> None:
        """Forget a group taken by TRL: later copies of its trajectories count as `late`."""
        for task_id in [t for t, (g, _) in self.tasks.items() if g is group]:
            del self.tasks[task_id]

    async def _send(self, group: Group, member: int) -> None:
        attempt = group.attempts[member]
        task_id = f"{group.group_id}-{member}" + (f"-r{attempt}" if attempt else "")
        if attempt >= self.max_attempts:
            group.error = RolloutFailed(
                f"group {group.group_id} (prompt {group.spec.prompt!r}): member {member} got no usable trajectory from {attempt} tasks: "
                + "; ".join(group.reasons[member])
            )
            group.finished.set()
            return
        group.attempts[member] += 1
        group.current[member], group.sent_at[member] = task_id, time.monotonic()
        self.tasks[task_id] = (group, member)
        task = group.spec.task(
            task_id,
            group_id=group.group_id,
            group_size=group.size,
            max_turns=self.max_turns,
            max_tokens=self.max_tokens,
            batch_id=group.batch_id,
            batch_size=group.batch_size,
        )
        self.stats["handed_out"] += 1
        await self.publish(task)

    async def on_trajectory(self, t: Trajectory) -> None:
        """A trajectory from the stream (at least once): fill its member, or hand the member out again."""
        self.stats["received"] += 1
        found = self.tasks.get(t.task_id)
        if found is None:
            self.stats["late"] += 1  # of a group already taken, or of another run
            return
        group, member = found
        if group.members[member] is not None or group.finished.is_set():
            self.stats["duplicates"] += 1
            return
        current = t.task_id == group.current[member]
        if t.status != "completed":
            if current:
                self.stats["rerolled_failed"] += 1
                group.reasons[member].append(f"{t.task_id} {t.status}: {t.reason or 'no reason given'}")
                await self._send(group, member)
            return
        if group.min_version is not None and oldest_version(t) < group.min_version:
            if current:
                self.stats["rerolled_stale"] += 1
                group.reasons[member].append(f"{t.task_id} sampled with v{oldest_version(t)}, older than v{group.min_version}")
                await self._send(group, member)
            return
        group.members[member] = t
        self.stats["completed"] += 1
        if group.complete():
            group.finished.set()

    async def expire(self, now: float) -> None:
        """Hand out again every member whose newest task has had no trajectory for `member_timeout_s`."""
        for group in {g for g, _ in self.tasks.values()}:
            for member in range(group.size):
                waiting = group.attempts[member] and group.members[member] is None and not group.finished.is_set()  # sent, not back
                if waiting and now - group.sent_at[member] > self.member_timeout_s:
                    self.stats["rerolled_lost"] += 1
                    group.reasons[member].append(f"{group.current[member]} lost: no trajectory in {self.member_timeout_s:.0f} s")
                    await self._send(group, member)
