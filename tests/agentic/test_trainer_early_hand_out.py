"""`grpo.early_hand_out`: the asynchronous trainer hands a step out early when the fleet's rollout
capacity idles, never past `max_staleness`, and the usual hand-out after training then waits.

The trainer runs as the service does (real nats-server, real weight publisher, real tiny policy);
the test plays the SLO monitor (each executor's headroom on slo.headroom, its `rollout_queue`) and
the rollout worker. Decided from what the trainer puts on the task queue: which steps' tasks
appear, and when."""

from __future__ import annotations

import asyncio
import time

import msgspec

from rose.client import WeightsClient
from rose.contracts.registry import HEADROOM, ROLLOUT_TASK, SERVICE_REGISTRY, TRAINING_STEP, TRAJECTORY
from rose.contracts.rollout import RolloutTask
from rose.contracts.slo import Headroom
from rose.contracts.training import TrainingStep
from rose.services.trainer.capacity import RolloutCapacity
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
from rose.testing import messages
from rose.testing.agentic import TINY_POLICY
from rose.testing.polling import until

TIMEOUT_S = 90.0
REPORT_EVERY_S = 0.2  # the test's SLO monitor
QUIET_S = 1.5  # long enough for several reports and trainer polls: a hand-out that was going to happen has


def headroom(executor_id: str, queue: int, role: str = "dedicated") -> Headroom:
    """What the SLO monitor reports of an executor: here only its rollout queue matters."""
    return msgspec.structs.replace(messages.headroom(time.time(), ex=executor_id), role=role, rollout_queue=queue)


def test_capacity_idles_only_when_every_live_executor_reported_no_queue_since_the_hand_out():
    cap = RolloutCapacity()
    assert not cap.idle(10.0, since=0.0)  # nobody heard from: no verdict
    cap.observe(headroom("a", 0), 1.0)
    cap.observe(headroom("b", 2), 1.0)
    assert not cap.idle(1.5, since=0.0)  # b has a queue
    cap.observe(headroom("a", 0), 2.0)
    cap.observe(headroom("b", 0), 2.0)
    assert cap.idle(2.5, since=0.0) and cap.interval() == 1.0
    assert not cap.idle(2.5, since=2.0)  # handed out at 2.0: the reports from before it do not count
    cap.observe(headroom("a", 0), 3.0)
    assert not cap.idle(3.5, since=2.5)  # b has not reported since
    # b goes quiet: after GONE_AFTER_INTERVALS of the observed 1 s interval it leaves the verdict
    cap.observe(headroom("a", 0), 4.0)
    cap.observe(headroom("a", 0), 5.0)
    assert cap.idle(5.5, since=2.5) and [r.received for r in cap.live(5.5)] == [5.0]


