"""The emulated agentic job (shared/agentic/env_emulated.py) and its trainer step (services/trainer/emulated.py).

The episode a task carries is the simulator's workload drawn from the task's seed: the same on every
delivery, different between a group's members, with rewards that vary within a group. Text is words of one
token each, so lengths are exact; the worker asks each turn for the workload's length and waits out the
tool's latency without a thread; the trainer's step takes the priced time and changes the stand-in weights.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from rose.services.rollout_worker.episode import turn_budget
from rose.services.trainer.config import EmulatedTraining, TasksSettings
from rose.services.trainer.emulated import EmulatedStep
from rose.shared.agentic.env_emulated import WORDS, EmulatedAgentEnv, words
from rose.shared.agentic.tools import EnvironmentFailure
from rose.shared.devices import DEVICES, MODELS, train_seconds
from rose.shared.workload import RolloutSpec


def test_each_word_is_one_token_of_the_local_tokenizer(models_dir):
    from rose.shared.models import load_tokenizer

    tokenizer = load_tokenizer(models_dir / "policy")
    assert all(len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1 for w in WORDS)
    assert len(tokenizer.encode(words(777, seed=3), add_special_tokens=False)) == 777


def test_an_episode_is_the_workloads_and_replays_the_same():
    spec = RolloutSpec(turns_median=4, gen_median=100, gen_max=300, max_turns=9)
    env = EmulatedAgentEnv(spec)
    tasks = [env.task(11, task_id=f"g-{j}", group_id="g", group_size=8) for j in range(8)]
    episodes = [env.episode_of(t) for t in tasks]
    assert len({e.prompt_tokens for e in episodes}) == 1  # one prompt per group
    assert len({tuple(e.gen) for e in episodes}) > 1  # lengths differ between members
    assert all(1 <= len(e.gen) <= 9 and all(16 <= g <= 300 for g in e.gen) for e in episodes)
    assert env.episode(11, "g-3") == episodes[3]  # the same task, the same episode
    rewards = [e.reward for s in range(20) for e in [env.episode(s, f"x-{j}") for j in range(8)]]
    assert set(rewards) == {0.0, 1.0}
    groups = np.array(rewards).reshape(20, 8)
    assert (groups.min(axis=1) != groups.max(axis=1)).sum() >= 10  # most groups are not degenerate
    # the worker takes each turn's length from the task; the env answers with the tool's output and latency
    t, e = tasks[0], episodes[0]
    assert [turn_budget(t, i, 24) for i in range(len(e.gen))] == e.gen
    if len(e.gen) > 1:
        step = env.step(t, 0, "x", "length", [])
        assert not step.done and step.latency_s == pytest.approx(e.tool_s[0]) and len(step.observation.split()) == e.tool_tokens[0]
    last = env.step(t, len(e.gen) - 1, "x", "length", [])
    assert last.done and last.reward == e.reward


def test_a_task_without_its_episode_fails_clearly():
    env = EmulatedAgentEnv()
    task = env.task(1, task_id="t")
    task.env_args.pop("episode")
    with pytest.raises(EnvironmentFailure, match="episode"):
        env.reset(task)
    with pytest.raises(ValueError, match="unknown fields"):
        TasksSettings(envs=["emulated"], workload={"gen_medain": 100.0})


def test_the_emulated_trainer_step_takes_the_priced_time_and_moves_the_weights(monkeypatch):
    monkeypatch.setenv("ROSE_TIME_SCALE", "0.01")  # 1 % of the priced time: the test checks the accounting, fast
    model = torch.nn.Linear(64, 64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = EmulatedStep(model, EmulatedTraining(device="H100", model="7B", gpus=16, changed_fraction=0.05))

    class Seq:
        tokens = list(range(40_000))

    priced = train_seconds(MODELS["7B"], 400_000, 16, DEVICES["H100"]) * 0.01
    started = time.monotonic()
    out = step([Seq()] * 10)
    assert time.monotonic() - started >= priced and out["tokens"] == 400_000
    changed = sum(int((model.state_dict()[k] != before[k]).sum()) for k in before) / sum(v.numel() for v in before.values())
    assert 0.02 < changed < 0.1
