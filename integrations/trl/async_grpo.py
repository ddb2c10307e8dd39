"""TRL's `AsyncGRPOTrainer` on ROSE: a rollout worker and a weight transfer, through TRL's own protocols.

`trl.experimental.async_grpo.AsyncGRPOTrainer` takes a `rollout_worker` (RolloutWorkerProtocol:
`rollout_buffer`, `metrics_queue`, `start`, `stop`, `update_model_version`, `check_health`) and a
`weight_transfer` (WeightTransferProtocol: `init_weight_transfer`, `pause`, `send_weights`,
`resume`, `destroy`). Its samples carry `old_log_probs`, `model_version` and `group_id`; it
computes the importance ratio against `old_log_probs` and drops a sample more than
`max_staleness` versions behind. Both are ROSE's, one to one:

* `RoseRolloutWorker` keeps groups of the task table in flight on ROSE's fleet (as many as TRL's
  `max_inflight_tasks` samples allow), scores each complete group with the reward functions
  (`env_reward` by default: the environment's reward from the worker) and queues one
  `RolloutSample` per row of each episode (sequences.py): the executor's logprobs as
  `old_log_probs`, and as `model_version` TRL's sync count at the episode's oldest token (from
  its ROSE version, bridge.py `trl_version`), so TRL's staleness filter sees ROSE's real lag.
* `RoseWeightTransfer` publishes the policy through ROSE's weight publisher on each of TRL's syncs
  (TRL's first, on train begin, included) and returns once every executor can fetch it. What is
  published is `policy_state_dict(model)` (policy.py: the whole model, or a `PeftModel`'s adapter
  read from its own parameters, which TRL's merge before the sync leaves as they are), so the
  transfer needs the trainer's model: `transfer.bind(trainer.model)` after building the trainer.
  `pause` and `resume` have nothing to do: executors swap versions between their own iterations,
  and each token records the version that sampled it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

with warnings.catch_warnings():  # this integration is on TRL's experimental API on purpose (docs/trl.md)
    warnings.filterwarnings("ignore", message="You are importing from 'trl.experimental'")
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from rose.contracts.rollout import Trajectory
from rose.shared.errors import RoseError

from .bridge import RoseConnection
from .groups import Group
from .policy import check_policy, policy_state_dict
from .sequences import episode_runs
from .tasks import ENV_REWARD_FIELD, env_reward

log = logging.getLogger(__name__)

ADVANTAGE_EPS = 1e-8  # TRL's own rollout worker's (async_rollout_worker.py `_score_group`): (r - mean) / (std + 1e-8)


class NotBound(RoseError, RuntimeError):
    """The weight transfer was asked to send weights before it knew the trainer's model."""


