"""Write a small Python function; a `python` tool runs it against the tests in the sandbox.

A problem (seeded) names a function and says what it must do. The `python` tool runs the
model's code with the problem's test inputs in the sandbox and reports how many tests pass
and the first failure. The final `<answer>` is the code; its reward is the fraction of tests
it passes.

The expected outputs never enter the sandbox: the harness prints the *actual* results (as
`repr`) on a line tagged with a fresh random nonce, and the worker compares them with the
ground truth. So a program cannot learn the answers, and printing a fake result line needs
the nonce (the harness file is deleted before the program runs).

A program that loops, blows its memory or floods its output is the model's failure (the
sandbox contained it): the tool reports it and those tests count as failed. A sandbox that
cannot run at all is the environment's failure (`EnvironmentFailure`). With no isolating
sandbox backend on the machine (and `unsafe` not chosen), the environment refuses every
episode at reset, with what to install or enable (docs/sandbox.md).
"""

from __future__ import annotations

import json
import random
import secrets
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from rose.contracts.rollout import RolloutTask

from .envs import ENVIRONMENTS
from .sandbox import ISOLATING_BACKENDS, Backend, BackendChoice, Sandbox, SandboxLimits, SandboxResult, SandboxUnavailable
from .tool_env import Problem, ToolEnv
from .tools import EnvironmentFailure, Tool, ToolError, format_answer, format_call

TESTS_PER_PROBLEM = 5
# wall_s is the backstop for a sleeping program; the CPU limit stops a busy one (the sandbox runs
# at nice 10, so on a loaded machine 2 s of CPU can take well over 10 s of wall time)
SANDBOX_LIMITS = SandboxLimits(wall_s=20.0, cpu_s=2, memory_bytes=256 << 20, max_output_bytes=16 << 10)
TOOL_DEADLINE_S = 35.0  # the sandbox's own wall limit plus generous start-up slack
MAX_CODE_CHARS = 2000


@dataclass(frozen=True)
class Spec:
    function: str
    params: str
    description: str
    body: str  # the reference implementation's body, one expression
    inputs: list[tuple[Any, ...]]


def _spec(rng: random.Random) -> Spec:
    k = rng.randint(2, 9)
    kind = rng.randrange(5)
    xs = [(rng.randint(-20, 50),) for _ in range(TESTS_PER_PROBLEM)]
    if kind == 0:
        return Spec(f"add_{k}", "x", f"returns x plus {k}", f"x + {k}", xs)
    if kind == 1:
        return Spec(f"times_{k}", "x", f"returns x times {k}", f"x * {k}", xs)
    if kind == 2:
        return Spec(f"is_multiple_of_{k}", "x", f"returns True when x is a multiple of {k}, else False", f"x % {k} == 0", xs)
    if kind == 3:
        words = ["model", "token", "river", "agent", "queue", "batch", "reward", "tree"]
        ss = [(rng.choice(words) * rng.randint(1, 2),) for _ in range(TESTS_PER_PROBLEM)]
        c = rng.choice("aeiou")
        return Spec(f"count_{c}", "s", f"returns how many times the letter {c!r} occurs in the string s", f"s.count({c!r})", ss)
    return Spec(f"clamp_{k}", "x", f"returns x limited to the range 0 to {k * 5}", f"max(0, min({k * 5}, x))", xs)


def reference(spec: Spec) -> str:
    return f"def {spec.function}({spec.params}):\n    return {spec.body}\n"


def expected_results(spec: Spec) -> list[str]:
    namespace: dict[str, Any] = {}
    exec(reference(spec), namespace)  # our own reference code, never the model's
    return [repr(namespace[spec.function](*args)) for args in spec.inputs]


def harness(code: str, spec: Spec, nonce: str) -> str:
    """The program the sandbox runs: the model's code, then each test input, results tagged by nonce."""
    return (
        f"{code}\n\n"
        "def _rose_run_tests():\n"
        "    import json\n"
        "    out = []\n"
        f"    for args in {spec.inputs!r}:\n"
        "        try:\n"
        f"            out.append(repr({spec.function}(*args)))\n"
        "        except BaseException as exc:\n"
        "            out.append('error: ' + type(exc).__name__)\n"
        f"    print({nonce!r} + json.dumps(out), flush=True)\n"
        "_rose_run_tests()\n"
    )


