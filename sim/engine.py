"""The fleet simulator: SimPy processes (trainer, trajectories) over a per-second fluid model of
every instance (coserve.py), with the services' decisions made by their own functions
(policies.py).

The fleet (``SimConfig``): ``gpus`` serving GPUs in instances of ``serving_tp`` GPUs (sized
so the serving model and a copy of the policy fit, devices.py); a dedicated rollout pool of
``rollout_gpu_ratio x gpus`` GPUs in instances of ``rollout_tp``; a trainer of
``trainer_gpu_ratio x gpus`` GPUs in the dedicated pool's cluster. Serving traffic follows a
trace (traces.py) scaled to ``load`` x the fleet's SLO capacity. RL is synchronous on-policy
(one version per step): sync weights -> roll out one batch (rollouts.py) -> train -> repeat;
or, with ``prefetch_steps`` >= 1, asynchronous as the reference trainer runs it
(trainer.py ``Trainer.pipelined``: the next batches roll out on older versions while a step trains).

Processes and time:
- a clock ticks every ``dt`` (1 s; an emulated job's 0.05 s, bench/emulated.py; ``Simulation._tick``): Poisson
  arrivals per serving instance, the serving model (latency, SLO accounting) with what each instance's rollout lane
  gets (two-model: coserve.py ``lane_second``; co-batched mode, ``SimConfig.rollout_mode``: the rows that ride
  serving's own iterations, co_batched.py ``co_batched_second``), rollout progress (rollout.py: admission FIFO under
  the batch-slot and KV caps; iterations as the executor runs them, a decode step with the executor's prefill chunk
  riding on it, ``mixed_s``), turn completions (at their interpolated time inside the tick), then the control plane:
  the monitor's burst detection and headroom (monitor.py ``SloMonitor``), then the scheduler's lease plan
  (``plan_lending`` in the policy's mode), leases applied and enforced (control.py);
- the trainer's process (trainer.py); one process per (bundle of) trajectory (worker.py): route a turn (the
  scheduler's ``place_turn`` over its ``Fleet``), wait for it, run the tool, next turn;
- training time = 8 x params x tokens / (trainer GPUs x peak x ``train_mfu``) (forward +
  backward = 6, old-logprob forward = 2 FLOPs per parameter and token; MFU 0.4 assumed);
- weight sync per step (weights.py): the dedicated pool over the trainer's fabric before the
  batch starts; serving instances over the inter-cluster link (rose: delta; the others:
  full), rollout on them waits for it.

Rollout workers follow shared/turns/runner.py: every route request names the turn's
RL batch and its size (the scheduler's tail rule); an interrupted turn resumes elsewhere with
its tokens (recompute), a refused one goes elsewhere, a straggler past the route's
``hedge_after_s`` (a turn on a lease) or max(2 s, 1.5 x the typical turn) asks the scheduler
for a hedge (``should_hedge``) and the first result wins. The scheduler's ``Fleet`` reads a
finished trajectory's turns (model error of its placement predictions) as the service does.
Batches have a random stream of their own, so every policy rolls out the same batches. Prefix
caches follow the executor's (``TurnTable``): one entry per trajectory and instance, evicted
oldest first, written through to a host tier of ``host_kv_ratio`` x the instance's rollout KV
(a restore delays its turn by the copy, ``Roofline.host_load_s``), missed once the instance has
a newer policy version (``TrainerState.version_at``).

Partial rollouts (``over_provision``, grpo.over_provision): the first batch goes out with k
groups more, each step trains on the first N complete groups and the rest roll on into the next
steps (``Trainer.pipelined``, also without prefetch: synchronous RL); a group whose trajectories
started more than ``max_staleness`` versions before the step is dropped, counted.

Not simulated: executor failures, the worker's per-attempt timeout (its 60 s default is sized
for the tiny CPU models), the trainer's time to hand out a batch (~0.1-0.2 s per step on the
e2e box), preemption inside a running batch when a lease shrinks.

Who owns which state (the engine reads the fixed figures everywhere and writes them nowhere; each
changing part has one owner):
- ``Simulation.sized`` (sizing.py ``SizedFleet``, fixed): ``shape`` (models, device, instance
  counts and widths, step models), ``memory`` (weights, KV per token, the serving pool, what a
  serving instance can lend, a dedicated instance's rollout KV), ``traffic`` (the serving trace
  and its request sizes, one instance's SLO capacity) and the rollout figures;
- ``Simulation.serving`` (sizing.py ``ServingSetup``, fixed per policy): co-hosting or not, the
  serving KV pool, the lane ceiling, the serving-alone baseline;
- ``Simulation.streams`` (``RandomStreams``): serving arrivals and the RL job's batches, each its
  own stream (the router draws from its own);
- ``clock`` (clock.py ``Clock``): the tick count;
- ``inst`` (instances.py ``Instances``): per instance, what its rollout lane may hold now (lease
  caps, a burst's park), when it has the current weights, each serving instance's queue;
- ``turns`` (turns.py ``TurnTable``): the turns in flight, their prefix caches, ``bundle``;
- ``rollout`` (rollout.py ``RolloutEngines``): what the engines' last tick left for the monitor to
  report (turns running and queued, the device share rollout got lately), the lane pool's share;
- ``monitor.state`` (monitor.py ``MonitorState``): the SLO monitor's windows, detectors and step
  models, and when it may rest;
- ``router`` (routing.py ``Router``): the scheduler's ``Fleet`` (roles, leases, headroom, the
  trajectories in flight), its per-tick placement candidates and settings;
- ``capacity`` (services/trainer ``RolloutCapacity``): the trainer's view of the same headroom;
- ``worker`` (worker.py ``RolloutWorker``): episode slots and recent turn times;
- ``trainer.state`` (trainer_state.py ``TrainerState``): steps trained, batches handed out, groups waiting;
- ``counts`` (counters.py ``Counters``): the result's tallies, written only;
- ``Simulation`` itself: the configuration, the SimPy environment and the policy.

Who changes them:
- the clock (``Simulation._tick``): arrivals, serving's second (``inst.queue``), the tick into
  ``monitor.state``, then in turn the rollout engines, the monitor and the scheduler;
- ``rollout.tick``: admission and progress of ``turns`` under ``inst``'s caps, turn ends (their
  events, the prefix caches they leave);
- ``monitor`` (monitor.py ``SloMonitor``): at each metrics snapshot, alerts (the policy's
  ``on_alert``), step models and every executor's headroom, through ``control``;
- ``control`` (control.py ``ControlPlane``): leases applied, parked and taken back on ``inst`` and
  ``turns``, headroom into ``router.fleet`` and ``capacity``, each tick's lease expiries and park ends;
- ``worker`` (``RolloutWorker.trajectory``): each trajectory's turns (routes, ``turns`` rows, prefix
  cache entries taken), a finished trajectory reported to ``router.fleet`` and ``trainer.state``;
- ``trainer`` (trainer.py ``Trainer``): the job's loop: weight versions (``inst.ready_at``,
  ``trainer.state``), batches handed out (``turns`` rows, the worker's processes), the monitor's rest.
"""

