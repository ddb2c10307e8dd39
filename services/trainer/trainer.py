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

   A LoRA policy (an adapter of the serving model, lora.py) publishes its adapter's tensors the same way:
   `get_peft_model_state_dict(model)`, under the names of its `adapter_model.safetensors`.

That is all: leasing serving GPUs, routing turns, shipping weight deltas and applying them
between iterations happen behind these three calls. This module does exactly that, with
GRPO (grpo.py), a staleness bound (groups.py) and an expert warm start (sft.py).

Training runs in a worker thread (`asyncio.to_thread`) so the bus keeps heartbeating and
collecting the next step's trajectories meanwhile (asynchronous RL: with `prefetch_steps` >= 1
the next step's tasks are already rolling out on the previous version, which the staleness
bound accounts for). With `early_hand_out`, a step waiting for its groups also hands the next
step out when the fleet's rollout capacity idles (capacity.py: no executor has a rollout queue),
as far ahead as `max_staleness` allows; the hand-out after training then waits until the lead
is back to `prefetch_steps`.

No fault loses work: every `checkpoint.every_steps` steps, and after the warm start, the
trainer writes a checkpoint (checkpoint.py: weights, optimizer, RNGs, step, run id, version, the
task cursor, the groups handed out and not yet trained on; resume.py: when, and what it resumed
from). A trajectory is acked only once a checkpoint covers the step that trained on it
(ledger.py: held, kept alive, redelivered after a restart). A restarted trainer resumes from its
newest valid checkpoint: the same run id, the next step, no new warm start, versions after the
last one on the manifest stream; it hands out again (same task ids, which JetStream and the
workers de-duplicate) the tasks that may not have gone out, and it drops redeliveries of groups
it already trained on (acked, counted as `already_used`), so nothing is trained on or counted twice.

This module: the three SDK calls, the job loop (warm start, then wait for groups, GRPO step,
checkpoint, publish, emit) and the heartbeat load; it owns the job's progress (run id, steps,
version, task cursor, rewards) and builds the `TrainerState` a checkpoint records from it.

Degenerate groups: a step whose every group has equal rewards (all 0: the policy never solves
the task, or a broken reward) gives GRPO no advantage, so it is skipped, not trained on. A
skipped step still counts toward `max_steps` (the job is that many rounds of rollouts, so the
tasks it hands out are bounded by `(max_steps + prefetch_steps) x groups_per_step x
group_size`), and `DEGENERATE_STEPS_LIMIT` skipped steps in a row end the job (any job, also
`max_steps = 0`) with an error log that says why. `skipped_steps` and `skipped_in_a_row` are in
the trainer's heartbeat load.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import torch

from rose.client.weights import WeightsClient
from rose.contracts.registry import AGENT_TASK, HEADROOM, ROLLOUT_TASK, TRAINING_STEP, TRAJECTORY
from rose.contracts.rollout import RolloutTask
from rose.contracts.slo import Headroom
from rose.contracts.training import TrainingStep
from rose.contracts.weights import VERSION_NOT_NEWER
from rose.shared.agentic.tool_env import ToolEnv
from rose.shared.bus import Bus, RemoteError
from rose.shared.metrics import meter, metric_name

from .batch import pad
from .capacity import RolloutCapacity
from .checkpoint import CheckpointStore, TrainerState, default_dir, job_identity
from .config import TrainerConfig
from .emulated import EmulatedStep
from .groups import GroupCollector, partial_rollout_costs
from .grpo import grpo_step
from .ledger import TRAJECTORY_MAX_DELIVER, AckLedger, group_id
from .local_rollout import Tokens
from .lora import trainable_parameters, trained_state
from .resume import Checkpoints, last_published
from .sft import SFT_EVAL_SEEDS, expert_sequences, warm_start

log = logging.getLogger(__name__)

GROUP_POLL_S = 0.1
DEGENERATE_STEPS_LIMIT = 8  # skipped steps in a row (every group's rewards equal) that end a job: see `_degenerate_job_ends`


def warmed_up_lr(lr: float, warmup_steps: int, step: int) -> float:
    """The lr of GRPO step `step` (0-based): rising linearly to `lr` over `warmup_steps` (grpo.lr_warmup_steps)."""
    return lr * min(1.0, (step + 1) / warmup_steps) if warmup_steps else lr


