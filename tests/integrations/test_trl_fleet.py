"""Hugging Face TRL trains through ROSE, both seams and both kinds of policy, on real fleets: the examples themselves run.

`examples/trl/grpo_rollout_func.py` (GRPOTrainer + `rollout_func`) takes 3 optimizer steps of a full-weight policy on
groups ROSE's fleet rolls out, while the rollout worker is killed (SIGKILL) in the middle of an episode of the second
step and started again, and reports each step on the bus. `examples/trl/async_grpo.py --lora` (AsyncGRPOTrainer +
ROSE's rollout worker and weight transfer) takes 3 steps of a LoRA policy, an adapter of the serving model, on
executors in the co-batched mode while serving traffic runs: its rollout rows ride in serving's own batches. Checked
from the public events, as any user could: every version TRL published was applied by every executor (the LoRA run:
the last one bit-exact, by the executors' digests), every task handed out came back as a trajectory (none lost), the
rewards TRL trained on are the ones ROSE's environment gave, turns ran on both the leased serving executor and the
dedicated one, and (LoRA) the serving executor's heartbeats count forwards that carried both kinds of rows.

The other two combinations run on the same two fleets, for a few seconds more each: the async seam on full weights
(3 steps; the full-weight fleet is up for the first test) and the GRPOTrainer seam on a LoRA policy (2 steps, its
last version bit-exact everywhere). test_trl_pieces.py checks what a LoRA policy publishes.

Each fleet (one per policy kind, real processes on a nats-server of its own): a serving executor whose spare capacity
the scheduler lends, a dedicated executor, the SLO monitor, the scheduler, a rollout worker and the weight publisher,
on the demo's models (`init_models(..., preset="demo")`, with `lora=` for the LoRA fleet). This process is TRL's
trainer. ~40 s for the module on a quiet 2-core box: each fleet ~9 s to start, the full-weight runs ~8 s each, the
LoRA runs 1-2 s (the warm-started base's episodes are short).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import aiohttp
import pytest
import torch

from rose.contracts.registry import HEARTBEAT, ROLLOUT_TASK, TRAINING_STEP, TRAJECTORY, TURN_CHECKPOINT, WEIGHT_APPLIED
from rose.contracts.rollout import RolloutTask, Trajectory, TurnCheckpoint
from rose.contracts.service import Heartbeat
from rose.contracts.training import TrainingStep
from rose.contracts.weights import WeightApplied
from rose.services.trainer.local_rollout import Tokens
from rose.services.trainer.sft import expert_sequences, warm_start
from rose.shared.agentic.env_arithmetic import ArithmeticEnv
from rose.shared.bus import Bus
from rose.shared.config import BusConfig
from rose.shared.launch import ServiceProcess, start_all, stop_all
from rose.shared.lora import LoraShape
from rose.shared.models import DEMO_POLICY_SHAPE, init_adapter, init_models, load_model, load_tokenizer
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.shared.task_queue import still_queued
from rose.testing.polling import until, within

START_TIMEOUT_S = 120.0
MAX_OPERAND = 4  # the demo's job (shared/workload.py TRAINER): single-digit arithmetic a tiny policy can learn
# 40 AdamW steps at 5e-3 on 300 expert traces (~5 s on one core): NLL/token 8.2 -> 0.4, the tool format learnt (short,
# two-turn episodes) and ~5 % of episodes right. A step whose groups all have equal rewards changes no weight (a version
# the executors relabel); learning is the demo's and the bench's business, not this test's
WARM_START = {"steps": 40, "lr": 5e-3, "batch_size": 16, "traces": 300}
# The LoRA fleet's adapter: `rose models init --lora`'s default shape (shared/lora.py DEFAULT_LORA) but rank 2, so that a
# wrong rank anywhere on the way (TRL's config, the executors' bank) shows as a refused version
LORA = LoraShape(rank=2, alpha=4.0)
LORA_LR = "1e-2"  # a LoRA job's lr, ~10x full fine-tuning's ("LoRA Without Regret", docs/lora.md)
EXECUTORS = ("trl-serving", "trl-dedicated")
COMMON = {"ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5"}
EXECUTOR = {
    "ROSE_METRICS_INTERVAL_S": "0.2",
    "ROSE_ENGINE__DEVICE": "cpu",
    "ROSE_ENGINE__SERVING_KV_MIB": "16",
    "ROSE_ENGINE__ROLLOUT_KV_MIB": "32",
}
# the dedicated executor's slots fewer than a batch's episodes (8): else the scheduler's tail rule may keep a whole batch
# home, and the leased serving executor's part, which the tests check, would be left to chance
DEDICATED = {"ROSE_ENGINE__ROLLOUT_MAX_BATCH": "4"}
# the LoRA fleet's executors: rollout rows in serving's own batches, and a digest of the live adapter in each WeightApplied
CO_BATCHED = {"ROSE_ENGINE__ROLLOUT_MODE": "co_batched", "ROSE_WEIGHTS__REPORT_DIGEST": "true"}
SCHEDULER = {"ROSE_TICK_S": "0.2", "ROSE_LEASES__TTL_S": "4", "ROSE_LEASES__RENEW_BEFORE_S": "2", "ROSE_LEASES__COOLDOWN_S": "1"}
# ack_wait 4 s: a killed worker's episodes go back to the work queue 4 s after it stopped renewing them
WORKER = {"ROSE_CONCURRENCY": "16", "ROSE_ACK_WAIT_S": "4", "ROSE_TURNS__MAX_TOKENS": "16", "ROSE_TURNS__GENERATE_TIMEOUT_S": "15"}
SERVING_CLIENTS = 2  # serving requests kept in flight on the LoRA fleet's serving executor while TRL trains
SERVING_TOKENS = 16


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
    applied: dict[str, dict[int, WeightApplied]] = field(default_factory=dict)  # executor -> version -> its WeightApplied
    steps: dict[str, list[TrainingStep]] = field(default_factory=dict)  # run id -> its TrainingStep events
    checkpointed: set[str] = field(default_factory=set)  # task ids with a finished turn (the worker's turn checkpoints)
    beats: dict[str, Heartbeat] = field(default_factory=dict)  # instance -> its latest heartbeat


@dataclass
class TrlFleet:
    server: NatsServer
    bus: Bus
    procs: dict[str, ServiceProcess]
    policy: Path  # what TRL loads: a warm-started copy of the policy model, or the LoRA fleet's adapter directory
    observed: Observed
    serving_url: str


def warm_started(model_dir: Path, out: Path) -> Path:
    """The model at `model_dir` warm-started on the job's expert traces, saved at `out` (its tokenizer too)."""
    tokens = Tokens(load_tokenizer(model_dir))
    model = load_model(model_dir)
    traces = expert_sequences([ArithmeticEnv(MAX_OPERAND)], tokens, range(WARM_START["traces"]))
    with torch_threads(1):
        torch.manual_seed(0)
        warm_start(model, traces, tokens.pad_id, steps=WARM_START["steps"], lr=WARM_START["lr"], batch_size=WARM_START["batch_size"])
    model.save_pretrained(out, safe_serialization=True)
    tokens.tokenizer.save_pretrained(out)
    return out


