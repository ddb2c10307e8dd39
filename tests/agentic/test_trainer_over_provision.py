"""`grpo.over_provision` (partial rollouts across steps) on the trainer service: synchronous RL, the first
step hands out N + k groups, a step trains on the first N complete without waiting for the rest, and a
group that finishes later is trained by the next step with its lag counted.

The trainer runs as the service does (real nats-server, real weight publisher, real tiny policy); the
test plays the rollout worker. Decided from what the trainer puts on the task queue and reports."""

from __future__ import annotations

import asyncio

import pytest

from rose.client import WeightsClient
from rose.contracts.registry import ROLLOUT_TASK, SERVICE_REGISTRY, TRAINING_STEP, TRAJECTORY
from rose.contracts.rollout import RolloutTask
from rose.contracts.training import TrainingStep
from rose.services.trainer.config import CheckpointSettings, GrpoSettings, SftSettings, TasksSettings, TrainerConfig
from rose.services.trainer.local_rollout import Tokens, scripted_episode
from rose.services.trainer.main import run as run_trainer
from rose.services.weight_publisher.config import WeightPublisherConfig
from rose.services.weight_publisher.main import run as run_publisher
from rose.shared.agentic import agentic_envs  # noqa: F401 - registers the envs
from rose.shared.agentic.envs import ENVIRONMENTS
from rose.shared.bus import Bus, Delivery
from rose.shared.config import BusConfig, RuntimeConfig
from rose.shared.models import PolicyModelRef, build_model, load_tokenizer
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.testing.agentic import TINY_POLICY
from rose.testing.polling import until

TIMEOUT_S = 90.0


async def test_a_step_trains_the_first_complete_groups_and_the_carried_one_trains_next(tiny_policy, tmp_path, monkeypatch):
    """groups_per_step 1, over_provision 1, synchronous: step 0 goes out with two groups. Its second group
    completes first and step 1 trains on it alone; step 1's one group goes out. The first group, sampled on
    v1, completes after that and step 2 trains on it at v2: one version of lag, counted, within the bound."""
    monkeypatch.setenv("ROSE_STATE_DIR", str(tmp_path / "state"))
    run = "over-run"
    with NatsServer(tmp_path / "nats") as server:
        bus_config = BusConfig(url=server.url, initial_connect_deadline_s=10.0, drain_timeout_s=2.0)
        config = TrainerConfig(
            bus=bus_config,
            runtime=RuntimeConfig(instance="trainer-over", heartbeat_interval_s=0.3),
            models=PolicyModelRef(policy_dir=str(tiny_policy)),
            grpo=GrpoSettings(group_size=2, groups_per_step=1, max_staleness=2, prefetch_steps=0, over_provision=1, lr=1e-3),
            sft=SftSettings(steps=2, traces_per_env=8, batch_size=8),
            tasks=TasksSettings(envs=["arithmetic"], max_turns=3, max_operand=9),
            checkpoint=CheckpointSettings(dir=str(tmp_path / "checkpoints")),
            run_id=run,
            threads=1,
        )
        publisher = asyncio.create_task(run_publisher(WeightPublisherConfig(bus=bus_config, runtime=RuntimeConfig(instance="wp-over"))))
        trainer = asyncio.create_task(run_trainer(config))
        groups: dict[str, list[RolloutTask]] = {}  # group id -> its tasks, as they appeared
        steps: list[TrainingStep] = []
        env = ENVIRONMENTS["arithmetic"]
        tokenizer = load_tokenizer(tiny_policy)
        behaviour, tokens = build_model(TINY_POLICY, len(tokenizer), tokenizer.eos_token_id, seed=1), Tokens(tokenizer)

        async def take(task: RolloutTask, delivery: Delivery) -> None:
            groups.setdefault(task.group_id, []).append(task)

        async def roll(bus: Bus, group: str, version: int) -> None:
            """One group: one right, one wrong answer (a reward spread to train on)."""
            for task in sorted(groups[group], key=lambda t: t.task_id):
                expert = env.expert(env.problem_of(task))
                completions = expert if task.task_id.endswith("-0") else [expert[0], "<answer>-1</answer>"]
                traj = scripted_episode(behaviour, tokens, env, task, completions, version=version)
                await bus.publish(TRAJECTORY, traj, msg_id=traj.trajectory_id, status=traj.status)

        async with Bus(bus_config, service="tests", instance="over-worker") as bus:
            await provision(bus.js)
            await bus.consume(ROLLOUT_TASK, take, durable="over_worker")
            await bus.consume(TRAINING_STEP, lambda s, _d: asyncio.sleep(0, steps.append(s)), durable="over_steps")
            try:
                async with WeightsClient(bus, "policy") as weights:
                    await weights.published(1, timeout=TIMEOUT_S)  # the warm start
                    first, second = f"{run}-s0-g0", f"{run}-s0-g1"
                    await until(lambda: all(len(groups.get(g, [])) == 2 for g in (first, second)), TIMEOUT_S, "step 0: N + k groups")
                    assert all(t.batch_size == 4 for g in (first, second) for t in groups[g])  # the step's batch names both groups
                    await roll(bus, second, 1)
                    await until(lambda: steps, TIMEOUT_S, "step 1 trained on the group that completed first")
                    assert steps[0].groups == 1 and steps[0].trained_sequences == 2
                    await weights.published(2, timeout=TIMEOUT_S)
                    await until(lambda: len(groups.get(f"{run}-s1-g0", [])) == 2, TIMEOUT_S, "step 1 refills the N it took")
                    await roll(bus, first, 1)  # the carried group, sampled on v1, completes now
                    await until(lambda: len(steps) >= 2, TIMEOUT_S, "step 2 trained on the carried group")
                    assert steps[1].trained_sequences == 2 and steps[1].stale_dropped == 0
                    assert f"{run}-s2-g0" not in groups or len(groups) == 4  # N + k in flight, never more

                async def load():
                    beat = await bus.kv_get(SERVICE_REGISTRY, service="trainer", instance="trainer-over")
                    return beat.load if beat is not None and beat.load.get("steps") == 2.0 else None

                beat = await until(load, TIMEOUT_S, "the trainer's heartbeat after step 2")
                assert beat["collector_max_trained_lag"] == 1
                assert beat["trained_staleness_mean"] == pytest.approx(0.5)  # two of the four trained trajectories a version old
                assert 0.0 < beat["length_bias"] <= 2.0
            finally:
                for task in (trainer, publisher):
                    task.cancel()
                await asyncio.wait([trainer, publisher], timeout=10)
