"""The ReAct loop shared by tool-using environments, on the worker's `Environment` interface.

`envs.Environment` is `reset(task) -> prompt text` and `step(task, turn_index, completion,
finish_reason, history) -> Step`. A `ToolEnv` subclass only says what a problem is, which
tools it has, how an answer is scored, and what an expert would write; this class turns that
into the loop: parse the completion (tools.py), run the tool or score the answer, and render
the observation in the chat format the worker appends token for token.

Tasks are deterministic by seed: `task.env_args["seed"]` picks the problem, so a redelivered
task, a replay, and the trainer's expert traces all see the same problem. `task.prompt` is
informational (the problem's question), not trusted.

A broken tool or environment raises `tools.EnvironmentFailure`; the worker marks the
trajectory failed with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rose.contracts.rollout import RolloutTask, ToolCall

from .envs import IM_END, IM_START, Step
from .tools import EnvironmentFailure, Tool, format_result, invoke, parse

SEED_ARG = "seed"
DEFAULT_MAX_TURNS = 3
SYSTEM_PROMPT = "Use <tool>NAME: ARGS</tool> to call a tool and <answer>...</answer> to answer. Tools: {tools}."


@dataclass(frozen=True)
class Problem:
    """One generated task: the question shown, the ground truth, and anything the env needs."""

    seed: int
    question: str
    answer: str
    data: Any = None


class ToolEnv:
    """Base of the built-in tool environments; subclasses set `name` and implement the four hooks."""

    name = "tool_env"
    max_turns = DEFAULT_MAX_TURNS
    system_prompt = True  # list the tools in a system message (a tiny policy trained on the format can skip it)

    # ---- what a subclass provides -------------------------------------------------------

    def problem(self, seed: int) -> Problem:
        raise NotImplementedError

    def tools(self, problem: Problem | None = None) -> dict[str, Tool]:
        """The tools, bound to `problem` when a tool's behaviour depends on it (the code tests)."""
        raise NotImplementedError

    def score(self, problem: Problem, answer: str) -> float:
        raise NotImplementedError

    def expert(self, problem: Problem) -> list[str]:
        """The completions of a correct episode, one per turn (scripted from the ground truth)."""
        raise NotImplementedError

    # ---- tasks --------------------------------------------------------------------------

    def task(self, seed: int, *, task_id: str, group_id: str = "", group_size: int = 1, max_turns: int | None = None) -> RolloutTask:
        problem = self.problem(seed)
        return RolloutTask(
            task_id=task_id,
            env=self.name,
            prompt=problem.question,
            group_id=group_id,
            group_size=group_size,
            max_turns=max_turns or self.max_turns,
            env_args={SEED_ARG: str(seed)},
        )

    def seed_of(self, task: RolloutTask) -> int:
        try:
            return int(task.env_args[SEED_ARG])
        except (KeyError, ValueError) as exc:
            raise EnvironmentFailure(f"{self.name}: task {task.task_id} needs an integer env_args[{SEED_ARG!r}]") from exc

    def problem_of(self, task: RolloutTask) -> Problem:
        """The task's problem; an env whose problems take options from `env_args` overrides this."""
        return self.problem(self.seed_of(task))

    # ---- the worker's interface ---------------------------------------------------------

    def system(self) -> str:
        return SYSTEM_PROMPT.format(tools=", ".join(sorted(self.tools())))

    def reset(self, task: RolloutTask) -> str:
        problem = self.problem_of(task)
        system = f"{IM_START}system\n{self.system()}{IM_END}\n" if self.system_prompt else ""
        return f"{system}{IM_START}user\n{problem.question}{IM_END}\n{IM_START}assistant\n"

    def observation(self, text: str, finish_reason: str) -> str:
        close = "" if finish_reason == "stop" else IM_END  # a stopped turn already ended its message
        return f"{close}\n{IM_START}tool\n{format_result(text)}{IM_END}\n{IM_START}assistant\n"

    def step(self, task: RolloutTask, turn_index: int, completion: str, finish_reason: str, history: list[str]) -> Step:
        problem = self.problem_of(task)
        last = turn_index + 1 >= max(1, task.max_turns)
        action = parse(completion)
        if action.kind == "answer":
            return Step("", True, self._score(problem, action.answer))
        calls: list[ToolCall] = []
        if action.kind == "tool":
            tools = self.tools(problem)
            tool = tools.get(action.name)
            if tool is None:
                text = f"error: unknown tool {action.name!r}; tools: {', '.join(sorted(tools))}"
                calls.append(ToolCall(tool=action.name, arguments=action.arguments, error=text))
            else:
                call = invoke(tool, action.arguments)
                calls.append(call)
                text = call.result if not call.error else f"error: {call.error}"
        else:
            text = f"error: {action.error}"
        if last:
            return Step("", True, 0.0, calls)  # out of turns without an answer
        return Step(self.observation(text, finish_reason), False, 0.0, calls)

    def _score(self, problem: Problem, answer: str) -> float:
        try:
            return float(self.score(problem, answer))
        except EnvironmentFailure:
            raise
        except Exception as exc:
            raise EnvironmentFailure(f"{self.name}: scoring failed: {type(exc).__name__}: {exc}") from exc

    # ---- expert traces for the warm start -----------------------------------------------

    def expert_episode(self, seed: int) -> tuple[str, list[tuple[str, str]]]:
        """(reset text, [(completion, observation after it)]) of a correct episode, via `step` itself.

        Completions are assumed to end with the end-of-message token (finish reason "stop"),
        which the caller appends when tokenizing.
        """
        problem = self.problem(seed)
        task = self.task(seed, task_id=f"expert-{self.name}-{seed}", max_turns=len(self.expert(problem)))
        turns: list[tuple[str, str]] = []
        for index, completion in enumerate(self.expert(problem)):
            step = self.step(task, index, completion, "stop", ["stop"] * index)
            turns.append((completion, step.observation))
            if step.done:
                if step.reward <= 0:
                    raise EnvironmentFailure(f"{self.name}: the expert trace of seed {seed} scores {step.reward}")
                break
        return self.reset(task), turns
