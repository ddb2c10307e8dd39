"""Hugging Face TRL trains through ROSE, both seams, on a real fleet: the examples themselves run.

`examples/trl/grpo_rollout_func.py` (GRPOTrainer + `rollout_func`) takes 3 optimizer steps on
groups ROSE's fleet rolls out, while the rollout worker is killed (SIGKILL) in the middle of an
episode of the second step and started again, and reports each step on the bus;
`examples/trl/async_grpo.py` (AsyncGRPOTrainer + ROSE's rollout worker and weight transfer) takes
3 steps on ROSE's samples. Checked from the public events, as any user could:
every version TRL published was applied by every executor, every task handed out came back as a
trajectory (none lost), the rewards TRL trained on are the ones ROSE's environment gave, and turns
ran on both the leased serving executor and the dedicated one.

The fleet (one per module, real processes on a nats-server of its own): a serving executor whose
spare capacity the scheduler lends, a dedicated executor, the SLO monitor, the scheduler, a rollout
worker and the weight publisher, on the demo's models (`init_models(..., preset="demo")`).
This process is TRL's trainer; ~60 s for both tests on a quiet 2-core box.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest
import torch

from rose.contracts.registry import ROLLOUT_TASK, TRAINING_STEP, TRAJECTORY, TURN_CHECKPOINT, WEIGHT_APPLIED
from rose.contracts.rollout import RolloutTask, Trajectory, TurnCheckpoint
from rose.contracts.training import TrainingStep
from rose.services.trainer.local_rollout import Tokens
from rose.services.trainer.sft import expert_sequences, warm_start
from rose.shared.agentic.env_arithmetic import ArithmeticEnv
from rose.shared.bus import Bus
from rose.shared.config import BusConfig
from rose.shared.launch import ServiceProcess, start_all, stop_all
from rose.shared.models import DEMO_POLICY_SHAPE, init_models, load_model, load_tokenizer
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.shared.task_queue import still_queued
from rose.testing.polling import until, within

START_TIMEOUT_S = 120.0
MAX_OPERAND = 4  # the demo's job (shared/workload.py TRAINER): single-digit arithmetic a tiny policy can learn
# 40 AdamW steps at 5e-3 on 300 expert traces (~5 s on one core): NLL/token 8.2 -> 0.4, the tool format learnt (short,
# two-turn episodes) and ~5 % of episodes right. A step whose groups all have equal rewards changes no weight (the bridge's
# unchanged-version path); learning is the demo's and the bench's business, not this test's
WARM_START = {"steps": 40, "lr": 5e-3, "batch_size": 16, "traces": 300}
EXECUTORS = ("trl-serving", "trl-dedicated")
COMMON = {"ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5"}
EXECUTOR = {
    "ROSE_METRICS_INTERVAL_S": "0.2",
    "ROSE_ENGINE__DEVICE": "cpu",
    "ROSE_ENGINE__SERVING_KV_MIB": "16",
    "ROSE_ENGINE__ROLLOUT_KV_MIB": "32",
}
SCHEDULER = {"ROSE_TICK_S": "0.2", "ROSE_LEASES__TTL_S": "4", "ROSE_LEASES__RENEW_BEFORE_S": "2", "ROSE_LEASES__COOLDOWN_S": "1"}
# ack_wait 4 s: a killed worker's episodes go back to the work queue 4 s after it stopped renewing them
WORKER = {"ROSE_CONCURRENCY": "16", "ROSE_ACK_WAIT_S": "4", "ROSE_TURNS__MAX_TOKENS": "16", "ROSE_TURNS__GENERATE_TIMEOUT_S": "15"}


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """One core for the test process's own training: two threads thrash on a box the fleet shares."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class Observed:
    tasks: dict[str, RolloutTask] = field(default_factory=dict)
    trajectories: dict[str, Trajectory] = field(default_factory=dict)  # by task id
    applied: dict[str, set[int]] = field(default_factory=dict)  # executor -> versions it applied
    steps: dict[str, list[TrainingStep]] = field(default_factory=dict)  # run id -> its TrainingStep events
    checkpointed: set[str] = field(default_factory=set)  # task ids with a finished turn (the worker's turn checkpoints)


