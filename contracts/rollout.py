"""Rollout work: tasks in, turn routing, trajectories out."""

from __future__ import annotations

from typing import Literal

import msgspec

from .base import Identifier, Message, NonNegFloat, NonNegInt, UnixSeconds


class RolloutTask(Message):
    """One agent episode to run; delivered at least once from a work-queue stream."""

    task_id: Identifier
    env: Identifier
    prompt: str
    group_id: str = ""
    group_size: NonNegInt = 1
    max_turns: NonNegInt = 4
    env_args: dict[str, str] = msgspec.field(default_factory=dict)
    created_at: UnixSeconds = 0.0
    # How turns are placed: "affinity" (prefer the executor holding the prefix cache) or
    # "random" (the baseline `rose bench elastic` measures affinity against).
    routing: Literal["affinity", "random"] = "affinity"


class TurnRouteRequest(Message):
    """A worker asks the scheduler where the next turn of a trajectory should run."""

    trajectory_id: Identifier
    turn_index: NonNegInt
    prompt_tokens: NonNegInt
    previous_executor: str = ""
    task_id: str = ""
    group_id: str = ""
    group_size: NonNegInt = 1
    routing: Literal["affinity", "random"] = "affinity"
    exclude: list[str] = msgspec.field(default_factory=list)  # executors that refused or failed this turn
    hedge: bool = False  # a duplicate of a straggling turn: first result wins
    elapsed_s: NonNegFloat = 0.0  # how long the turn being hedged has run
    typical_turn_s: NonNegFloat = 0.0  # the worker's median turn time, for the straggler test


class TurnRoute(Message):
    """The scheduler's answer: an executor and the lease the turn runs under.

    An empty `executor_id` means no executor can take the turn now (or a hedge was not
    worth it); the worker waits `retry_after_s` and asks again.
    """

    trajectory_id: Identifier
    turn_index: NonNegInt
    executor_id: str = ""
    lease_id: str = ""
    lease_epoch: NonNegInt = 0
    role: Literal["serving", "dedicated", ""] = ""
    reason: str = ""
    retry_after_s: NonNegFloat = 0.0


class PlacementEvent(Message):
    """A placement decision, published so that it can be audited and traced."""

    trajectory_id: Identifier
    turn_index: NonNegInt
    executor_id: Identifier
    at: UnixSeconds
    reason: str
    lease_id: str = ""
    lease_epoch: NonNegInt = 0
    hedge: bool = False


class ToolCall(msgspec.Struct, kw_only=True):
    tool: str
    arguments: str
    result: str = ""
    error: str = ""
    duration_ms: NonNegFloat = 0.0


class TurnRecord(msgspec.Struct, kw_only=True):
    """Everything a trainer needs from one turn: tokens, logprobs, version, where it ran."""

    turn_index: NonNegInt
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    policy_version: NonNegInt
    executor_id: str
    finish_reason: str = ""
    prefix_cached_tokens: NonNegInt = 0
    attempts: NonNegInt = 1  # executors tried (refusals, failures, interrupted turns resumed by recompute)
    text: str = ""
    observation: str = ""  # what the environment answered after this turn
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    started_at: UnixSeconds = 0.0
    finished_at: UnixSeconds = 0.0


class TurnCheckpoint(Message):
    """A finished turn, kept in a KV bucket so a redelivered task resumes instead of redoing it.

    Keyed by (task id, turn index): that is the idempotence key of at-least-once rollout.
    """

    task_id: Identifier
    trajectory_id: Identifier
    turn: TurnRecord
    done: bool = False
    reward: float = 0.0


class Trajectory(Message):
    """A finished (or failed) episode with its reward."""

    task_id: Identifier
    trajectory_id: Identifier
    env: Identifier
    status: Literal["completed", "failed"]
    worker_id: str = ""
    group_id: str = ""
    reason: str = ""
    reward: float = 0.0
    routing: str = "affinity"
    turns: list[TurnRecord] = msgspec.field(default_factory=list)
    created_at: UnixSeconds = 0.0
    finished_at: UnixSeconds = 0.0
