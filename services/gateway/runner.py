"""The gateway's episodes: one per agent task, from the work queue to the published trajectory.

    task (work queue) -> open: restore its checkpointed turns, a fresh key -> launch its agent with
    OPENAI_BASE_URL / OPENAI_API_KEY -> each HTTP call: plan (episode.py), run the turn on the policy
    as the rollout worker does (shared/turns: routed by the scheduler, leases, cache affinity, parking,
    hedging, continuation after a revoke), checkpoint it, answer -> end: a posted reward, the agent's
    exit (scored by the reward function of the task's environment, rewards.py), the deadline or the
    turn limit (truncated) -> publish the trajectory, ack the task.

At least once, idempotent by (episode, turn): a turn is checkpointed before its answer leaves, and a
turn runs to its end even if the agent's connection drops (its retry is answered from the record). A
gateway that dies takes its agents with it; the task comes back (to it or another gateway), the
episode reopens with its turns and a new key, and the relaunched agent's requests are answered from
the checkpoints until it asks for something new. Owns: the episodes in flight (`active`), the keys of
the ones that ended lately (`ended`, so a late caller hears why its key is refused).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rose.contracts.gateway import EpisodeEvent, EpisodeTurn
from rose.contracts.registry import EPISODE_EVENT, EPISODE_TURN, TRAJECTORY
from rose.contracts.rollout import RolloutTask, Trajectory, TrajectoryStatus, TurnRecord
from rose.shared.bus import Bus, Delivery
from rose.shared.openai_api import ApiError
from rose.shared.turns.runner import TurnFailed, TurnRunner, TurnSpec

from .agents import AgentLauncher, AgentRun
from .chat import ChatFormat, Message, ToolChoice, conversation_digest, digest
from .config import GatewayConfig
from .episode import Api, Ending, Episode, Plan, Turn
from .rewards import REWARDS
from .telemetry import GatewayMetrics

log = logging.getLogger(__name__)

ENDED_REMEMBERED = 4096  # ended episodes whose key is answered "ended" (403) rather than "unknown" (401)
LOG_TAIL_CHARS = 600


def trajectory_id_of(task: RolloutTask) -> str:
    """One trajectory per task, with a stable id (the rollout worker's rule): the de-duplication key downstream."""
    return f"{task.task_id}-traj"[:128]


def seed_of(task: RolloutTask, turn_index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{task.task_id}:{turn_index}".encode()).digest()[:4], "little")


class EpisodeClosed(ApiError):
    """The episode ended (or ends with this request): the agent's key no longer opens it."""

    def __init__(self, episode: Episode) -> None:
        ending = episode.ending
        assert ending is not None
        super().__init__(403, f"episode {episode.episode_id} has ended ({ending.status}: {ending.reason})", code="episode_ended")


@dataclass(frozen=True)
class Ended:
    key: str
    status: str
    reason: str


@dataclass(frozen=True)
class Ask:
    """One request of an agent, as the HTTP layer validated it."""

    api: Api
    messages: list[Message] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    choice: ToolChoice = "auto"
    prompt: dict[str, Any] = field(default_factory=dict)  # completion: {"text": ...} or {"ids": [...]}
    max_tokens: int | None = None
    seed: int | None = None


@dataclass(frozen=True)
class Answer:
    turn: Turn
    index: int  # the turn's position in its episode: with the episode id, what the answer's id names
    replayed: bool  # answered from the record of an earlier identical request
    sampling_s: float = 0.0  # in the turn runner (route, generate): the rest of the request's time is the gateway's own


class Episodes:
    def __init__(self, bus: Bus, turns: TurnRunner, fmt: ChatFormat, launcher: AgentLauncher | None, config: GatewayConfig, gateway_id: str) -> None:
        self.bus, self.turns, self.fmt, self.launcher, self.config, self.gateway_id = bus, turns, fmt, launcher, config, gateway_id
        self.base_url = ""  # the HTTP server's, once it listens
        self.logs_dir = Path(".")
        self.max_positions = 0  # the policy's context; 0: unknown (the executor refuses what does not fit)
        self.active: dict[str, Episode] = {}
        self.ended: OrderedDict[str, Ended] = OrderedDict()
        self._inflight: set[asyncio.Task] = set()
        self.metrics = GatewayMetrics()
        self.stats = {
            "episodes": 0,
            "completed": 0,
            "failed": 0,
            "truncated": 0,
            "turns": 0,
            "replayed_turns": 0,
            "restored_turns": 0,
            "segment_breaks": 0,
        }

    # ---- opening -------------------------------------------------------------------------------

    def _limits(self, task: RolloutTask) -> tuple[int, int]:
        e = self.config.episodes
        max_turns = e.max_turns or max(1, task.max_turns)
        max_tokens = e.max_tokens or int(task.env_args.get("max_tokens", self.config.turns.max_tokens))
        return max_turns, max_tokens

    async def open(self, task: RolloutTask, *, deadline_s: float | None = None) -> Episode:
        """An episode for the task, with the turns checkpointed by an earlier delivery, under a fresh key."""
        max_turns, _ = self._limits(task)
        episode = Episode(
            task.task_id, task, secrets.token_urlsafe(32), max_turns=max_turns, deadline_s=deadline_s or self.config.episodes.deadline_s
        )
        saved: list[EpisodeTurn] = []
        while True:
            cp = await self.bus.kv_get(EPISODE_TURN, episode_id=episode.episode_id, turn_index=str(len(saved)))
            if cp is None:
                break
            saved.append(cp)
        episode.restore(saved)
        self.stats["restored_turns"] += len(saved)
        self.active[episode.episode_id] = episode
        self.ended.pop(episode.episode_id, None)
        self.stats["episodes"] += 1
        await self._event(episode, "opened")
        return episode

    def urls(self, episode: Episode) -> tuple[str, str]:
        """The episode's own URL (reward, state) and its OpenAI base URL."""
        root = f"{self.base_url}/episodes/{episode.episode_id}"
        return root, f"{root}/v1"

    def agent_env(self, episode: Episode) -> dict[str, str]:
        root, base = self.urls(episode)
        t = episode.task
        task = {"task_id": t.task_id, "env": t.env, "prompt": t.prompt, "env_args": t.env_args, "max_turns": episode.max_turns}
        return {"OPENAI_BASE_URL": base, "OPENAI_API_KEY": episode.key, "ROSE_EPISODE_URL": root, "ROSE_TASK": json.dumps(task)}

    # ---- the work queue ------------------------------------------------------------------------

    async def handle(self, task: RolloutTask, delivery: Delivery) -> None:
        """One agent task: run its episode to its end and publish the trajectory (the bus keeps the task alive
        meanwhile, and acks it on return). Raising naks it (another delivery resumes from the checkpoints); the
        last delivery publishes a failed trajectory instead."""
        episode = await self.open(task)
        run: AgentRun | None = None
        try:
            if self.launcher is None:
                self.end(episode, "failed", "this gateway runs no agent (set agent.script or agent.command)")
            else:
                log_path = self.logs_dir / f"{episode.episode_id}.log"
                run = await self.launcher.launch(episode.episode_id, self.agent_env(episode), [task.prompt], log_path)
                await self._watch(episode, run)
        except Exception as exc:
            if run is not None and self.launcher is not None:
                await self.launcher.kill(run)  # its episode closes here: the next delivery launches it again
            if delivery.attempt < self.config.max_deliver and episode.ending is None:
                self._forget(episode)
                raise
            log.exception("episode %s failed for good", episode.episode_id)
            if episode.ending is None:
                self.end(episode, "failed", f"gave up after {delivery.attempt} deliveries: {exc!r}")
        await self.publish(episode)

    async def _watch(self, episode: Episode, run: AgentRun) -> None:
        """Until the episode ends: the agent's exit, a posted reward, the deadline."""
        while episode.ending is None:
            left = episode.deadline - time.monotonic()
            if left <= 0:
                async with episode.lock:  # a turn in flight is recorded first
                    self.end(episode, "truncated", f"deadline: the episode ran {self.config.episodes.deadline_s:g} s", scored=True)
                break
            waiter: asyncio.Future = asyncio.ensure_future(episode.woken.wait())
            await asyncio.wait({waiter, run.exited}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if run.exited.done() and episode.ending is None:
                async with episode.lock:
                    if episode.ending is None:
                        self._agent_exited(episode, run)
        if not run.exited.done():  # a reward was posted: a moment to exit on its own; an episode cut short: at once
            assert self.launcher is not None
            try:
                grace = self.config.agent.exit_grace_s if episode.ending and episode.ending.status == "completed" else 0.0
                await asyncio.wait_for(asyncio.shield(run.exited), grace)
            except TimeoutError:
                await self.launcher.kill(run)

    def _agent_exited(self, episode: Episode, run: AgentRun) -> None:
        code = run.exited.result()
        if code != 0:
            self.end(episode, "failed", f"the agent exited with code {code} without a reward: ...{_tail(run.log_path)}")
        elif episode.task.env in REWARDS:
            self.end(episode, "completed", f"the agent exited; scored by the {episode.task.env!r} reward function", scored=True)
        else:
            self.end(episode, "failed", f"the agent exited without posting a reward, and no reward function is registered for {episode.task.env!r}")

    # ---- turns ---------------------------------------------------------------------------------

    async def turn(self, episode: Episode, ask: Ask, planned: asyncio.Future[int] | None = None) -> Answer:
        """Answer one request; the turn runs to its end (and is checkpointed) even if the caller leaves meanwhile.
        `planned` gets the index of the turn that will answer as soon as it is known (a stream's first chunk
        carries the answer's id), and nothing if the request is refused first."""
        task = asyncio.ensure_future(self._turn(episode, ask, planned))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return await asyncio.shield(task)

    async def _turn(self, episode: Episode, ask: Ask, planned: asyncio.Future[int] | None) -> Answer:
        async with episode.lock:
            if episode.ending is not None:
                raise EpisodeClosed(episode)
            if ask.api == "chat":
                plan = episode.plan_chat(self.fmt, ask.messages, ask.tools)
            else:
                plan = episode.plan_completion(self.fmt, ask.prompt)
            if plan.replay >= 0:
                episode.replays += 1
                self.stats["replayed_turns"] += 1
                self.metrics.replayed.add(1)
                _tell(planned, plan.replay)
                return Answer(episode.turns[plan.replay], plan.replay, replayed=True)
            if len(episode.turns) >= episode.max_turns:
                self.end(episode, "truncated", f"turn limit: the agent asked for turn {len(episode.turns) + 1} of {episode.max_turns}", scored=True)
                raise EpisodeClosed(episode)
            _tell(planned, len(episode.turns))
            started = time.perf_counter()
            record = await self._sample(episode, plan, ask)
            sampling_s = time.perf_counter() - started
            turn = self._record(episode, plan, ask, record)
            await self.bus.kv_put(
                EPISODE_TURN,
                turn.checkpoint(episode.episode_id, episode.task.task_id),
                episode_id=episode.episode_id,
                turn_index=str(len(episode.turns)),
            )
            episode.turns.append(turn)
            self.stats["turns"] += 1
            self.metrics.turns.add(1)
            if len(episode.turns) > 1 and turn.extends != len(episode.turns) - 2:
                self.stats["segment_breaks"] += 1
                self.metrics.breaks.add(1)
            return Answer(turn, len(episode.turns) - 1, replayed=False, sampling_s=sampling_s)

    async def _sample(self, episode: Episode, plan: Plan, ask: Ask) -> TurnRecord:
        _, cap = self._limits(episode.task)
        max_tokens = min(ask.max_tokens or cap, cap)
        if self.max_positions:
            room = self.max_positions - len(plan.prompt_ids)
            if room < 1:
                self.end(
                    episode, "truncated", f"context full: the prompt has {len(plan.prompt_ids)} tokens, the policy {self.max_positions}", scored=True
                )
                raise EpisodeClosed(episode)
            max_tokens = min(max_tokens, room)
        index = len(episode.turns)
        previous = episode.turns[-1].record.executor_id if episode.turns else ""
        seed = ask.seed if ask.seed is not None else seed_of(episode.task, index)
        spec = TurnSpec(episode.task, trajectory_id_of(episode.task), index, plan.prompt_ids, previous, max_tokens, self.fmt.stop_token_ids, seed)
        try:
            record = await self.turns.run(spec)
        except TurnFailed as exc:
            raise ApiError(503, f"no executor completed the turn: {exc}", code="turn_failed", kind="server_error") from exc
        record.text = self.fmt.decode(record.token_ids)
        return record

    def _record(self, episode: Episode, plan: Plan, ask: Ask, record: TurnRecord) -> Turn:
        index = len(episode.turns)
        if ask.api == "completion":
            return Turn(
                record,
                "completion",
                [],
                [],
                {"text": record.text},
                digest("completion", ask.prompt),
                plan.extends,
                plan.segment_reason,
                prompt=ask.prompt,
            )
        parsed = self.fmt.reply(record.token_ids, ask.tools, ask.choice)
        reply: Message = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            reply["tool_calls"] = [
                {"id": _call_id(episode.episode_id, index, j), "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for j, c in enumerate(parsed.calls)
            ]
        request_digest = conversation_digest(ask.messages, ask.tools)
        return Turn(record, "chat", ask.messages, ask.tools, reply, request_digest, plan.extends, plan.segment_reason, delta=plan.delta)

    # ---- ending --------------------------------------------------------------------------------

    def end(self, episode: Episode, status: TrajectoryStatus, reason: str, reward: float = 0.0, *, scored: bool = False) -> None:
        """Mark the episode ended (once); `scored`: the reward comes from the task environment's reward function."""
        if episode.ending is not None:
            return
        if scored and episode.task.env in REWARDS:
            last = next((t.reply.get("content") or "" for t in reversed(episode.turns) if t.api == "chat"), "")
            if not last:
                last = next((t.reply.get("text") or "" for t in reversed(episode.turns) if t.api == "completion"), "")
            try:
                reward = float(REWARDS[episode.task.env](episode.task, last))
            except Exception as exc:  # a broken reward function is the environment's failure, not the agent's
                status, reason = "failed", f"the {episode.task.env!r} reward function raised {type(exc).__name__}: {exc}"
        episode.ending = Ending(status, reason, reward)
        episode.woken.set()

    async def post_reward(self, episode: Episode, reward: float, reason: str = "") -> None:
        async with episode.lock:
            if episode.ending is not None:
                raise EpisodeClosed(episode)
            self.end(episode, "completed", reason or "the agent posted its reward", reward)

    async def publish(self, episode: Episode) -> Trajectory:
        ending = episode.ending
        assert ending is not None
        records, breaks = episode.trajectory(self.fmt)
        task = episode.task
        trajectory = Trajectory(
            task_id=task.task_id,
            trajectory_id=trajectory_id_of(task),
            env=task.env,
            status=ending.status,
            worker_id=self.gateway_id,
            group_id=task.group_id,
            reason=ending.reason,
            reward=ending.reward,
            routing=task.routing,
            turns=records,
            created_at=task.created_at,
            finished_at=time.time(),
            segment_breaks=breaks,
        )
        await self.bus.publish(TRAJECTORY, trajectory, msg_id=trajectory.trajectory_id, status=ending.status)
        self.stats[ending.status] += 1
        self.metrics.episodes.add(1, {"status": ending.status})
        await self._event(episode, "ended")
        self.ended[episode.episode_id] = Ended(episode.key, ending.status, ending.reason)
        while len(self.ended) > ENDED_REMEMBERED:
            self.ended.popitem(last=False)
        self._forget(episode)
        return trajectory

    def _forget(self, episode: Episode) -> None:
        if self.active.get(episode.episode_id) is episode:
            del self.active[episode.episode_id]

    async def _event(self, episode: Episode, kind: str) -> None:
        ending = episode.ending
        event = EpisodeEvent(
            kind=kind,  # type: ignore[arg-type]
            episode_id=episode.episode_id,
            task_id=episode.task.task_id,
            gateway_id=self.gateway_id,
            at=time.time(),
            status=ending.status if ending else None,
            reason=ending.reason if ending else "",
            reward=ending.reward if ending else 0.0,
            turns=len(episode.turns),
            segments=1 + sum(1 for i, t in enumerate(episode.turns) if i > 0 and t.extends != i - 1) if episode.turns else 0,
            duration_s=time.monotonic() - episode.opened_at,
        )
        try:
            await self.bus.publish(EPISODE_EVENT, event, kind=kind, episode_id=episode.episode_id)
        except Exception as exc:  # an event is for integrators: never the reason an episode fails
            log.warning("episode event %s of %s not published: %r", kind, episode.episode_id, exc)


def _tell(planned: asyncio.Future[int] | None, index: int) -> None:
    if planned is not None and not planned.done():
        planned.set_result(index)


def _call_id(episode_id: str, turn: int, j: int) -> str:
    """A tool call's id, the same when the turn is answered again (a retry, a replay)."""
    return "call_" + hashlib.sha256(f"{episode_id}:{turn}:{j}".encode()).hexdigest()[:24]


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:].strip()
    except OSError:
        return "(no log)"
