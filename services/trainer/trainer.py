"""The reference GRPO trainer, and the example of what any RL framework does to drive ROSE.

The public API a user's own trainer calls (everything else is ROSE's business):

1. Hand out rollout work: publish `RolloutTask`s on the work queue. Tasks of one GRPO group
   share a `group_id` (and say `group_size`); `env` names an environment the workers know
   and `env_args` its arguments (the built-in tool envs take a `seed`):

       await bus.publish(ROLLOUT_TASK, RolloutTask(task_id=..., env="arithmetic", prompt=...,
                         group_id=..., group_size=8, max_turns=3, env_args={"seed": "17"}))

2. Receive trajectories from the durable stream, with acks (at least once; de-duplicate by
   `trajectory_id`). Each `TurnRecord` has the prompt and generated token ids, the
   executor's logprobs (the behaviour policy), the `policy_version` they were sampled with
   and where they ran; the `Trajectory` has the reward, or `status="failed"` and the reason:

       await bus.consume(TRAJECTORY, on_trajectory, durable="my-trainer")

3. Publish new weights after a step, and (optionally) wait until every executor can fetch them:

       async with WeightsClient(bus, "policy") as weights:
           await weights.publish(model.state_dict(), version=v)   # or a safetensors dir path
           await weights.published(v)

That is all: leasing serving GPUs, routing turns, shipping weight deltas and applying them
between iterations happen behind these three calls. This module does exactly that, with
GRPO (grpo.py), a staleness bound (groups.py) and an expert warm start (sft.py).

Training runs in a worker thread (`asyncio.to_thread`) so the bus keeps acking, heartbeating
and collecting the next step's trajectories meanwhile (asynchronous RL: with
`prefetch_steps` >= 1 the next step's tasks are already rolling out on the previous version,
which the staleness bound accounts for). A trajectory is acked once collected: a trainer
that dies mid-step loses the groups it held in memory (they are counted as received, not
trained on), while every trajectory stays in the durable stream for replay.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import torch

from rose.client.weights import WeightsClient
from rose.contracts.registry import ROLLOUT_TASK, TRAINING_STEP, TRAJECTORY
from rose.contracts.rollout import Trajectory
from rose.contracts.training import TrainingStep
from rose.shared.agentic.tool_env import ToolEnv
from rose.shared.bus import Bus, Delivery

from .batch import pad
from .config import TrainerConfig
from .groups import GroupCollector
from .grpo import grpo_step
from .local_rollout import Tokens
from .sft import expert_sequences, warm_start

log = logging.getLogger(__name__)

GROUP_POLL_S = 0.1
SFT_EVAL_SEEDS = range(1_000_000, 1_000_032)  # held out from the training traces


def task_seed(base: int, step: int, group: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{base}:{step}:{group}".encode()).digest()[:4], "little")


class Trainer:
    def __init__(self, bus: Bus, model, tokens: Tokens, envs: list[ToolEnv], config: TrainerConfig, run_id: str) -> None:
        self.bus, self.model, self.tokens, self.envs, self.config, self.run_id = bus, model, tokens, envs, config, run_id
        g = config.grpo
        self.collector = GroupCollector(max_staleness=g.max_staleness, stale_policy=g.stale_policy, group_timeout_s=g.group_timeout_s)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=g.lr, weight_decay=0.0)
        self.weights = WeightsClient(bus, config.publish.model, staging_dir=config.publish.staging_dir or None)
        self.version = config.initial_version
        self.emitted_steps = 0
        self.steps = 0
        self.rewards: list[float] = []  # mean reward of each step's groups
        self.stats: dict[str, float] = {}
        self.last: dict[str, float] = {}  # the last GRPO step's loss statistics

    # ---- the three SDK calls -----------------------------------------------------------

    async def start(self) -> None:
        await self.weights.start()
        await self.bus.consume(TRAJECTORY, self._on_trajectory, durable=self.config.durable, batch=64)

    async def _on_trajectory(self, trajectory: Trajectory, delivery: Delivery) -> None:
        self.collector.add(trajectory)

    async def emit(self, step: int) -> None:
        """Publish the tasks of one step: `groups_per_step` groups of `group_size` copies of a task."""
        g, t = self.config.grpo, self.config.tasks
        for i in range(g.groups_per_step):
            index = step * g.groups_per_step + i
            env = self.envs[index % len(self.envs)]
            group_id = f"{self.run_id}-s{step}-g{i}"
            seed = task_seed(t.seed, -1, index % t.problems) if t.problems else task_seed(t.seed, step, i)
            self.collector.expect(group_id, g.group_size)
            for j in range(g.group_size):
                task = env.task(seed, task_id=f"{group_id}-{j}", group_id=group_id, group_size=g.group_size, max_turns=t.max_turns)
                task.env_args["max_tokens"] = str(t.max_tokens)
                task.routing, task.created_at = t.routing, time.time()
                await self.bus.publish(ROLLOUT_TASK, task, msg_id=task.task_id)
        self.emitted_steps = max(self.emitted_steps, step + 1)

    async def publish(self) -> None:
        dtype = getattr(torch, self.config.publish.dtype)
        state = {k: v.detach().to(dtype).contiguous().clone() for k, v in self.model.state_dict().items()}
        for attempt in range(50):  # the publisher may still be starting
            try:
                await self.weights.publish(state, self.version)
                break
            except Exception as exc:
                if attempt == 49:
                    raise
                log.info("publish of v%d not accepted yet (%r); retrying", self.version, exc)
                await asyncio.sleep(0.2)
        await self.weights.published(self.version, timeout=self.config.publish.published_timeout_s)
        log.info("published policy v%d", self.version)

    # ---- training ----------------------------------------------------------------------

    async def warm_start(self) -> None:
        s = self.config.sft
        if s.steps == 0:
            return
        train = expert_sequences(self.envs, self.tokens, range(s.traces_per_env))
        held_out = expert_sequences(self.envs, self.tokens, SFT_EVAL_SEEDS)
        report = await asyncio.to_thread(warm_start, self.model, train, self.tokens.pad_id, steps=s.steps, lr=s.lr, batch_size=s.batch_size, eval_seqs=held_out)
        self.stats.update(sft_steps=report.steps, sft_nll_before=report.nll_before, sft_nll_after=report.nll_after)
        log.info("warm start: %d steps, expert NLL/token %.3f -> %.3f", report.steps, report.nll_before, report.nll_after)
        self.version += 1
        await self.publish()

    async def next_groups(self, stop: asyncio.Event) -> list:
        want = self.config.grpo.groups_per_step
        ready: list = []
        while len(ready) < want and not stop.is_set():
            ready += self.collector.ready()
            if len(ready) < want:
                await asyncio.sleep(GROUP_POLL_S)
        return ready

    def _train(self, seqs) -> dict[str, float]:
        mb = self.config.grpo.micro_batch
        batches = [pad(seqs[i : i + mb], self.tokens.pad_id) for i in range(0, len(seqs), mb)]
        g = self.config.grpo
        s = grpo_step(self.model, self.optimizer, batches, clip_eps=g.clip_eps, max_grad_norm=g.max_grad_norm, epochs=g.epochs)
        return {"loss": s.loss, "tokens": s.tokens, "clip_fraction": s.clip_fraction, "mean_ratio": s.mean_ratio, "approx_kl": s.approx_kl}

    async def step(self, stop: asyncio.Event) -> bool:
        """Wait for a step's groups, train, publish; False if stopped first."""
        groups = await self.next_groups(stop)
        if stop.is_set():
            return False
        rewards = [t.reward for g in groups for t in g.members.values() if t.status == "completed"]
        self.rewards.append(sum(rewards) / len(rewards) if rewards else 0.0)
        seqs = self.collector.sequences(groups, self.version)
        if seqs:
            started = time.monotonic()
            self.last = await asyncio.to_thread(self._train, seqs)
            trained = time.monotonic()
            self.version += 1
            self.steps += 1
            await self.publish()
            await self._report(groups, len(rewards), len(seqs), trained - started, time.monotonic() - trained)
        else:
            self.stats["skipped_steps"] = self.stats.get("skipped_steps", 0) + 1
        await self.emit(self.emitted_steps)
        log.info("step %d: reward %.3f, version %d, %s", self.steps, self.rewards[-1], self.version, self.last)
        return True

    async def _report(self, groups: list, trajectories: int, sequences: int, train_s: float, publish_s: float) -> None:
        """The public progress event (TRAINING_STEP) of the step just taken."""
        await self.bus.publish(TRAINING_STEP, TrainingStep(
            run_id=self.run_id, step=self.steps, version=self.version, reward_mean=self.rewards[-1], groups=len(groups),
            trajectories=trajectories, trained_sequences=sequences, loss=self.last.get("loss", 0.0),
            clip_fraction=self.last.get("clip_fraction", 0.0), approx_kl=self.last.get("approx_kl", 0.0),
            stale_dropped=self.collector.stats["stale_dropped"], train_s=train_s, publish_s=publish_s, at=time.time(),
        ), run_id=self.run_id)

    def load(self) -> dict[str, float]:
        out = {f"collector_{k}": float(v) for k, v in self.collector.stats.items()}
        out.update({k: float(v) for k, v in self.stats.items()})
        out.update({f"last_{k}": float(v) for k, v in self.last.items()})
        out.update(steps=float(self.steps), version=float(self.version), reward_last=self.rewards[-1] if self.rewards else 0.0)
        return out