class RoseRolloutWorker:
    """TRL's RolloutWorkerProtocol on ROSE: scored `RolloutSample`s from ROSE's fleet in `rollout_buffer`."""

    def __init__(self, rose: RoseConnection, args: Any, *, reward_funcs: list[Callable[..., list[float]]] | None = None) -> None:
        self.rose, self.args = rose, args  # TRL's AsyncGRPOConfig: its num_generations and max_inflight_tasks, read at start
        self.reward_funcs = reward_funcs or [env_reward]
        self.rollout_buffer: queue.Queue[RolloutSample] = queue.Queue()
        self.metrics_queue: queue.Queue[dict[str, float]] = queue.Queue()
        self.model_version = 0
        self.groups_scored = 0
        self._running: Any = None  # the producer's future on the bus thread
        self._progress_at = time.time()
        self._stopping = False
        self._warned_stale = False

    def start(self) -> None:
        """Begin handing out groups (TRL calls it on train begin, after its first weight sync)."""
        if self._running is None:
            self._progress_at = time.time()
            self._running = self.rose.spawn(self._produce())

    def stop(self) -> None:
        self._stopping = True
        if self._running is not None:
            self._running.cancel()

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        """Raise if the producer failed, or no group completed for `stale_after_s` (TRL's heartbeat_stale_after_s)."""
        if self._running is not None and self._running.done() and not self._running.cancelled():
            error = self._running.exception()
            if error is not None:
                raise RuntimeError("the ROSE rollout worker failed; see the chained exception") from error
        idle = time.time() - self._progress_at
        if idle > stale_after_s:
            raise RuntimeError(
                f"no group came back from ROSE for {idle:.0f} s (> heartbeat_stale_after_s {stale_after_s:.0f} s): "
                f"are ROSE's rollout workers and executors up? (`rose status`; handed out so far: {self.rose.stats})"
            )

    async def _produce(self) -> None:
        size = int(self.args.num_generations)
        in_flight = max(1, int(self.args.max_inflight_tasks) // size)  # TRL counts samples in flight, a group is `size` of them
        specs = self.rose.tasks.specs_in_order()
        waiting: dict[asyncio.Task[list[Trajectory]], Group] = {}
        handed = 0
        while not self._stopping:
            while len(waiting) < in_flight:
                spec = specs[handed % len(specs)]
                run = self.rose.run_id
                group = await self.rose.book.open(spec, size, group_id=f"{run}-a{handed}", batch_id=f"{run}-a", batch_size=0)
                waiting[asyncio.ensure_future(group.wait())] = group
                handed += 1
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for finished in done:
                group = waiting.pop(finished)
                self.rose.book.close(group)
                self._queue(group, finished.result())  # a group's RolloutFailed ends the worker: check_health raises it
                self._progress_at = time.time()

    def _queue(self, group: Group, trajectories: list[Trajectory]) -> None:
        kwargs: dict[str, Any] = {
            "prompts": [[{"role": "user", "content": group.spec.prompt}]] * len(trajectories),
            "completions": [[{"role": "assistant", "content": "".join(turn.text for turn in t.turns)}] for t in trajectories],
            "completion_ids": [[tok for run in episode_runs(t) for tok in run.completion_ids] for t in trajectories],
            ENV_REWARD_FIELD: [t.reward for t in trajectories],
        }
        per_func = np.array([[float(r) for r in f(**kwargs)] for f in self.reward_funcs], dtype=float)
        rewards = per_func.sum(axis=0)
        advantages = (rewards - rewards.mean()) / (rewards.std() + ADVANTAGE_EPS)
        std = float(rewards.std())
        names = [getattr(f, "__name__", type(f).__name__) for f in self.reward_funcs]
        group_number = self.groups_scored
        self.groups_scored += 1
        for i, t in enumerate(trajectories):
            metrics = {"reward": float(rewards[i]), "reward_std": std, **{f"rewards/{n}": float(per_func[k, i]) for k, n in enumerate(names)}}
            for run in episode_runs(t):
                self.rollout_buffer.put(
                    RolloutSample(
                        prompt=kwargs["prompts"][i],
                        completion=kwargs["completions"][i],
                        input_ids=np.asarray(run.tokens, dtype=np.int64),
                        completion_mask=np.asarray(run.mask, dtype=np.int64),
                        old_log_probs=np.asarray(run.logprobs, dtype=np.float32),
                        advantage=float(advantages[i]),
                        model_version=self.rose.trl_version(run.oldest_version),
                        group_id=group_number,
                        metrics=dict(metrics),
                        enqueued_at=time.time(),
                    )
                )
        lag = [self.model_version - self.rose.trl_version(r.oldest_version) for t in trajectories for r in episode_runs(t)]
        too_old = sum(1 for v in lag if v > self.args.max_staleness)
        if too_old and not self._warned_stale:
            self._warned_stale = True
            log.warning(
                "%d of %d samples lag TRL's policy by more than max_staleness=%d versions and will be dropped by TRL: the fleet runs "
                "versions behind (rose/lag_mean); raise max_staleness or lower max_inflight_tasks",
                too_old,
                len(lag),
                self.args.max_staleness,
            )
        self.metrics_queue.put({"rose/groups": 1.0, "rose/lag_mean": sum(lag) / len(lag) if lag else math.nan, "rose/too_stale": float(too_old)})


class RoseWeightTransfer:
    """TRL's WeightTransferProtocol on ROSE: each sync is a ROSE policy version every executor applies."""

    def __init__(self, rose: RoseConnection, *, dtype: torch.dtype | None = None) -> None:
        self.rose, self.dtype = rose, dtype
        self.model: torch.nn.Module | None = None
        self.sent: list[int] = []  # the ROSE version of each sync, in order

    def bind(self, model: torch.nn.Module) -> RoseWeightTransfer:
        """The trainer's model, whose `policy_state_dict` each sync publishes (`transfer.bind(trainer.model)`); a LoRA
        configuration the executors cannot run is refused here, before TRL's first sync."""
        check_policy(_unwrapped(model))
        self.model = model
        return self

    def init_weight_transfer(self) -> None:
        if self.model is None:
            raise NotBound("RoseWeightTransfer needs the trainer's model: call transfer.bind(trainer.model) after building the trainer")

    def pause(self) -> None:
        """Nothing to pause: executors apply a version between their own iterations (turns in flight keep theirs)."""

    def resume(self) -> None:
        """Nothing was paused (see `pause`)."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Publish the bound model's policy (TRL's stream of merged parameters is left unread: the state dict says it all)."""
        if self.model is None:
            raise NotBound("RoseWeightTransfer.send_weights before bind(trainer.model)")
        state = policy_state_dict(_unwrapped(self.model), self.dtype)
        self.sent.append(self.rose.call(self.rose.publish(state)))

    def destroy(self) -> None:
        """The connection is the caller's (`with RoseConnection(...)`): nothing of the transfer's own to release."""


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """Under DDP the trainer's model is the wrapper; its `module` is the model."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model