@dataclass
class TrlFleet:
    server: NatsServer
    bus: Bus
    procs: dict[str, ServiceProcess]
    policy: Path
    observed: Observed


def warm_started_policy(models: Path, out: Path) -> Path:
    """The demo's policy warm-started, saved at `out` for TRL to load (its first publish takes it to the executors)."""
    tokens = Tokens(load_tokenizer(models / "policy"))
    model = load_model(models / "policy")
    traces = expert_sequences([ArithmeticEnv(MAX_OPERAND)], tokens, range(WARM_START["traces"]))
    with torch_threads(1):
        torch.manual_seed(0)
        warm_start(model, traces, tokens.pad_id, steps=WARM_START["steps"], lr=WARM_START["lr"], batch_size=WARM_START["batch_size"])
    model.save_pretrained(out, safe_serialization=True)
    tokens.tokenizer.save_pretrained(out)
    return out


async def observe(bus: Bus, seen: Observed) -> None:
    async def on_task(task: RolloutTask, _d) -> None:
        seen.tasks[task.task_id] = task

    async def on_trajectory(t: Trajectory, _d) -> None:
        seen.trajectories.setdefault(t.task_id, t)

    async def on_applied(a, _d) -> None:
        seen.applied.setdefault(a.executor_id, set()).add(a.version)

    async def on_step(step: TrainingStep, _d) -> None:
        seen.steps.setdefault(step.run_id, []).append(step)

    await bus.subscribe(ROLLOUT_TASK, on_task)  # a core subscription beside the workers' work queue
    await bus.consume(TRAJECTORY, on_trajectory, durable="tests_trl_trajectories")
    await bus.consume(WEIGHT_APPLIED, on_applied, durable="tests_trl_applied")
    await bus.consume(TRAINING_STEP, on_step, durable="tests_trl_steps")

    async def on_turn(_key: str, checkpoint: TurnCheckpoint | None) -> None:
        if checkpoint is not None:
            seen.checkpointed.add(checkpoint.task_id)

    await bus.kv_watch(TURN_CHECKPOINT, on_turn)


@pytest.fixture(scope="module")
async def trl_fleet(tmp_path_factory) -> TrlFleet:
    """The fleet starts on the demo's untrained policy while this process warm-starts TRL's copy of it (seconds of the
    start-up either way); TRL's first publish, before any task goes out, puts the warm policy on every executor."""
    root = tmp_path_factory.mktemp("trl")
    init_models(root / "models", 0, DEMO_POLICY_SHAPE, preset="demo")
    server = NatsServer(root / "nats").start()
    env = {"NATS_URL": server.url, "ROSE_MODELS__DIR": str(root / "models"), "ROSE_STATE_DIR": str(root / "state"), **COMMON}
    serving, dedicated = EXECUTORS
    procs = {
        "serving": ServiceProcess("executor", serving, {**env, **EXECUTOR, "ROSE_ROLE": "serving"}, root / "serving.log"),
        "dedicated": ServiceProcess("executor", dedicated, {**env, **EXECUTOR, "ROSE_ROLE": "dedicated"}, root / "dedicated.log"),
        "monitor": ServiceProcess("slo_monitor", "trl-monitor", {**env, "ROSE_HEADROOM_INTERVAL_S": "0.3"}, root / "monitor.log"),
        "scheduler": ServiceProcess("scheduler", "trl-scheduler", {**env, **SCHEDULER}, root / "scheduler.log"),
        "worker": ServiceProcess("rollout_worker", "trl-worker", {**env, **WORKER}, root / "worker.log"),
        "publisher": ServiceProcess("weight_publisher", "trl-publisher", env, root / "publisher.log"),
    }
    bus = Bus(BusConfig(url=server.url, initial_connect_deadline_s=10.0, drain_timeout_s=2.0), service="tests", instance="trl")
    await bus.connect()
    await provision(bus.js)
    seen = Observed()
    await observe(bus, seen)
    try:
        warm = asyncio.ensure_future(asyncio.to_thread(warm_started_policy, root / "models", root / "trl-policy"))
        await start_all(bus, list(procs.values()), START_TIMEOUT_S)
        yield TrlFleet(server, bus, procs, await warm, seen)
    finally:
        stop_all(list(procs.values()))
        await bus.close()
        server.stop()


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "trl"
STEPS = 3
GROUP_SIZE, GROUPS = 4, 2  # 8 episodes a step: the smallest batch with two groups
TRAIN_TIMEOUT_S = 240.0
DRAIN_TIMEOUT_S = 30.0
JOB = ["--steps", str(STEPS), "--group-size", str(GROUP_SIZE), "--max-operand", str(MAX_OPERAND), "--max-turns", "3", "--max-tokens", "16"]

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # AsyncGRPOTrainer lives in trl.experimental


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"trl_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def run_example(name: str, argv: list[str]) -> dict:
    """The example's `main` on a thread of this process (this process is TRL's trainer), its `--json` summary.

    A daemon thread, not the loop's executor: a test that fails while TRL waits on a fleet that is gone must not
    hold the event loop's shutdown until the training thread returns."""
    main, loop = example(name).main, asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()

    def settle(result: int, error: BaseException | None) -> None:
        if done.done():
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def train() -> None:
        try:
            loop.call_soon_threadsafe(settle, main(argv), None)
        except BaseException as exc:  # handed to the test, which raises it
            loop.call_soon_threadsafe(settle, 1, exc)

    with torch_threads(1):
        threading.Thread(target=train, name=f"trl-{name}", daemon=True).start()
        assert await asyncio.wait_for(done, TRAIN_TIMEOUT_S) == 0
    return json.loads(Path(argv[argv.index("--json") + 1]).read_text())


