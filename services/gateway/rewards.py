"""Reward functions registered with the gateway: what an episode is worth when its agent posts no reward.

An agent may post its episode's reward (`POST {ROSE_EPISODE_URL}/reward`); one that does not, as an
agent written for an OpenAI endpoint would not, is scored here from its task and the last answer the
policy gave it, by the function registered for the task's environment. Every tool environment the
rollout worker knows is registered (its `score` of the answer: the text inside `<answer>...</answer>`
when there is one, else the whole answer), so the trainer's tasks need no reward code in the agent.
`register(env_name, fn)` adds a user's own.
"""

from __future__ import annotations

from collections.abc import Callable

from rose.contracts.rollout import RolloutTask
from rose.shared.agentic import agentic_envs
from rose.shared.agentic.envs import ENVIRONMENTS
from rose.shared.agentic.tool_env import ToolEnv
from rose.shared.agentic.tools import parse

RewardFn = Callable[[RolloutTask, str], float]  # (task, the policy's last answer) -> reward

REWARDS: dict[str, RewardFn] = {}


def register(env: str, fn: RewardFn) -> None:
    REWARDS[env] = fn


def tool_env_reward(env: ToolEnv) -> RewardFn:
    def reward(task: RolloutTask, answer: str) -> float:
        action = parse(answer)
        return float(env.score(env.problem_of(task), action.answer if action.kind == "answer" else answer.strip()))

    return reward


def register_tool_envs() -> None:
    agentic_envs.register_agentic_envs()
    for name, env in ENVIRONMENTS.items():
        if isinstance(env, ToolEnv) and name not in REWARDS:
            register(name, tool_env_reward(env))


register_tool_envs()