def task_seed(base: int, step: int, group: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{base}:{step}:{group}".encode()).digest()[:4], "little")


def group_tasks(config: TrainerConfig, envs: list[ToolEnv], run_id: str, step: int, group: int) -> list[RolloutTask]:
    """The `group_size` tasks of group `group` of step `step`: its environment and problem depend only on the run id,
    the step and the task settings (so handing a step out again repeats it; `rose bench lora` samples the same job).
    With a fixed problem set (`tasks.problems`) the first step's extra groups repeat step 1's first problems."""
    g, t = config.grpo, config.tasks
    index = step * g.groups_per_step + group
    env = envs[index % len(envs)]
    seed = task_seed(t.seed, -1, index % t.problems) if t.problems else task_seed(t.seed, step, group)
    gid = group_id(run_id, step, group)
    tasks = []
    for j in range(g.group_size):
        task = env.task(seed, task_id=f"{gid}-{j}", group_id=gid, group_size=g.group_size, max_turns=t.max_turns)
        task.env_args["max_tokens"] = str(t.max_tokens)
        tasks.append(task)
    return tasks


class Trainer:
    def __init__(self, bus: Bus, model, tokens: Tokens, envs: list[ToolEnv], config: TrainerConfig, run_id: str) -> None:
        self.bus, self.model, self.tokens, self.envs, self.config, self.run_id = bus, model, tokens, envs, config, run_id
        g, c = config.grpo, config.checkpoint
        self.collector = GroupCollector(max_staleness=g.max_staleness, stale_policy=g.stale_policy, group_timeout_s=g.group_timeout_s)
        # Trajectories handed out and never received by their group's timeout: lost (the alert
        # RoseTrajectoriesLost, deploy/compose/prometheus/rules.yml). Exported at 0 from the start.
        self.missing_counter = meter().create_counter(
            metric_name("trainer.trajectories_missing"),
            unit="{trajectory}",
            description="Members of groups trained on after the group timeout without them (lost or too late).",
        )
        self.missing_counter.add(0)
        # a LoRA policy's optimizer steps the adapter only (lora.py)
        self.optimizer = torch.optim.AdamW(trainable_parameters(model), lr=g.lr, weight_decay=0.0)
        self.weights = WeightsClient(bus, config.publish.model, staging_dir=config.publish.staging_dir or None)
        self.ledger = AckLedger(
            self.collector, group_size=g.group_size, groups_per_step=g.groups_per_step, ack_wait_s=c.ack_wait_s, over_provision=g.over_provision
        )
        self.checkpoints = Checkpoints(CheckpointStore(default_dir(config), job_identity(config), c.keep) if c.every_steps else None)
        self.version = config.initial_version
        self.emitted_steps = 0
        self.steps = 0
        self.rewards: list[float] = []  # mean reward of each step's groups
        self.stats: dict[str, float] = {}
        self.last: dict[str, float] = {}  # the last GRPO step's loss statistics
        self.warm_started = False  # this process ran the warm start
        self.emit_target = 0  # on resume: hand out the tasks of steps [emitted_steps, emit_target) again
        self.capacity = RolloutCapacity()  # the fleet's rollout queues (slo.headroom), for `early_hand_out`
        # an emulated training cluster: the optimizer step is timed, not run (emulated.py)
        self.emulated = EmulatedStep(model, config.emulation) if config.emulation.device else None
        self.handed_out_at = time.monotonic()  # the last emit: capacity reports before it do not count

    # ---- the three SDK calls -----------------------------------------------------------

    async def start(self) -> None:
        """Listen for weight outcomes and consume trajectories (after `restore`, so resumed groups are known)."""
        await self.weights.start()
        await self.bus.subscribe(HEADROOM, self._on_headroom)  # always: the registry names what a service reads, whatever its settings
        c = self.config.checkpoint
        await self.bus.consume(
            TRAJECTORY,
            self.ledger.on_trajectory,
            durable=self.config.durable,
            batch=64,
            manual_ack=True,
            ack_wait_s=c.ack_wait_s,
            max_deliver=TRAJECTORY_MAX_DELIVER,
        )
        self.ledger.start()

    async def stop(self) -> None:
        self.ledger.stop()

    async def _on_headroom(self, headroom: Headroom, _delivery) -> None:
        self.capacity.observe(headroom, time.monotonic())

    @property
    def hands_out_early(self) -> bool:
        g = self.config.grpo
        return g.early_hand_out and g.prefetch_steps >= 1 and g.max_staleness > g.prefetch_steps

    def rounds(self) -> int:
        """Steps taken, trained or skipped: each hands one step out (the job's task cursor moves with it)."""
        return self.steps + int(self.stats.get("skipped_steps", 0))

    def hand_out_due(self) -> bool:
        """After a step: is the lead of steps handed out over steps taken below `prefetch_steps` + 1?
        (Not when a step went out early while this one waited.)"""
        return self.emitted_steps < self.rounds() + self.config.grpo.prefetch_steps + 1

    async def hand_out_early(self) -> None:
        """While a step waits for its groups: hand the next step out if the fleet's rollout capacity idles
        (capacity.py) and its trajectories stay within `max_staleness` when trained. A step handed out
        k rounds ahead of the last one taken is trained about k versions later than it started."""
        g = self.config.grpo
        step = self.emitted_steps
        if not self.hands_out_early or step - self.rounds() > g.max_staleness:
            return
        if self.config.max_steps and step >= self.config.max_steps:
            return  # a step the job will not train on
        if not self.capacity.idle(time.monotonic(), since=self.handed_out_at):
            return
        log.info("rollout capacity idles (no executor has a rollout queue): handing step %d out early, %d ahead", step, step - self.rounds())
        self.stats["early_hand_outs"] = self.stats.get("early_hand_outs", 0) + 1
        await self.emit(step)

    async def emit(self, step: int) -> None:
        """Publish the tasks of one step: `groups_per_step` groups of `group_size` copies of a task (the first
        step `over_provision` groups more: ledger.py `groups_in`).

        Deterministic: a step's group and task ids and problems depend only on the run id, the
        step and the task settings, so handing a step out again after a restart repeats it.
        """
        g, t = self.config.grpo, self.config.tasks
        groups = self.ledger.groups_in(step)
        for i in range(groups):
            gid = group_id(self.run_id, step, i)
            if gid in self.ledger.used:
                continue
            self.ledger.open(gid)
            for task in group_tasks(self.config, self.envs, self.run_id, step, i):
                task.routing, task.created_at = t.routing, time.time()
                # the step's batch, for the scheduler's tail rule (placement.in_tail)
                task.batch_id, task.batch_size = f"{self.run_id}-s{step}", groups * g.group_size
                await self.bus.publish(AGENT_TASK if t.agent else ROLLOUT_TASK, task, msg_id=task.task_id)
        self.emitted_steps = max(self.emitted_steps, step + 1)
        self.handed_out_at = time.monotonic()

    async def publish(self) -> None:
        dtype = getattr(torch, self.config.publish.dtype)
        state = {k: v.detach().to(dtype).contiguous().clone() for k, v in trained_state(self.model).items()}  # a LoRA policy: its adapter
        for attempt in range(50):  # the publisher may still be starting
            try:
                await self.weights.publish(state, self.version)
                break
            except Exception as exc:
                if isinstance(exc, RemoteError) and exc.reason == VERSION_NOT_NEWER:
                    taken = exc.data.get("latest")
                    if isinstance(taken, int) and taken >= self.version:
                        # the publisher already took this number: the process before a restart asked for it just before
                        # it died (or another publisher of this model): these weights go out under the next free one
                        log.warning("v%d is taken at the publisher (%s): publishing as v%d", self.version, exc.description, taken + 1)
                        self.version = taken + 1
                        continue
                if attempt == 49:
                    raise
                log.info("publish of v%d not accepted yet (%r); retrying", self.version, exc)
                await asyncio.sleep(0.2)
        await self.weights.published(self.version, timeout=self.config.publish.published_timeout_s)
        log.info("published policy v%d", self.version)

    # ---- checkpoint / resume (resume.py keeps the store, ledger.py the groups) ---------------

    async def restore(self) -> bool:
        """Before `start`: resume from the newest valid checkpoint of this job; False: a fresh run (and why, logged)."""
        loaded, self.run_id = await self.checkpoints.load(self.model, self.optimizer, self.run_id)
        if loaded is None:
            return False
        s = loaded.state
        self.steps, self.version = s.step, s.version
        self.emitted_steps, self.emit_target = s.emit_from, s.emitted_steps
        self.rewards, self.stats, self.last = list(s.rewards), dict(s.stats), dict(s.last)
        self.collector.stats.update(s.collector_stats)
        self.ledger.restore(self.run_id, outstanding=s.outstanding, used_groups=s.used_groups, emit_from=s.emit_from, emitted_steps=s.emitted_steps)
        if loaded.published is not None:  # its weights went out (maybe re-numbered by an earlier resume)
            self.version = max(self.version, loaded.published)
        log.info(
            "resumed run %s from checkpoint %s: step %d, version %d (%s), %d groups open, tasks handed out through step %d",
            self.run_id,
            loaded.path,
            s.step,
            self.version,
            "published" if loaded.published is not None else "publish not recorded",
            self.ledger.open_groups(),
            s.emitted_steps - 1,
        )
        return True

    async def resume(self) -> None:
        """After `start` on a resumed run: finish the publish the checkpoint may have cut short, hand out its steps again."""
        last = await last_published(self.weights)
        publish_due = self.checkpoints.publish_due
        if last is not None and (last > self.version or (last == self.version and publish_due)):
            # a version went out after ours (another publisher's), or one with our number that may not be ours:
            # executors must run the checkpoint's weights, under a number after every other
            log.info(
                "the manifest stream's last version is v%d (the checkpoint's: v%d): publishing the checkpoint's weights as v%d",
                last,
                self.version,
                last + 1,
            )
            self.version = last + 1
            await self.publish()
            self.checkpoints.mark_published(self.version)
        elif publish_due:
            log.info("publishing v%d, which the checkpoint was written for (the previous process stopped before it went out)", self.version)
            await self.publish()
            self.checkpoints.mark_published(self.version)
        for step in range(self.emitted_steps, self.emit_target):
            await self.emit(step)

    async def fresh(self) -> None:
        """After `start` on a fresh run: version numbers go on after the last one on the manifest stream."""
        last = await last_published(self.weights)
        if last is not None and last > self.version:
            log.info("the manifest stream already has v%d of %s: this run's versions follow it", last, self.config.publish.model)
            self.version = last

    def _state(self, emit_owed: int, publish_due: bool) -> TrainerState:
        return TrainerState(
            run_id=self.run_id,
            step=self.steps,
            version=self.version,
            emitted_steps=self.emitted_steps + emit_owed,
            emit_from=self.emitted_steps,
            outstanding=self.ledger.outstanding(),
            used_groups=self.ledger.used_groups(),
            rewards=list(self.rewards),
            collector_stats=self.ledger.settled_stats(),
            stats=dict(self.stats),
            last=dict(self.last),
            warm_started=True,
            publish_due=publish_due,
        )

    async def checkpoint(self, emit_owed: int, publish_due: bool = True) -> None:
        """Write a checkpoint (a failure is logged, never fatal), then ack the trajectories it covers."""
        if self.checkpoints.store is None:
            return
        if await self.checkpoints.save(self.model, self.optimizer, self._state(emit_owed, publish_due)):
            await self.ledger.settle()

    async def final_checkpoint(self) -> None:
        """On a clean stop: checkpoint the steps taken since the last one (every_steps > 1), so none is redone."""
        if self.checkpoints.behind(self.steps):
            await self.checkpoint(emit_owed=0, publish_due=True)
            self.checkpoints.mark_published(self.version)

    # ---- training ----------------------------------------------------------------------

    async def warm_start(self) -> None:
        s = self.config.sft
        trained = False
        if s.steps:
            train = expert_sequences(self.envs, self.tokens, range(s.traces_per_env))
            held_out = expert_sequences(self.envs, self.tokens, SFT_EVAL_SEEDS)
            report = await asyncio.to_thread(
                warm_start, self.model, train, self.tokens.pad_id, steps=s.steps, lr=s.lr, batch_size=s.batch_size, eval_seqs=held_out
            )
            self.stats.update(sft_steps=report.steps, sft_nll_before=report.nll_before, sft_nll_after=report.nll_after)
            log.info("warm start: %d steps, expert NLL/token %.3f -> %.3f", report.steps, report.nll_before, report.nll_after)
            self.warm_started = trained = True
            self.version += 1
        # step 0 of the run: a restart from here on resumes (no second warm start); its tasks go out next
        await self.checkpoint(emit_owed=self.config.grpo.prefetch_steps + 1, publish_due=trained)
        if trained:
            await self.publish()
            self.checkpoints.mark_published(self.version)

    async def next_groups(self, stop: asyncio.Event) -> list:
        """The oldest `groups_per_step` complete groups, whichever step handed them out (with
        `prefetch_steps` >= 1 a step never waits for an older step's slowest group; groups.py `take`).
        Exactly that many: a step that took every ready group (a prefetched step's too) would leave
        the next step waiting for a batch just handed out, and the prefetch would stop hiding rollout
        behind training. Groups wholly beyond the staleness bound are dropped, counted, not waited for."""
        want = self.config.grpo.groups_per_step
        ready: list = []
        while len(ready) < want and not stop.is_set():
            missing = self.collector.stats["missing"]
            usable, expired = self.collector.expire(self.collector.ready(), self.version)
            if self.collector.stats["missing"] > missing:
                self.missing_counter.add(self.collector.stats["missing"] - missing)
            ready += usable
            self.ledger.use([g.group_id for g in expired])  # never trained on: acked with the next checkpoint, redeliveries ignored
            if len(ready) < want:
                await self.hand_out_early()
                await asyncio.sleep(GROUP_POLL_S)
        taken, back = self.collector.take(ready, want) if not stop.is_set() else ([], ready)
        for g in back:  # not trained on now: open again (a final checkpoint lists them, their trajectories stay unacked)
            self.collector.groups[g.group_id] = g
        return taken

    def _train(self, seqs) -> dict[str, float]:
        if self.emulated is not None:
            return self.emulated(seqs)
        mb = self.config.grpo.micro_batch
        batches = [pad(seqs[i : i + mb], self.tokens.pad_id) for i in range(0, len(seqs), mb)]
        g = self.config.grpo
        for group in self.optimizer.param_groups:  # from the step count, which a checkpoint keeps: a resumed run goes on
            group["lr"] = warmed_up_lr(g.lr, g.lr_warmup_steps, self.steps)
        s = grpo_step(self.model, self.optimizer, batches, clip_eps=g.clip_eps, max_grad_norm=g.max_grad_norm, epochs=g.epochs)
        return {"loss": s.loss, "tokens": s.tokens, "clip_fraction": s.clip_fraction, "mean_ratio": s.mean_ratio, "approx_kl": s.approx_kl}

    async def step(self, stop: asyncio.Event) -> bool:
        """Wait for a step's groups, train, checkpoint, publish; False if stopped first or the job ends
        (`max_steps` rounds taken, skipped ones included, or too many skipped in a row: `_degenerate_job_ends`).

        The checkpoint comes before the publish and the report: a step reported was
        checkpointed (with every_steps = 1), so a restart never redoes a reported step.
        """
        groups = await self.next_groups(stop)
        if stop.is_set():
            return False  # groups taken but not trained on stay unacked: redelivered to the next process
        rewards = [t.reward for g in groups for t in g.members.values() if t.status == "completed"]
        self.rewards.append(sum(rewards) / len(rewards) if rewards else 0.0)
        seqs = self.collector.sequences(groups, self.version)
        every = self.config.checkpoint.every_steps
        if seqs:
            self.stats["skipped_in_a_row"] = 0
            started = time.monotonic()
            self.last = await asyncio.to_thread(self._train, seqs)
            trained = time.monotonic()
            self.version += 1
            self.steps += 1
            self.ledger.use([g.group_id for g in groups])
            if every == 0:  # no checkpoints: acked once trained on
                await self.ledger.settle()
            elif self.steps % every == 0:
                await self.checkpoint(emit_owed=int(self.hand_out_due()))
            await self.publish()
            if every and self.checkpoints.last_step == self.steps:
                self.checkpoints.mark_published(self.version)
            await self._report(groups, len(rewards), len(seqs), trained - started, time.monotonic() - trained)
        else:
            self.stats["skipped_steps"] = self.stats.get("skipped_steps", 0) + 1
            self.stats["skipped_in_a_row"] = self.stats.get("skipped_in_a_row", 0) + 1
            self.ledger.use([g.group_id for g in groups])  # acked with the next checkpoint (redone as skipped after a restart)
            if every == 0:
                await self.ledger.settle()
            if self._degenerate_job_ends():
                return False  # no more tasks handed out: the job ends here (main: final checkpoint, exit)
        if seqs and self.config.max_steps and self.rounds() >= self.config.max_steps:
            return False  # the job's rounds are done (skipped steps count: `_degenerate_job_ends`)
        if self.hand_out_due():
            await self.emit(self.emitted_steps)
        log.info("step %d: reward %.3f, version %d, %s", self.steps, self.rewards[-1], self.version, self.last)
        return True

    def _degenerate_job_ends(self) -> bool:
        """After a skipped step (every group's rewards equal: GRPO has no advantage to learn from):
        True when the job must end. Skipped steps count toward `max_steps` (a job is that many rounds
        of rollouts, so the tasks it hands out stay bounded), and `DEGENERATE_STEPS_LIMIT` of them in a
        row end any job, `max_steps = 0` included: the reward gives no signal, more rollouts only fill
        the task queue."""
        skipped, in_a_row = int(self.stats["skipped_steps"]), int(self.stats["skipped_in_a_row"])
        max_steps = self.config.max_steps
        if in_a_row >= DEGENERATE_STEPS_LIMIT:
            log.error(
                "stopping run %s: %d steps in a row had every group's rewards equal (last reward %.3f), so GRPO had nothing to learn from; "
                "check the environment's reward and the policy's warm start (rose.services.trainer.trainer: degenerate groups)",
                self.run_id,
                in_a_row,
                self.rewards[-1] if self.rewards else 0.0,
            )
            return True
        if max_steps and self.steps + skipped >= max_steps:
            log.warning(
                "run %s ends: %d steps of max_steps %d taken, %d of them skipped (every group's rewards equal)",
                self.run_id,
                self.steps + skipped,
                max_steps,
                skipped,
            )
            return True
        return False

    async def _report(self, groups: list, trajectories: int, sequences: int, train_s: float, publish_s: float) -> None:
        """The public progress event (TRAINING_STEP) of the step just taken."""
        await self.bus.publish(
            TRAINING_STEP,
            TrainingStep(
                run_id=self.run_id,
                step=self.steps,
                version=self.version,
                reward_mean=self.rewards[-1],
                groups=len(groups),
                trajectories=trajectories,
                trained_sequences=sequences,
                loss=self.last.get("loss", 0.0),
                clip_fraction=self.last.get("clip_fraction", 0.0),
                approx_kl=self.last.get("approx_kl", 0.0),
                stale_dropped=self.collector.stats["stale_dropped"],
                train_s=train_s,
                publish_s=publish_s,
                at=time.time(),
                resumed_from_step=self.checkpoints.resumed_from,
            ),
            run_id=self.run_id,
        )

    def load(self) -> dict[str, float]:
        out = {f"collector_{k}": float(v) for k, v in self.collector.stats.items()}
        out.update(partial_rollout_costs(self.collector.stats))
        out.update({k: float(v) for k, v in self.stats.items()})
        out.update({f"last_{k}": float(v) for k, v in self.last.items()})
        out.update(steps=float(self.steps), version=float(self.version), reward_last=self.rewards[-1] if self.rewards else 0.0)
        resumed_from = self.checkpoints.resumed_from
        out.update(
            resumed_from_step=float(-1 if resumed_from is None else resumed_from),
            checkpoint_step=float(self.checkpoints.last_step),
            warm_started=float(self.warm_started),
            held_trajectories=float(self.ledger.held_trajectories()),
        )
        return out
