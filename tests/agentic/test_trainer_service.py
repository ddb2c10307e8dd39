"""The trainer service on a real nats-server: warm start and publish v1 through a real weight
publisher, emit task groups, consume the trajectory groups from the durable stream (one stale,
one failed), take a GRPO step and publish v2. The test plays the rollout worker."""

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
GROUP_SIZE, GROUPS = 4, 2
INSTANCE = "trainer-test"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Its own server: the trainer's durable consumer reads the whole trajectory stream."""
    s = NatsServer(tmp_path_factory.mktemp("trainer-nats")).start()
    yield s
    s.stop()


async def test_trainer_consumes_groups_and_publishes_a_version(server, tiny_policy, tmp_path, monkeypatch):
    monkeypatch.setenv("ROSE_STATE_DIR", str(tmp_path / "state"))  # the in-process publisher's signing key, not ./.rose
    bus_config = BusConfig(url=server.url, initial_connect_deadline_s=10.0, drain_timeout_s=2.0)
    config = TrainerConfig(
        bus=bus_config,
        runtime=RuntimeConfig(instance=INSTANCE, heartbeat_interval_s=0.3),
        models=PolicyModelRef(policy_dir=str(tiny_policy)),
        grpo=GrpoSettings(group_size=GROUP_SIZE, groups_per_step=GROUPS, max_staleness=0, prefetch_steps=0, lr=1e-3),
        sft=SftSettings(steps=3, traces_per_env=16, batch_size=8),
        tasks=TasksSettings(envs=["arithmetic"], max_turns=3, max_operand=9),
        checkpoint=CheckpointSettings(dir=str(tmp_path / "checkpoints")),
        threads=1,
    )
    publisher = asyncio.create_task(run_publisher(WeightPublisherConfig(bus=bus_config, runtime=RuntimeConfig(instance="wp-trainer-test"))))
    trainer = asyncio.create_task(run_trainer(config))
    tasks: list[RolloutTask] = []

    async def take(task: RolloutTask, delivery: Delivery) -> None:
        tasks.append(task)

    try:
        async with Bus(bus_config, service="tests", instance="trainer-test-worker") as bus:
            await provision(bus.js)
            await bus.consume(ROLLOUT_TASK, take, durable="test_worker")
            steps: list[TrainingStep] = []
            await bus.consume(TRAINING_STEP, lambda s, _d: asyncio.sleep(0, steps.append(s)), durable="test_steps")
            async with WeightsClient(bus, "policy") as weights:
                v1 = await weights.published(1, timeout=TIMEOUT_S)  # the warm start, published by the real publisher
                assert v1.keyframe
                await until(lambda: len(tasks) >= GROUP_SIZE * GROUPS, TIMEOUT_S, "the first step's tasks")
                groups = sorted({t.group_id for t in tasks})
                assert len(groups) == GROUPS and all(t.env == "arithmetic" and t.group_size == GROUP_SIZE for t in tasks)
                # the job's difficulty travels with each task: the worker's own env (default 99) poses the trainer's problem
                assert all(t.env_args["max_operand"] == "9" for t in tasks)

                # Play the rollout worker: scripted episodes, behaviour logprobs from the initial policy.
                env = ENVIRONMENTS["arithmetic"]
                tokenizer = load_tokenizer(tiny_policy)
                behaviour = build_model(TINY_POLICY, len(tokenizer), tokenizer.eos_token_id, seed=1)
                tokens = Tokens(tokenizer)
                for task in sorted(tasks, key=lambda t: t.task_id):
                    problem = env.problem_of(task)
                    j = int(task.task_id.rsplit("-", 1)[1])
                    right = j % 2 == 0
                    completions = env.expert(problem) if right else [env.expert(problem)[0], "<answer>-1</answer>"]
                    stale = task.group_id == groups[1] and j == 0  # sampled with v0: one version behind
                    traj = scripted_episode(behaviour, tokens, env, task, completions, version=0 if stale else 1)
                    if task.group_id == groups[1] and j == 3:
                        traj.status, traj.reason, traj.reward = "failed", "tool 'calc' ran past its deadline", 0.0
                    await bus.publish(TRAJECTORY, traj, msg_id=traj.trajectory_id, status=traj.status)

                v2 = await weights.published(2, timeout=TIMEOUT_S)  # the GRPO step's weights
                assert v2.base_version == 1 and not v2.keyframe and v2.changed_fraction > 0
                assert await weights.last_version() == 2  # what a restarted trainer numbers its next version after
                assert await WeightsClient(bus, "no-such-model").last_version() is None

            async def trained():
                beat = await bus.kv_get(SERVICE_REGISTRY, service="trainer", instance=INSTANCE)
                return beat.load if beat is not None and beat.load.get("steps") == 1.0 and beat.load.get("checkpoint_step") == 1.0 else None

            load = await until(trained, TIMEOUT_S, "the trainer's heartbeat after its step")
            assert load["version"] == 2.0
            assert load["collector_received"] == GROUP_SIZE * GROUPS
            assert load["collector_stale_dropped"] == 1 and load["collector_failed"] == 1 and load["collector_groups_used"] == 2
            assert load["sft_nll_after"] < load["sft_nll_before"]
            assert load["reward_last"] == pytest.approx(4 / 7)  # 4 right of the 7 completed trajectories (stale included)
            await until(lambda: steps, TIMEOUT_S, "the TrainingStep event")
            step = steps[0]
            assert (step.run_id, step.step, step.version, step.groups, step.trajectories) == (config.run_id or INSTANCE, 1, 2, GROUPS, 7)
            assert step.reward_mean == pytest.approx(4 / 7) and step.stale_dropped == 1 and step.trained_sequences == 6
            assert step.resumed_from_step is None and load["resumed_from_step"] == -1.0 and load["warm_started"] == 1.0
            # checkpoints of the warm start (step 0) and of step 1 (heartbeat: checkpoint_step), each complete; the step's
            # trajectories acked once it was written
            (job,) = (tmp_path / "checkpoints").iterdir()
            assert sorted(p.name for p in job.iterdir()) == ["step-00000000", "step-00000001"]
            assert all((p / "manifest.json").is_file() for p in job.iterdir())

            async def all_acked():
                info = await bus.js.consumer_info("ROSE_TRAJECTORIES", config.durable)
                return info.num_ack_pending == 0 and info.num_pending == 0

            await until(all_acked, TIMEOUT_S, "every trajectory of the step acked")
    finally:
        for task in (trainer, publisher):
            task.cancel()
        await asyncio.wait([trainer, publisher], timeout=10)


