"""The simulated trainer: the RL job's processes (engine.py starts one), over its record (trainer_state.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import simpy

from rose.services.trainer.capacity import RolloutCapacity
from rose.shared.devices import fold_seconds, sync_seconds, train_seconds
from rose.shared.workload import batch_trajectories, bundle_size, sample_batch

from .config import SimConfig
from .instances import Instances
from .monitor import MonitorState
from .policies import FleetPolicy
from .sizing import SizedFleet
from .trainer_state import TrainerState
from .turns import TurnTable
from .worker import RolloutWorker

PREWARM_S = 35.0  # rose's per-executor monitor runs from this long before a rollout phase (its windows are 30 s)
GROUP_POLL_S = 0.1  # the trainer looks for complete groups this often (services/trainer/trainer.py GROUP_POLL_S)
# the trainer's trajectory consumer (shared/bus.py): fetch(64, timeout=1 s) in a loop; a fetch returns once 64
# messages arrived or its window ends (config.py FETCH_WINDOW_S), so the trainer learns of a trajectory only then
# (a test checks both constants)
TRAINER_FETCH_BATCH = 64


@dataclass(frozen=True)
class PipelineShape:
    """The asynchronous trainer's batches (``Trainer.pipelined``): ``prefetch`` batches ahead, each of
    ``trajectories`` (``rows`` simulated trajectories of ``bundle`` sequences, ``group_rows`` to a group,
    ``per_step`` groups a step), ``extra`` rows more in the first (over-provisioning), handed out early or not,
    in ``slots`` groups of turn-table rows."""

    prefetch: int
    trajectories: int
    bundle: int
    rows: int
    group_rows: int
    per_step: int
    extra: int
    early: bool
    slots: int


class Trainer:
    """The trainer service's loop as SimPy processes: synchronous (sync weights, roll out one batch, train) or, with
    ``prefetch_steps`` >= 1 or partial rollouts, asynchronous as services/trainer/trainer.py runs it (``pipelined``),
    with its trajectory consumer; the batches it hands out run as the rollout worker's trajectories. Its record
    (``state``) is what the result reads.

    It exists to keep the job's loop, which moves every weight version and batch through the fleet (the instances'
    weights, the turn table's rows, the monitor's rest), apart from the fleet's per-tick model.
    """

    def __init__(
        self,
        env: simpy.Environment,
        cfg: SimConfig,
        policy: FleetPolicy,
        sized: SizedFleet,
        batches: np.random.Generator,
        inst: Instances,
        turns: TurnTable,
        mon: MonitorState,
        worker: RolloutWorker,
        capacity: RolloutCapacity,
        state: TrainerState,
    ) -> None:
        self.env, self.cfg, self.policy, self.sized = env, cfg, policy, sized
        self.batches = batches  # the RL job's random stream (``RandomStreams.batches``)
        self.inst, self.turns, self.mon, self.worker = inst, turns, mon, worker
        self.capacity = capacity  # the trainer's view of the fleet's rollout queues (grpo.early_hand_out)
        self.state = state
        self.done = env.event()  # the last step trained

    # ------------------------------------------------------------------ the job's figures
    def critical_paths(self, batch) -> np.ndarray:
        """Per trajectory of ``batch``: the least seconds any placement can roll it out in, its turns in
        sequence, each alone on the fastest instance the policy runs on (batch 1, the whole device,
        its prefix cached) and its tools' latencies between them. No capacity makes a step's rollout
        shorter than its slowest trajectory's (the ceiling's latency bound, ceiling.py)."""
        out = np.zeros(batch.n)
        shape = self.sized.shape
        for i in range(batch.n):
            k = int(batch.turns[i])
            gen = batch.gen[i, :k].astype(float)
            new = np.r_[float(batch.prompt[i]), batch.tool_tokens[i, : k - 1].astype(float)]
            before = np.cumsum(new) + np.r_[0.0, np.cumsum(gen)[:-1]]  # context once a turn's new tokens are in
            cached = before - new
            mid = before + gen / 2.0
            turn_s = np.minimum(
                shape.pperf_d.prefill_s(new, cached) + gen * shape.pperf_d.decode_s(1.0, mid),
                shape.pperf_s.prefill_s(new, cached) + gen * shape.pperf_s.decode_s(1.0, mid),
            )
            out[i] = float(turn_s.sum()) + float(batch.tool_s[i, : k - 1].sum())
        return out

    def _batch_shape(self) -> tuple[int, int]:
        c = self.cfg
        shape, memory = self.sized.shape, self.sized.memory
        inst_kv_tokens = memory.dedicated_kv / memory.kvb_p
        trajectories = c.trajectories or batch_trajectories(c.rollout, shape.n_ded * inst_kv_tokens)
        return trajectories, bundle_size(c.rollout, trajectories, inst_kv_tokens)

    def _train_seconds(self, tokens: float) -> float:
        """Training time of one step's ``tokens``: the measured time per step (calibration), else the FLOPs model."""
        c = self.cfg
        if c.train_s is not None:
            return c.train_s
        shape = self.sized.shape
        return train_seconds(shape.pmodel, tokens, shape.trainer_gpus, shape.device, c.train_mfu)

    def _next_idle_s(self, batch) -> float:
        """Seconds from the end of this rollout to the next one's start (training + dedicated sync)."""
        return self._train_seconds(batch.tokens()) + self._sync_seconds()[0]

    def _sync_seconds(self) -> tuple[float, float]:
        """A new version's sync: to the dedicated pool over the trainer's fabric (co-batched: then folded into each
        instance's copy of the base), to the serving instances over the inter-cluster link (rose: a delta of a full
        policy; a LoRA adapter whole, as the executors price it: nearly all its elements move each step)."""
        c, mem = self.cfg, self.sized.memory
        serving_mode = "full" if c.rollout_mode == "co_batched" else self.policy.serving_sync_mode
        dedicated = sync_seconds(mem.policy_weight_bytes, "full", c.sync, cross_cluster=False) + fold_seconds(mem.fold_bytes, c.sync)
        return dedicated, sync_seconds(mem.policy_weight_bytes, serving_mode, c.sync, cross_cluster=True)

    # ------------------------------------------------------------------ processes
    def run(self):
        """The job: synchronous, or pipelined with prefetch or partial rollouts."""
        if self.cfg.prefetch_steps > 0 or self.cfg.over_provision > 0:
            yield from self.pipelined()
            return
        yield from self.synchronous()

    def synchronous(self):
        """Synchronous on-policy RL: sync weights -> roll out one batch -> train -> repeat."""
        c, env, t = self.cfg, self.env, self.turns
        self.mon.active_from = c.warmup_s - PREWARM_S
        yield env.timeout(c.warmup_s)
        trajectories, bundle = self._batch_shape()
        self.worker.size(c.worker_concurrency, bundle)
        for step in range(c.steps):
            t0 = env.now
            sync_ded, sync_srv = self._sync_seconds()
            if step > 0:  # the version trained last step (every prefix cache went with its batch: t.alloc below)
                self.state.published(t0 + sync_ded, t0 + sync_srv)
            yield env.timeout(sync_ded)  # the batch starts once the dedicated pool has the version
            t_roll = env.now
            self.inst.ready_at[self.inst.on_serving_gpus] = t0 + sync_srv
            batch = sample_batch(c.rollout, trajectories, self.batches, bundle)
            critical_s = float(self.critical_paths(batch).max()) if batch.n else 0.0
            t.bundle = batch.bundle
            t.alloc(batch.n)
            procs = [env.process(self.worker.trajectory(step, i, batch)) for i in range(batch.n)]
            yield simpy.AllOf(env, procs)
            end = float(t.finished_at.max()) if batch.n else env.now
            if end > env.now:
                yield env.timeout(end - env.now)
            rollout_s = env.now - t_roll
            # no rollout until the next batch: rose's monitor can rest until its windows must refill
            self.mon.active_from = env.now + self._next_idle_s(batch) - PREWARM_S
            fin = np.sort(t.finished_at[: batch.n])
            p90 = float(fin[int(0.9 * (len(fin) - 1))]) if len(fin) else env.now
            tail_s = max(0.0, env.now - p90)
            tokens = batch.tokens()
            train_s = self._train_seconds(tokens)
            yield env.timeout(train_s)
            self.state.steps.append(
                dict(
                    step=step,
                    start=t0,
                    rollout_s=rollout_s,
                    train_s=train_s,
                    sync_dedicated_s=sync_ded,
                    sync_serving_s=sync_srv,
                    step_s=env.now - t0,
                    tail_s=tail_s,
                    critical_s=critical_s,
                    trajectories=batch.trajectories,
                    bundle=batch.bundle,
                    tokens=tokens,
                    generated=batch.generated(),
                )
            )
        self.done.succeed()

    def _pipeline_shape(self) -> PipelineShape:
        """The asynchronous trainer's batches (``pipelined``): p capped at ``max_staleness``; the first batch goes out
        with k groups more when over-provisioning, then each step's hand-out refills the N it took."""
        c = self.cfg
        p = max(1, min(c.prefetch_steps, max(1, c.max_staleness))) if c.prefetch_steps > 0 else 0
        trajectories, bundle = self._batch_shape()
        n = math.ceil(trajectories / bundle)
        group_rows = max(1, int(round(c.rollout.group_size / bundle)))
        per_step = math.ceil(n / group_rows)
        extra = math.ceil(c.over_provision * per_step) * group_rows if c.over_provision > 0 else 0
        early = c.early_hand_out and 1 <= p < c.max_staleness  # as Trainer.hands_out_early
        slots = (c.max_staleness if early else max(p, c.max_staleness if extra else 0)) + 2  # turn-table slot groups: batches in flight, one spare
        return PipelineShape(p, trajectories, bundle, n, group_rows, per_step, extra, early, slots)

    def pipelined(self):
        """Asynchronous RL as services/trainer/trainer.py runs it with ``grpo.prefetch_steps`` = p >= 1.

        - Tasks: batches 0..p are handed out at the start; after every training step (and its
          publish) the next batch is handed out, so batch n+1.. rolls out on an older version while
          step n trains. The rollout worker runs ``worker_concurrency`` episodes at a time, oldest
          batch first. p is capped at ``max_staleness`` (further ahead, the collector would drop
          the batch as stale), so no trajectory is dropped here.
        - The trainer (``Trainer.next_groups``) polls every ``GROUP_POLL_S`` until a step's worth
          of groups (``groups_per_step``) is complete and takes exactly that many, oldest first;
          groups of a later batch that completed early wait for the next step.
        - ``early_hand_out`` (``Trainer.hand_out_early``): while it waits, the trainer hands the next
          batch out when the monitor's latest headroom reports no rollout queue on any executor
          (``RolloutCapacity``, the trainer's own class), as long as that batch is at most
          ``max_staleness`` ahead of the steps taken; after training it hands out only while the
          lead is below p + 1.
        - Weights: after training the trainer publishes (the dedicated pool has the version after
          the full sync), then hands out; serving instances get it over the inter-cluster link
          meanwhile. Rollout never stops for a sync: an executor swaps weights between iterations
          (the swap itself is taken as free) and a turn keeps the version it started on.
        - A step's period is the time between training completions, so a step completes when both
          its training and the groups it needs allow.
        - Partial rollouts (``over_provision``, also without prefetch: synchronous RL): the first batch
          goes out with k groups more, each step trains on the first N complete groups and the rest roll on.
        """
        c, env, tr = self.cfg, self.env, self.state
        ps = self._pipeline_shape()
        p = ps.prefetch
        tr.pipelined = p > 0
        tr.partial = c.over_provision > 0
        tr.effective_prefetch = p
        self.mon.active_from = c.warmup_s - PREWARM_S  # a batch is rolling out nearly always: rose's monitor never rests
        yield env.timeout(c.warmup_s)
        started = env.now
        self.worker.size(c.worker_concurrency, ps.bundle)
        self.turns.bundle = ps.bundle
        self.turns.alloc(ps.slots * (ps.rows + ps.extra))
        sync_ded, sync_srv = self._sync_seconds()
        if c.trajectory_fetch_s > 0:
            env.process(self.consumer())
        last_done = started if not tr.pipelined else None
        yield env.timeout(sync_ded)  # the first version reaches the dedicated pool
        if not tr.pipelined:  # synchronous: serving lanes roll out once they have the step's version, as ``synchronous``
            self.inst.ready_at[self.inst.on_serving_gpus] = started + sync_srv
        for b in range(p + 1):
            yield from self._hand_out(b, ps.trajectories + (ps.extra * ps.bundle if b == 0 else 0), ps)
        handed, per_step = p + 1, ps.per_step
        last_done = env.now if last_done is None else last_done
        for step in range(c.steps):
            t0 = env.now
            while len(tr.ready_groups) < per_step:
                if ps.early and handed - step <= c.max_staleness and handed < c.steps and self.capacity.idle(env.now, since=tr.handed_out_at):
                    yield from self._hand_out(handed, ps.trajectories, ps)
                    handed += 1
                    tr.early_hand_outs += 1
                yield env.timeout(GROUP_POLL_S)
                tr.drop_stale(step, c.max_staleness)  # as GroupCollector.expire: past the bound, dropped whole, counted
            # as Trainer.next_groups: exactly one step's worth, oldest first, the rest kept for the next step
            tr.ready_groups.sort(key=lambda g: (g[0], g[1]))
            taken, tr.ready_groups = tr.ready_groups[:per_step], tr.ready_groups[per_step:]
            waited = env.now - t0
            rollout_s, tail_s = tr.took(taken, t0, env.now)
            # without prefetch, the least rollout time of this step: it needs N complete groups, of which at most the k
            # carried ones may be done already; the rest come from the batch handed out at its start
            fresh = sorted(tr.batch_info[step]["group_crit"]) if not tr.pipelined and step in tr.batch_info else []
            need = per_step - (0 if step == 0 else ps.extra // ps.group_rows)
            critical_s = fresh[need - 1] if fresh and 1 <= need <= len(fresh) else 0.0
            tokens = sum(t for _, _, t in taken)
            train_s = self._train_seconds(tokens)
            yield env.timeout(train_s)
            tr.published(env.now + sync_ded, env.now + sync_srv)
            if not tr.pipelined:
                self.inst.ready_at[self.inst.on_serving_gpus] = env.now + sync_srv
            yield env.timeout(sync_ded)  # publish: the dedicated pool has the new version
            # versions between the one a group's batch was handed out at and the one trained on
            staleness = float(np.mean([step - tr.batch_version[b] for b, _, _ in taken])) if taken else 0.0
            tr.trained_lags.extend(step - tr.batch_version[b] for b, _, _ in taken)
            tr.steps.append(
                dict(
                    step=step,
                    start=t0,
                    done=env.now,
                    wait_s=waited,
                    train_s=train_s,
                    sync_dedicated_s=sync_ded,
                    sync_serving_s=sync_srv,
                    step_s=env.now - last_done,
                    groups=len(taken),
                    batches=sorted({b for b, _, _ in taken}),
                    tokens=tokens,
                    staleness=staleness,
                    trajectories=ps.trajectories,
                    bundle=ps.bundle,
                    # without prefetch (partial rollouts only) a step's rollout is from its start to its groups in hand
                    rollout_s=rollout_s if not tr.pipelined else float("nan"),
                    tail_s=tail_s,
                    critical_s=critical_s,
                    generated=sum(tr.group_generated[(b, g)] for b, g, _ in taken),
                )
            )
            last_done = env.now
            if handed < step + 1 + p + 1:  # the lead back to p (not when a batch went out early meanwhile)
                yield from self._hand_out(handed, ps.trajectories, ps)
                handed += 1
        self.done.succeed()

    def _hand_out(self, b: int, trajectories: int, ps: PipelineShape):
        """Hand out batch ``b`` of ``trajectories``: its trajectories start (the worker's slots permitting) in
        turn-table slot group b mod ``ps.slots``."""
        env, tr, slots, group_rows = self.env, self.state, ps.slots, ps.group_rows
        old = tr.batch_info.get(b - slots)
        if old is not None and old["procs"]:  # its slot group is reused: the batch before must be out (it nearly always is)
            yield simpy.AllOf(env, old["procs"])
        batch = sample_batch(self.cfg.rollout, trajectories, self.batches, ps.bundle)
        groups = math.ceil(batch.n / group_rows)
        per_traj = [
            (
                int(batch.prompt[i])
                + int(batch.gen[i, : int(batch.turns[i])].sum())
                + int(batch.tool_tokens[i, : max(0, int(batch.turns[i]) - 1)].sum())
            )
            * batch.bundle
            for i in range(batch.n)
        ]
        crit = self.critical_paths(batch)
        group_crit = []
        for g in range(groups):
            rows = range(g * group_rows, min(batch.n, (g + 1) * group_rows))
            group_crit.append(float(crit[list(rows)].max()))
            tr.group_generated[(b, g)] = int(sum(int(batch.gen[i, : int(batch.turns[i])].sum()) for i in rows)) * batch.bundle
        tr.handed_tokens += float(sum(per_traj))
        tr.handed_trajectories += batch.trajectories
        info: dict[str, Any] = dict(
            batch=b,
            handed=env.now,
            first=None,
            last=env.now,
            finished=[],
            left=[min(group_rows, batch.n - g * group_rows) for g in range(groups)],
            group_fins=[[] for _ in range(groups)],  # finish times of each group's trajectories (the step's tail)
            group_crit=sorted(group_crit),  # each group's least rollout time (``critical_paths``), shortest first
            group_rows=group_rows,
            bundle=batch.bundle,
            group_tokens=[float(sum(per_traj[g * group_rows : (g + 1) * group_rows])) for g in range(groups)],
            generated=batch.generated(),
            trajectories=batch.trajectories,
            procs=[],
        )
        tr.batch_info[b] = info
        tr.batch_version[b] = len(tr.steps)  # the version its trajectories start on (the steps trained so far)
        tr.handed_out_at = env.now
        base = (b % slots) * (ps.rows + ps.extra)
        info["procs"] = [env.process(self.worker.trajectory(b, i, batch, base + i, info)) for i in range(batch.n)]
        tr.batches_done_stats()
        tr.batch_info.pop(b - slots - 1, None)

    def consumer(self):
        """The trainer's trajectory consumer: fetch windows of ``trajectory_fetch_s`` back to back; a
        window closes early once a fetch's worth (64 trajectories) has arrived."""
        env, window, tr = self.env, self.cfg.trajectory_fetch_s, self.state
        per_fetch = max(1, TRAINER_FETCH_BATCH // max(1, self.turns.bundle))
        while True:
            end = env.now + window
            while len(tr.arrived) < per_fetch and env.now < end - 1e-12:
                tr.arrival_evt = env.event()
                yield simpy.AnyOf(env, [tr.arrival_evt, env.timeout(end - env.now)])
            tr.arrival_evt = None
            tr.deliver(min(per_fetch, len(tr.arrived)))
