"""kill -9 of the real trainer process mid-job, on a real nats-server with a real weight publisher:
the restarted trainer (another instance name) resumes from its checkpoint with the same run id,
at the next step, without a second warm start, its versions going on where they were, and the
trajectories the dead process had collected but not trained on come back (they were not acked),
so the step after the restart trains on complete groups and nothing is counted twice.
The test plays the rollout worker (scripted episodes)."""

from __future__ import annotations

import asyncio

import pytest

from rose.contracts.registry import ROLLOUT_TASK, SERVICE_REGISTRY, TRAINING_STEP, TRAJECTORIES_STREAM, TRAJECTORY, WEIGHT_MANIFEST
from rose.contracts.rollout import RolloutTask
from rose.contracts.training import TrainingStep
from rose.services.trainer.local_rollout import Tokens, scripted_episode
from rose.services.weight_publisher.config import WeightPublisherConfig
from rose.services.weight_publisher.main import run as run_publisher
from rose.shared.agentic import agentic_envs  # noqa: F401 - registers the envs
from rose.shared.agentic.envs import ENVIRONMENTS
from rose.shared.bus import Bus, Delivery
from rose.shared.config import BusConfig, RuntimeConfig
from rose.shared.launch import ServiceProcess
from rose.shared.models import load_tokenizer
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.testing.polling import until

TIMEOUT_S = 120.0
GROUP_SIZE, GROUPS = 2, 2
FIRST, SECOND = "resume-a", "resume-b"  # instance names of the trainer before and after the kill


