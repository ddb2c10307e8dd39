"""Messages of the rollout gateway: external agents' episodes, checkpointed per turn, and their events.

An agent (a loop over the `openai` client, the OpenAI Agents SDK, ...) talks to the policy through
the gateway's OpenAI-compatible HTTP API with a base URL and a key valid for one episode; each call is
one turn. What crosses the bus is below; the trajectory itself is the rollout worker's `Trajectory`.
"""

from __future__ import annotations

from typing import Literal

from .base import Identifier, Message, NonNegFloat, NonNegInt, UnixSeconds
from .rollout import TrajectoryStatus, TurnRecord

EpisodeEventKind = Literal["opened", "ended"]
Api = Literal["chat", "completion"]  # which of the OpenAI APIs an agent's turn came through


class EpisodeTurn(Message):
    """One turn of an agent's episode, checkpointed before the agent gets its answer.

    Keyed by (episode id, turn index). A gateway that restarts (or a task delivered again) reloads
    these: an agent that asks again for a turn already answered (a retry, or a relaunched agent
    replaying its episode) gets the recorded answer, not a second sample.
    """

    episode_id: Identifier
    task_id: Identifier
    turn: TurnRecord
    api: Api = "chat"
    # the turn whose prompt + tokens this turn's prompt extends token for token; -1: it starts a segment
    extends: int = -1
    segment_reason: str = ""  # why a segment starts here (empty for the episode's first turn)
    request_digest: str = ""  # SHA-256 of the canonical request (messages and tools, or the prompt): retries are answered from here
    request: str = ""  # JSON: the messages appended after the turn it extends (every message when it starts a segment), or the prompt
    tools: str = ""  # JSON: the tools offered
    reply: str = ""  # JSON: the assistant message (chat) or the text (completion) the gateway answered


class EpisodeEvent(Message):
    """An agent's episode opened at a gateway, or ended (with its status and why)."""

    kind: EpisodeEventKind
    episode_id: Identifier
    task_id: Identifier
    gateway_id: str
    at: UnixSeconds
    status: TrajectoryStatus | None = None  # when ended
    reason: str = ""
    reward: float = 0.0
    turns: NonNegInt = 0
    segments: NonNegInt = 0
    duration_s: NonNegFloat = 0.0
