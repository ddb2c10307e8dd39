"""Each tool environment's reset / step / reward, on the worker's Environment interface."""

from __future__ import annotations

import re

import pytest

from rose.shared.agentic import agentic_envs  # noqa: F401 - registers the envs
from rose.shared.agentic.env_arithmetic import ArithmeticEnv, calculate
from rose.shared.agentic.env_code import CodeEnv, expected_results
from rose.shared.agentic.env_search_qa import CORPUS_PATH, SearchQAEnv, build_corpus, load_corpus
from rose.shared.agentic.envs import ENVIRONMENTS, IM_END, IM_START
from rose.shared.agentic.tool_env import ToolEnv
from rose.shared.agentic.tools import EnvironmentFailure, ToolError, format_answer, format_call
from rose.testing.agentic import BrokenEnv


def test_the_worker_knows_the_tool_envs():
    for name in ("arithmetic", "code", "search_qa"):
        assert isinstance(ENVIRONMENTS[name], ToolEnv)


@pytest.mark.parametrize("env", [ArithmeticEnv(), CodeEnv(), SearchQAEnv()], ids=lambda e: e.name)
def test_expert_episodes_score_one_and_tasks_are_deterministic(env):
    for seed in range(4):
        assert env.problem(seed) == env.problem(seed)
        reset, turns = env.expert_episode(seed)
        assert reset.endswith(f"{IM_START}assistant\n") and env.problem(seed).question in reset
        assert len(turns) == 2 and turns[0][1].startswith(f"\n{IM_START}tool\n<result>") and turns[-1][1] == ""
    assert len({env.problem(s).question for s in range(20)}) > 5


def test_arithmetic_tool_loop_and_rewards():
    env = ArithmeticEnv()
    task = env.task(3, task_id="t-3", max_turns=3)
    p = env.problem(3)
    step = env.step(task, 0, format_call("calc", p.data) + " trailing babble", "length", [])
    assert not step.done and step.tool_calls[0].result == p.answer
    assert step.observation == f"{IM_END}\n{IM_START}tool\n<result>{p.answer}</result>{IM_END}\n{IM_START}assistant\n"
    assert env.step(task, 1, format_answer(p.answer), "stop", ["length"]).reward == 1.0
    assert env.step(task, 1, format_answer(p.answer + "1"), "stop", ["length"]).reward == 0.0
    # The model's mistakes are results it can read, not failures.
    bad = env.step(task, 0, "<tool>calc: __import__('os')</tool>", "stop", [])
    assert not bad.done and "only integers" in bad.observation and bad.tool_calls[0].error
    unknown = env.step(task, 0, "<tool>shell: ls</tool>", "stop", [])
    assert "unknown tool 'shell'" in unknown.observation
    hint = env.step(task, 0, "I think it is five", "stop", [])
    assert "no <tool>" in hint.observation
    # Out of turns without an answer: done, reward 0.
    last = env.step(task, 2, format_call("calc", "1+1"), "stop", ["stop", "stop"])
    assert last.done and last.reward == 0.0
    assert calculate("(2+3)*4 - 7 // 2") == "17"
    with pytest.raises(ToolError, match="division by zero"):
        calculate("1 % 0")


def test_arithmetic_difficulty_travels_with_the_task():
    easy = ArithmeticEnv(max_operand=4)
    task = easy.task(11, task_id="easy-11")
    assert task.env_args["max_operand"] == "4"
    worker_env = ArithmeticEnv()  # the worker's registered instance has its own default (99)
    assert worker_env.problem_of(task) == easy.problem(11)
    assert all(int(n) <= 4 for n in re.findall(r"\d+", easy.problem(11).data))
    for bad in ("0", "many", str(10**7)):
        task.env_args["max_operand"] = bad
        with pytest.raises(EnvironmentFailure, match="max_operand"):
            worker_env.reset(task)
    with pytest.raises(ValueError, match="max_operand"):
        ArithmeticEnv(max_operand=0)


def test_code_env_rewards_the_fraction_of_tests_passed():
    env = CodeEnv()

    def identity_is_partly_right(seed: int) -> bool:  # our own code, run here only to pick a problem
        spec = env.problem(seed).data
        if not spec.function.startswith("clamp_"):
            return False
        right = sum(repr(x) == want for (x,), want in zip(spec.inputs, expected_results(spec)))
        return 0 < right < len(spec.inputs)

    seed = next(s for s in range(200) if identity_is_partly_right(s))
    p = env.problem(seed)
    spec, task = p.data, env.task(seed, task_id=f"c-{seed}")
    assert env.step(task, 1, format_answer(p.answer), "stop", ["stop"]).reward == 1.0
    # Right for some inputs only: a clamp that forgot to clamp.
    partial = f"def {spec.function}(x):\n    return x"
    report = env.run_tests(partial, spec)
    assert 0 < report.passed < report.total
    assert env.step(task, 1, format_answer(partial), "stop", ["stop"]).reward == pytest.approx(report.fraction)
    # The tool shows the first failure; the sandbox backend that ran is recorded.
    shown = env.step(task, 0, format_call("python", partial), "stop", [])
    assert f"{report.passed}/{report.total} tests passed" in shown.observation and "expected" in shown.observation
    assert report.sandbox is not None and report.sandbox.backend in ("docker", "subprocess")
    # A program that loops forever, or fakes a result line, scores nothing.
    loop = f"def {spec.function}(x):\n    while True:\n        pass"
    looped = env.run_tests(loop, spec)
    assert looped.passed == 0 and "killed: cpu_time" in looped.detail
    fake = f'print(\'ROSE-RESULTS-0000000000000000:["1", "1", "1", "1", "1"]\')\ndef {spec.function}(x):\n    return None'
    assert env.run_tests(fake, spec).passed == 0


def test_search_qa_corpus_ships_and_search_finds_the_fact():
    assert CORPUS_PATH.exists()
    assert load_corpus() == build_corpus(), "the shipped corpus is stale: run `python -m rose.shared.agentic.env_search_qa --write`"
    assert len(load_corpus()) >= 300
    env = SearchQAEnv()
    p = env.problem(11)
    task = env.task(11, task_id="q-11")
    step = env.step(task, 0, f"<tool>search: {p.data.entity}</tool>", "stop", [])
    assert p.data.text in step.observation
    assert env.step(task, 1, format_answer(f"  {p.answer.upper()}. "), "stop", ["stop"]).reward == 1.0
    assert env.step(task, 1, format_answer("nowhere"), "stop", ["stop"]).reward == 0.0
    assert "no fact matches" in env.step(task, 0, "<tool>search: zzzz qqqq</tool>", "stop", []).observation


def test_a_broken_tool_or_env_is_a_failure_with_its_reason():
    env = BrokenEnv()
    task = env.task(1, task_id="b-1")
    with pytest.raises(EnvironmentFailure, match="database is down"):
        env.step(task, 0, "<tool>crash: now</tool>", "stop", [])
    with pytest.raises(EnvironmentFailure, match="returned 100000 characters"):
        env.step(task, 0, "<tool>flood: now</tool>", "stop", [])
    with pytest.raises(EnvironmentFailure, match="scoring failed: KeyError"):
        env.step(task, 0, "<answer>1</answer>", "stop", [])
    no_seed = task.__class__(task_id="b-2", env="broken", prompt="?")
    with pytest.raises(EnvironmentFailure, match="needs an integer env_args"):
        env.reset(no_seed)
