"""A LoRA policy in the reference trainer (services/trainer/lora.py), with real peft over a real tiny Qwen2 base:
version 0 is the base, a GRPO step moves only the adapter, what is published is the adapter under peft's names (and
loads in peft unchanged), a checkpoint holds the adapter and its optimizer and resumes bit-exact, an adapter over
another base is refused; and the trainer process itself trains, publishes and resumes a LoRA job after kill -9."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import shutil

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from rose.contracts.registry import ROLLOUT_TASK, SERVICE_REGISTRY, TRAINING_STEP, TRAJECTORY, WEIGHT_MANIFEST
from rose.contracts.rollout import RolloutTask
from rose.contracts.training import TrainingStep
from rose.contracts.weights import WeightManifest
from rose.services.trainer.batch import pad
from rose.services.trainer.checkpoint import POLICY, CheckpointStore, TrainerState
from rose.services.trainer.groups import GroupCollector
from rose.services.trainer.grpo import grpo_step
from rose.services.trainer.local_rollout import Tokens, scripted_episode
from rose.services.trainer.lora import load_policy, trainable_parameters, trained_state
from rose.services.weight_publisher.config import WeightPublisherConfig
from rose.services.weight_publisher.main import run as run_publisher
from rose.shared.agentic import agentic_envs  # noqa: F401 - registers the envs
from rose.shared.agentic.envs import ENVIRONMENTS
from rose.shared.bus import Bus, Delivery
from rose.shared.config import BusConfig, RuntimeConfig
from rose.shared.launch import ServiceProcess
from rose.shared.lora import ROSE_ADAPTER_FILE, AdapterError, LoraShape, adapter_targets, read_adapter, write_adapter
from rose.shared.models import init_models, load_model, load_tokenizer
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.testing.polling import until

LORA = LoraShape(rank=4, alpha=8.0)
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    """The demo preset's LoRA layout: serving/ (the base) and policy/ (version 0 of its adapter)."""
    return init_models(tmp_path_factory.mktemp("lora"), seed=0, preset="demo", lora=LORA)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic and light on a shared 2-core machine
    yield
    torch.set_num_threads(threads)


def groups_of(model, tokens: Tokens, seed: int = 0, groups: int = 2, size: int = 4) -> list:
    """Training sequences of real arithmetic groups with a reward spread (expert answers and wrong ones)."""
    env = ENVIRONMENTS["arithmetic"]
    collector = GroupCollector(max_staleness=10)
    for g in range(groups):
        gid = f"lora-s0-g{g}"
        collector.expect(gid, size)
        for j in range(size):
            task = env.task(seed * 100 + g, task_id=f"{gid}-{j}", group_id=gid, group_size=size, max_turns=3)
            expert = env.expert(env.problem_of(task))
            collector.add(scripted_episode(model, tokens, env, task, expert if j % 2 == 0 else [expert[0], "<answer>-1</answer>"]))
    return [pad(collector.sequences(collector.ready(), 0), tokens.pad_id)]


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_grpo_step_moves_only_the_adapter_and_publishes_its_tensors(lora_models, tmp_path):
    base = load_model(lora_models.serving)
    policy = load_policy(lora_models.policy)
    ids = torch.randint(0, base.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(policy, ids), logits(base, ids))  # version 0 is the base exactly

    adapter = read_adapter(lora_models.policy)
    published = trained_state(policy)
    assert {n: tuple(t.shape) for n, t in published.items()} == {n: tuple(t.shape) for n, t in adapter.tensors.items()}  # peft's names
    trainable = trainable_parameters(policy)
    assert sum(p.numel() for p in trainable) == sum(t.numel() for t in adapter.tensors.values())  # the optimizer steps the adapter only

    frozen = {n: t.clone() for n, t in base.state_dict().items()}
    optimizer = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.0)
    stats = grpo_step(policy, optimizer, groups_of(policy, Tokens(load_tokenizer(lora_models.policy))), clip_eps=0.2, max_grad_norm=1.0)
    assert stats.tokens > 0
    after = {n.replace(".base_layer", ""): t for n, t in policy.get_base_model().state_dict().items() if ".lora_" not in n}
    assert after.keys() == frozen.keys() and all(torch.equal(after[n], frozen[n]) for n in frozen)  # the base did not move
    moved = trained_state(policy)
    assert all(not torch.equal(moved[n], adapter.tensors[n]) for n in moved if ".lora_B." in n)  # every B left zero
    assert not torch.equal(logits(policy, ids), logits(base, ids))

    # a version as published (the adapter's tensors) is an adapter peft loads unchanged, with the trained policy's logits
    write_adapter(tmp_path / "v1", dataclasses.replace(adapter, tensors=moved))
    reloaded = PeftModel.from_pretrained(load_model(lora_models.serving), str(tmp_path / "v1"))
    assert torch.equal(logits(reloaded, ids), logits(policy, ids))


