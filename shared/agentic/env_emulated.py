"""The emulated agentic job: episodes shaped like the simulator's workload, played against the real services.

An emulated fleet (services/executor/emulated.py) has no model to learn a task with, but everything
around the model is real: the trainer hands out tasks and groups them, the worker routes each turn
through the scheduler, checkpoints it and waits for its tool, the executors batch it. This
environment gives that machinery the job the simulator prices (shared/workload.py, one definition):
each task draws one trajectory of ``sample_batch`` from its own seed, its turn count, its tokens per
turn (the turn's ``max_tokens``: an emulated device generates exactly that many), the tool output
appended after each turn and the tool's latency, which the worker waits out without holding a thread
(``Step.latency_s``, times the fleet's time scale, shared/clock.py).

Rewards vary within a group, as GRPO needs: each group (one seed, the same prompt) has a success
probability drawn uniformly, and each of its trajectories succeeds with it (reward 1) or not (0). The
policy cannot change them: an emulated job measures the system, not learning.

Text is made of words that are one token each in the local tokenizer (``WORDS``; a test holds the
tiny tokenizer to it), so a prompt or tool output of N tokens is N words.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from rose.contracts.rollout import RolloutTask
from rose.shared.clock import time_scale
from rose.shared.workload import RolloutSpec, sample_batch

from .envs import Step
from .tool_env import SEED_ARG, Problem, ToolEnv
from .tools import EnvironmentFailure, Tool

EPISODE_ARG = "episode"  # env_args: the trajectory drawn for the task (JSON), so every delivery replays the same one
TURN_BUDGETS_ARG = "max_tokens_by_turn"  # env_args read by the worker: each turn's max_tokens ("312,45,...")
WORDS = tuple(
    [
        "add",
        "agent",
        "answer",
        "batch",
        "big",
        "blue",
        "calc",
        "cat",
        "checks",
        "computes",
        "day",
        "dog",
        "fast",
        "finds",
        "first",
        "gives",
        "good",
        "green",
        "house",
        "keeps",
        "last",
        "latency",
        "light",
        "long",
        "makes",
        "new",
        "run",
        "sees",
        "sends",
        "small",
        "tool",
        "tree",
        "what",
        "writes",
    ]
)


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little")


def words(n: int, seed: int) -> str:
    """``n`` one-token words (a leading space each: a byte-level BPE keeps " word" one token)."""
    rng = np.random.default_rng(seed)
    return "".join(" " + WORDS[i] for i in rng.integers(0, len(WORDS), max(0, n)))


@dataclasses.dataclass(frozen=True)
class Episode:
    """One trajectory of the workload: what the worker and this environment play."""

    prompt_tokens: int
    gen: list[int]  # tokens of each turn (its max_tokens)
    tool_tokens: list[int]  # appended after each turn but the last
    tool_s: list[float]  # the tool's latency after each turn but the last, emulated seconds
    reward: float

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Episode:
        return cls(**json.loads(text))


class EmulatedAgentEnv(ToolEnv):
    """Tasks drawn from ``spec`` (the simulator's workload); see the module doc."""

    name = "emulated"
    system_prompt = False

    def __init__(self, spec: RolloutSpec | None = None) -> None:
        self.spec = spec or RolloutSpec()

    def episode(self, seed: int, task_id: str, max_turns: int | None = None) -> Episode:
        """The trajectory of task ``task_id`` in the group of ``seed``: its lengths from the task's own seed,
        its prompt and success probability from the group's (the group's trajectories share a prompt)."""
        group = np.random.default_rng(_seed("group", seed))
        prompt = int(sample_batch(self.spec, 1, group, bundle=1).prompt[0])
        success = float(group.uniform())
        b = sample_batch(self.spec, 1, np.random.default_rng(_seed("task", seed, task_id)), bundle=1)
        turns = max(1, min(int(b.turns[0]), max_turns or self.spec.max_turns))
        reward = 1.0 if np.random.default_rng(_seed("reward", seed, task_id)).uniform() < success else 0.0
        return Episode(
            prompt_tokens=prompt,
            gen=[int(x) for x in b.gen[0, :turns]],
            tool_tokens=[int(x) for x in b.tool_tokens[0, : turns - 1]],
            tool_s=[float(x) for x in b.tool_s[0, : turns - 1]],
            reward=reward,
        )

    def task(self, seed: int, *, task_id: str, group_id: str = "", group_size: int = 1, max_turns: int | None = None) -> RolloutTask:
        ep = self.episode(seed, task_id, max_turns)
        return RolloutTask(
            task_id=task_id,
            env=self.name,
            prompt=f"emulated task {seed}",
            group_id=group_id,
            group_size=group_size,
            max_turns=len(ep.gen),
            env_args={SEED_ARG: str(seed), EPISODE_ARG: ep.to_json(), TURN_BUDGETS_ARG: ",".join(map(str, ep.gen))},
        )

    def episode_of(self, task: RolloutTask) -> Episode:
        try:
            return Episode.from_json(task.env_args[EPISODE_ARG])
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvironmentFailure(f"{self.name}: task {task.task_id} carries no valid env_args[{EPISODE_ARG!r}]: {exc}") from exc

    # ---- the worker's interface ---------------------------------------------------------

    def reset(self, task: RolloutTask) -> str:
        return words(self.episode_of(task).prompt_tokens, _seed("prompt", self.seed_of(task)))

    def step(self, task: RolloutTask, turn_index: int, completion: str, finish_reason: str, history: list[str]) -> Step:
        ep = self.episode_of(task)
        if turn_index + 1 >= len(ep.gen):
            return Step("", True, ep.reward)
        observation = words(ep.tool_tokens[turn_index], _seed("tool", task.task_id, turn_index))
        return Step(observation, False, 0.0, latency_s=ep.tool_s[turn_index] * time_scale())

    # ---- ToolEnv hooks: an emulated task has no problem to solve, no tools and no expert ----

    def problem(self, seed: int) -> Problem:
        return Problem(seed=seed, question=f"emulated task {seed}", answer="")

    def tools(self, problem: Problem | None = None) -> dict[str, Tool]:
        return {}

    def score(self, problem: Problem, answer: str) -> float:
        return 0.0

    def expert(self, problem: Problem) -> list[str]:
        raise EnvironmentFailure(f"{self.name}: an emulated job has no expert traces (run it with sft.steps = 0)")
