"""Rollout work: tasks in, turn routing, trajectories out."""

from __future__ import annotations

from typing import Literal

import msgspec

from .base import Identifier, Message, NonNegFloat, NonNegInt, UnixSeconds
from .executor import ExecutorRole

# How a trajectory's turns are placed: "affinity" (prefer the executor holding the prefix cache) or "random" (the baseline
# `rose bench elastic` measures affinity against)
Routing = Literal["affinity", "random"]
# "truncated": an agent's episode at the gateway ended on its deadline or turn limit before a reward came
# (the reason says which); the reference trainer trains on completed trajectories only
TrajectoryStatus = Literal["completed", "failed", "truncated"]


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
    routing: Routing = "affinity"  # how its turns are placed
    # the RL batch (a step's tasks) this task belongs to and its number of tasks; the worker passes them on
    # in each `TurnRouteRequest` (the scheduler's tail rule); "" / 0: unknown
    batch_id: str = ""
    batch_size: NonNegInt = 0


class TurnRouteRequest(Message):
    """A worker asks the scheduler where the next turn of a trajectory should run."""

    trajectory_id: Identifier
    turn_index: NonNegInt
    prompt_tokens: NonNegInt
    previous_executor: str = ""
    task_id: str = ""
    group_id: str = ""
    group_size: NonNegInt = 1
    routing: Routing = "affinity"
    exclude: list[str] = msgspec.field(default_factory=list)  # executors that refused or failed this turn
    hedge: bool = False  # a duplicate of a straggling turn: first result wins
    elapsed_s: NonNegFloat = 0.0  # how long the turn being hedged has run
    typical_turn_s: NonNegFloat = 0.0  # the worker's median turn time, for the straggler test
    # the RL batch the task was handed out in (e.g. the policy version it was handed out at) and that batch's
    # trajectories: the scheduler's tail rule (services/scheduler/placement.py); "" / 0: unknown, no tail rule
    batch_id: str = ""
    batch_size: NonNegInt = 0


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
    role: Literal[ExecutorRole, ""] = ""  # empty: no executor can take the turn now
    reason: str = ""
    retry_after_s: NonNegFloat = 0.0
    # Straggler hedging decided at placement: the turn is predicted to finish late where it is placed, so the
    # worker also runs it at once on this executor (a dedicated one) under this lease; first result wins, the
    # other is aborted. Empty: no hedge (the worker may still ask for one later, `TurnRouteRequest.hedge`).
    hedge_executor: str = ""
    hedge_lease_id: str = ""
    hedge_lease_epoch: NonNegInt = 0
    # a turn placed on leased capacity: still running after this many seconds (its predicted time there), it is
    # late: ask for a hedge (TurnRouteRequest hedge=True), granted on a dedicated executor with a free slot (0: no hint)
    hedge_after_s: NonNegFloat = 0.0


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
    # a typical turn's predicted seconds there, the model's error per role corrected, and before the correction
    # (0: no prediction: a hedge, or no typical turn measured yet); an audit of placement against the turn it placed
    predicted_s: NonNegFloat = 0.0
    model_s: NonNegFloat = 0.0
    # which rule of the placement placed it (services/scheduler/placement.py RULES; "": an older scheduler)
    rule: str = ""


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
    policy_version: NonNegInt  # the oldest version among its tokens
    executor_id: str
    # the version that produced each token (a turn continued elsewhere, or across a weight swap, mixes versions);
    # empty in records written before this field: then every token is `policy_version`
    token_policy_versions: list[NonNegInt] = msgspec.field(default_factory=list)
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


class SegmentBreak(msgspec.Struct, kw_only=True):
    """Where an episode's token history starts over, and why (an agent at the gateway edited or summarised
    its conversation, so that the next prompt no longer extends what was sampled): the turns from
    `turn_index` on are a new segment, their prompts re-encoded from the agent's messages, never a
    silent re-tokenization of tokens already trained on."""

    turn_index: NonNegInt  # the first turn of the new segment (its position in `Trajectory.turns`)
    reason: str


class Trajectory(Message):
    """A finished (or failed) episode with its reward."""

    task_id: Identifier
    trajectory_id: Identifier
    env: Identifier
    status: TrajectoryStatus
    worker_id: str = ""
    group_id: str = ""
    reason: str = ""
    reward: float = 0.0
    routing: str = "affinity"
    turns: list[TurnRecord] = msgspec.field(default_factory=list)
    created_at: UnixSeconds = 0.0
    finished_at: UnixSeconds = 0.0
    # episodes driven by an external agent (the gateway): each turn after the first extends the previous turn's
    # prompt and tokens exactly, except where a segment break says why it does not
    segment_breaks: list[SegmentBreak] = msgspec.field(default_factory=list)