def warm_lora_models(models: Path) -> None:
    """The LoRA fleet's models before its executors load them: the serving model warm-started in place (a production
    serving model is a trained one), then version 0 of the adapter rebuilt over it (its fingerprint is the warm base's)."""
    warm_started(models / "serving", models / "serving")
    init_adapter(models / "serving", models / "policy", LORA)


async def observe(bus: Bus, seen: Observed) -> None:
    async def on_task(task: RolloutTask, _d) -> None:
        seen.tasks[task.task_id] = task

    async def on_trajectory(t: Trajectory, _d) -> None:
        seen.trajectories.setdefault(t.task_id, t)

    async def on_applied(a: WeightApplied, _d) -> None:
        seen.applied.setdefault(a.executor_id, {})[a.version] = a

    async def on_step(step: TrainingStep, _d) -> None:
        seen.steps.setdefault(step.run_id, []).append(step)

    async def on_beat(beat: Heartbeat, _d) -> None:
        seen.beats[beat.instance] = beat

    await bus.subscribe(ROLLOUT_TASK, on_task)  # a core subscription beside the workers' work queue
    await bus.subscribe(HEARTBEAT, on_beat, service="executor")
    await bus.consume(TRAJECTORY, on_trajectory, durable="tests_trl_trajectories")
    await bus.consume(WEIGHT_APPLIED, on_applied, durable="tests_trl_applied")
    await bus.consume(TRAINING_STEP, on_step, durable="tests_trl_steps")

    async def on_turn(_key: str, checkpoint: TurnCheckpoint | None) -> None:
        if checkpoint is not None:
            seen.checkpointed.add(checkpoint.task_id)

    await bus.kv_watch(TURN_CHECKPOINT, on_turn)


