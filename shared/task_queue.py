"""What the rollout task work queue still holds: tells a late task from a lost one.

The task stream is a work queue: a worker acknowledges a task only once its trajectory is
published, and an acknowledged task is deleted. So a task whose trajectory has not come is
either still in the queue (running, or waiting to be delivered again after a worker died:
late) or gone without its trajectory (lost). Benches and tests that count lost trajectories
ask here before calling one lost.
"""

from __future__ import annotations

from nats.js.errors import NotFoundError

from rose.contracts.registry import ROLLOUT_TASK
from rose.contracts.rollout import RolloutTask

from .bus import Bus
from .codec import decode


async def still_queued(bus: Bus, task_ids: set[str]) -> set[str]:
    """Which of ``task_ids`` the task work queue still holds (not acknowledged by any worker).

    Reads the stream message by message (a bench's queue holds hundreds): ``bus`` must be allowed
    to read the task stream (the operator or the cli user)."""
    if not task_ids:
        return set()
    assert ROLLOUT_TASK.stream is not None
    stream = ROLLOUT_TASK.stream.name
    state = (await bus.js.stream_info(stream)).state
    queued: set[str] = set()
    for seq in range(state.first_seq, state.last_seq + 1):
        try:
            msg = await bus.js.get_msg(stream, seq)
        except NotFoundError:  # acknowledged: the work queue deleted it
            continue
        task = decode(msg.data or b"", RolloutTask)
        if task.task_id in task_ids:
            queued.add(task.task_id)
    return queued