async def test_async_trainer_never_waits_for_a_straggling_group_and_never_trains_it_too_stale(tiny_policy, tmp_path, monkeypatch):
    """Asynchronous RL (prefetch_steps 1, max_staleness 1), the test playing the rollout worker: one
    group of the first step straggles. The trainer takes GRPO steps 1 and 2 on the groups that
    finished, whichever step handed them out, while the straggler is still out (its TrainingStep
    events arrive first). The straggler finally arrives with its first turn sampled under v1 and
    its last continued under v3: as stale as its oldest tokens, 2 versions behind the trainer's v3,
    so it is dropped whole and counted, and step 3 waits for two usable groups instead of spending a
    slot on it."""
    monkeypatch.setenv("ROSE_STATE_DIR", str(tmp_path / "state"))
    run = "async-run"
    with NatsServer(tmp_path / "nats") as server:  # its own server: a work queue of tasks and a stream of trajectories of this run only
        bus_config = BusConfig(url=server.url, initial_connect_deadline_s=10.0, drain_timeout_s=2.0)
        config = TrainerConfig(
            bus=bus_config,
            runtime=RuntimeConfig(instance="trainer-async", heartbeat_interval_s=0.3),
            models=PolicyModelRef(policy_dir=str(tiny_policy)),
            grpo=GrpoSettings(group_size=2, groups_per_step=2, max_staleness=1, prefetch_steps=1, lr=1e-3),
            sft=SftSettings(steps=2, traces_per_env=8, batch_size=8),
            tasks=TasksSettings(envs=["arithmetic"], max_turns=3, max_operand=9),
            checkpoint=CheckpointSettings(dir=str(tmp_path / "checkpoints")),
            run_id=run,
            threads=1,
        )
        publisher = asyncio.create_task(run_publisher(WeightPublisherConfig(bus=bus_config, runtime=RuntimeConfig(instance="wp-async"))))
        trainer = asyncio.create_task(run_trainer(config))
        tasks: dict[str, list[RolloutTask]] = {}
        steps: list[TrainingStep] = []
        env = ENVIRONMENTS["arithmetic"]
        tokenizer = load_tokenizer(tiny_policy)
        behaviour, tokens = build_model(TINY_POLICY, len(tokenizer), tokenizer.eos_token_id, seed=1), Tokens(tokenizer)

        async def take(task: RolloutTask, delivery: Delivery) -> None:
            tasks.setdefault(task.group_id, []).append(task)

        async def roll(bus: Bus, step: int, group: int, version: int, last_turn_version: int | None = None) -> None:
            """The group's trajectories (one right, one wrong answer: the group has a reward spread)."""
            gid = f"{run}-s{step}-g{group}"
            await until(lambda: len(tasks.get(gid, [])) == 2, TIMEOUT_S, f"the tasks of {gid}")
            for task in sorted(tasks[gid], key=lambda t: t.task_id):
                expert = env.expert(env.problem_of(task))
                completions = expert if task.task_id.endswith("-0") else [expert[0], "<answer>-1</answer>"]
                traj = scripted_episode(behaviour, tokens, env, task, completions, version=version)
                if last_turn_version is not None:  # continued under a newer version after a swap
                    traj.turns[-1].policy_version = last_turn_version
                await bus.publish(TRAJECTORY, traj, msg_id=traj.trajectory_id, status=traj.status)

        async def stepped(n: int) -> TrainingStep:
            await until(lambda: len(steps) >= n, TIMEOUT_S, f"TrainingStep {n}")
            return steps[n - 1]

        try:
            async with Bus(bus_config, service="tests", instance="async-worker") as bus:
                await provision(bus.js)
                await bus.consume(ROLLOUT_TASK, take, durable="async_worker")
                await bus.consume(TRAINING_STEP, lambda s, _d: asyncio.sleep(0, steps.append(s)), durable="async_steps")
                async with WeightsClient(bus, "policy") as weights:
                    await weights.published(1, timeout=TIMEOUT_S)  # the warm start: steps 0 and 1 handed out under v1
                    await roll(bus, 0, 0, 1)
                    await roll(bus, 1, 0, 1)  # step 1's first group done before step 0's second (the straggler)
                    first = await stepped(1)
                    await weights.published(2, timeout=TIMEOUT_S)
                    await roll(bus, 1, 1, 1)  # sampled under v1, trained at v2: within the bound
                    await roll(bus, 2, 0, 2)
                    second = await stepped(2)
                    await weights.published(3, timeout=TIMEOUT_S)
                    assert [s.step for s in steps] == [1, 2]  # two steps taken, the straggler still out
                    assert (first.groups, first.trained_sequences, second.groups, second.trained_sequences) == (2, 4, 2, 4)
                    await roll(bus, 0, 1, 1, last_turn_version=3)  # the straggler: 2 versions behind by its oldest turn
                    await roll(bus, 2, 1, 3)
                    await asyncio.sleep(1.0)  # an old trainer would now take the straggler and step 2's second group as step 3
                    assert len(steps) == 2
                    await roll(bus, 3, 0, 3)
                    third = await stepped(3)
                    assert (third.groups, third.trained_sequences, third.stale_dropped) == (2, 4, 2)

                async def load():
                    beat = await bus.kv_get(SERVICE_REGISTRY, service="trainer", instance="trainer-async")
                    return beat.load if beat is not None and beat.load.get("checkpoint_step") == 3.0 else None

                beat = await until(load, TIMEOUT_S, "the trainer's heartbeat after step 3")
                assert beat["collector_stale_groups"] == 1 and beat["collector_stale_dropped"] == 2
                assert beat["collector_max_trained_lag"] == 1  # step 1's second group, sampled under v1, trained at v2
                # step 1 took step 1's first group past the straggler; step 2 both of its groups; step 3 none
                assert beat["collector_trained_past_tail"] == 3

                async def all_acked():  # the dropped straggler's trajectories too: acked with step 3's checkpoint
                    info = await bus.js.consumer_info("ROSE_TRAJECTORIES", config.durable)
                    return info.num_ack_pending == 0 and info.num_pending == 0

                await until(all_acked, TIMEOUT_S, "every trajectory acked")
        finally:
            for task in (trainer, publisher):
                task.cancel()
            await asyncio.wait([trainer, publisher], timeout=10)