@asynccontextmanager
async def running_fleet(root: Path, executor_env: dict[str, str], models_ready: Awaitable[object] | None = None) -> AsyncIterator[TrlFleet]:
    """The fleet on `root / "models"`, on a nats-server of its own; the executors start once `models_ready` (what
    prepares the models they load) is done, the other services meanwhile. `policy` is left for the caller to set."""
    server = NatsServer(root / "nats").start()
    env = {"NATS_URL": server.url, "ROSE_MODELS__DIR": str(root / "models"), "ROSE_STATE_DIR": str(root / "state"), **COMMON}
    serving, dedicated = EXECUTORS
    executor = {**env, **EXECUTOR, **executor_env}
    procs = {
        "serving": ServiceProcess("executor", serving, {**executor, "ROSE_ROLE": "serving"}, root / "serving.log"),
        "dedicated": ServiceProcess("executor", dedicated, {**executor, **DEDICATED, "ROSE_ROLE": "dedicated"}, root / "dedicated.log"),
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
        executors = [procs["serving"], procs["dedicated"]]
        others = asyncio.ensure_future(start_all(bus, [p for p in procs.values() if p not in executors], START_TIMEOUT_S))
        if models_ready is not None:
            await models_ready
        await start_all(bus, executors, START_TIMEOUT_S)
        await others
        url = (await procs["serving"].wait_ready(bus, START_TIMEOUT_S))["http"]
        yield TrlFleet(server, bus, procs, root / "models" / "policy", seen, url)
    finally:
        stop_all(list(procs.values()))
        await bus.close()
        server.stop()


@pytest.fixture(scope="module")
async def trl_fleet(tmp_path_factory) -> AsyncIterator[TrlFleet]:
    """Full weights, the executors in the two-model mode. The fleet starts on the demo's untrained policy while this
    process warm-starts TRL's copy of it (seconds of the start-up either way); TRL's first publish, before any task
    goes out, puts the warm policy on every executor."""
    root = tmp_path_factory.mktemp("trl")
    init_models(root / "models", 0, DEMO_POLICY_SHAPE, preset="demo")
    warm = asyncio.ensure_future(asyncio.to_thread(warm_started, root / "models" / "policy", root / "trl-policy"))
    async with running_fleet(root, {}) as fleet:
        fleet.policy = await warm
        yield fleet


@pytest.fixture(scope="module")
async def lora_fleet(tmp_path_factory) -> AsyncIterator[TrlFleet]:
    """A LoRA policy of the serving model (`rose models init --lora`'s layout), the executors co-batched: TRL trains
    the adapter in policy/ over the warm-started serving model the executors serve."""
    root = tmp_path_factory.mktemp("trl-lora")
    init_models(root / "models", 0, DEMO_POLICY_SHAPE, preset="demo", lora=LORA)
    async with running_fleet(root, CO_BATCHED, asyncio.to_thread(warm_lora_models, root / "models")) as fleet:
        yield fleet


async def serving_traffic(url: str, stop: asyncio.Event) -> int:
    """Serving requests on the executor's OpenAI API, `SERVING_CLIENTS` in flight, until `stop`; how many finished."""
    done = 0

    async def client(session: aiohttp.ClientSession, k: int) -> None:
        nonlocal done
        while not stop.is_set():
            body = {"model": "rose-serving", "messages": [{"role": "user", "content": f"What is {k}+{done % 5}?"}], "max_tokens": SERVING_TOKENS}
            async with session.post(f"{url}/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                done += 1

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session, k) for k in range(SERVING_CLIENTS)))
    return done


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
    return {ex: [v for v in versions if v not in fleet.observed.applied.get(ex, {})] for ex in EXECUTORS}


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


