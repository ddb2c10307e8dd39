"""Arithmetic with a calculator tool: the simplest agentic task that needs a tool call.

A problem is `a OP b` (seeded); the expert calls `<tool>calc: a OP b</tool>`, reads the
result and answers it. Reward 1 for the exact integer, else 0. The calculator evaluates a
bounded expression grammar (integers, + - * // % and parentheses) by walking the AST, never
`eval`, so the model cannot run code through it.
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Callable

from rose.contracts.rollout import RolloutTask

from .tool_env import Problem, ToolEnv
from .tools import EnvironmentFailure, Tool, ToolError, format_answer, format_call

MAX_OPERAND = 99
MAX_OPERAND_LIMIT = 10**6
MAX_OPERAND_ARG = "max_operand"
MAX_EXPRESSION_CHARS = 200
MAX_RESULT_DIGITS = 60
OPS = ("+", "-", "*")

_BINARY: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY: dict[type[ast.unaryop], Callable[[int], int]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Evaluate an integer expression; a bad expression is the model's error (`ToolError`)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"cannot parse {expression!r}") from exc

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                raise ToolError("division by zero")
            out = _BINARY[type(node.op)](left, right)
            if len(str(abs(out))) > MAX_RESULT_DIGITS:
                raise ToolError("result too large")
            return out
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ToolError(f"only integers, + - * // % and parentheses are allowed, not {type(node).__name__}")

    return str(value(tree.body))


class ArithmeticEnv(ToolEnv):
    """`max_operand` sets the difficulty (a tiny policy learns single digits in seconds).

    The difficulty travels with each task (`env_args["max_operand"]`), so the worker poses
    the same problem the trainer asked for (and scripted its expert traces from) whatever
    default the worker's own instance has.
    """

    name = "arithmetic"
    max_turns = 3

    def __init__(self, max_operand: int = MAX_OPERAND, *, system_prompt: bool = True) -> None:
        if not 1 <= max_operand <= MAX_OPERAND_LIMIT:
            raise ValueError(f"max_operand must be in 1..{MAX_OPERAND_LIMIT}, not {max_operand}")
        self.max_operand, self.system_prompt = max_operand, system_prompt

    def task(self, seed: int, **kwargs) -> RolloutTask:
        task = super().task(seed, **kwargs)
        task.env_args[MAX_OPERAND_ARG] = str(self.max_operand)
        return task

    def problem_of(self, task: RolloutTask) -> Problem:
        raw = task.env_args.get(MAX_OPERAND_ARG, str(self.max_operand))
        try:
            max_operand = int(raw)
        except ValueError:
            max_operand = 0
        if not 1 <= max_operand <= MAX_OPERAND_LIMIT:
            raise EnvironmentFailure(
                f"arithmetic: task {task.task_id}: env_args[{MAX_OPERAND_ARG!r}] must be an integer in 1..{MAX_OPERAND_LIMIT}, not {raw!r}"
            )
        return self.problem(self.seed_of(task), max_operand)

    def problem(self, seed: int, max_operand: int | None = None) -> Problem:
        top = self.max_operand if max_operand is None else max_operand
        rng = random.Random(f"arithmetic:{seed}")
        a, b, op = rng.randint(0, top), rng.randint(0, top), rng.choice(OPS)
        expression = f"{a}{op}{b}"
        return Problem(seed=seed, question=f"What is {expression}?", answer=calculate(expression), data=expression)

    def tools(self, problem: Problem | None = None) -> dict[str, Tool]:
        return {"calc": Tool("calc", calculate, deadline_s=5.0)}

    def score(self, problem: Problem, answer: str) -> float:
        return 1.0 if answer.strip() == problem.answer else 0.0

    def expert(self, problem: Problem) -> list[str]:
        return [format_call("calc", problem.data), format_answer(problem.answer)]