def test_a_lora_checkpoint_holds_the_adapter_and_resumes_bit_exact(lora_models, tmp_path):
    tokens = Tokens(load_tokenizer(lora_models.policy))
    policy = load_policy(lora_models.policy)
    optimizer = torch.optim.AdamW(trainable_parameters(policy), lr=1e-2, weight_decay=0.0)
    batches = groups_of(policy, tokens)
    grpo_step(policy, optimizer, batches, clip_eps=0.2, max_grad_norm=1.0)
    store = CheckpointStore(tmp_path, {"job": "lora"}, keep=2)
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    path = store.save(policy, optimizer, TrainerState(run_id="lora", step=1, version=2, emitted_steps=2, emit_from=1))
    assert set(load_file(str(path / POLICY))) == set(read_adapter(lora_models.policy).tensors)  # the adapter, not the base
    later = groups_of(policy, tokens, seed=1)
    grpo_step(policy, optimizer, later, clip_eps=0.2, max_grad_norm=1.0)

    fresh = load_policy(lora_models.policy)  # version 0 again: everything must come from the checkpoint
    fresh_optimizer = torch.optim.AdamW(trainable_parameters(fresh), lr=1e-2, weight_decay=0.0)
    loaded = store.load(fresh, fresh_optimizer)
    assert loaded is not None and loaded.state.step == 1
    assert fresh_optimizer.param_groups[0]["params"][0] is trainable_parameters(fresh)[0]  # loaded in place: the optimizer still steps them
    grpo_step(fresh, fresh_optimizer, later, clip_eps=0.2, max_grad_norm=1.0)  # the same next step as the original took
    expected, found = trained_state(policy), trained_state(fresh)
    assert all(torch.equal(expected[n], found[n]) for n in expected)
    for a, b in zip(optimizer.state_dict()["state"].values(), fresh_optimizer.state_dict()["state"].values(), strict=True):
        assert all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def test_an_adapter_over_another_base_is_refused_before_training(lora_models, tmp_path):
    moved = tmp_path / "job" / "policy"
    shutil.copytree(lora_models.policy, moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    with pytest.raises(AdapterError, match="no base model found"):  # no base named, none beside it
        load_policy(moved)
    shutil.copytree(lora_models.serving, tmp_path / "job" / "serving")
    load_policy(moved)  # its base beside it: found and checked
    (moved / ROSE_ADAPTER_FILE).write_text(json.dumps({"format": 1, "base_fingerprint": "sha256:another"}))
    with pytest.raises(AdapterError, match="not the base this adapter was built on"):
        load_policy(moved)


@pytest.mark.slow
async def test_the_trainer_trains_publishes_and_resumes_a_lora_job(tmp_path, lora_models, monkeypatch):
    """The trainer process on a LoRA policy, a real publisher and nats-server: the warm start and GRPO steps publish
    the adapter's tensors (peft names, nothing of the base), checkpoint them, and after kill -9 a new process resumes
    at the next step and version (the test plays the rollout worker: scripted episodes with a reward spread)."""
    state = tmp_path / "state"
    monkeypatch.setenv("ROSE_STATE_DIR", str(state))  # the in-process publisher's signing key
    server = NatsServer(tmp_path / "nats").start()
    bus_config = BusConfig(url=server.url, initial_connect_deadline_s=10.0, drain_timeout_s=2.0)
    env = {
        "NATS_URL": server.url,
        "ROSE_STATE_DIR": str(state),
        "ROSE_MODELS__POLICY_DIR": str(lora_models.policy),
        "ROSE_THREADS": "1",
        "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.3",
        "ROSE_GRPO__GROUP_SIZE": "2",
        "ROSE_GRPO__GROUPS_PER_STEP": "2",
        "ROSE_GRPO__PREFETCH_STEPS": "0",
        "ROSE_GRPO__MAX_STALENESS": "1000",
        "ROSE_GRPO__LR": "1e-2",
        "ROSE_SFT__STEPS": "2",
        "ROSE_SFT__TRACES_PER_ENV": "8",
        "ROSE_SFT__BATCH_SIZE": "4",
        "ROSE_TASKS__MAX_OPERAND": "9",
        "ROSE_CHECKPOINT__ACK_WAIT_S": "2",
    }
    first = ServiceProcess("trainer", "lora-a", dict(env), tmp_path / "trainer-a.log")
    second = ServiceProcess("trainer", "lora-b", dict(env), tmp_path / "trainer-b.log")
    publisher = asyncio.create_task(run_publisher(WeightPublisherConfig(bus=bus_config, runtime=RuntimeConfig(instance="wp-lora"))))
    arithmetic = ENVIRONMENTS["arithmetic"]
    tokens = Tokens(load_tokenizer(lora_models.policy))
    answer_from_step = [2]  # tasks of later steps wait until the test lets them through
    waiting: list[RolloutTask] = []
    seen: set[str] = set()
    steps: list[TrainingStep] = []
    manifests: list[WeightManifest] = []

    async def answer(task: RolloutTask) -> None:
        expert = arithmetic.expert(arithmetic.problem_of(task))
        completions = expert if int(task.task_id.rsplit("-", 1)[1]) % 2 == 0 else [expert[0], "<answer>-1</answer>"]
        traj = scripted_episode(None, tokens, arithmetic, task, completions, version=1)
        await bus.publish(TRAJECTORY, traj, msg_id=traj.trajectory_id, status=traj.status)

    async def work(task: RolloutTask, _d: Delivery) -> None:
        if task.task_id in seen:
            return
        seen.add(task.task_id)
        if int(task.group_id.rsplit("-s", 1)[1].split("-")[0]) < answer_from_step[0]:
            await answer(task)
        else:
            waiting.append(task)

    async def heartbeat(instance: str) -> dict[str, float]:
        beat = await bus.kv_get(SERVICE_REGISTRY, service="trainer", instance=instance)
        return beat.load if beat is not None and beat.state == "ready" else {}

    try:
        async with Bus(bus_config, service="tests", instance="lora-worker") as bus:
            await provision(bus.js)
            await bus.consume(ROLLOUT_TASK, work, durable="lora_worker")
            await bus.consume(TRAINING_STEP, lambda s, _d: asyncio.sleep(0, steps.append(s)), durable="lora_steps")
            await bus.subscribe(WEIGHT_MANIFEST, lambda m, _d: asyncio.sleep(0, manifests.append(m)))
            first.start()
            await until(lambda: len(steps) >= 2, TIMEOUT_S, f"two GRPO steps of the LoRA trainer:\n{first.log_tail()}")
            await until(lambda: _at(heartbeat("lora-a"), "checkpoint_step", 2.0), TIMEOUT_S, "the checkpoint of step 2")
            await asyncio.to_thread(first.kill)
            adapter_names = set(read_adapter(lora_models.policy).tensors)
            assert [m.version for m in manifests] == [1, 2, 3]  # the warm start (on the adapter), then two GRPO steps
            assert all({t.name for t in m.tensors} == adapter_names for m in manifests)  # the adapter only, under peft's names
            assert len(adapter_targets({t.name: torch.empty(t.shape) for t in manifests[-1].tensors})) == 2 * 7
            assert "a LoRA adapter (rank 4, alpha 8," in first.log_tail(20_000)

            second.start()
            await second.wait_ready(bus, TIMEOUT_S)
            answer_from_step[0] = 10**6
            for task in waiting:
                await answer(task)
            await until(lambda: len(steps) >= 3, TIMEOUT_S, f"the resumed trainer's step:\n{second.log_tail()}")
            assert (steps[2].run_id, steps[2].step, steps[2].version, steps[2].resumed_from_step) == ("lora-a", 3, 4, 2)
            assert manifests[-1].version == 4 and {t.name for t in manifests[-1].tensors} == adapter_names
            assert "resumed run lora-a from checkpoint" in second.log_tail(20_000) and "warm start:" not in second.log_tail(20_000)
    finally:
        for p in (first, second):
            await asyncio.to_thread(p.stop)
        publisher.cancel()
        await asyncio.wait([publisher], timeout=10)
        server.stop()


async def _at(beat, key: str, value: float):
    load = await beat
    return load if load.get(key) == value else None