from __future__ import annotations

import numpy as np
import simpy

from rose.services.trainer.capacity import RolloutCapacity
from rose.shared.workload import steady_step_rate

from . import POLICIES
from .ceiling import rollout_capacity_ceiling
from .clock import Clock
from .co_batched import CoBatchPlan, co_batched_second
from .config import SimConfig
from .control import ControlPlane
from .coserve import ServingTick, lane_second
from .counters import Counters
from .instances import Instances
from .monitor import SloMonitor
from .policies import executor_signals, make_fleet_policy
from .rollout import RolloutEngines
from .routing import Router
from .sizing import Infeasible as Infeasible  # re-exported: bench/sim.py, plan.py and tests catch it from here
from .sizing import lane_shares, serving_setup, size_fleet
from .trainer import Trainer
from .trainer_state import TrainerState
from .turns import TurnTable
from .worker import RolloutWorker


class RandomStreams:
    """The run's random streams, one per use: serving arrivals and the RL job's batches.

    Separate streams so that every policy rolls out the same batches: a shared stream would shift with
    the ticks and the draws a policy's rollout takes."""

    def __init__(self, seed: int) -> None:
        self.arrivals = np.random.default_rng(seed)
        self.batches = np.random.default_rng([seed, 1])


class Simulation:
    """One run: the clock's process and the trainer's (which starts one per trajectory) over the parts the
    module docstring lists by owner. The fixed figures come from ``size_fleet`` and ``serving_setup``
    (sizing.py); this class builds the parts, ticks the clock over them and reads the result."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.streams = RandomStreams(cfg.seed)
        self.env = env = simpy.Environment()
        if cfg.policy not in POLICIES:
            make_fleet_policy(cfg.policy)  # raises with the list of policies
        self.sized = sized = size_fleet(cfg)
        shape, memory = sized.shape, sized.memory
        self.policy = make_fleet_policy(cfg.policy, cfg.quantum_ms, cfg.max_rollout_batch, max(0.0, memory.cohost_free_bytes))
        self.serving = serving_setup(cfg, sized, self.policy)
        if cfg.lane_pool and cfg.policy != "static":
            raise ValueError(f"lane_pool runs static's job on the lane pool, not {cfg.policy!r}")
        if cfg.lane_pool and cfg.rollout_mode != "two_model":
            raise ValueError("lane_pool runs two-model lanes (a policy copy in bounded quanta): rollout_mode must be two_model")
        # the lane pool's instances, where a serving instance has memory to lend (else the lane pool is static itself)
        self.inst = inst = Instances(shape.n_serv, shape.n_ded, shape.n_serv if cfg.lane_pool and memory.can_cohost else 0)
        for d in range(shape.n_serv, inst.D):
            lane = bool(inst.is_lane[d])
            inst.set_caps(d, sized.max_rollout_batch, max(0.0, memory.cohost_free_bytes) if lane else memory.dedicated_kv)
        # the lane pool's run: per second, the share of its serving instance's time each lane instance gets (None: no lanes)
        lane_pool_share = (
            lane_shares(sized, make_fleet_policy("rose", cfg.quantum_ms).executor_policy, memory.pool_tokens) if inst.is_lane.any() else None
        )
        self.turns = TurnTable(inst.D)  # sized per step by the trainer
        self.router = Router(self.policy, inst, self.turns, cfg.rollout.group_size, cfg.seed)
        self.capacity = RolloutCapacity()  # the trainer's view of the same headroom (grpo.early_hand_out)
        self.counts = Counters()
        self.clock = Clock(cfg.dt)
        record = TrainerState()
        self.rollout = RolloutEngines(sized, inst, self.turns, record, self.counts, lane_pool_share)
        self.control = ControlPlane(env, cfg, self.policy, sized, self.serving, inst, self.turns, self.router.fleet, self.capacity, self.counts)
        self.monitor = SloMonitor(self.policy, cfg, sized, self.serving, inst, self.rollout, self.control, self.counts)
        self.worker = RolloutWorker(env, cfg, self.clock, sized, inst, self.turns, self.router, self.rollout, record, self.counts)
        mon = self.monitor.state
        self.trainer = Trainer(env, cfg, self.policy, sized, self.streams.batches, inst, self.turns, mon, self.worker, self.capacity, record)

    # ------------------------------------------------------------------ the clock
    def _clock(self):
        env, dt = self.env, self.clock.dt
        while True:
            self._tick(env.now, dt)
            yield env.timeout(dt)

    def _tick(self, now: float, dt: float) -> None:
        """One tick: serving's second and what each rollout lane gets of it, the rollout engines' second, the tick
        recorded for the monitor, then the control plane."""
        c, pol, inst, turns = self.cfg, self.policy, self.inst, self.turns
        n, mon = inst.n_serv, self.monitor.state
        traffic = self.sized.traffic
        fleet_rps = float(traffic.fleet_rate[min(len(traffic.fleet_rate) - 1, int(now))])
        lent = inst.lent()
        serving_mode = ~lent if pol.drains_lent else np.ones(n, dtype=bool)
        per_inst = fleet_rps / max(1, int(serving_mode.sum()))
        arrivals = np.where(serving_mode, self.streams.arrivals.poisson(per_inst * dt, n), 0).astype(float)
        # latency from the expected rate (the p99 formulas already hold the Poisson variation);
        # the sampled arrivals feed burst detection and request accounting
        rate = np.where(serving_mode, per_inst, 0.0)
        # rollout running on serving instances, at the start of the tick
        running = turns.state == 2
        br = np.bincount(turns.dev[running], minlength=inst.D)[:n] * turns.bundle if running.any() else np.zeros(n)
        st, extra, lane_share, co_plan = self._serving_second(now, dt, rate, br, running)
        inst.queue = np.where(serving_mode, st.queue, 0.0)
        inst.prev_iter_ms = st.iteration_s * 1e3
        violating = self._count_serving(now, dt, serving_mode, arrivals, st, lent)
        tokens = self._rollout_second(now, dt, lane_share, co_plan)
        mon.record_rollout(self.clock.ticks, tokens)
        mon.record_serving(self.clock.ticks, serving_mode, st, extra, arrivals, inst.queue, br)
        self.clock.ticks += 1
        self._control_plane(now, st)
        if c.record_timeline:
            tl = self.counts.timeline
            tl["t"].append(now)
            tl["fleet_rps"].append(fleet_rps)
            tl["rollout_tps"].append(float(tokens.sum()) / dt)
            tl["lent"].append(int(inst.lent().sum()))
            tl["violating"].append(int(violating.sum()))

    def _serving_second(
        self, now: float, dt: float, rate: np.ndarray, br: np.ndarray, running: np.ndarray
    ) -> tuple[ServingTick, np.ndarray, np.ndarray, CoBatchPlan | None]:
        """(serving's second, what rollout adds to each serving iteration, the share of the device rollout's forwards
        get, the co-batched plan the rollout engines follow) per serving instance, with ``br`` rollout sequences
        running there (``running``: the turns that run). Two-model: a lane of its own in bounded quanta between
        serving's iterations (coserve.py). Co-batched: rows in serving's own iterations (co_batched.py)."""
        c, inst, n, turns = self.cfg, self.inst, self.inst.n_serv, self.turns
        shape, traffic, serving = self.sized.shape, self.sized.traffic, self.serving
        sizes = (traffic.prompt_mean, traffic.output_mean, traffic.prompt_p99)
        may_run = (inst.ready_at[:n] <= now) & (inst.slots[:n] > 0)  # a lease and the current weights
        if serving.co_batched:
            decoding, ctx, _, cached, waiting = (a[:n] for a in turns.ready_to_ride())
            return co_batched_second(
                shape.sperf,
                c.lora,
                rate,
                sizes,
                inst.queue,
                dt,
                serving.kv_tokens,
                (decoding * turns.bundle, ctx, cached, waiting),
                may_run,
                chunk_tokens=shape.pperf_s.rollout_prefill_tokens,
                slo_tpot_s=c.slo_tpot_ms / 1e3,
                quantum_s=c.quantum_ms / 1e3,
                guarded=self.policy.name != "naive_share",
            )
        mon = self.monitor.state
        last_bs = mon.ring["bs"][:, (self.clock.ticks - 1) % mon.W]
        ep = self.policy.executor_policy if serving.cohosting else None
        st, extra, lane_share = lane_second(
            ep,
            shape.sperf,
            shape.pperf_s,
            sizes,
            rate,
            br,
            turns.mean_ctx(running)[:n],
            may_run,
            inst.queue,
            dt,
            serving.kv_tokens,
            self.sized.turn_p90,
            lambda d: executor_signals(now, last_bs[d], inst.prev_iter_ms[d], c.slo_tpot_ms),
        )
        return st, extra, lane_share, None

    def _count_serving(self, now: float, dt: float, serving_mode: np.ndarray, arrivals: np.ndarray, st: ServingTick, lent: np.ndarray) -> np.ndarray:
        """Serving's SLO accounting for the tick; which serving instances broke the SLO with requests arriving."""
        c, acc, serving, n = self.cfg, self.counts.serving, self.serving, self.inst.n_serv
        slo_ttft, slo_tpot = c.slo_ttft_ms / 1e3, c.slo_tpot_ms / 1e3
        violating = serving_mode & (arrivals > 0) & ((st.ttft_p99_s > slo_ttft) | (st.tpot_p99_s > slo_tpot))
        acc.violations += float(violating.sum()) * dt
        acc.bad_requests += float(arrivals[violating].sum())
        acc.requests += float(arrivals.sum())
        acc.serving_instance_s += float(int(serving_mode.sum())) * dt
        # the same trace on the whole fleet serving alone (what static sees), for attribution
        acc.violations_alone += float(serving.alone_bad[min(len(serving.alone_bad) - 1, int(now))]) * n * dt
        if serving.cohosting:
            acc.lent_instance_s += float(lent.sum()) * dt
        return violating

    def _rollout_second(self, now: float, dt: float, lane_share: np.ndarray, co_plan: CoBatchPlan | None) -> np.ndarray:
        """The rollout engines' tick at the share of the device each gets (a serving instance ``lane_share`` where its
        policy runs rollout there); the tokens each generated."""
        acc, serving, t = self.counts.rollout, self.serving, self.turns
        lanes = lane_share if self.policy.executor_policy is not None and serving.cohosting else None
        share = self.rollout.shares(now, lanes)
        if t.N and bool(((t.state == 1) | (t.state == 2)).any()):
            acc.rollout_work_s += dt
            if serving.lane_ceiling is not None:
                acc.lane_ceiling_s += float(serving.lane_ceiling[min(len(serving.lane_ceiling) - 1, int(now))]) * self.inst.n_serv * dt
        return self.rollout.tick(now, dt, share, co_plan)

    def _control_plane(self, now: float, st: ServingTick) -> None:
        """After the tick: the monitor's snapshots (every ``k_snap`` ticks; rose's may rest while no rollout is
        coming), the scheduler's lease plan (every ``k_sched``), each executor's lease enforcement."""
        pol, mon, ticks = self.policy, self.monitor.state, self.clock.ticks
        if pol.uses_monitor and ticks % mon.k_snap == 0 and (not pol.monitor_idle_skippable or now >= mon.active_from):
            self.monitor.serving_snapshot(now, ticks, st)
        if ticks % mon.k_snap == 0:
            self.monitor.dedicated_snapshot(now, ticks)
        if ticks % self.clock.k_sched == 0:
            pol.control(self.control, now)
        self.control.enforce(now)

    # ------------------------------------------------------------------ run
    def run(self) -> dict:
        c, env = self.cfg, self.env
        env.process(self._clock())
        env.process(self.trainer.run())
        env.run(until=simpy.AnyOf(env, [self.trainer.done, env.timeout(c.warmup_s + c.max_sim_s)]))
        return self.result()

    def result(self) -> dict:
        """The run's figures (``simulate``'s result), from the trainer's record and the counters."""
        c, a, tr = self.cfg, self.counts, self.trainer.state
        sized, serving = self.sized, self.serving
        shape = sized.shape
        steps = tr.steps
        complete = len(steps) == c.steps
        step_s = float(np.mean([s["step_s"] for s in steps])) if steps else float("nan")
        rate = 3600.0 / step_s if steps else 0.0
        rollouts = steps
        if tr.pipelined:
            tr.batches_done_stats()
            rollouts = tr.batch_spans
            if len(steps) >= 2:  # steady state, as rose bench e2e measures it (shared/workload.py)
                rate = steady_step_rate([s["done"] for s in steps], tr.effective_prefetch)
                step_s = 3600.0 / rate if rate > 0 else float("nan")
        rollout_s = float(np.mean([s["rollout_s"] for s in rollouts])) if rollouts else float("nan")
        gen = sum(s["generated"] for s in rollouts)
        roll_total = sum(s["rollout_s"] for s in rollouts)
        sim_s = max(1e-9, self.env.now)
        hits, misses = a.turns.prefix_hits, a.turns.prefix_misses
        lane = (
            a.rollout.lane_ceiling_s / (a.rollout.rollout_work_s * shape.n_serv)
            if serving.lane_ceiling is not None and a.rollout.rollout_work_s > 0
            else None
        )
        return dict(
            model=c.model,
            device=c.device,
            gpus=c.gpus,
            policy=c.policy,
            rollout_mode=c.rollout_mode,  # two_model, or co_batched (sim/co_batched.py)
            complete=complete,
            steps=len(steps),
            serving_instances=shape.n_serv,
            serving_tp=shape.tp_s,
            dedicated_instances=shape.n_ded,
            rollout_tp=shape.tp_r,
            rollout_gpus=shape.n_ded * shape.tp_r,
            trainer_gpus=shape.trainer_gpus,
            cohosting=serving.cohosting,
            serving_capacity_rps_per_instance=sized.traffic.cap_rps,
            cohost_free_gb=sized.memory.cohost_free_bytes / 1e9,
            rl_steps_per_hour=rate,
            step_s=step_s,
            rollout_s_per_step=rollout_s,
            prefetch_steps=tr.effective_prefetch,
            trainer_wait_s_per_step=float(np.median([s["wait_s"] for s in steps[1:]])) if tr.pipelined and len(steps) > 1 else None,
            groups_per_trained_step=float(np.mean([s["groups"] for s in steps])) if tr.pipelined and steps else None,
            staleness_mean=float(np.mean([s["staleness"] for s in steps])) if (tr.pipelined or tr.partial) and steps else 0.0,
            # partial rollouts: the most versions a trained group lagged, the complete groups dropped past max_staleness, and
            # the length bias of what completes first (mean tokens of a trained trajectory over a handed-out one's)
            over_provision=c.over_provision,
            policy_model=c.policy_model or c.model,
            staleness_max=max(tr.trained_lags, default=0),
            stale_groups_dropped=tr.stale_groups,
            length_bias=(tr.trained_tokens / tr.trained_trajectories) / (tr.handed_tokens / tr.handed_trajectories)
            if tr.trained_trajectories and tr.handed_trajectories
            else None,
            tail_s_per_step=float(np.mean([s["tail_s"] for s in rollouts])) if rollouts else float("nan"),
            critical_s_per_step=float(np.mean([s.get("critical_s", 0.0) for s in steps])) if steps else 0.0,
            early_hand_outs=tr.early_hand_outs,
            train_s_per_step=float(np.mean([s["train_s"] for s in steps])) if steps else float("nan"),
            sync_serving_s=float(steps[0]["sync_serving_s"]) if steps else float("nan"),
            trajectories_per_step=steps[0]["trajectories"] if steps else 0,
            bundle=steps[0]["bundle"] if steps else 0,
            rollout_tokens_per_s=gen / roll_total if roll_total else 0.0,
            turn_s_p50=float(np.median(a.rollout.turn_durations)) if a.rollout.turn_durations else float("nan"),
            dedicated_rollout_tokens_per_s=float(np.mean(a.rollout.ded_snapshots_tps)) if a.rollout.ded_snapshots_tps else 0.0,
            tail_fraction=sum(s["tail_s"] for s in rollouts) / roll_total if roll_total else 0.0,
            rollout_tokens_on_serving_fraction=a.rollout.serving_tokens / max(1.0, a.rollout.rollout_tokens),
            lane_pool_instances=int(self.inst.is_lane.sum()),
            rollout_tokens_on_lane_pool_fraction=a.rollout.lane_pool_tokens / max(1.0, a.rollout.rollout_tokens),
            lane_share_ceiling=lane,
            rollout_capacity_ceiling=rollout_capacity_ceiling(lane, shape.n_serv * shape.tp_s, shape.n_ded * shape.tp_r),
            lane_value=sized.lane_value,
            rollout_capacity_ceiling_kv=rollout_capacity_ceiling(lane, shape.n_serv * shape.tp_s, shape.n_ded * shape.tp_r, sized.lane_value),
            unlendable_reasons=dict(a.control.unlendable.most_common(3)),
            slo_violations=a.serving.violations,
            slo_violations_serving_alone=a.serving.violations_alone,
            serving_slo_attainment=1.0 - a.serving.bad_requests / max(1.0, a.serving.requests),
            lent_instance_fraction=a.serving.lent_instance_s / max(1e-9, sim_s * shape.n_serv),
            leases=dict(granted=a.control.granted, renewed=a.control.renewed, revoked=a.control.revoked, expired=a.control.expired),
            alerts=a.control.alerts,
            interrupted_turns=a.turns.interrupted,
            parked_leases=a.control.parks,
            aborted_turns=a.turns.aborted,
            bounced_turns=a.turns.bounced,
            hedges=a.turns.hedges,
            hedge_wins=a.turns.hedge_wins,
            # every placement by the executor's role and the rule that made it (placement.py RULES), most first
            placement_rules=dict(self.router.rules.most_common()),
            # later turns' first attempts that found part of their prompt cached where they ran (`rose bench elastic`'s)
            prefix_hit_rate=hits / (hits + misses) if hits + misses else 0.0,
            # of the context their turn before computed, the share found cached (bench/e2e.py ``later_turns``)
            prefix_reuse=a.turns.prefix_cached_tokens / a.turns.prefix_reusable_tokens if a.turns.prefix_reusable_tokens else 0.0,
            prefix_host_share=a.turns.host_hits / (hits + misses) if hits + misses else 0.0,  # of them, from the host tier
            # the prefill that prefix-cache misses redid, over every rollout forward's device time
            reprefill_share=a.turns.reprefill_s / a.rollout.device_s if a.rollout.device_s > 0 else 0.0,
            reprefill_moved_share=a.turns.reprefill_moved_s / a.rollout.device_s if a.rollout.device_s > 0 else 0.0,
            simulated_s=sim_s,
        )


def simulate(cfg: SimConfig) -> dict:
    """Run one configuration; the result dict (plus ``timeline`` when recorded)."""
    sim = Simulation(cfg)
    out = sim.run()
    if cfg.record_timeline:
        out["timeline"] = sim.counts.timeline
    return out
