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

from .tool_env import Problem, ToolEnv
from .tools import Tool, ToolError, format_answer, format_call

MAX_OPERAND = 99
MAX_EXPRESSION_CHARS = 200
MAX_RESULT_DIGITS = 60
OPS = ("+", "-", "*")

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


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
    """`max_operand` sets the difficulty (a tiny policy learns single digits in seconds)."""

    name = "arithmetic"
    max_turns = 3

    def __init__(self, max_operand: int = MAX_OPERAND, *, system_prompt: bool = True) -> None:
        self.max_operand, self.system_prompt = max_operand, system_prompt

    def problem(self, seed: int) -> Problem:
        rng = random.Random(f"arithmetic:{seed}")
        a, b, op = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand), rng.choice(OPS)
        expression = f"{a}{op}{b}"
        return Problem(seed=seed, question=f"What is {expression}?", answer=calculate(expression), data=expression)

    def tools(self, problem: Problem | None = None) -> dict[str, Tool]:
        return {"calc": Tool("calc", calculate, deadline_s=5.0)}

    def score(self, problem: Problem, answer: str) -> float:
        return 1.0 if answer.strip() == problem.answer else 0.0

    def expert(self, problem: Problem) -> list[str]:
        return [format_call("calc", problem.data), format_answer(problem.answer)]
