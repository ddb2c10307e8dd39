"""The trainer on degenerate groups: every trajectory gets the same reward (0), so GRPO has nothing to
learn from and every step is skipped. The job must end, not hand out tasks for ever: skipped steps
count toward `max_steps`, and `DEGENERATE_STEPS_LIMIT` of them in a row end even a job without one.
The test plays the rollout worker (every task answered with a zero-reward trajectory)."""

from __future__ import annotations

import asyncio

import pytest

from rose.contracts.registry import CHANNELS, ROLLOUT_TASK, TRAJECTORY, WEIGHT_APPLIED, Kind
from rose.contracts.rollout import RolloutTask
from rose.services.trainer.config import CheckpointSettings, GrpoSettings, SftSettings, TasksSettings, TrainerConfig
from rose.services.trainer.local_rollout import Tokens, scripted_episode
from rose.services.trainer.main import run as run_trainer
from rose.services.trainer.trainer import DEGENERATE_STEPS_LIMIT
from rose.shared.agentic import agentic_envs  # noqa: F401 - registers the envs
from rose.shared.agentic.envs import ENVIRONMENTS
from rose.shared.bus import Bus, Delivery
from rose.shared.config import BusConfig, RuntimeConfig
from rose.shared.models import PolicyModelRef, load_tokenizer
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision

TIMEOUT_S = 90.0
GROUP_SIZE, GROUPS = 2, 1


@pytest.mark.parametrize("max_steps, rounds", [(3, 3), (0, DEGENERATE_STEPS_LIMIT)], ids=["max_steps", "no_max_steps"])
async def test_a_job_whose_rewards_are_all_equal_ends_with_bounded_tasks(tiny_policy, tmp_path, max_steps, rounds):
    server = NatsServer(tmp_path / "nats").start()  # its own: the trainer's durable consumer reads the whole trajectory stream
    bus_config = BusConfig(url=server.url, initial_connect_deadline_s=10.0, drain_timeout_s=2.0)
    instance = f"trainer-degenerate-{max_steps}"
    config = TrainerConfig(
        bus=bus_config,
        runtime=RuntimeConfig(instance=instance, heartbeat_interval_s=0.2),
        models=PolicyModelRef(policy_dir=str(tiny_policy)),
        grpo=GrpoSettings(group_size=GROUP_SIZE, groups_per_step=GROUPS, max_staleness=1, prefetch_steps=1),
        sft=SftSettings(steps=0),  # no warm start, so nothing to publish: no weight publisher needed
        tasks=TasksSettings(envs=["arithmetic"], max_turns=1, max_operand=9),
        checkpoint=CheckpointSettings(dir=str(tmp_path / "checkpoints")),
        max_steps=max_steps,
        threads=1,
    )
    env = ENVIRONMENTS["arithmetic"]
    tokens = Tokens(load_tokenizer(tiny_policy))
    tasks: list[RolloutTask] = []
    trainer = None
    connect = Bus.connect
    try:
        async with Bus(bus_config, service="tests", instance="degenerate-worker") as bus:
            await provision(bus.js)

            async def answer(task: RolloutTask, _d: Delivery) -> None:  # the worker: a wrong answer, reward 0, for every task
                tasks.append(task)
                trajectory = scripted_episode(None, tokens, env, task, ["<answer>-1</answer>"], version=0)
                assert trajectory.reward == 0.0 and trajectory.status == "completed"
                await bus.publish(TRAJECTORY, trajectory, msg_id=trajectory.trajectory_id, status=trajectory.status)

            await bus.consume(ROLLOUT_TASK, answer, durable="degenerate_worker")
            buses: list[Bus] = []  # the trainer's bus, to compare what it read with the registry's consumers

            async def recording_connect(self: Bus) -> None:
                buses.append(self)
                await connect(self)

            Bus.connect = recording_connect  # type: ignore[method-assign]
            trainer = asyncio.create_task(run_trainer(config))
            await asyncio.wait_for(asyncio.shield(trainer), TIMEOUT_S)  # the job ends by itself
            trainer.result()
            await asyncio.sleep(0.5)  # a task handed out last would have reached the worker by now
    finally:
        Bus.connect = connect  # type: ignore[method-assign]
        if trainer is not None and not trainer.done():
            trainer.cancel()
            await asyncio.wait([trainer], timeout=10)
        server.stop()
    # every round skipped, none trained; tasks handed out: the rounds taken plus the prefetched one, no more
    handed_out = (rounds + config.grpo.prefetch_steps) * GROUPS * GROUP_SIZE
    assert len({t.task_id for t in tasks}) == handed_out, sorted(t.task_id for t in tasks)
    # the registry (and docs/subjects.md) lists as the trainer's reads exactly what its bus read, but for what only
    # an outside trainer's bridge reads under the trainer's name (TRL's waits for weights.applied: test_trl_fleet.py)
    (trainer_bus,) = [b for b in buses if b.service == "trainer"]
    registry = {c.name for c in CHANNELS if "trainer" in c.consumers and c.kind is not Kind.OBJECTS}
    assert trainer_bus.reads == registry - {WEIGHT_APPLIED.name}
