"""One agent's episode at the gateway: its turns, how a request relates to them, its trajectory.

State and planning, no I/O (runner.py drives it). Each request the agent sends is planned against the turns so far:

- the same request as a turn answered before (a retry after a lost answer, a relaunched agent replaying
  its episode after a gateway restart): that turn's answer again, nothing sampled;
- a request that extends a turn (its messages are that turn's, its answer, then new ones): a new turn
  whose prompt is that turn's prompt + generated ids + the appended tokens (chat.py). Usually the turn
  extended is the latest; an agent that goes back to an earlier conversation (a side call in between,
  a retry of an older step) extends that one, and the trajectory notes where a turn does not extend
  the one before it;
- anything else starts a new segment, its prompt encoded from the messages, with the reason.

Every turn sampled stays in the trajectory: the trainer trains each run of turns that line up as one
sequence (services/trainer/batch.py), so nothing is trained twice and no token differs from what was
sampled.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rose.contracts.gateway import Api, EpisodeTurn
from rose.contracts.rollout import RolloutTask, SegmentBreak, ToolCall, TrajectoryStatus, TurnRecord

from .chat import Break, ChatFormat, Message, conversation_digest, digest


@dataclass
class Turn:
    """A turn answered: the record the trainer gets, and what the agent sent and was answered."""

    record: TurnRecord
    api: Api
    request: list[Message]  # chat: the whole conversation of the request; completion: []
    tools: list[dict[str, Any]]
    reply: Message  # chat: the assistant message answered (tool call ids included); completion: {"text": ...}
    request_digest: str
    extends: int = -1  # the turn whose prompt + tokens this one's prompt extends; -1: it starts a segment
    segment_reason: str = ""
    delta: list[Message] = field(default_factory=list)  # chat: the messages added after the turn extended (all, at a segment start)
    prompt: dict[str, Any] = field(default_factory=dict)  # completion: {"text": ...} or {"ids": [...]}, as sent

    def checkpoint(self, episode_id: str, task_id: str) -> EpisodeTurn:
        request = self.delta if self.api == "chat" else self.prompt
        return EpisodeTurn(
            episode_id=episode_id,
            task_id=task_id,
            turn=self.record,
            api=self.api,
            extends=self.extends,
            segment_reason=self.segment_reason,
            request_digest=self.request_digest,
            request=json.dumps(request, ensure_ascii=False),
            tools=json.dumps(self.tools, ensure_ascii=False),
            reply=json.dumps(self.reply, ensure_ascii=False),
        )


@dataclass(frozen=True)
class Plan:
    """How to answer one request: replay turn `replay`, or sample a turn with `prompt_ids`."""

    replay: int = -1
    prompt_ids: list[int] = field(default_factory=list)
    extends: int = -1
    segment_reason: str = ""
    delta: list[Message] = field(default_factory=list)


@dataclass
class Ending:
    status: TrajectoryStatus
    reason: str
    reward: float = 0.0


class Episode:
    """An episode's turns and lifecycle; the key is the agent's (compared in constant time by the HTTP layer)."""

    def __init__(self, episode_id: str, task: RolloutTask, key: str, *, max_turns: int, deadline_s: float) -> None:
        self.episode_id, self.task, self.key = episode_id, task, key
        self.max_turns = max_turns
        self.opened_at = time.monotonic()
        self.deadline = self.opened_at + deadline_s
        self.turns: list[Turn] = []
        self.ending: Ending | None = None
        self.replays = 0
        self.lock = asyncio.Lock()  # one turn at a time; an ending waits for the turn in flight
        self.woken = asyncio.Event()  # set when the episode ends (a posted reward, a limit): its watcher stops waiting

    # ---- planning ----

    def plan_chat(self, fmt: ChatFormat, messages: list[Message], tools: list[dict[str, Any]]) -> Plan:
        wanted = conversation_digest(messages, tools)
        for k in reversed(range(len(self.turns))):
            if self.turns[k].api == "chat" and self.turns[k].request_digest == wanted:
                return Plan(replay=k)
        reason = ""
        for k in reversed(range(len(self.turns))):
            turn = self.turns[k]
            if turn.api != "chat":
                reason = reason or "the previous turn was a completion (/v1/completions), this one a chat"
                continue
            added = fmt.continuation(turn.request, turn.reply, turn.tools, messages, tools)
            if not isinstance(added, Break):
                appended = fmt.appended_ids(turn.request, turn.reply, turn.record.token_ids, turn.record.finish_reason, messages, tools)
                if not isinstance(appended, Break):
                    prompt = turn.record.prompt_token_ids + turn.record.token_ids + appended[0]
                    return Plan(prompt_ids=prompt, extends=k, delta=added)
                added = appended
            reason = reason or added.reason
        return Plan(prompt_ids=fmt.prompt_ids(messages, tools), segment_reason=reason if self.turns else "", delta=messages)

    def plan_completion(self, fmt: ChatFormat, prompt: dict[str, Any]) -> Plan:
        wanted = digest("completion", prompt)
        for k in reversed(range(len(self.turns))):
            if self.turns[k].api == "completion" and self.turns[k].request_digest == wanted:
                return Plan(replay=k)
        ids = prompt.get("ids")
        reason = "the previous turn was a chat, this one a completion (/v1/completions)" if self.turns else ""
        for k in reversed(range(len(self.turns))):
            turn = self.turns[k]
            if turn.api != "completion":
                continue
            held = turn.record.prompt_token_ids + turn.record.token_ids
            if ids is not None and ids[: len(held)] == held:
                return Plan(prompt_ids=list(ids), extends=k)
            before = turn.prompt.get("text")
            if ids is None and before is not None and prompt["text"].startswith(before + turn.reply["text"]):
                return Plan(prompt_ids=held + fmt.encode(prompt["text"][len(before) + len(turn.reply["text"]) :]), extends=k)
            reason = "the prompt does not extend the previous prompt and its completion"
            break
        return Plan(prompt_ids=list(ids) if ids is not None else fmt.encode(prompt["text"]), segment_reason=reason)

    # ---- the trajectory ----

    def trajectory(self, fmt: ChatFormat) -> tuple[list[TurnRecord], list[SegmentBreak]]:
        """The turns in order (turn_index = position), each with the text appended after it and its tool calls'
        results; and a break wherever a turn does not extend the one before it, with why."""
        records: list[TurnRecord] = []
        breaks: list[SegmentBreak] = []
        for i, turn in enumerate(self.turns):
            record = msgspec.structs.replace(turn.record, turn_index=i)
            if i > 0 and turn.extends != i - 1:
                why = turn.segment_reason or f"continues turn {turn.extends}, not turn {i - 1} (the agent went back to an earlier conversation)"
                breaks.append(SegmentBreak(turn_index=i, reason=why))
            nxt = self.turns[i + 1] if i + 1 < len(self.turns) else None
            if nxt is not None and nxt.extends == i:
                held = len(turn.record.prompt_token_ids) + len(turn.record.token_ids)
                record.observation = fmt.decode(nxt.record.prompt_token_ids[held:], special=True)
            record.tool_calls = self._tool_calls(turn, nxt if nxt is not None and nxt.extends == i else None)
            records.append(record)
        return records, breaks

    @staticmethod
    def _tool_calls(turn: Turn, nxt: Turn | None) -> list[ToolCall]:
        calls = (turn.reply.get("tool_calls") or []) if turn.api == "chat" else []
        results = {m.get("tool_call_id"): m["content"] for m in (nxt.delta if nxt else []) if m["role"] == "tool"}
        ordered = [m["content"] for m in (nxt.delta if nxt else []) if m["role"] == "tool"]
        out = []
        for j, call in enumerate(calls):
            result = results.get(call["id"], ordered[j] if j < len(ordered) else "")
            out.append(ToolCall(tool=call["function"]["name"], arguments=json.dumps(call["function"]["arguments"]), result=result))
        return out

    # ---- restore ----

    def restore(self, saved: list[EpisodeTurn]) -> None:
        """The turns checkpointed before (in index order), with each chat turn's whole conversation rebuilt."""
        for cp in saved:
            request = json.loads(cp.request)
            tools, reply = json.loads(cp.tools), json.loads(cp.reply)
            if cp.api == "chat":
                base = self.turns[cp.extends] if 0 <= cp.extends < len(self.turns) else None
                conversation = [*base.request, base.reply, *request] if base is not None else list(request)
                turn = Turn(cp.turn, "chat", conversation, tools, reply, cp.request_digest, cp.extends, cp.segment_reason, delta=request)
            else:
                turn = Turn(cp.turn, "completion", [], [], reply, cp.request_digest, cp.extends, cp.segment_reason, prompt=request)
            self.turns.append(turn)