@pytest.mark.slow
async def test_a_killed_trainer_resumes_its_run_where_it_was(tmp_path, tiny_policy, monkeypatch):
    state = tmp_path / "state"
    monkeypatch.setenv("ROSE_STATE_DIR", str(state))  # the in-process publisher's signing key
    server = NatsServer(tmp_path / "nats").start()
    bus_config = BusConfig(url=server.url, initial_connect_deadline_s=10.0, drain_timeout_s=2.0)
    env = {
        "NATS_URL": server.url,
        "ROSE_STATE_DIR": str(state),
        "ROSE_MODELS__POLICY_DIR": str(tiny_policy),
        "ROSE_THREADS": "1",
        "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.3",
        "ROSE_GRPO__GROUP_SIZE": str(GROUP_SIZE),
        "ROSE_GRPO__GROUPS_PER_STEP": str(GROUPS),
        "ROSE_GRPO__PREFETCH_STEPS": "0",
        "ROSE_GRPO__MAX_STALENESS": "1000",
        "ROSE_GRPO__LR": "1e-3",
        "ROSE_SFT__STEPS": "2",
        "ROSE_SFT__TRACES_PER_ENV": "8",
        "ROSE_SFT__BATCH_SIZE": "4",
        "ROSE_TASKS__MAX_OPERAND": "9",
        "ROSE_CHECKPOINT__ACK_WAIT_S": "2",  # the dead process's unacked trajectories come back after this
    }
    first = ServiceProcess("trainer", FIRST, dict(env), tmp_path / "trainer-a.log")
    second = ServiceProcess("trainer", SECOND, dict(env), tmp_path / "trainer-b.log")
    publisher = asyncio.create_task(run_publisher(WeightPublisherConfig(bus=bus_config, runtime=RuntimeConfig(instance="wp-resume"))))
    env_ = ENVIRONMENTS["arithmetic"]
    tokens = Tokens(load_tokenizer(tiny_policy))
    seen: set[str] = set()
    held: list = []  # trajectories the test holds back (the second member of each group of the step-2 tasks)
    steps: list[TrainingStep] = []
    versions: list[int] = []

    async def work(task: RolloutTask, _d: Delivery) -> None:  # the rollout worker: one scripted episode per task id
        if task.task_id in seen or int(task.group_id.rsplit("-s", 1)[1].split("-")[0]) > 2:
            return  # the test's job has three steps of tasks (s0..s2): the trainer then waits after step 3
        seen.add(task.task_id)
        problem = env_.problem_of(task)
        j = int(task.task_id.rsplit("-", 1)[1])
        completions = env_.expert(problem) if j % 2 == 0 else [env_.expert(problem)[0], "<answer>-1</answer>"]  # a reward spread
        traj = scripted_episode(None, tokens, env_, task, completions, version=1)
        if "-s2-" in task.group_id and j == 1:
            held.append(traj)
        else:
            await bus.publish(TRAJECTORY, traj, msg_id=traj.trajectory_id, status=traj.status)

    async def load_of(instance: str) -> dict[str, float]:
        beat = await bus.kv_get(SERVICE_REGISTRY, service="trainer", instance=instance)
        return beat.load if beat is not None and beat.state == "ready" else {}

    try:
        async with Bus(bus_config, service="tests", instance="resume-worker") as bus:
            await provision(bus.js)
            await bus.consume(ROLLOUT_TASK, work, durable="resume_worker")
            await bus.consume(TRAINING_STEP, lambda s, _d: asyncio.sleep(0, steps.append(s)), durable="resume_steps")
            await bus.subscribe(WEIGHT_MANIFEST, lambda m, _d: asyncio.sleep(0, versions.append(m.version)))
            first.start()
            await until(lambda: len(steps) >= 2, TIMEOUT_S, f"two GRPO steps of the first trainer:\n{first.log_tail()}")
            # It trained on the groups of steps 0 and 1, checkpointed, and handed out step 2's tasks; it now
            # holds the first member of each step-2 group (the test holds the second back): collected, not trained on.
            load = await until(
                lambda: _when(load_of(FIRST), lambda beat: beat.get("held_trajectories", 0) >= GROUPS and beat.get("checkpoint_step") == 2.0),
                TIMEOUT_S,
                "the first trainer holding the step-2 trajectories",
            )
            assert load["steps"] == 2.0 and load["warm_started"] == 1.0 and load["resumed_from_step"] == -1.0

            async def unacked() -> bool:
                info = await bus.js.consumer_info(TRAJECTORIES_STREAM.name, "trainer")
                return info.num_ack_pending == GROUPS

            await until(unacked, TIMEOUT_S, "the collected step-2 trajectories unacked")
            await asyncio.to_thread(first.kill)  # kill -9 between collection and the step that would use them
            run_id, published_before = steps[-1].run_id, max(versions)
            assert run_id == FIRST and [s.step for s in steps] == [1, 2] and published_before == 3  # warm start v1, steps v2, v3

            second.start()
            await second.wait_ready(bus, TIMEOUT_S)
            for traj in held:  # the rest of the step-2 groups arrives only now
                await bus.publish(TRAJECTORY, traj, msg_id=traj.trajectory_id, status=traj.status)
            await until(lambda: len(steps) >= 3, TIMEOUT_S, f"the resumed trainer's step:\n{second.log_tail()}")
            step = steps[2]
            assert (step.run_id, step.step, step.version, step.resumed_from_step) == (run_id, 3, published_before + 1, 2)
            assert step.groups == GROUPS and step.trajectories == GROUPS * GROUP_SIZE  # complete groups: nothing the dead process held was lost
            assert sorted(set(versions))[:4] == [1, 2, 3, 4]  # no second warm start, no version skipped or reused
            load = await until(lambda: _when(load_of(SECOND), lambda beat: beat.get("steps") == 3.0), TIMEOUT_S, "the resumed trainer's heartbeat")
            assert load["warm_started"] == 0.0 and load["resumed_from_step"] == 2.0 and "sft_steps" in load  # from the checkpoint, not rerun
            assert load["collector_received"] == 3 * GROUPS * GROUP_SIZE and load["collector_already_used"] == 0  # each trajectory counted once
            assert load["collector_unknown_group"] == 0
            log = second.log_tail(20_000)
            assert "resumed run resume-a from checkpoint" in log and "warm start:" not in log
    finally:
        for p in (first, second):
            await asyncio.to_thread(p.stop)
        publisher.cancel()
        await asyncio.wait([publisher], timeout=10)
        server.stop()


async def _when(value, check):
    v = await value
    return v if check(v) else None