async def nothing_lost(fleet: TrlFleet, run_id: str) -> set[str]:
    """Every task this run handed out came back as a trajectory (waiting out the ones still running); those that did not."""
    mine = {t for t in fleet.observed.tasks if t.startswith(run_id)}
    await within(lambda: mine <= set(fleet.observed.trajectories), DRAIN_TIMEOUT_S, step=0.2)
    missing = mine - set(fleet.observed.trajectories)
    return missing - await still_queued(fleet.bus, missing)  # still in the work queue: late, not lost


def env_reward_of(task: RolloutTask, trajectory: Trajectory) -> float:
    """The reward ROSE's arithmetic environment gives the trajectory's turns, replayed here (it is deterministic)."""
    env, history = ArithmeticEnv(MAX_OPERAND), []
    for turn in trajectory.turns:
        step = env.step(task, turn.turn_index, turn.text, turn.finish_reason, history)
        history.append(turn.finish_reason)
        if step.done:
            return step.reward
    return 0.0


def applied_everywhere(fleet: TrlFleet, versions: list[int]) -> dict[str, list[int]]:
    """The versions each executor has not applied (empty lists: every executor applied every one)."""
    return {ex: [v for v in versions if v not in fleet.observed.applied.get(ex, set())] for ex in EXECUTORS}


