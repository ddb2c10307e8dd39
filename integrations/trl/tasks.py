"""The job TRL trains on, as ROSE tasks: a table from TRL's prompts to ROSE's environments.

TRL hands a rollout function only the prompt strings of its dataset (`rollout_func(prompts,
trainer)`), so the prompt is the key: `TaskTable` builds the dataset from ROSE's tool
environments (a problem's question is its prompt) and turns each prompt back into the
`RolloutTask` a rollout worker runs (environment, seed, turns, tokens per turn). Two seeds
that pose the same question are one task (the question determines the problem in the
built-in environments); a prompt the table does not hold is refused, naming the table's size.

The reward is the environment's own: the worker scores each episode with the same `ToolEnv`
ROSE's reference trainer uses, and `env_reward` is the TRL reward function that returns it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rose.contracts.rollout import RolloutTask
from rose.shared.agentic.tool_env import ToolEnv
from rose.shared.errors import RoseError

# The key under which the rollout function hands each trajectory's environment reward to TRL's reward
# functions (TRL passes every extra field a rollout function returns to them as a keyword argument).
ENV_REWARD_FIELD = "env_reward"


class UnknownPrompt(RoseError, KeyError):
    """TRL asked for a prompt the task table does not hold."""


@dataclass(frozen=True)
class TaskSpec:
    """One problem of the job: the environment that poses and scores it, its seed, its prompt."""

    env: ToolEnv
    seed: int
    prompt: str

    def task(self, task_id: str, *, group_id: str, group_size: int, max_turns: int, max_tokens: int, batch_id: str, batch_size: int) -> RolloutTask:
        """The rollout task of one member of a group (the worker's `max_tokens` per turn travels in env_args, as the
        reference trainer sends it)."""
        task = self.env.task(self.seed, task_id=task_id, group_id=group_id, group_size=group_size, max_turns=max_turns)
        task.env_args["max_tokens"] = str(max_tokens)
        task.created_at = time.time()
        task.batch_id, task.batch_size = batch_id, batch_size
        return task


class TaskTable:
    """The job's problems by prompt, with the episode limits every task of the job shares."""

    def __init__(self, envs: Sequence[ToolEnv], seeds: Iterable[int], *, max_turns: int = 3, max_tokens: int = 16) -> None:
        if not envs:
            raise ValueError("TaskTable needs at least one environment (e.g. ArithmeticEnv(4))")
        if max_turns < 1 or max_tokens < 1:
            raise ValueError(f"max_turns and max_tokens must be at least 1, not {max_turns} and {max_tokens}")
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.specs: dict[str, TaskSpec] = {}
        for i, seed in enumerate(seeds):
            env = envs[i % len(envs)]  # as the reference trainer cycles its environments
            prompt = env.problem(seed).question
            self.specs.setdefault(prompt, TaskSpec(env, seed, prompt))
        if not self.specs:
            raise ValueError("TaskTable needs at least one seed")

    def __len__(self) -> int:
        return len(self.specs)

    def spec(self, prompt: Any) -> TaskSpec:
        """The task of a TRL prompt (a string, or a conversation whose last message's content is the question)."""
        text = prompt[-1]["content"] if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict) else prompt
        spec = self.specs.get(text) if isinstance(text, str) else None
        if spec is None:
            raise UnknownPrompt(
                f"prompt {str(text)[:80]!r} is not one of the task table's {len(self.specs)} problems: "
                "train on TaskTable.dataset() (or build the table from the seeds your dataset was made from)"
            )
        return spec

    def specs_in_order(self) -> list[TaskSpec]:
        return list(self.specs.values())

    def dataset(self) -> Any:
        """A `datasets.Dataset` with one row per problem: `prompt` (the question), `env` and `seed` (informational)."""
        from datasets import Dataset

        specs = self.specs_in_order()
        return Dataset.from_dict({"prompt": [s.prompt for s in specs], "env": [s.env.name for s in specs], "seed": [s.seed for s in specs]})


def env_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """TRL reward function: each episode's reward as ROSE's environment scored it in the rollout worker.

    The rollout function (and the async rollout worker) hand it over as the extra field `env_reward`;
    without it there is nothing to score (TRL's own generation did not run ROSE's episode)."""
    rewards = kwargs.get(ENV_REWARD_FIELD)
    if rewards is None:
        raise RoseError(f"env_reward needs the {ENV_REWARD_FIELD!r} field that rose.integrations.trl's rollout function returns")
    return [float(r) for r in rewards]
