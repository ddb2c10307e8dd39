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


class TurnRouteRequest(Message):
    """A worker asks the scheduler where the next turn of a trajectory should run."""

    trajectory_id: Identifier
    turn_index: NonNegInt
    prompt_tokens: NonNegInt
    previous_executor: str = ""


class TurnRoute(Message):
    """The scheduler's answer: an executor and the lease the turn runs under."""

    trajectory_id: Identifier
    turn_index: NonNegInt
    executor_id: Identifier
    lease_id: str = ""
    lease_epoch: NonNegInt = 0
    reason: str = ""


class PlacementEvent(Message):
    """A placement decision, published so that it can be audited and traced."""

    trajectory_id: Identifier
    turn_index: NonNegInt
    executor_id: Identifier
    at: UnixSeconds
    reason: str


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
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    started_at: UnixSeconds = 0.0
    finished_at: UnixSeconds = 0.0


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
    turns: list[TurnRecord] = msgspec.field(default_factory=list)
    created_at: UnixSeconds = 0.0
    finished_at: UnixSeconds = 0.0