async def run_async(fleet: TrlFleet, tmp_path: Path, *extra: str) -> dict:
    """The async example's run of STEPS steps (its own args: `extra`), checked as every run of it is: each of TRL's syncs
    (the cold one on train begin, then one per step) applied by every executor, TRL's staleness bound held, none lost."""
    samples = GROUP_SIZE * GROUPS
    argv = [*JOB, "--policy", str(fleet.policy), "--nats-url", fleet.server.url, "--samples", str(samples), "--in-flight", str(2 * samples)]
    summary = await run_example(
        "async_grpo", [*argv, *extra, "--out", str(tmp_path / "out"), "--max-staleness", "2", "--json", str(tmp_path / "a.json")]
    )
    assert summary["steps"] == STEPS and len(summary["versions"]) == STEPS + 1
    everywhere = {ex: [] for ex in EXECUTORS}
    await within(lambda: applied_everywhere(fleet, summary["versions"]) == everywhere, DRAIN_TIMEOUT_S, step=0.2)
    assert applied_everywhere(fleet, summary["versions"]) == everywhere
    assert max(summary["staleness_max"]) <= 2 and len(summary["rewards"]) == STEPS
    assert await nothing_lost(fleet, summary["run_id"]) == set()
    assert summary["stats"].get("rerolled_lost", 0) == 0
    return summary


@pytest.mark.slow
async def test_async_grpo_trainer_trains_full_weights_through_rose(trl_fleet, tmp_path):
    await run_async(trl_fleet, tmp_path)


@pytest.mark.slow
async def test_async_grpo_trainer_trains_a_lora_policy_on_co_batched_executors(lora_fleet, tmp_path):
    fleet = lora_fleet
    stop = asyncio.Event()
    serving = asyncio.ensure_future(serving_traffic(fleet.serving_url, stop))  # serving's own batches, for rollout rows to ride in
    try:
        summary = await run_async(fleet, tmp_path, "--lora", "--lr", LORA_LR)
    finally:
        stop.set()
    assert await serving > 0
    # every executor runs the adapter TRL trained, bit-exact: the digest of its live adapter after the last version
    last = summary["versions"][-1]
    assert {ex: fleet.observed.applied[ex][last].params_sha256 for ex in EXECUTORS} == dict.fromkeys(EXECUTORS, summary["policy_sha256"])
    # the adapter's rows rode in serving's own batches (the serving executor's heartbeats count such forwards)
    await until(lambda: all(ex in fleet.observed.beats for ex in EXECUTORS), 10, "both executors' heartbeats")
    beats = {ex: fleet.observed.beats[ex] for ex in EXECUTORS}
    assert {b.labels["mode"] for b in beats.values()} == {"co_batched"}
    assert beats["trl-serving"].load["co_batched_iterations"] > 0
    mine = [t for task_id, t in fleet.observed.trajectories.items() if task_id.startswith(summary["run_id"])]
    assert {turn.executor_id for t in mine for turn in t.turns} == set(EXECUTORS)  # leased serving capacity and the dedicated executor


@pytest.mark.slow
async def test_grpo_trainer_trains_a_lora_policy(lora_fleet, tmp_path):
    """The GRPOTrainer seam's peft path: shorter, the publishing is the one the async seam's run checks above."""
    fleet, steps = lora_fleet, 2
    argv = [*JOB, "--steps", str(steps), "--policy", str(fleet.policy), "--nats-url", fleet.server.url, "--groups", str(GROUPS), "--lora"]
    summary = await run_example("grpo_rollout_func", [*argv, "--lr", LORA_LR, "--out", str(tmp_path / "out"), "--json", str(tmp_path / "g.json")])
    assert summary["steps"] == steps and len(summary["versions"]) == steps + 1
    everywhere = {ex: [] for ex in EXECUTORS}
    await within(lambda: applied_everywhere(fleet, summary["versions"]) == everywhere, DRAIN_TIMEOUT_S, step=0.2)
    last = summary["versions"][-1]
    assert {ex: fleet.observed.applied[ex][last].params_sha256 for ex in EXECUTORS} == dict.fromkeys(EXECUTORS, summary["policy_sha256"])
    assert all(turn.policy_version >= r["min_version"] for r in summary["rounds"] for t in r["trajectories"] for turn in fleet_turns(fleet, t))
    assert await nothing_lost(fleet, summary["run_id"]) == set()


def fleet_turns(fleet: TrlFleet, trajectory_id: str) -> list:
    return next(t.turns for t in fleet.observed.trajectories.values() if t.trajectory_id == trajectory_id)
