"""One episode per task, at least once, idempotent by (task id, turn index).

Every finished turn is checkpointed in the turns KV bucket before the next begins. A task
delivered again (its worker died, the server restarted) replays its checkpointed turns
through the environment and continues from the first missing one, so no turn is generated
twice and the trajectory comes out the same; the trajectory is published with its id as
`Nats-Msg-Id`, so the stream also drops a second copy inside its duplicate window.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

from rose.contracts.registry import TRAJECTORY, TURN_CHECKPOINT
from rose.contracts.rollout import RolloutTask, Trajectory, TrajectoryStatus, TurnCheckpoint, TurnRecord
from rose.shared.agentic.env_emulated import TURN_BUDGETS_ARG
from rose.shared.agentic.envs import ENVIRONMENTS, Environment
from rose.shared.agentic.tools import EnvironmentFailure
from rose.shared.bus import Bus, Delivery
from rose.shared.turns.runner import TurnRunner, TurnSpec

log = logging.getLogger(__name__)


def trajectory_id_of(task: RolloutTask) -> str:
    """One trajectory per task, with a stable id: the de-duplication key downstream."""
    return f"{task.task_id}-traj"[:128]


def turn_budget(task: RolloutTask, turn_index: int, default: int) -> int:
    """A turn's max_tokens: the task's own for this turn (``env_args["max_tokens_by_turn"]``, comma-separated:
    the emulated job's workload), else the task's (``env_args["max_tokens"]``), else the worker's."""
    by_turn = task.env_args.get(TURN_BUDGETS_ARG, "")
    try:
        budgets = [int(x) for x in by_turn.split(",") if x.strip()]
        if turn_index < len(budgets) and budgets[turn_index] > 0:
            return budgets[turn_index]
        return int(task.env_args.get("max_tokens", default))
    except ValueError as exc:
        raise EnvironmentFailure(f"task {task.task_id}: env_args max_tokens / {TURN_BUDGETS_ARG} must be integers: {exc}") from exc


def seed_of(task: RolloutTask, turn_index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{task.task_id}:{turn_index}".encode()).digest()[:4], "little")


class EpisodeRunner:
    def __init__(self, bus: Bus, runner: TurnRunner, tokenizer, worker_id: str, *, max_tokens: int, max_deliver: int) -> None:
        self.bus, self.runner, self.tokenizer, self.worker_id = bus, runner, tokenizer, worker_id
        self.max_tokens, self.max_deliver = max_tokens, max_deliver
        self.stop_token_ids = [t for t in (tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id) if isinstance(t, int) and t >= 0]
        self.stats = {"episodes": 0, "resumed_turns": 0, "failed": 0}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def handle(self, task: RolloutTask, delivery: Delivery) -> None:
        """The work-queue handler: returning acks the task; raising naks it for a retry."""
        env = ENVIRONMENTS.get(task.env)
        if env is None:
            await self._publish(task, [], "failed", 0.0, f"unknown environment {task.env!r}; known: {sorted(ENVIRONMENTS)}")
            return
        try:
            turns, reward = await self.run(task, env)
        except EnvironmentFailure as exc:  # broken env or tool: another delivery would fail the same way
            log.warning("task %s: environment failure: %s", task.task_id, exc)
            await self._publish(task, [], "failed", 0.0, f"environment failure: {exc}")
            return
        except Exception as exc:
            if delivery.attempt < self.max_deliver - 1:
                raise  # nak: another delivery resumes from the checkpoints
            log.exception("task %s failed for good", task.task_id)
            await self._publish(task, [], "failed", 0.0, f"gave up after {delivery.attempt} deliveries: {exc!r}")
            return
        await self._publish(task, turns, "completed", reward, "")

    async def run(self, task: RolloutTask, env: Environment) -> tuple[list[TurnRecord], float]:
        tid = trajectory_id_of(task)
        context = self.encode(env.reset(task))
        turns: list[TurnRecord] = []
        reward, previous = 0.0, ""
        for index in range(max(1, task.max_turns)):
            checkpoint = await self.bus.kv_get(TURN_CHECKPOINT, task_id=task.task_id, turn_index=str(index))
            if checkpoint is not None:
                record, done, reward = checkpoint.turn, checkpoint.done, checkpoint.reward
                self.stats["resumed_turns"] += 1
            else:
                max_tokens = turn_budget(task, index, self.max_tokens)
                spec = TurnSpec(task, tid, index, list(context), previous, max_tokens, self.stop_token_ids, seed_of(task, index))
                record = await self.runner.run(spec)
                record.text = self.tokenizer.decode(record.token_ids, skip_special_tokens=True)
                # in a thread: a tool (the code sandbox) may block for seconds, the turns of other tasks go on
                step = await asyncio.to_thread(env.step, task, index, record.text, record.finish_reason, [t.finish_reason for t in turns])
                record.observation, record.tool_calls, done, reward = step.observation, step.tool_calls, step.done, step.reward
                if step.latency_s > 0:
                    await asyncio.sleep(step.latency_s)  # an external tool's latency (the emulated job's), no thread held
                await self.bus.kv_put(
                    TURN_CHECKPOINT,
                    TurnCheckpoint(task_id=task.task_id, trajectory_id=tid, turn=record, done=done, reward=reward),
                    task_id=task.task_id,
                    turn_index=str(index),
                )
            turns.append(record)
            previous = record.executor_id
            if done:
                break
            context = context + record.token_ids + self.encode(record.observation)
        self.stats["episodes"] += 1
        return turns, reward

    async def _publish(self, task: RolloutTask, turns: list[TurnRecord], status: TrajectoryStatus, reward: float, reason: str) -> None:
        tid = trajectory_id_of(task)
        trajectory = Trajectory(
            task_id=task.task_id,
            trajectory_id=tid,
            env=task.env,
            status=status,
            worker_id=self.worker_id,
            group_id=task.group_id,
            reason=reason,
            reward=reward,
            routing=task.routing,
            turns=turns,
            created_at=task.created_at,
            finished_at=time.time(),
        )
        if status == "failed":
            self.stats["failed"] += 1
        await self.bus.publish(TRAJECTORY, trajectory, msg_id=tid, status=status)
