"""An agent written with the OpenAI Agents SDK (`pip install openai-agents`), with one tool: a calculator.

Under ROSE's rollout gateway, the three lines marked `ROSE` are all that is set for it: the episode's base
URL and key (the gateway passes them as OPENAI_BASE_URL and OPENAI_API_KEY) and the policy's model name,
on the SDK's Chat Completions model (the gateway speaks Chat Completions, not the Responses API). The
gateway also sets OPENAI_AGENTS_DISABLE_TRACING=1, so the SDK never sends its traces (and the episode's
key) to OpenAI. The question is the first argument; the answer is printed.

    OPENAI_BASE_URL=... OPENAI_API_KEY=... python examples/agents/agents_sdk.py "What is 3+4?"
"""

from __future__ import annotations

import ast
import asyncio
import operator
import os
import sys

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI

BASE_URL = os.environ["OPENAI_BASE_URL"]  # ROSE: the episode's base URL
API_KEY = os.environ["OPENAI_API_KEY"]  # ROSE: the episode's key
MODEL = os.environ.get("AGENT_MODEL", "rose-policy")  # ROSE: the policy
MAX_TURNS = 3  # model calls before the agent gives up

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


@function_tool
def calc(expression: str) -> str:
    """Evaluate an integer arithmetic expression (+, -, *, //, %, parentheses)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an integer expression: {expression!r}")

    try:
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


async def main(question: str) -> str:
    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI(base_url=BASE_URL, api_key=API_KEY))
    agent = Agent(name="calculator", tools=[calc], model=model)
    try:
        result = await Runner.run(agent, question, max_turns=MAX_TURNS)
    except MaxTurnsExceeded:
        return "no answer"
    return str(result.final_output)


if __name__ == "__main__":
    print(asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "What is 3+4?")))
