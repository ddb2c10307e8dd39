"""An agent loop over the official `openai` client, with one tool: a calculator.

Nothing here knows ROSE: pointed at any OpenAI-compatible endpoint, it runs the same. Under ROSE's rollout
gateway, the three lines marked `ROSE` are all that is set for it: the episode's base URL and key (the
gateway passes them as OPENAI_BASE_URL and OPENAI_API_KEY) and the policy's model name. The question is
the first argument; the answer is printed; the task's reward function scores the episode when it exits.

    OPENAI_BASE_URL=... OPENAI_API_KEY=... python examples/agents/openai_loop.py "What is 3+4?"
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys

import openai

BASE_URL = os.environ["OPENAI_BASE_URL"]  # ROSE: the episode's base URL
API_KEY = os.environ["OPENAI_API_KEY"]  # ROSE: the episode's key
MODEL = os.environ.get("AGENT_MODEL", "rose-policy")  # ROSE: the policy
MAX_STEPS = 3  # model calls before the agent gives up

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an integer arithmetic expression (+, -, *, //, %, parentheses).",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
        },
    }
]
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def calc(expression: str) -> str:
    """The tool: integers and + - * // % only, evaluated over the syntax tree (never eval)."""

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


def main(question: str) -> str:
    client = openai.OpenAI(base_url=BASE_URL, api_key=API_KEY)
    messages: list = [{"role": "user", "content": question}]
    for _ in range(MAX_STEPS):
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply)
        if not reply.tool_calls:
            return reply.content or ""
        for call in reply.tool_calls:
            try:
                result = calc(**json.loads(call.function.arguments))
            except (TypeError, ValueError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return "no answer"


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else "What is 3+4?"))
