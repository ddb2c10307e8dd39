"""Helpers shared by the agentic tests."""

from __future__ import annotations

from rose.shared.agentic.env_arithmetic import ArithmeticEnv
from rose.shared.agentic.tools import Tool


class BrokenEnv(ArithmeticEnv):
    """A tool that crashes, one that floods, and a scorer that crashes."""

    name = "broken"

    def tools(self, problem=None):
        def crash(_: str) -> str:
            raise RuntimeError("database is down")

        return {"crash": Tool("crash", crash), "flood": Tool("flood", lambda _: "x" * 100_000)}

    def score(self, problem, answer):
        raise KeyError("no ground truth")