async def test_a_step_goes_out_early_only_while_capacity_idles_and_within_the_staleness_bound(tiny_policy, tmp_path, monkeypatch):
    """prefetch_steps 1, max_staleness 2: steps 0 and 1 go out after the warm start. While an executor
    reports a rollout queue, nothing more goes out. Once none does, step 2 goes out before any step is
    trained, and step 3 does not (3 ahead of the 0 steps taken > max_staleness). After step 1 trains,
    the usual hand-out is skipped (the lead is already prefetch_steps + 1) while a queue is reported;
    idle again, step 3 goes out early."""
    monkeypatch.setenv("ROSE_STATE_DIR", str(tmp_path / "state"))
    run = "early-run"
    with NatsServer(tmp_path / "nats") as server:
        bus_config = BusConfig(url=server.url, initial_connect_deadline_s=10.0, drain_timeout_s=2.0)
        config = TrainerConfig(
            bus=bus_config,
            runtime=RuntimeConfig(instance="trainer-early", heartbeat_interval_s=0.3),
            models=PolicyModelRef(policy_dir=str(tiny_policy)),
            grpo=GrpoSettings(group_size=2, groups_per_step=1, max_staleness=2, prefetch_steps=1, lr=1e-3),
            sft=SftSettings(steps=2, traces_per_env=8, batch_size=8),
            tasks=TasksSettings(envs=["arithmetic"], max_turns=3, max_operand=9),
            checkpoint=CheckpointSettings(dir=str(tmp_path / "checkpoints")),
            run_id=run,
            threads=1,
        )
        publisher = asyncio.create_task(run_publisher(WeightPublisherConfig(bus=bus_config, runtime=RuntimeConfig(instance="wp-early"))))
        trainer = asyncio.create_task(run_trainer(config))
        tasks: dict[int, list[RolloutTask]] = {}  # step -> its tasks, as they appeared
        steps: list[TrainingStep] = []
        queue = {"ded-0": 3, "srv-0": 0}  # what the test's monitor reports
        env = ENVIRONMENTS["arithmetic"]
        tokenizer = load_tokenizer(tiny_policy)
        behaviour, tokens = build_model(TINY_POLICY, len(tokenizer), tokenizer.eos_token_id, seed=1), Tokens(tokenizer)

        async def take(task: RolloutTask, delivery: Delivery) -> None:
            tasks.setdefault(int(task.group_id.rsplit("-s", 1)[1].split("-")[0]), []).append(task)

        async def monitor(bus: Bus) -> None:
            while True:
                for eid, q in queue.items():
                    await bus.publish(HEADROOM, headroom(eid, q, "dedicated" if eid.startswith("ded") else "serving"), executor_id=eid)
                await asyncio.sleep(REPORT_EVERY_S)

        async def roll(bus: Bus, step: int, version: int) -> None:
            """Step `step`'s one group: one right, one wrong answer (a reward spread to train on)."""
            for task in sorted(tasks[step], key=lambda t: t.task_id):
                expert = env.expert(env.problem_of(task))
                completions = expert if task.task_id.endswith("-0") else [expert[0], "<answer>-1</answer>"]
                traj = scripted_episode(behaviour, tokens, env, task, completions, version=version)
                await bus.publish(TRAJECTORY, traj, msg_id=traj.trajectory_id, status=traj.status)

        async with Bus(bus_config, service="tests", instance="early-worker") as bus:
            await provision(bus.js)
            await bus.consume(ROLLOUT_TASK, take, durable="early_worker")
            await bus.consume(TRAINING_STEP, lambda s, _d: asyncio.sleep(0, steps.append(s)), durable="early_steps")
            reports = asyncio.create_task(monitor(bus))
            try:
                async with WeightsClient(bus, "policy") as weights:
                    await weights.published(1, timeout=TIMEOUT_S)  # the warm start
                    await until(lambda: len(tasks.get(1, [])) == 2, TIMEOUT_S, "steps 0 and 1 handed out")
                    await asyncio.sleep(QUIET_S)
                    assert sorted(tasks) == [0, 1]  # ded-0 has a queue: capacity is full, nothing more goes out

                    queue["ded-0"] = 0
                    await until(lambda: len(tasks.get(2, [])) == 2, TIMEOUT_S, "step 2 handed out early")
                    await asyncio.sleep(QUIET_S)
                    assert sorted(tasks) == [0, 1, 2] and not steps  # not step 3: 3 ahead of 0 steps taken

                    queue["ded-0"] = 3
                    # the trainer decides its next hand-out as soon as step 1 trains: the queue must have reached it
                    # by then (a report still saying 0 was a race on a loaded box: step 3 went out early)
                    await asyncio.sleep(QUIET_S)
                    await roll(bus, 0, 1)
                    await until(lambda: steps, TIMEOUT_S, "step 1 trained")
                    await weights.published(2, timeout=TIMEOUT_S)
                    await asyncio.sleep(QUIET_S)
                    assert sorted(tasks) == [0, 1, 2]  # the usual hand-out after training: not due, the lead is 2 already

                    queue["ded-0"] = 0
                    await until(lambda: len(tasks.get(3, [])) == 2, TIMEOUT_S, "step 3 handed out early")
                    await asyncio.sleep(QUIET_S)
                    assert sorted(tasks) == [0, 1, 2, 3]  # not step 4: 3 ahead of the 1 step taken

                    # the early step's trajectories are trained on within the bound: step 2 sampled under v1, trained at v3
                    await roll(bus, 1, 1)
                    await until(lambda: len(steps) >= 2, TIMEOUT_S, "step 2 trained")
                    await roll(bus, 2, 1)
                    await until(lambda: len(steps) >= 3, TIMEOUT_S, "step 3 trained")
                    assert [s.stale_dropped for s in steps] == [0, 0, 0] and [s.trained_sequences for s in steps] == [2, 2, 2]

                async def load():
                    beat = await bus.kv_get(SERVICE_REGISTRY, service="trainer", instance="trainer-early")
                    return beat.load if beat is not None and beat.load.get("steps") == 3.0 else None

                beat = await until(load, TIMEOUT_S, "the trainer's heartbeat after step 3")
                assert beat["early_hand_outs"] >= 2 and beat["collector_max_trained_lag"] == 2
            finally:
                reports.cancel()
                for task in (trainer, publisher):
                    task.cancel()
                await asyncio.wait([trainer, publisher], timeout=10)