@pytest.mark.slow
async def test_grpo_trainer_trains_through_rose_and_survives_a_worker_kill(trl_fleet, tmp_path):
    fleet = trl_fleet
    out = tmp_path / "grpo.json"
    argv = [*JOB, "--policy", str(fleet.policy), "--nats-url", fleet.server.url, "--groups", str(GROUPS), "--out", str(tmp_path / "out")]
    training = asyncio.ensure_future(run_example("grpo_rollout_func", [*argv, "--json", str(out)]))

    def mid_episode() -> set[str]:
        """Episodes of the second step with a turn checkpointed and no trajectory yet: in flight on the worker."""
        second = {t for t, task in fleet.observed.tasks.items() if task.batch_id.endswith("-r1")}
        return (second & fleet.observed.checkpointed) - set(fleet.observed.trajectories)

    await until(lambda: mid_episode() or training.done(), TRAIN_TIMEOUT_S, "an episode of the second step in flight", step=0.01)
    worker = fleet.procs["worker"]
    in_flight, killed_pid = mid_episode(), worker.pid
    assert in_flight, "the run ended before the second step's episodes ran"
    worker.kill()  # SIGKILL mid-episode: its episodes go back to the work queue after its ack wait, and resume from their checkpoints
    worker.start()
    summary = await training
    assert worker.pid != killed_pid and worker.alive()
    assert in_flight <= set(fleet.observed.trajectories)  # the episodes the kill cut came back, resumed by the new worker

    assert summary["steps"] == STEPS and len(summary["rounds"]) == STEPS
    assert await nothing_lost(fleet, summary["run_id"]) == set()
    assert summary["stats"].get("rerolled_lost", 0) == 0 and summary["stats"]["completed"] == STEPS * GROUP_SIZE * GROUPS
    # TRL's initial weights, then one version per step (the last by `finish`): each live on every executor before tasks went out
    assert len(summary["versions"]) == STEPS + 1
    everywhere = {ex: [] for ex in EXECUTORS}
    await within(lambda: applied_everywhere(fleet, summary["versions"]) == everywhere, DRAIN_TIMEOUT_S, step=0.2)  # our consumer's lag
    assert applied_everywhere(fleet, summary["versions"]) == everywhere
    # each step on the bus as ROSE's own trainer reports its steps: the version its weights went out as, its batch's reward
    await until(lambda: len(fleet.observed.steps.get(summary["run_id"], [])) == STEPS, 10, "the steps' events")
    steps = fleet.observed.steps[summary["run_id"]]
    assert [(s.step, s.version) for s in steps] == [(k + 1, v) for k, v in enumerate(summary["versions"][1:])]
    assert [s.reward_mean for s in steps] == pytest.approx([r["reward_mean"] for r in summary["rounds"]])
    by_id = {t.trajectory_id: t for t in fleet.observed.trajectories.values()}
    for step, r in enumerate(summary["rounds"]):
        trained = [by_id[tid] for tid in r["trajectories"]]
        assert r["step"] == step and r["version"] == summary["versions"][step] and len(trained) == GROUP_SIZE * GROUPS
        assert all(turn.policy_version >= r["min_version"] for t in trained for turn in t.turns)  # on-policy
        # the rewards TRL trained on are those ROSE's arithmetic environment gave in the worker
        assert [t.reward for t in trained] == [env_reward_of(fleet.observed.tasks[t.task_id], t) for t in trained]
        assert r["reward_mean"] == pytest.approx(sum(t.reward for t in trained) / len(trained))
    assert summary["trl_rewards"] == pytest.approx([r["reward_mean"] for r in summary["rounds"]])
    trained = [by_id[tid] for r in summary["rounds"] for tid in r["trajectories"]]
    assert {turn.executor_id for t in trained for turn in t.turns} == set(EXECUTORS)  # leased serving capacity and the dedicated executor
    assert max(len(t.turns) for t in trained) > 1  # multi-turn: a tool call, its result, then the answer


@pytest.mark.slow
async def test_async_grpo_trainer_trains_through_rose(trl_fleet, tmp_path):
    fleet = trl_fleet
    out = tmp_path / "async.json"
    samples = GROUP_SIZE * GROUPS
    argv = [*JOB, "--policy", str(fleet.policy), "--nats-url", fleet.server.url, "--samples", str(samples), "--in-flight", str(2 * samples)]
    summary = await run_example("async_grpo", [*argv, "--out", str(tmp_path / "out"), "--max-staleness", "2", "--json", str(out)])

    assert summary["steps"] == STEPS
    # TRL's syncs: the cold one on train begin, then one per step; every executor applies each (the last one after training)
    assert len(summary["versions"]) == STEPS + 1
    everywhere = {ex: [] for ex in EXECUTORS}
    await within(lambda: applied_everywhere(fleet, summary["versions"]) == everywhere, DRAIN_TIMEOUT_S, step=0.2)
    assert applied_everywhere(fleet, summary["versions"]) == everywhere
    assert max(summary["staleness_max"]) <= 2 and len(summary["rewards"]) == STEPS
    assert await nothing_lost(fleet, summary["run_id"]) == set()
    assert summary["stats"].get("rerolled_lost", 0) == 0
