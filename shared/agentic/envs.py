"""Environments behind a small pluggable interface: `reset(task) -> prompt text` and
`step(task, turn_index, completion, finish_reason) -> Step`.

Token-in, token-out: the worker tokenizes the reset text once and then only *appends* (the
model's tokens, then the tokenized observation), so each turn's prompt extends the previous
one exactly and the executor's retained prefix cache applies. Environments must be
deterministic functions of their inputs: a redelivered task is resumed by replaying the
checkpointed completions through `step`.

`ConversationEnv` is the minimal built-in environment, with no tools: a scripted user keeps
a conversation going for N turns. It is complete as it stands; issue 6 adds tool-using
environments (calculator, code sandbox, search) through `register`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Protocol

from rose.contracts.rollout import RolloutTask, ToolCall

IM_START, IM_END = "<|im_start|>", "<|im_end|>"

FOLLOW_UPS = (
    "Can you say more about that?",
    "Why do you think so?",
    "Give me an example.",
    "What would you do next?",
    "Summarise it in one line.",
    "Is there another way to see it?",
    "What is the main risk?",
    "How would you test that?",
)


@dataclass(frozen=True)
class Step:
    observation: str  # appended after the model's tokens; empty when done
    done: bool
    reward: float = 0.0  # the episode's reward, meaningful when done
    tool_calls: list[ToolCall] = field(default_factory=list)
    # an external tool's latency the worker waits out before the next turn, holding no thread (the emulated job's
    # tools, env_emulated.py; a tool that runs in `step` itself has already taken its time)
    latency_s: float = 0.0


class Environment(Protocol):
    name: str

    def reset(self, task: RolloutTask) -> str: ...

    def step(self, task: RolloutTask, turn_index: int, completion: str, finish_reason: str, history: list[str]) -> Step: ...


class ConversationEnv:
    """Continue a conversation for N turns (`env_args["turns"]`, default `task.max_turns`).

    Reward: the share of turns the model ended on its own (finish reason "stop"), i.e. a
    preference for concise turns. Follow-up questions are picked by a hash of (task, turn).
    """

    name = "conversation"

    def reset(self, task: RolloutTask) -> str:
        return f"{IM_START}user\n{task.prompt}{IM_END}\n{IM_START}assistant\n"

    def turns(self, task: RolloutTask) -> int:
        return max(1, int(task.env_args.get("turns", task.max_turns)))

    def step(self, task: RolloutTask, turn_index: int, completion: str, finish_reason: str, history: list[str]) -> Step:
        if turn_index + 1 >= self.turns(task):
            stops = [r == "stop" for r in [*history, finish_reason]]
            return Step("", True, sum(stops) / len(stops))
        digest = hashlib.sha256(f"{task.task_id}:{turn_index}".encode()).digest()
        question = FOLLOW_UPS[digest[0] % len(FOLLOW_UPS)]
        close = "" if finish_reason == "stop" else IM_END  # a stopped turn already ended its message
        return Step(f"{close}\n{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n", False)


ENVIRONMENTS: dict[str, Environment] = {}


def register(env: Environment) -> None:
    """Add an environment under its name (users plug in their own this way)."""
    ENVIRONMENTS[env.name] = env


register(ConversationEnv())
