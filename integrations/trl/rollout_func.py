"""TRL's `GRPOTrainer` rolls out through ROSE: its `rollout_func`.

`GRPOTrainer._generate` (trl/trainer/grpo_trainer.py) calls `rollout_func(prompts, trainer)` once
per generation batch, with each prompt already repeated `num_generations` times, consecutively.
Each call here:

1. publishes the trainer's weights through ROSE's weight publisher when the trainer's step has
   moved since the last publish (and on the first call: the executors then serve exactly the
   policy TRL holds), and waits until every executor runs the version (bridge.py `applied`);
2. hands out each run of equal prompts as one ROSE group (`num_generations` tasks sharing a group id,
   the batch's id and size for the scheduler's tail rule) and waits for every member's trajectory:
   multi-turn episodes, tool calls, turns placed on leased and dedicated executors as for any ROSE
   job; a failed, stale or lost member is handed out again (groups.py), so TRL always gets its batch;
3. returns TRL's fields: `prompt_ids` (the episode's first prompt), `completion_ids` (every later token,
   the environment's included), `logprobs` (the executor's, 0.0 on the environment's tokens),
   `env_mask` (1 on sampled tokens: TRL's loss and length metrics skip the rest) and `env_reward`
   (the environment's reward, for `env_reward` the reward function).

On-policy by construction: TRL without vLLM ignores the returned logprobs (its importance
correction runs on the vLLM path only), so a stale sample would be trained uncorrected. The
version published in step 1 is the bound: a trajectory with a token sampled before it
(`max_staleness` versions before it, default 0) is handed out again and counted (`rerolled_stale`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rose.contracts.rollout import Trajectory
from rose.contracts.training import TrainingStep

from .bridge import RoseConnection
from .policy import policy_state_dict
from .sequences import single_run
from .tasks import ENV_REWARD_FIELD


@dataclass
class Round:
    """One call of the rollout function: what TRL's step trained on, for logs, tests and the bench."""

    step: int  # trainer.state.global_step at the call
    version: int  # the ROSE version published for it (the trainer's weights at the call)
    min_version: int  # the oldest version a token it trained on may carry (the staleness bound)
    groups: int
    rewards: list[float]
    trajectory_ids: list[str]
    executors: set[str] = field(default_factory=set)
    reported: bool = False  # its TrainingStep went out (once the weights trained on it were published)
    publish_s: float = 0.0  # publishing the step's weights until every executor ran them
    rollout_s: float = 0.0

    @property
    def reward_mean(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else 0.0


def prompt_runs(prompts: list[Any], group_size: int) -> list[tuple[Any, int]]:
    """Consecutive equal prompts as (prompt, count) groups of at most `group_size` (a prompt drawn twice in a row is two groups)."""
    runs: list[tuple[Any, int]] = []
    for p in prompts:
        if runs and runs[-1][0] == p and runs[-1][1] < group_size:
            runs[-1] = (p, runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


class RoseRolloutFunc:
    """`GRPOTrainer(..., rollout_func=RoseRolloutFunc(rose))`: every generation batch rolled out by ROSE's fleet.

    Each batch TRL trained on is reported as a `TrainingStep` event (`rose.events.training.{run_id}`) once its
    weights are out, as ROSE's own trainer reports its steps: `rose demo`, dashboards and `rose events forward`
    follow a TRL job as they follow ROSE's. After `trainer.train()`, `finish(trainer)` publishes the trained
    weights and reports the last batch (no rollout follows it to do so)."""

    def __init__(self, rose: RoseConnection, *, max_staleness: int = 0, dtype: torch.dtype | None = None) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be 0 or more (versions a token may lag the trainer's), not {max_staleness}")
        self.rose, self.max_staleness, self.dtype = rose, max_staleness, dtype
        self.rounds: list[Round] = []
        self._published_step: int | None = None
        self._returned_at = 0.0  # when the last batch went back to TRL (monotonic): its training started then

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        started = time.monotonic()
        self._sync(trainer)
        published = time.monotonic()
        size = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        min_version = self.rose.version - self.max_staleness
        batch_id = f"{self.rose.run_id}-r{len(self.rounds)}"
        runs = prompt_runs(list(prompts), size)
        trajectories = self.rose.call(self._rollout(runs, batch_id, len(prompts), min_version))
        fields = trl_fields(trajectories)
        self.rounds.append(
            Round(
                step=int(trainer.state.global_step),
                version=self.rose.version,
                min_version=min_version,
                groups=len(runs),
                rewards=[t.reward for t in trajectories],
                trajectory_ids=[t.trajectory_id for t in trajectories],
                executors={turn.executor_id for t in trajectories for turn in t.turns},
                publish_s=published - started,
                rollout_s=time.monotonic() - published,
            )
        )
        self._returned_at = time.monotonic()
        return fields

    def finish(self, trainer: Any) -> None:
        """After training: the executors get the trained weights, and the last batch is reported."""
        self._sync(trainer)

    def _sync(self, trainer: Any) -> None:
        """When the trainer's step moved since the last publish (or on the first call): publish its weights, wait until
        every executor runs them, and report the batch it trained on since."""
        step = int(trainer.state.global_step)
        if step == self._published_step:
            return
        trained_s = time.monotonic() - self._returned_at if self.rounds else 0.0
        started = time.monotonic()
        state = policy_state_dict(trainer.accelerator.unwrap_model(trainer.model), self.dtype)
        self.rose.call(self._publish(state))
        self._published_step = step
        if self.rounds and not self.rounds[-1].reported:
            last = self.rounds[-1]
            last.reported = True
            losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
            report = TrainingStep(
                run_id=self.rose.run_id,
                step=sum(r.reported for r in self.rounds),
                version=self.rose.version,
                reward_mean=last.reward_mean,
                groups=last.groups,
                trajectories=len(last.rewards),
                trained_sequences=len(last.rewards),
                loss=float(losses[-1]) if losses else 0.0,
                stale_dropped=self.rose.stats.get("rerolled_stale", 0),
                train_s=trained_s,
                publish_s=time.monotonic() - started,
                at=time.time(),
            )
            self.rose.call(self.rose.report(report))

    async def _publish(self, state: dict[str, torch.Tensor]) -> None:
        version = await self.rose.publish(state)
        await self.rose.applied(version)

    async def _rollout(self, runs: list[tuple[Any, int]], batch_id: str, batch_size: int, min_version: int) -> list[Trajectory]:
        book = self.rose.book
        groups = [
            await book.open(
                self.rose.tasks.spec(prompt), count, group_id=f"{batch_id}-g{i}", batch_id=batch_id, batch_size=batch_size, min_version=min_version
            )
            for i, (prompt, count) in enumerate(runs)
        ]
        try:
            members = await asyncio.gather(*(g.wait() for g in groups))
        finally:
            for g in groups:
                book.close(g)
        return [t for group in members for t in group]


def trl_fields(trajectories: list[Trajectory]) -> dict[str, list]:
    """TRL's rollout_func output for trajectories in prompt order (one prompt and one completion each)."""
    out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], ENV_REWARD_FIELD: []}
    for t in trajectories:
        run = single_run(t)
        out["prompt_ids"].append(run.tokens[: run.prompt_len])
        out["completion_ids"].append(run.completion_ids)
        out["logprobs"].append(run.logprobs[run.prompt_len :])
        out["env_mask"].append(run.mask[run.prompt_len :])
        out[ENV_REWARD_FIELD].append(float(t.reward))
    return out
