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
(``_trainer_pipelined``: the next batches roll out on older versions while a step trains).

Processes and time:
- a clock ticks every ``dt`` (1 s; an emulated job's 0.05 s, bench/emulated.py): Poisson arrivals per
  serving instance, the serving model (latency, SLO accounting), what each instance's rollout lane gets (co-batched
  mode, ``SimConfig.rollout_mode``: the rows that ride serving's own iterations, co_batched.py),
  rollout progress (admission FIFO under the batch-slot and KV caps; iterations as the executor runs
  them, a decode step with the executor's prefill chunk riding on it, ``mixed_s``), turn completions
  (at their interpolated time inside the tick), then the control plane: the monitor's burst
  detection and headroom, then the scheduler's lease plan (``plan_lending`` in the policy's mode);
- a trainer process per step; one process per (bundle of) trajectory: route a turn (the
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
steps (``_trainer_pipelined``, also without prefetch: synchronous RL); a group whose trajectories
started more than ``max_staleness`` versions before the step is dropped, counted.

Not simulated: executor failures, the worker's per-attempt timeout (its 60 s default is sized
for the tiny CPU models), the trainer's time to hand out a batch (~0.1-0.2 s per step on the
e2e box), preemption inside a running batch when a lease shrinks.

Who owns which state (the engine reads the fixed figures everywhere and writes them nowhere; each
changing part has one owner, which the processes below update):
- ``Simulation.sized`` (sizing.py ``SizedFleet``, fixed): ``shape`` (models, device, instance
  counts and widths, step models), ``memory`` (weights, KV per token, the serving pool, what a
  serving instance can lend, a dedicated instance's rollout KV), ``traffic`` (the serving trace
  and its request sizes, one instance's SLO capacity) and the rollout figures;
- ``Simulation.serving`` (sizing.py ``ServingSetup``, fixed per policy): co-hosting or not, the
  serving KV pool, the lane ceiling, the serving-alone baseline;
- ``Simulation.streams`` (``RandomStreams``): serving arrivals and the RL job's batches, each its
  own stream (the router draws from its own);
- ``inst`` (instances.py ``Instances``): per instance, what its rollout lane may hold now (lease
  caps, a burst's park), when it has the current weights, each serving instance's queue;
- ``turns`` (turns.py ``TurnTable``): the turns in flight, their prefix caches, ``bundle``;
- ``mon`` (monitor.py ``MonitorState``): the SLO monitor's windows, detectors and step models;
- ``router`` (routing.py ``Router``): the scheduler's ``Fleet`` (roles, leases, headroom, the
  trajectories in flight), its per-tick placement candidates and settings;
- ``capacity`` (services/trainer ``RolloutCapacity``): the trainer's view of the same headroom;
- ``worker`` (worker.py ``RolloutWorker``): episode slots and recent turn times;
- ``trainer`` (trainer_state.py ``TrainerState``): steps trained, batches handed out, groups waiting;
- ``counts`` (counters.py ``Counters``): the result's tallies, written only;
- ``Simulation`` itself: the configuration, the SimPy environment, the policy, the clock's tick
  and the event that ends the run.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import simpy

from rose.contracts.executor import ExecutorRole
from rose.contracts.slo import Headroom, SloAlert
from rose.services.executor.metrics import PREFILL_RATE_EMA
from rose.services.scheduler.fleet import Fleet
from rose.services.slo_monitor.windows import WindowStats
from rose.services.trainer.capacity import RolloutCapacity
from rose.shared.devices import sync_seconds, train_seconds
from rose.shared.turns.hedging import hedge_ask_again_after
from rose.shared.workload import batch_trajectories, bundle_size, sample_batch, steady_step_rate

from . import POLICIES
from .ceiling import rollout_capacity_ceiling
from .co_batched import CoBatchPlan, co_batch_plan
from .config import SimConfig
from .coserve import rollout_interference, rollout_share, serving_tick
from .counters import Counters
from .instances import Instances
from .monitor import MonitorState
from .policies import executor_signals, make_fleet_policy, monitor_settings, serving_snapshot
from .routing import Router
from .sizing import Infeasible as Infeasible  # re-exported: bench/sim.py, plan.py and tests catch it from here
from .sizing import lane_shares, serving_setup, size_fleet
from .trainer_state import TrainerState
from .turns import TurnTable
from .worker import RolloutWorker

SCHEDULER_TICK_S = 0.5  # the scheduler's lease planning (services/scheduler/config.py tick_s)
PREWARM_S = 35.0  # rose's per-executor monitor runs from this long before a rollout phase (its windows are 30 s)
GROUP_POLL_S = 0.1  # the trainer looks for complete groups this often (services/trainer/trainer.py GROUP_POLL_S)
# the trainer's trajectory consumer (shared/bus.py): fetch(64, timeout=1 s) in a loop; a fetch returns once 64
# messages arrived or its window ends (config.py FETCH_WINDOW_S), so the trainer learns of a trajectory only then
# (a test checks both constants)
TRAINER_FETCH_BATCH = 64


class RandomStreams:
    """The run's random streams, one per use: serving arrivals and the RL job's batches.

    Separate streams so that every policy rolls out the same batches: a shared stream would shift with
    the ticks and the draws a policy's rollout takes."""

    def __init__(self, seed: int) -> None:
        self.arrivals = np.random.default_rng(seed)
        self.batches = np.random.default_rng([seed, 1])


class Simulation:
    """One run: the SimPy processes (the clock, the trainer, one per trajectory) over the state the
    module docstring lists by owner. The fixed figures come from ``size_fleet`` and
    ``serving_setup`` (sizing.py); this class holds the parts and runs the processes over them."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.streams = RandomStreams(cfg.seed)
        self.env = simpy.Environment()
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
        self.inst = Instances(shape.n_serv, shape.n_ded, shape.n_serv if cfg.lane_pool and memory.can_cohost else 0)
        for d in range(shape.n_serv, self.inst.D):
            lane = bool(self.inst.is_lane[d])
            self.inst.set_caps(d, sized.max_rollout_batch, max(0.0, memory.cohost_free_bytes) if lane else memory.dedicated_kv)
        # the lane pool's run: per second, the share of its serving instance's time each lane instance gets (None: no lanes)
        self.lane_pool_share = (
            lane_shares(sized, make_fleet_policy("rose", cfg.quantum_ms).executor_policy, memory.pool_tokens) if self.inst.is_lane.any() else None
        )
        self.turns = TurnTable(self.inst.D)  # sized per step by the trainer
        self.router = Router(self.policy, self.inst, self.turns, cfg.rollout.group_size, cfg.seed)
        self.capacity = RolloutCapacity()  # the trainer's view of the same headroom (grpo.early_hand_out)
        # the clock
        self.tick_no = 0
        # per instance, rollout turns running and queued as its last admission left them (``_rollout_tick``)
        self.admitted_view = (np.zeros(self.inst.D, dtype=np.int64), np.zeros(self.inst.D, dtype=np.int64))
        # per instance, the share of its device rollout's forwards got lately (a moving mean, as the executor's prefill rate)
        self.rollout_share_seen = np.ones(self.inst.D)
        # co-batched mode: this tick's plan of the serving instances' iterations (None: no rollout rides them)
        self.co_plan: CoBatchPlan | None = None
        self.k_sched = max(1, int(round(SCHEDULER_TICK_S / cfg.dt)))  # ticks per scheduler tick
        # the monitor
        self.mon = MonitorState(
            monitor_settings(cfg.slo_ttft_ms, cfg.slo_tpot_ms, sized.max_rollout_batch, int(max(0.0, memory.cohost_free_bytes))),
            cfg.dt,
            shape.n_serv,
            self.inst.D - shape.n_serv,  # the dedicated pool and any lane instances
            max(0.0, float(shape.sperf.decode_s(1.0, sized.traffic.prompt_mean)) * 1e3),
            serving_snapshot(shape.device.name, memory.total_s, memory.cohost_free_bytes, memory.kvb_p, cfg.rollout_mode),
            "sticky_throughput" in cfg.what_if,
        )
        self.worker = RolloutWorker()
        self.trainer = TrainerState()
        self.counts = Counters()

    # ------------------------------------------------------------------ read-only figures for callers (bench/emulated.py, tests)
    @property
    def n_serv(self) -> int:
        return self.sized.shape.n_serv

    @property
    def n_ded(self) -> int:
        return self.sized.shape.n_ded

    @property
    def tp_s(self) -> int:
        return self.sized.shape.tp_s

    @property
    def tp_r(self) -> int:
        return self.sized.shape.tp_r

    @property
    def trainer_gpus(self) -> float:
        return self.sized.shape.trainer_gpus

    @property
    def kvb_s(self) -> float:
        return self.sized.memory.kvb_s

    @property
    def pool_tokens(self) -> float:
        return self.sized.memory.pool_tokens

    @property
    def cohost_free_bytes(self) -> float:
        return self.sized.memory.cohost_free_bytes

    @property
    def dedicated_kv(self) -> float:
        return self.sized.memory.dedicated_kv

    @property
    def fleet_rate(self) -> np.ndarray:
        return self.sized.traffic.fleet_rate

    @property
    def fleet(self) -> Fleet:
        """The scheduler's fleet view, where leases live (``Router.fleet``)."""
        return self.router.fleet

    # ------------------------------------------------------------------ hooks for policies (policies.py)
    @property
    def ids(self) -> list[str]:
        """Executor ids, by instance index (``Instances.ids``)."""
        return self.inst.ids

    @property
    def slots(self) -> np.ndarray:
        """Rollout sequences each instance may run now (``Instances.slots``)."""
        return self.inst.slots

    def apply_lease(self, kind: str, lease, reason: str) -> None:
        d = self.inst.index[lease.executor_id]
        self.router.fleet.on_lease(lease, self.env.now)
        if kind == "revoked" and lease.park_until > self.env.now:
            self.park_device(d, lease.park_until)
        elif kind in ("revoked", "expired"):
            self.revoke_device(d, reason, keep_tokens=self.policy.keep_tokens)
        elif self.serving.cohosting:  # the executor clamps a lease to its rollout pool
            self.inst.set_caps(d, lease.max_rollout_batch, min(float(lease.kv_bytes), max(0.0, self.sized.memory.cohost_free_bytes)))
        self.counts.control.lease(kind)

    def park_device(self, d: int, until: float) -> None:
        """A burst's revocation (``Lease.park_until``): device d runs and admits nothing, its turns keep
        their place and KV until a new lease (``apply_lease``) resumes them or ``until`` interrupts
        them (``revoke_device``, checked each tick in ``_tick``)."""
        self.inst.set_caps(d, 0, self.inst.kvcap[d])
        self.inst.park_until[d] = until
        self.counts.control.parks += 1

    def revoke_device(self, d: int, reason: str, keep_tokens: bool) -> None:
        """Rollout taken back from device d: in-flight turns are interrupted (keep_tokens: resumed
        elsewhere by recompute, else lost: whole-job preemption) and its prefix cache dropped."""
        self.inst.set_caps(d, 0, 0)
        t = self.turns
        on = np.flatnonzero((t.dev == d) & (t.state > 0))
        for i in on:
            done = float(t.gen_turn[i] - t.dec_left[i]) if t.state[i] == 2 else 0.0
            t.state[i], t.dev[i] = 0, -1
            if keep_tokens:
                self.counts.turns.interrupted += 1
                t.events[i].succeed(("interrupted", max(0.0, math.floor(done))))
            else:
                self.counts.turns.aborted += 1
                t.events[i].succeed(("aborted", 0.0))
        t.drop_instance_cache(d, keep_host=self.cfg.host_kv_ratio > 0)

    def _prefill_rates(self) -> np.ndarray:
        """Per instance, the prompt tokens/s of a rollout forward that carries a prefill chunk beside the decode steps
        running there, from its step model, at the share of the device its rollout got lately: what an executor
        reports as ``rollout_prefill_tokens_per_s``, timing its forwards by the wall clock, serving's turns between
        included (services/executor/emulated.py yields a rollout forward to serving ones). The device's rate alone
        read a lane 2.4x its measured rate (docs/benchmarks.md, 2026-12-05 (evening 2))."""
        t, D, shape = self.turns, self.inst.D, self.sized.shape
        run = t.state == 2
        rows = np.bincount(t.dev[run], minlength=D).astype(float)
        ctx = np.bincount(t.dev[run], weights=t.ctx[run], minlength=D) / np.maximum(rows, 1.0)
        chunk = np.where(self.inst.on_serving_gpus, shape.pperf_s.rollout_prefill_tokens, shape.pperf_d.rollout_prefill_tokens).astype(float)
        alone = chunk / np.maximum(self._pol_perf(np.arange(D), "mixed_s", rows * t.bundle, np.maximum(ctx, 1.0), chunk), 1e-12)
        return alone * self.rollout_share_seen

    def _headroom_role(
        self, d: int, role: ExecutorRole, now: float, running: float = 0.0, queued: float = 0.0, tps: float = 0.0, prefill_rate: float = 0.0
    ) -> None:
        slots = int(self.inst.slots[d]) if role == "dedicated" else 0
        if role == "dedicated" and "kv_slots" in self.cfg.what_if:
            slots = min(slots, self.sized.kv_slots(self.inst.kvcap[d]))
        tps = self.mon.reported_tps(d, tps)
        self._headroom(
            Headroom(
                executor_id=self.inst.ids[d],
                at=now,
                kv_bytes=0,
                compute_share=1.0 if role == "dedicated" else 0.0,
                rollout_batch_slots=slots,
                ttft_p99_ms=0.0,
                tpot_p99_ms=0.0,
                slo_ttft_ms=self.cfg.slo_ttft_ms,
                slo_tpot_ms=self.cfg.slo_tpot_ms,
                arrival_rate_rps=0.0,
                serving_queue=0,
                role=role,
                lendable=role == "dedicated",
                reason="dedicated rollout executor" if role == "dedicated" else "serving",
                rollout_running=int(running),
                rollout_queue=int(queued),
                rollout_tokens_per_s=float(tps),
                rollout_prefill_tokens_per_s=float(prefill_rate),
            )
        )

    def _headroom(self, headroom: Headroom) -> None:
        """The monitor's headroom goes to the scheduler's fleet and to the trainer's capacity view."""
        self.router.fleet.on_headroom(headroom)
        self.capacity.observe(headroom, self.env.now)

    # ------------------------------------------------------------------ the clock
    def _clock(self):
        c, env = self.cfg, self.env
        dt = c.dt
        serving_idx = np.arange(self.inst.n_serv)
        while True:
            now = env.now
            self._tick(now, dt, serving_idx)
            yield env.timeout(dt)

    def _tick(self, now: float, dt: float, serving_idx: np.ndarray) -> None:
        c = self.cfg
        pol = self.policy
        inst, turns, mon, acc = self.inst, self.turns, self.mon, self.counts
        n = self.inst.n_serv
        sized, serving = self.sized, self.serving
        traffic = sized.traffic
        fleet_rps = float(traffic.fleet_rate[min(len(traffic.fleet_rate) - 1, int(now))])
        lent = inst.lent()
        serving_mode = ~lent if pol.drains_lent else np.ones(n, dtype=bool)
        n_active = int(serving_mode.sum())
        per_inst = fleet_rps / max(1, n_active)
        arrivals = np.where(serving_mode, self.streams.arrivals.poisson(per_inst * dt, n), 0).astype(float)
        # latency from the expected rate (the p99 formulas already hold the Poisson variation);
        # the sampled arrivals feed burst detection and request accounting
        rate = np.where(serving_mode, per_inst, 0.0)
        # rollout running on serving instances, at the start of the tick
        running = turns.state == 2
        br = np.bincount(turns.dev[running], minlength=inst.D)[:n] * turns.bundle if running.any() else np.zeros(n)
        st, extra, lane_share = self._serving_second(now, dt, rate, br, running)
        inst.queue = np.where(serving_mode, st.queue, 0.0)
        inst.prev_iter_ms = st.iteration_s * 1e3
        slo_ttft, slo_tpot = c.slo_ttft_ms / 1e3, c.slo_tpot_ms / 1e3
        violating = serving_mode & (arrivals > 0) & ((st.ttft_p99_s > slo_ttft) | (st.tpot_p99_s > slo_tpot))
        acc.serving.violations += float(violating.sum()) * dt
        acc.serving.bad_requests += float(arrivals[violating].sum())
        acc.serving.requests += float(arrivals.sum())
        acc.serving.serving_instance_s += float(n_active) * dt
        # the same trace on the whole fleet serving alone (what static sees), for attribution
        acc.serving.violations_alone += float(serving.alone_bad[min(len(serving.alone_bad) - 1, int(now))]) * n * dt
        # what each instance's rollout lane gets this second
        share = np.zeros(inst.D)
        share[n:] = (inst.ready_at[n:] <= now).astype(float)
        if self.lane_pool_share is not None:
            share[inst.is_lane] *= float(self.lane_pool_share[min(len(self.lane_pool_share) - 1, int(now))])
        if pol.executor_policy is not None and serving.cohosting:
            share[:n] = lane_share
        if serving.cohosting:
            acc.serving.lent_instance_s += float(lent.sum()) * dt
        if self.turns.N and bool(((self.turns.state == 1) | (self.turns.state == 2)).any()):
            acc.rollout.rollout_work_s += dt
            if serving.lane_ceiling is not None:
                acc.rollout.lane_ceiling_s += float(serving.lane_ceiling[min(len(serving.lane_ceiling) - 1, int(now))]) * n * dt
        tokens = self._rollout_tick(now, dt, share)
        rolling = self.admitted_view[0] > 0  # the device share its forwards got, where rollout ran this tick
        self.rollout_share_seen[rolling] += PREFILL_RATE_EMA * (share[rolling] - self.rollout_share_seen[rolling])
        mon.record_rollout(self.tick_no, tokens)
        mon.record_serving(self.tick_no, serving_mode, st, extra, arrivals, inst.queue, br)
        self.tick_no += 1
        if pol.uses_monitor and self.tick_no % mon.k_snap == 0 and (not pol.monitor_idle_skippable or now >= mon.active_from):
            self._monitor(now, serving_mode, st)
        if self.tick_no % mon.k_snap == 0:
            self._dedicated_headroom(now)
        if self.tick_no % self.k_sched == 0:
            pol.control(self, now)
        for d in np.flatnonzero(inst.lent()).tolist():  # each executor enforces its lease's expiry itself
            if not pol.is_active(self.router.fleet.info(inst.ids[d]).lease, now):
                self.revoke_device(d, "lease expired", keep_tokens=pol.keep_tokens)
        parked = np.flatnonzero(inst.parked())
        if parked.size:  # a park ends at its deadline (what is left is interrupted), or once nothing is left there
            held = np.bincount(turns.dev[turns.state > 0], minlength=inst.D) if (turns.state > 0).any() else np.zeros(inst.D)
            for d in parked.tolist():
                if now >= inst.park_until[d] or held[d] == 0:
                    self.revoke_device(d, "park ended", keep_tokens=pol.keep_tokens)
        if c.record_timeline:
            tl = acc.timeline
            tl["t"].append(now)
            tl["fleet_rps"].append(fleet_rps)
            tl["rollout_tps"].append(float(tokens.sum()) / dt)
            tl["lent"].append(int(inst.lent().sum()))
            tl["violating"].append(int(violating.sum()))

    def _serving_second(self, now: float, dt: float, rate: np.ndarray, br: np.ndarray, running: np.ndarray):
        """(serving's second, what rollout adds to each serving iteration, the share of the device rollout's forwards
        get) per serving instance, with ``br`` rollout sequences running there (``running``: the turns that run).

        Two-model: a lane of its own in bounded quanta between serving's iterations (coserve.py). Co-batched: rows in
        serving's own iterations (co_batched.py); the plan, ``self.co_plan``, then drives the rollout tick."""
        c, pol, inst, n = self.cfg, self.policy, self.inst, self.inst.n_serv
        sized, serving = self.sized, self.serving
        shape, traffic = sized.shape, sized.traffic
        ep = pol.executor_policy
        ready = inst.ready_at[:n] <= now
        self.co_plan = None
        if serving.co_batched:
            return self._co_batched_second(dt, rate, ready & (inst.slots[:n] > 0))
        ctx_r = self.turns.mean_ctx(running)[:n]
        tau_r = shape.pperf_s.decode_s(np.maximum(br, 1), np.maximum(ctx_r, 1.0))
        active = (br > 0) & (inst.slots[:n] > 0) & ready if (ep is not None and serving.cohosting) else np.zeros(n, dtype=bool)
        last_bs = self.mon.ring["bs"][:, (self.tick_no - 1) % self.mon.W]
        extra, wait, may = rollout_interference(
            ep, active, tau_r, sized.turn_p90, lambda d: executor_signals(now, last_bs[d], inst.prev_iter_ms[d], c.slo_tpot_ms)
        )
        sizes = (traffic.prompt_mean, traffic.output_mean, traffic.prompt_p99)
        st = serving_tick(shape.sperf, rate, *sizes, extra, wait, inst.queue, dt, serving.kv_tokens)
        lane_share = np.where(ready & (inst.slots[:n] > 0), rollout_share(ep, st, extra, may), 0.0) if ep is not None else np.zeros(n)
        return st, extra, lane_share

    def _co_batched_second(self, dt: float, rate: np.ndarray, active: np.ndarray):
        """``_serving_second`` in co-batched mode: the rows ready to decode on each serving instance that may run rollout
        (``active``: a lease, the current weights), and a chunk of prefill where turns wait for theirs, ride serving's
        iterations under the guard (co_batched.py ``co_batch_plan``; naive_share's rows ride unguarded)."""
        n, shape, traffic, c = self.inst.n_serv, self.sized.shape, self.sized.traffic, self.cfg
        decoding, ctx, _, cached, waiting = (a[:n] for a in self.turns.ready_to_ride())
        rows = np.where(active, decoding * self.turns.bundle, 0)
        chunk = np.where(active & waiting, shape.pperf_s.rollout_prefill_tokens, 0)
        sizes = (traffic.prompt_mean, traffic.output_mean, traffic.prompt_p99, self.inst.queue, dt, self.serving.kv_tokens)
        if not (rows.any() or chunk.any()):  # nothing rides: serving alone
            return serving_tick(shape.sperf, rate, *sizes[:3], 0.0, 0.0, *sizes[3:]), np.zeros(n), np.zeros(n)
        self.co_plan = plan = co_batch_plan(
            shape.sperf,
            c.lora,
            rate,
            *sizes,
            rows=rows,
            rows_ctx=ctx,
            prefill_tokens=chunk,
            prefill_cached=cached,
            slo_tpot_s=c.slo_tpot_ms / 1e3,
            quantum_s=c.quantum_ms / 1e3,
            guarded=self.policy.name != "naive_share",
        )
        return plan.serving, plan.extra_s, np.where(active, plan.rollout_time_share(), 0.0)

    def _dedicated_headroom(self, now: float) -> None:
        t = self.turns
        nr, nq = self.admitted_view
        # each dedicated executor's metrics snapshot: rollout tokens/s over the interval, kept when rollout is running
        # (what rose bench e2e averages into calibration.dedicated_rollout_tokens_per_s)
        self.counts.rollout.ded_snapshots_tps.extend(self.mon.close_dedicated_interval(nr[self.inst.n_serv :]))
        peak_tps = self.mon.peak_interval_tps(self.tick_no)
        prefill = self._prefill_rates()
        for d in range(self.inst.n_serv, self.inst.D):
            self._headroom_role(d, "dedicated", now, nr[d] * t.bundle, nq[d] * t.bundle, peak_tps[d], prefill[d])

    # ------------------------------------------------------------------ rollout progress
    def _pol_perf(self, d: np.ndarray, fn: str, *args):
        a = getattr(self.sized.shape.pperf_d, fn)(*args)
        b = getattr(self.sized.shape.pperf_s, fn)(*args)
        return np.where(self.inst.on_serving_gpus[d], b, a)

    def _turns_by_state(self) -> tuple[np.ndarray, np.ndarray]:
        """Per instance, rollout turns (rows) running and queued now."""
        t, D = self.turns, self.inst.D
        if t.N == 0:
            return np.zeros(D, dtype=np.int64), np.zeros(D, dtype=np.int64)
        return np.bincount(t.dev[t.state == 2], minlength=D), np.bincount(t.dev[t.state == 1], minlength=D)

    def _rollout_tick(self, now: float, dt: float, share: np.ndarray) -> np.ndarray:
        inst, t, acc, D = self.inst, self.turns, self.counts, self.inst.D
        sized = self.sized
        shape = sized.shape
        tokens: np.ndarray = np.zeros(D)
        if t.N == 0 or not t.state.any():
            self.admitted_view = self._turns_by_state()
            return tokens
        bundle, kvb = t.bundle, sized.memory.kvb_p
        # --- admission, FIFO per device under the slot and KV caps
        q = np.flatnonzero(t.state == 1)
        if q.size:
            dq = t.dev[q]
            need = bundle * (t.ctx[q] + t.dec_left[q]) * kvb
            never = need > inst.kvcap[dq]
            for i in q[never]:  # can never fit there (or no rollout pool at all): the executor refuses, the worker goes elsewhere
                t.state[i], t.dev[i] = 0, -1
                acc.turns.bounced += 1
                t.events[i].succeed(("bounced", 0.0))
            keep = ~never
            q, dq, need = q[keep], dq[keep], need[keep]
        if q.size:
            order = np.lexsort((t.seq[q], dq))
            q, dq, need = q[order], dq[order], need[order]
            run = t.state == 2
            used_slots = (np.bincount(t.dev[run], minlength=D) * bundle) if run.any() else np.zeros(D)
            used_kv = np.bincount(t.dev[run], weights=bundle * (t.ctx[run] + t.dec_left[run]) * kvb, minlength=D) if run.any() else np.zeros(D)
            pos = np.arange(q.size)
            first = np.r_[True, dq[1:] != dq[:-1]]
            start = np.maximum.accumulate(np.where(first, pos, 0))
            cs = np.cumsum(np.full(q.size, float(bundle)))
            ck = np.cumsum(need)
            cs_g = cs - cs[start] + bundle
            ck_g = ck - ck[start] + need[start]
            ok = (used_slots[dq] + cs_g <= inst.slots[dq]) & (used_kv[dq] + ck_g <= inst.kvcap[dq]) & (inst.ready_at[dq] <= now)
            adm = q[ok]
            if adm.size:
                t.state[adm] = 2
                t.pf_left[adm] = bundle * t.pf_tokens[adm]  # prefill tokens left
        self.admitted_view = self._turns_by_state()
        # --- progress, as the executor iterates: each iteration one packed forward, the decode step of the running
        # turns plus a prefill chunk (the executor's rollout chunk) for the turns still prefilling; once the prefills
        # are done, decode steps alone
        run = np.flatnonzero(t.state == 2)
        if run.size == 0:
            return tokens
        dr = t.dev[run]
        pf = t.pf_left[run]
        pre = pf > 1e-9
        dec = ~pre
        PF = np.bincount(dr[pre], weights=pf[pre], minlength=D)
        cached_d = np.bincount(dr[pre], weights=t.pf_cached[run][pre] * pf[pre], minlength=D) / np.maximum(PF, 1e-30)
        ndec = np.bincount(dr[dec], minlength=D)
        nb = ndec * bundle
        ctx_d = np.maximum(np.bincount(dr[dec], weights=t.ctx[run][dec], minlength=D) / np.maximum(ndec, 1), 1.0)
        chunk = np.where(inst.on_serving_gpus, shape.pperf_s.rollout_prefill_tokens, shape.pperf_d.rollout_prefill_tokens)
        c = np.minimum(chunk, PF)
        tau_mix = self._pol_perf(np.arange(D), "mixed_s", nb, ctx_d, c, cached_d)
        tau = self._pol_perf(np.arange(D), "decode_s", np.maximum(nb, 1), ctx_d)
        T = share * dt
        n_mix = np.where(PF > 0, np.minimum(PF / np.maximum(c, 1e-30), T / np.maximum(tau_mix, 1e-30)), 0.0)
        n_it = n_mix + np.where(nb > 0, np.maximum(T - n_mix * tau_mix, 0.0) / tau, 0.0)
        device_s = np.where(nb > 0, T, np.minimum(T, n_mix * tau_mix))  # decode fills the tick
        chunks = n_mix * c  # prompt tokens the instance's rollout prefills this tick
        if self.co_plan is not None:  # co-batched serving instances: rollout rides serving's iterations (co_batched.py)
            n = self.inst.n_serv
            row_tokens, prefill, added = self.co_plan.per_second()
            n_it[:n] = np.where(nb[:n] > 0, row_tokens * dt / np.maximum(nb[:n], 1), 0.0)  # tokens per row this tick
            chunks[:n], device_s[:n] = prefill * dt, added * dt
        acc.rollout.device_s += float(device_s.sum())
        # the chunks go to the prefilling turns in admission order, as the engine's budget does (scheduling.py)
        ids = np.flatnonzero(pre)
        ids = ids[np.lexsort((t.seq[run][ids], dr[ids]))]
        want = pf[ids]
        before = np.cumsum(want) - want
        first = np.r_[True, dr[ids][1:] != dr[ids][:-1]] if ids.size else np.zeros(0, dtype=bool)
        before -= before[np.maximum.accumulate(np.where(first, np.arange(ids.size), 0))] if ids.size else 0.0
        took = np.clip(chunks[dr[ids]] - before, 0.0, want)
        new_pf = np.zeros(run.size)
        new_pf[ids] = np.where(want - took <= 1e-9, 0.0, want - took)
        t.pf_left[run] = new_pf
        adv = np.where(dec, n_it[dr], 0.0)
        left = t.dec_left[run]
        step_tokens = np.minimum(left, adv)
        t.dec_left[run] = left - step_tokens
        t.ctx[run] += step_tokens
        tokens = np.bincount(dr, weights=step_tokens * bundle, minlength=D)
        acc.rollout.rollout_tokens += float(tokens.sum())
        acc.rollout.serving_tokens += float(tokens[: self.inst.n_serv].sum())
        if self.lane_pool_share is not None:
            acc.rollout.lane_pool_tokens += float(tokens[inst.is_lane].sum())
        fin_mask = dec & (left - adv <= 1e-9) & (adv > 0)
        if fin_mask.any():
            fins = run[fin_mask]
            frac_t = np.clip(left[fin_mask] / np.maximum(adv[fin_mask], 1e-12), 0.0, 1.0)
            at = now + dt * frac_t
            for i, t_fin in zip(fins, at):
                t.finish(i, kvb, self.trainer.version_at(not inst.on_serving_gpus[t.dev[i]], float(t_fin)), float(t_fin))
                t.events[i].succeed(("done", float(t_fin)))
        return tokens

    # ------------------------------------------------------------------ monitor (real detector + headroom)
    def _monitor(self, now: float, serving_mode: np.ndarray, st) -> None:
        pol, m = self.policy, self.mon
        sized, serving = self.sized, self.serving
        shape, memory, traffic = sized.shape, sized.memory, sized.traffic
        r, W, S, dt = m.ring, m.W, m.S, self.cfg.dt
        filled = min(self.tick_no, W)
        last = (self.tick_no - 1 - np.arange(filled)) % W  # newest first
        short_idx, long_idx = last[: min(S, filled)], last
        recent_idx, base_idx = last[: m.k_snap], last[m.k_snap :]  # the latest snapshot, the history before it
        L = lambda a: a.tolist()  # noqa: E731  (plain floats: numpy scalars are slow in the loop)
        ttft_s, tpot_s = L(r["ttft"][:, short_idx].max(axis=1)), L(r["tpot"][:, short_idx].max(axis=1))
        ttft_l, tpot_l = L(r["ttft"][:, long_idx].max(axis=1)), L(r["tpot"][:, long_idx].max(axis=1))
        arr_s, arr_l = L(r["arrivals"][:, short_idx].sum(axis=1)), L(r["arrivals"][:, long_idx].sum(axis=1))
        arr_r, arr_b = L(r["arrivals"][:, recent_idx].sum(axis=1)), L(r["arrivals"][:, base_idx].sum(axis=1))
        bs_peak, bs_short = L(r["bs"][:, long_idx].max(axis=1)), L(r["bs"][:, short_idx].max(axis=1))
        q_now = L(r["queue"][:, last[0]])
        q_wait = L(r["queue_wait"][:, last[0]])
        q_prev = L(r["queue"][:, last[1]]) if filled > 1 else [0.0] * self.inst.n_serv
        tps_peak = L(m.peak_interval_tps(self.tick_no)[: self.inst.n_serv])
        kv_util = L(np.minimum(1.0, st.batch * (traffic.prompt_mean + traffic.output_mean) / max(1.0, serving.kv_tokens)))
        util = L(1.0 - np.exp(-st.batch))
        span_s, span_l, span_b, span_r = len(short_idx) * dt, filled * dt, len(base_idx) * dt, len(recent_idx) * dt
        refit = m.refit_due(self.tick_no)
        t = self.turns
        running_now, queued = L(self.admitted_view[0] * t.bundle), L(self.admitted_view[1])
        c, bundle = self.cfg, t.bundle
        prefill = L(self._prefill_rates())
        for d in range(self.inst.n_serv):
            eid = self.inst.ids[d]
            short = WindowStats(
                span_s=span_s,
                snapshots=len(short_idx),
                ttft_p99_ms=ttft_s[d],
                tpot_p99_ms=tpot_s[d],
                ttft_count=arr_s[d],
                arrival_rate_rps=arr_s[d] / span_s,
                arrivals=int(arr_s[d]),
                serving_queue=int(q_now[d]),
                serving_running_peak=int(bs_short[d]),
                rollout_tokens_per_s_peak=tps_peak[d],
                kv_utilisation=kv_util[d],
                compute_utilisation=util[d],
                serving_queue_wait_ms=q_wait[d],
            )
            recent = WindowStats(
                span_s=span_r,
                snapshots=1,
                ttft_p99_ms=0.0,
                tpot_p99_ms=0.0,
                ttft_count=arr_r[d],
                arrival_rate_rps=arr_r[d] / span_r,
                arrivals=int(arr_r[d]),
                serving_queue=int(q_now[d]),
                serving_running_peak=0,
                rollout_tokens_per_s_peak=0.0,
                kv_utilisation=0.0,
                compute_utilisation=0.0,
            )
            base = WindowStats(
                span_s=span_b,
                snapshots=len(base_idx),
                ttft_p99_ms=0.0,
                tpot_p99_ms=0.0,
                ttft_count=arr_b[d],
                arrival_rate_rps=arr_b[d] / span_b if span_b else 0.0,
                arrivals=int(arr_b[d]),
                serving_queue=0,
                serving_running_peak=0,
                rollout_tokens_per_s_peak=0.0,
                kv_utilisation=0.0,
                compute_utilisation=0.0,
            )
            found = pol.classify(short, [recent], base, int(q_now[d]), int(q_prev[d]), m.burst_cfg, m.head_cfg, q_wait[d])
            decided = pol.next_alert(m.burst_state[d], found, now, m.burst_cfg)
            if decided is not None:
                alert = SloAlert(
                    executor_id=eid,
                    at=now,
                    severity=decided[0],
                    reason=decided[1],
                    arrival_rate_rps=arr_r[d] / span_r,
                    serving_queue=int(q_now[d]),
                    ttft_p99_ms=ttft_s[d],
                    tpot_p99_ms=tpot_s[d],
                )
                if alert.severity != "recovered":
                    self.counts.control.alerts += 1
                pol.on_alert(self, d, alert, now)
            if refit:
                obs = list(zip(r["bs"][d, long_idx].tolist(), r["br"][d, long_idx].tolist(), r["tpot_mean"][d, long_idx].tolist()))
                m.step_models[d] = pol.fit_step_model(obs, tpot_s[d] or c.slo_tpot_ms / 4)
            long = WindowStats(
                span_s=span_l,
                snapshots=filled,
                ttft_p99_ms=ttft_l[d],
                tpot_p99_ms=tpot_l[d],
                ttft_count=arr_l[d],
                arrival_rate_rps=arr_l[d] / span_l,
                arrivals=int(arr_l[d]),
                serving_queue=int(q_now[d]),
                serving_running_peak=int(bs_peak[d]),
                rollout_tokens_per_s_peak=tps_peak[d],
                kv_utilisation=kv_util[d],
                compute_utilisation=0.0,
            )
            v = pol.assess(short, long, m.step_models[d], m.latest, m.head_cfg, m.burst_state[d].alerting)
            if not v.lendable:
                self.counts.control.unlendable[re.sub(r"\d+(\.\d+)? ms", "N ms", v.reason.split(";")[0])] += 1
            slots = v.slots if "kv_slots" not in c.what_if else min(v.slots, self.sized.kv_slots(v.kv_bytes))
            self._headroom(
                Headroom(
                    executor_id=eid,
                    at=now,
                    kv_bytes=v.kv_bytes,
                    compute_share=v.compute_share,
                    rollout_batch_slots=slots,
                    ttft_p99_ms=ttft_s[d],
                    tpot_p99_ms=tpot_s[d],
                    slo_ttft_ms=c.slo_ttft_ms,
                    slo_tpot_ms=c.slo_tpot_ms,
                    arrival_rate_rps=arr_s[d] / span_s,
                    serving_queue=int(q_now[d]),
                    role="serving",
                    lendable=v.lendable,
                    reason=v.reason,
                    ttft_p99_long_ms=ttft_l[d],
                    tpot_p99_long_ms=tpot_l[d],
                    arrival_rate_long_rps=arr_l[d] / span_l,
                    kv_utilisation=kv_util[d],
                    rollout_running=int(running_now[d]),
                    rollout_queue=queued[d] * bundle,
                    rollout_tokens_per_s=m.reported_tps(d, tps_peak[d]),
                    rollout_prefill_tokens_per_s=prefill[d],
                    device_kind="cuda",
                    device_name=shape.device.name,
                    device_memory_bytes=int(memory.total_s),
                )
            )

    # ------------------------------------------------------------------ rollout workers and trainer
    def _trajectory(self, step: int, i: int, batch, slot: int | None = None, info: dict | None = None):
        """One trajectory of ``batch`` (its row ``i``) in turn-table ``slot`` (default ``i``); ``info``:
        the pipelined trainer's record of the batch (first turn start, group completions)."""
        env = self.env
        slot = i if slot is None else slot
        worker, req = self.worker.episodes, None
        if worker is not None:  # the rollout worker runs a bounded number of episodes, first handed out first
            req = worker.request()
            yield req
        tid, gid = f"t{step}-{i}", f"g{step}-{i // max(1, self.cfg.rollout.group_size)}"
        ctx = int(batch.prompt[i])
        prev = ""
        turns = int(batch.turns[i])
        finish = env.now
        done_turns: list[tuple[int, int, float]] = []
        for k in range(turns):
            new_tokens = ctx if k == 0 else int(batch.tool_tokens[i, k - 1])
            started = env.now
            if info is not None and info["first"] is None:
                info["first"] = started
            finish, d = yield from self._turn(slot, tid, gid, k, ctx, new_tokens, float(batch.gen[i, k]), prev, (f"b{step}", batch.n))
            self.worker.durations.append(finish - started)
            self.counts.rollout.turn_durations.append(finish - started)
            done_turns.append((k, int(batch.gen[i, k]), finish - started))
            ctx += int(batch.gen[i, k])
            prev = self.inst.ids[d]
            if k + 1 < turns:
                ctx += int(batch.tool_tokens[i, k])
                wait = float(batch.tool_s[i, k]) - (env.now - finish)
                if wait > 0:
                    yield env.timeout(wait)
            else:
                self.turns.finished_at[slot] = finish
        self.turns.drop_cache(slot)
        self.router.fleet.on_trajectory(tid, gid, [int(x) for x in batch.gen[i, :turns]])
        for k, tokens, seconds in done_turns:  # the scheduler reads the turn records of a finished trajectory
            self.router.fleet.on_turn_result(tid, k, tokens, seconds)
        if worker is not None and req is not None:
            worker.release(req)
        if info is not None:
            info["last"] = max(info["last"], finish)
            info["finished"].append(finish)
            info["group_fins"][i // info["group_rows"]].append(finish)
            tr = self.trainer
            tr.arrived.append((info, i))
            if self.cfg.trajectory_fetch_s <= 0:
                tr.deliver(len(tr.arrived))
            elif tr.arrival_evt is not None and not tr.arrival_evt.triggered:
                tr.arrival_evt.succeed()

    def _consumer(self):
        """The trainer's trajectory consumer: fetch windows of ``trajectory_fetch_s`` back to back; a
        window closes early once a fetch's worth (64 trajectories) has arrived."""
        env, window, tr = self.env, self.cfg.trajectory_fetch_s, self.trainer
        per_fetch = max(1, TRAINER_FETCH_BATCH // max(1, self.turns.bundle))
        while True:
            end = env.now + window
            while len(tr.arrived) < per_fetch and env.now < end - 1e-12:
                tr.arrival_evt = env.event()
                yield simpy.AnyOf(env, [tr.arrival_evt, env.timeout(end - env.now)])
            tr.arrival_evt = None
            tr.deliver(min(per_fetch, len(tr.arrived)))

    def _turn(self, i: int, tid: str, gid: str, k: int, ctx: int, new_tokens: int, gen: float, prev: str, bid: tuple[str, int] = ("", 0)):
        """One turn as the rollout worker runs it (shared/turns/runner.py): route, generate;
        an interrupted attempt resumes elsewhere with its tokens; a bounced one goes elsewhere; a
        straggler gets a hedge when the scheduler's ``should_hedge`` agrees; the first result wins.
        Returns (finish time, device)."""
        env, t, ids = self.env, self.turns, self.inst.ids
        done_tokens = 0.0
        exclude: list[str] = []
        retry = self.router.settings.no_route_retry_s
        while True:
            routed = self.router.route(env.now, self.tick_no, tid, gid, k, ctx + done_tokens, prev, exclude, bid)
            if routed is None:
                exclude = []
                yield env.timeout(retry)
                continue
            d, hint = routed
            cached, load_s = self._cached(i, d, ctx + done_tokens)
            if load_s > 0:  # the prefix comes back from the host tier before the turn is admitted
                self.counts.turns.host_hits += 1
                self.counts.turns.host_load_s += load_s
                yield env.timeout(load_s)
            if k > 0 and done_tokens == 0:
                if cached:
                    self.counts.turns.prefix_hits += 1
                else:
                    self.counts.turns.prefix_misses += 1
                self.counts.turns.prefix_cached_tokens += cached
                self.counts.turns.prefix_reusable_tokens += min(ctx - new_tokens, ctx - 1)
                # the prefill this turn redoes beyond its new tokens: the context its cache no longer holds
                perf = self._policy_steps(d)
                redone = float(perf.prefill_s(ctx - cached, cached) - perf.prefill_s(new_tokens, ctx - new_tokens))
                if redone > 0:
                    self.counts.turns.reprefill_s += redone
                    if ids[d] != prev:
                        self.counts.turns.reprefill_moved_s += redone
            pending = {i: (self._submit(i, d, ctx + done_tokens - cached, cached, gen - done_tokens, ctx + done_tokens), d)}
            typical = self.worker.typical()
            leased = self.router.fleet.role_of(ids[d]) != "dedicated"
            hedge_at = self.worker.hedge_at(env.now, typical, leased)
            if hint > 0:  # the scheduler's hint for a turn on leased capacity: past its predicted time there, it is late
                hedge_at = min(hedge_at if hedge_at is not None else math.inf, env.now + hint)
            attempt_start = env.now
            failed: list[str] = []
            while pending:
                waits = [ev for ev, _ in pending.values()]
                if hedge_at is not None and len(pending) == 1 and i in pending:
                    waits.append(env.timeout(max(0.0, hedge_at - env.now)))
                yield simpy.AnyOf(env, waits)
                for slot, (ev, dd) in list(pending.items()):
                    if not ev.triggered:
                        continue
                    kind, value = ev.value
                    del pending[slot]
                    if kind == "done":
                        for other in pending:
                            t.cancel(other)  # the slower copy of a hedged turn: the worker ignores it; the executor drops it
                        if slot != i:
                            self.counts.turns.hedge_wins += 1
                            t.move_cache(slot, i)
                        return value, dd
                    if kind == "interrupted" and slot == i:
                        done_tokens += value
                    failed.append(ids[dd])
                if hedge_at is not None and env.now >= hedge_at and i in pending and len(pending) == 1:
                    primary = ids[pending[i][1]]
                    h = self.router.hedge(env.now, self.tick_no, tid, gid, k, ctx + done_tokens, primary, prev, env.now - attempt_start, typical, bid)
                    # refused: a turn on leased capacity asks again once its age has doubled (hedging.hedge_ask_again_after)
                    hedge_at = env.now + hedge_ask_again_after(env.now - attempt_start) if h is None and leased else None
                    if h is not None:
                        self.counts.turns.hedges += 1
                        slot = t.N + i
                        hc, _ = self._cached(i, h, ctx + done_tokens, host=False)  # the hedge takes the trajectory's entry there
                        pending[slot] = (self._submit(slot, h, ctx + done_tokens - hc, hc, gen - done_tokens, ctx + done_tokens), h)
            exclude += [e for e in failed if e not in exclude]  # the worker's exclude list grows until no route is left
            prev = ""

    def _cached(self, i: int, d: int, prompt: float, host: bool = True) -> tuple[float, float]:
        """(prompt tokens of trajectory row ``i`` that instance ``d`` still holds, seconds to copy them back from its
        host tier). As the executor's ``PrefixCache.take`` and ``HostTier.take``: the entry an earlier turn left there,
        taken (hit or miss), if the instance's policy version is the one that computed it and eviction (oldest first,
        ``TurnTable.where``) has not taken it from the device, else from the host tier too; at least one prompt token
        is left to compute. ``host=False`` (a hedge: its primary may finish before a copy would) leaves a host copy."""
        t, m = self.turns, self.sized.memory
        if t.cache_tokens[i, d] <= 0:  # none there (most routes of a moved turn): nothing to take, no KV to sum
            return 0.0, 0.0
        ded = not self.inst.on_serving_gpus[d]  # the pool's KV and weights, else a serving GPU's lent KV and link
        host_cap = self.cfg.host_kv_ratio * (m.dedicated_kv if ded else max(0.0, m.cohost_free_bytes))
        where = t.where(i, d, t.kv_in_use(d, m.kvb_p), float(self.inst.kvcap[d]), host_cap)
        if where == "host" and not host:
            return 0.0, 0.0
        held, version = t.take(i, d)
        if not where or version != self.trainer.version_at(ded, self.env.now):
            return 0.0, 0.0
        cached = float(min(held, prompt - 1.0))
        if where == "device":
            return cached, 0.0
        return cached, float(self._policy_steps(d).host_load_s(cached)) * t.bundle

    def _policy_steps(self, d: int):
        """The policy's step model on instance ``d`` (``_pol_perf`` picks it per instance for arrays)."""
        return self.sized.shape.pperf_s if self.inst.on_serving_gpus[d] else self.sized.shape.pperf_d

    def _submit(self, i: int, d: int, pf_tokens: float, cached: float, gen_left: float, ctx_now: float):
        """Turn-table row ``i`` goes to instance ``d``; the event its worker waits on."""
        ev = self.env.event()
        self.turns.submit(i, d, ev, pf_tokens, cached, gen_left, ctx_now)
        return ev

    def _next_idle_s(self, batch) -> float:
        """Seconds from the end of this rollout to the next one's start (training + dedicated sync)."""
        c = self.cfg
        train_s = self._train_seconds(batch.tokens())
        return train_s + sync_seconds(self.sized.memory.policy_weight_bytes, "full", c.sync, cross_cluster=False)

    def _critical_paths(self, batch) -> np.ndarray:
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

    def _trainer(self):
        if self.cfg.prefetch_steps > 0 or self.cfg.over_provision > 0:
            yield from self._trainer_pipelined()
            return
        c, env, t = self.cfg, self.env, self.turns
        self.mon.active_from = c.warmup_s - PREWARM_S
        yield env.timeout(c.warmup_s)
        trajectories, bundle = self._batch_shape()
        self.worker.size(env, c.worker_concurrency, bundle)
        wp = self.sized.memory.policy_weight_bytes
        for step in range(c.steps):
            t0 = env.now
            sync_ded = sync_seconds(wp, "full", c.sync, cross_cluster=False)
            sync_srv = sync_seconds(wp, self.policy.serving_sync_mode, c.sync, cross_cluster=True)
            if step > 0:  # the version trained last step (every prefix cache went with its batch: t.alloc below)
                self.trainer.published(t0 + sync_ded, t0 + sync_srv)
            yield env.timeout(sync_ded)  # the batch starts once the dedicated pool has the version
            t_roll = env.now
            self.inst.ready_at[self.inst.on_serving_gpus] = t0 + sync_srv
            batch = sample_batch(c.rollout, trajectories, self.streams.batches, bundle)
            critical_s = float(self._critical_paths(batch).max()) if batch.n else 0.0
            t.bundle = batch.bundle
            t.alloc(batch.n)
            procs = [env.process(self._trajectory(step, i, batch)) for i in range(batch.n)]
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
            self.trainer.steps.append(
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

    def _trainer_pipelined(self):
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
        """
        c, env, tr = self.cfg, self.env, self.trainer
        p = max(1, min(c.prefetch_steps, max(1, c.max_staleness))) if c.prefetch_steps > 0 else 0
        tr.pipelined = p > 0
        tr.partial = c.over_provision > 0
        tr.effective_prefetch = p
        self.mon.active_from = c.warmup_s - PREWARM_S  # a batch is rolling out nearly always: rose's monitor never rests
        yield env.timeout(c.warmup_s)
        started = env.now
        trajectories, bundle = self._batch_shape()
        self.worker.size(env, c.worker_concurrency, bundle)
        n = math.ceil(trajectories / bundle)
        group_rows = max(1, int(round(c.rollout.group_size / bundle)))
        per_step = math.ceil(n / group_rows)
        # over-provisioning: the first batch goes out with k groups more, then each step's hand-out refills the N it took
        extra = math.ceil(c.over_provision * per_step) * group_rows if c.over_provision > 0 else 0
        early = c.early_hand_out and 1 <= p < c.max_staleness  # as Trainer.hands_out_early
        slots = (c.max_staleness if early else max(p, c.max_staleness if extra else 0)) + 2  # turn-table slot groups: batches in flight, one spare
        self.turns.bundle = bundle
        self.turns.alloc(slots * (n + extra))
        wp = self.sized.memory.policy_weight_bytes
        sync_ded = sync_seconds(wp, "full", c.sync, cross_cluster=False)
        sync_srv = sync_seconds(wp, self.policy.serving_sync_mode, c.sync, cross_cluster=True)
        tr.ready_groups = []
        tr.batch_info = {}
        tr.arrived = []
        tr.arrival_evt = None
        if c.trajectory_fetch_s > 0:
            env.process(self._consumer())
        last_done = started if not tr.pipelined else None
        yield env.timeout(sync_ded)  # the first version reaches the dedicated pool
        if not tr.pipelined:  # synchronous: serving lanes roll out once they have the step's version, as ``_trainer``
            self.inst.ready_at[self.inst.on_serving_gpus] = started + sync_srv
        for b in range(p + 1):
            yield from self._hand_out(b, trajectories + (extra * bundle if b == 0 else 0), bundle, n + extra, slots, group_rows)
        handed = p + 1
        last_done = env.now if last_done is None else last_done
        for step in range(c.steps):
            t0 = env.now
            while len(tr.ready_groups) < per_step:
                if early and handed - step <= c.max_staleness and handed < c.steps and self.capacity.idle(env.now, since=tr.handed_out_at):
                    yield from self._hand_out(handed, trajectories, bundle, n + extra, slots, group_rows)
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
            need = per_step - (0 if step == 0 else extra // group_rows)
            critical_s = fresh[need - 1] if fresh and 1 <= need <= len(fresh) else 0.0
            tokens = sum(t for _, _, t in taken)
            train_s = self._train_seconds(tokens)
            yield env.timeout(train_s)
            tr.published(env.now + sync_ded, env.now + sync_srv)
            if not tr.pipelined:
                self.inst.ready_at[self.inst.on_serving_gpus] = env.now + sync_srv
            yield env.timeout(sync_ded)  # publish: the dedicated pool has the new version
            batches = sorted({b for b, _, _ in taken})
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
                    batches=batches,
                    tokens=tokens,
                    staleness=staleness,
                    trajectories=trajectories,
                    bundle=bundle,
                    # without prefetch (partial rollouts only) a step's rollout is from its start to its groups in hand
                    rollout_s=rollout_s if not tr.pipelined else float("nan"),
                    tail_s=tail_s,
                    critical_s=critical_s,
                    generated=sum(tr.group_generated[(b, g)] for b, g, _ in taken),
                )
            )
            last_done = env.now
            if handed < step + 1 + p + 1:  # the lead back to p (not when a batch went out early meanwhile)
                yield from self._hand_out(handed, trajectories, bundle, n + extra, slots, group_rows)
                handed += 1
        self.done.succeed()

    def _hand_out(self, b: int, trajectories: int, bundle: int, n: int, slots: int, group_rows: int):
        """Hand out batch ``b``: its trajectories start (the worker's slots permitting) in turn-table slot group b mod ``slots``."""
        env, tr = self.env, self.trainer
        old = tr.batch_info.get(b - slots)
        if old is not None and old["procs"]:  # its slot group is reused: the batch before must be out (it nearly always is)
            yield simpy.AllOf(env, old["procs"])
        batch = sample_batch(self.cfg.rollout, trajectories, self.streams.batches, bundle)
        groups = math.ceil(batch.n / group_rows)
        left = [min(group_rows, batch.n - g * group_rows) for g in range(groups)]
        per_traj = [
            (
                int(batch.prompt[i])
                + int(batch.gen[i, : int(batch.turns[i])].sum())
                + int(batch.tool_tokens[i, : max(0, int(batch.turns[i]) - 1)].sum())
            )
            * batch.bundle
            for i in range(batch.n)
        ]
        group_tokens = [float(sum(per_traj[g * group_rows : (g + 1) * group_rows])) for g in range(groups)]
        crit = self._critical_paths(batch)
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
            left=left,
            group_fins=[[] for _ in range(groups)],  # finish times of each group's trajectories (the step's tail)
            group_crit=sorted(group_crit),  # each group's least rollout time (``_critical_paths``), shortest first
            group_rows=group_rows,
            bundle=batch.bundle,
            group_tokens=group_tokens,
            generated=batch.generated(),
            trajectories=batch.trajectories,
            procs=[],
        )
        tr.batch_info[b] = info
        tr.batch_version[b] = len(tr.steps)  # the version its trajectories start on (the steps trained so far)
        tr.handed_out_at = env.now
        base = (b % slots) * n
        info["procs"] = [env.process(self._trajectory(b, i, batch, base + i, info)) for i in range(batch.n)]
        tr.batches_done_stats()
        tr.batch_info.pop(b - slots - 1, None)

    # ------------------------------------------------------------------ run
    def run(self) -> dict:
        c, env = self.cfg, self.env
        self.done = env.event()
        env.process(self._clock())
        env.process(self._trainer())
        env.run(until=simpy.AnyOf(env, [self.done, env.timeout(c.warmup_s + c.max_sim_s)]))
        return self.result()

    def result(self) -> dict:
        c, a, tr = self.cfg, self.counts, self.trainer
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