@dataclass(frozen=True)
class TestReport:
    passed: int
    total: int
    detail: str
    sandbox: SandboxResult | None = None

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


class CodeEnv(ToolEnv):
    """`sandbox_backend`: "auto" (docker, else kernel namespaces), "docker", "subprocess", or
    "unsafe" (no isolation: must be chosen by name); `auto_order`: what "auto" may use."""

    name = "code"
    max_turns = 3

    def __init__(self, sandbox_backend: BackendChoice = "auto", auto_order: tuple[Backend, ...] = ISOLATING_BACKENDS) -> None:
        self.sandbox_backend, self.auto_order = sandbox_backend, auto_order
        self._refused: SandboxUnavailable | None = None  # remembered: no new probe per episode

    @cached_property
    def sandbox(self) -> Sandbox:
        """Started on first use; raises `SandboxUnavailable` (what to install or enable) rather than run unconfined."""
        if self._refused is not None:
            raise self._refused
        try:
            return Sandbox(self.sandbox_backend, SANDBOX_LIMITS, auto_order=self.auto_order)
        except SandboxUnavailable as exc:
            self._refused = exc
            raise

    def use_sandbox(self, backend: BackendChoice) -> str:
        """Choose the backend (the worker's `sandbox.backend`) and start it now; '' or why the env refuses to run."""
        self.__dict__.pop("sandbox", None)
        self.sandbox_backend, self._refused = backend, None
        try:
            self.sandbox  # noqa: B018
        except SandboxUnavailable as exc:
            return str(exc)
        return ""

    def reset(self, task: RolloutTask) -> str:
        try:
            self.sandbox  # noqa: B018 - no episode starts without a sandbox that isolates (or an explicit unsafe)
        except SandboxUnavailable as exc:
            raise EnvironmentFailure(f"code: {exc}") from exc
        return super().reset(task)

    def problem(self, seed: int) -> Problem:
        spec = _spec(random.Random(f"code:{seed}"))
        question = f"Write a Python function {spec.function}({spec.params}) that {spec.description}."
        return Problem(seed=seed, question=question, answer=reference(spec), data=spec)

    def run_tests(self, code: str, spec: Spec) -> TestReport:
        """Run `code` on the spec's inputs in the sandbox and compare with the ground truth."""
        if len(code) > MAX_CODE_CHARS:
            return TestReport(0, len(spec.inputs), f"code longer than {MAX_CODE_CHARS} characters")
        nonce = f"ROSE-RESULTS-{secrets.token_hex(8)}:"
        result = self.sandbox.run(harness(code, spec, nonce))  # an OSError here is the environment's failure
        lines = [line[len(nonce) :] for line in result.stdout.splitlines() if line.startswith(nonce)]
        total = len(spec.inputs)
        if not lines or result.killed:
            reason = result.summary() if (result.killed or result.blocked) else (result.stderr.strip().splitlines() or ["no output"])[-1]
            return TestReport(0, total, f"0/{total} tests passed ({reason[:300]})", result)
        try:
            actual = json.loads(lines[-1])
        except ValueError:
            return TestReport(0, total, f"0/{total} tests passed (unreadable results)", result)
        want = expected_results(spec)
        passed = sum(1 for a, w in zip(actual, want) if a == w)
        detail = f"{passed}/{total} tests passed"
        for args, a, w in zip(spec.inputs, actual, want):
            if a != w:
                detail += f"; {spec.function}{args if len(args) != 1 else '(' + repr(args[0]) + ')'} returned {a}, expected {w}"
                break
        return TestReport(passed, total, detail, result)

    def tools(self, problem: Problem | None = None) -> dict[str, Tool]:
        def python(code: str) -> str:
            if problem is None:
                raise ToolError("no problem to test against")
            return self.run_tests(code, problem.data).detail

        return {"python": Tool("python", python, deadline_s=TOOL_DEADLINE_S)}

    def score(self, problem: Problem, answer: str) -> float:
        return self.run_tests(answer, problem.data).fraction

    def expert(self, problem: Problem) -> list[str]:
        code = problem.answer.rstrip("\n")
        return [format_call("python", code), format_answer(code)]


def configure_registered_code_env(backend: BackendChoice) -> str:
    """The worker's start: set the registered code env's sandbox backend and start it; '' or why it refuses episodes."""
    env = ENVIRONMENTS.get(CodeEnv.name)
    return env.use_sandbox(backend) if isinstance(env, CodeEnv) else ""
