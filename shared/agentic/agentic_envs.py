"""Register the tool-using environments (arithmetic, code, search QA, the emulated job) with the worker.

Importing this module adds them to `envs.ENVIRONMENTS`; the worker imports it at start.
"""

from __future__ import annotations

from .env_arithmetic import ArithmeticEnv
from .env_code import CodeEnv
from .env_emulated import EmulatedAgentEnv
from .env_search_qa import SearchQAEnv
from .envs import ENVIRONMENTS, register
from .tool_env import ToolEnv

TOOL_ENVS: tuple[type[ToolEnv], ...] = (ArithmeticEnv, CodeEnv, SearchQAEnv, EmulatedAgentEnv)


def register_agentic_envs() -> None:
    for cls in TOOL_ENVS:
        if cls.name not in ENVIRONMENTS:
            register(cls())


def tool_env_names() -> list[str]:
    return sorted(name for name, env in ENVIRONMENTS.items() if isinstance(env, ToolEnv))


register_agentic_envs()
