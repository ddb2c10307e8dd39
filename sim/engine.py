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
- a clock ticks every ``dt`` (1 s): Poisson arrivals per serving instance, the serving
  model (latency, SLO accounting), what each instance's rollout lane gets, rollout progress
  (admission FIFO under the batch-slot and KV caps, prefill then decode), turn completions
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
Batches and prefix-cache draws have random streams of their own, so every policy rolls out
the same batches.

Partial rollouts (``over_provision``, grpo.over_provision): the first batch goes out with k
groups more, each step trains on the first N complete groups and the rest roll on into the next
steps (``_trainer_pipelined``, also without prefetch: synchronous RL); a group whose trajectories
started more than ``max_staleness`` versions before the step is dropped, counted.

Not simulated: executor failures, the worker's per-attempt timeout (its 60 s default is sized
for the tiny CPU models), the trainer's time to hand out a batch (~0.1-0.2 s per step on the
e2e box), preemption inside a running batch when a lease shrinks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from rose.contracts.executor import DeviceTelemetry, ExecutorRole, MetricsSnapshot
from rose.contracts.rollout import TurnRouteRequest
from rose.contracts.service import Heartbeat
from rose.contracts.slo import Headroom, SloAlert
from rose.services.scheduler.config import SchedulerConfig
from rose.services.scheduler.fleet import Fleet
from rose.services.scheduler.placement import Candidate
from rose.services.slo_monitor.windows import WindowStats
from rose.services.trainer.capacity import RolloutCapacity
from rose.shared.devices import DEVICES, TRAIN_MFU, Roofline, SyncSpec, model_spec, rollout_tp, serving_tp, sync_seconds, train_seconds, usable_bytes
from rose.shared.errors import RoseError
from rose.shared.turns.hedging import hedge_ask_again_after
from rose.shared.workload import RolloutSpec, batch_trajectories, bundle_size, mean_context, sample_batch, turn_length_quantile

from . import POLICIES
from .candidates import CandidateCache
from .ceiling import lane_value, rollout_capacity_ceiling
from .coserve import lane_share_ceiling, rollout_interference, rollout_share, serving_tick, slo_capacity_rps
from .counters import Counters
from .instances import Instances
from .monitor import MonitorState
from .policies import executor_signals, make_fleet_policy, monitor_settings
from .traces import DiurnalBursty, Trace, diurnal_bursty
from .trainer_state import TrainerState
from .turns import TurnTable
from .worker import RolloutWorker

MAX_ROLLOUT_BATCH = 256  # sequences per rollout engine (vLLM's default max_num_seqs)
SERVING_POOL_MARGIN = 1.25  # a co-hosting serving pool holds 1.25 x its concurrency at the trace's peak rate, rollout running
SCHEDULER_TICK_S = 0.5  # the scheduler's lease planning (services/scheduler/config.py tick_s)
PREWARM_S = 35.0  # rose's per-executor monitor runs from this long before a rollout phase (its windows are 30 s)
GROUP_POLL_S = 0.1  # the trainer looks for complete groups this often (services/trainer/trainer.py GROUP_POLL_S)
# the trainer's trajectory consumer (shared/bus.py): fetch(64, timeout=1 s) in a loop; a fetch returns once 64
# messages arrived or its window ends, so the trainer learns of a trajectory only then (a test checks both constants)
TRAINER_FETCH_BATCH = 64
FETCH_WINDOW_S = 1.0  # shared/bus.py CONSUME_FETCH_TIMEOUT_S


class Infeasible(RoseError, ValueError):
    """This model does not fit this fleet (the reason says why)."""


@dataclass
class SimConfig:
    model: str = "7B"
    device: str = "H100"
    gpus: int = 8
    policy: str = "rose"
    policy_model: str | None = None  # default: the serving model's size
    rollout_gpu_ratio: float = 0.5
    trainer_gpu_ratio: float = 1.0
    train_mfu: float = TRAIN_MFU
    train_s: float | None = None  # a measured training time per step (calibration), instead of the FLOPs model
    steps: int = 3
    dt: float = 1.0
    seed: int = 0
    load: float = 0.35  # mean serving load as a fraction of the fleet's SLO capacity (synthetic trace; peaks ~0.75)
    start_hour: float = 10.0
    trace_shape: DiurnalBursty = field(default_factory=DiurnalBursty)
    trace: Trace | None = None  # an imported trace in req/s (overrides load and trace_shape)
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 100.0
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    sync: SyncSpec = field(default_factory=SyncSpec)
    warmup_s: float = 40.0  # serving only before the first step: the monitor's 30 s windows fill up
    max_sim_s: float = 8 * 3600.0
    quantum_ms: float = 10.0
    trajectories: int | None = None  # per step (default: rollouts.batch_trajectories of the dedicated pool)
    perf: tuple | None = None  # (serving, policy on a serving instance, policy on a dedicated instance) step models
    n_serving: int | None = None  # override the instance counts (calibration runs)
    n_dedicated: int | None = None
    memory: dict | None = None  # override memory figures (calibration runs)
    record_timeline: bool = False
    # what-if changes to the services' inputs (not their logic), to measure two gaps the simulator
    # shows: "kv_slots": headroom slots capped by what the lent KV holds at the mean rollout context
    # (the monitor counts compute only); "sticky_throughput": headroom reports the best rollout
    # tokens/s ever measured on an executor (the monitor's 30 s peak forgets it during training)
    what_if: frozenset = frozenset()
    max_rollout_batch: int = MAX_ROLLOUT_BATCH  # sequences per rollout engine (calibration runs: the executor's own)
    # asynchronous RL as the reference trainer runs it (services/trainer: grpo.prefetch_steps, grpo.max_staleness):
    # 0 = synchronous (the paper-style grid); N >= 1: N steps of tasks are handed out ahead of the one training
    # (at most max_staleness: a batch rolled out further ahead would be dropped as stale), see ``_trainer_pipelined``
    prefetch_steps: int = 0
    max_staleness: int = 2
    # partial rollouts across steps (grpo.over_provision, APRIL's over-provisioning): a step's batch goes out with this
    # share of its groups more (N + k), the trainer takes the first N complete groups and the unfinished ones roll on
    # into the next steps (their tokens keep the versions they were sampled with), dropped past max_staleness, counted;
    # > 0 also in synchronous mode (``_trainer_pipelined`` with no prefetch)
    over_provision: float = 0.0
    early_hand_out: bool = True  # grpo.early_hand_out: one more batch out while a step waits and no executor has a rollout queue
    worker_concurrency: int | None = None  # trajectories in flight per rollout worker fleet (None: unbounded)
    trajectory_fetch_s: float = FETCH_WINDOW_S  # pipelined trainer: its consumer's fetch window (0: sees a trajectory at once)


class Simulation:
    """One run. ``_size_fleet`` sets the fixed figures (instance counts, models, memory, the
    serving trace); the state that changes, by concern: ``inst`` (Instances: per-instance rollout
    caps, weight readiness, serving queues), ``turns`` (TurnTable: the turns in flight and their
    prefix caches), ``mon`` (MonitorState: the SLO monitor's windows and detectors), ``fleet``
    and ``cands`` (the scheduler's Fleet, where leases live, and its per-tick candidates),
    ``worker`` (RolloutWorker), ``trainer`` (TrainerState) and ``counts`` (Counters: the
    result's tallies); this class runs the processes over them."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)  # serving arrivals
        # the RL job's batches and the prefix-cache draws have streams of their own: every policy then rolls out
        # the same batches (a shared stream would shift with the ticks and draws a policy's rollout takes)
        self.batch_rng = np.random.default_rng([cfg.seed, 1])
        self.cache_rng = np.random.default_rng([cfg.seed, 2])
        self.route_rng = __import__("random").Random(cfg.seed)
        self.env = simpy.Environment()
        if cfg.policy not in POLICIES:
            make_fleet_policy(cfg.policy)  # raises with the list of policies
        self._size_fleet()
        self.policy = make_fleet_policy(cfg.policy, cfg.quantum_ms, cfg.max_rollout_batch, max(0.0, self.cohost_free_bytes))
        self._init_state()

    # ------------------------------------------------------------------ fleet sizing
    def _size_fleet(self) -> None:
        c = self.cfg
        self.smodel, self.pmodel = model_spec(c.model), model_spec(c.policy_model or c.model)
        self.device = DEVICES[c.device]
        self.tp_s, self.tp_r = serving_tp(self.smodel, self.pmodel, self.device), rollout_tp(self.pmodel, self.device)
        self.n_serv = c.n_serving if c.n_serving is not None else c.gpus // self.tp_s
        ded_gpus = int(round(c.gpus * c.rollout_gpu_ratio))
        self.n_ded = c.n_dedicated if c.n_dedicated is not None else ded_gpus // self.tp_r
        if self.n_serv < 1:
            raise Infeasible(f"{c.model} on {c.gpus}x{c.device}: a serving instance needs TP{self.tp_s} (serving model + policy copy in 65 % of HBM)")
        if self.n_ded < 1:
            raise Infeasible(f"{c.model}: the dedicated pool ({ded_gpus} GPUs) is smaller than one TP{self.tp_r} rollout instance")
        self.trainer_gpus = max(1.0, c.gpus * c.trainer_gpu_ratio)
        if c.perf is not None:
            self.sperf, self.pperf_s, self.pperf_d = c.perf
        else:
            self.sperf = Roofline(self.device, self.smodel, self.tp_s)
            self.pperf_s = Roofline(self.device, self.pmodel, self.tp_s)
            self.pperf_d = Roofline(self.device, self.pmodel, self.tp_r)
        if c.trace is not None:
            self.prompt_mean = float(np.mean(c.trace.prompt_mean))
            self.output_mean = float(np.mean(c.trace.output_mean))
            self.prompt_p99 = float(c.trace.prompt_p99)
        else:
            self.prompt_mean, self.output_mean, self.prompt_p99 = c.trace_shape.sizes.means()
        mem = c.memory or {}
        ws = mem.get("serving_weight_bytes", self.smodel.weight_bytes)
        wp = self.policy_weight_bytes = mem.get("policy_weight_bytes", self.pmodel.weight_bytes)
        self.kvb_s = mem.get("kvb_serving", self.smodel.kv_bytes_per_token)
        self.kvb_p = mem.get("kvb_policy", self.pmodel.kv_bytes_per_token)
        usable_s = mem.get("usable_serving", usable_bytes(self.device, self.tp_s))
        usable_r = mem.get("usable_dedicated", usable_bytes(self.device, self.tp_r))
        self.total_s = mem.get("total_serving", self.tp_s * self.device.hbm_bytes)
        self.alone_kv_tokens = max(1.0, (usable_s - ws) / self.kvb_s)
        slo_ttft, slo_tpot = c.slo_ttft_ms / 1e3, c.slo_tpot_ms / 1e3
        self.cap_rps = slo_capacity_rps(self.sperf, self.prompt_mean, self.output_mean, self.prompt_p99, slo_ttft, slo_tpot, self.alone_kv_tokens)
        if self.cap_rps <= 0:
            raise Infeasible(f"{c.model} on {self.tp_s}x{c.device}: no load meets TTFT {c.slo_ttft_ms:g} ms / TPOT {c.slo_tpot_ms:g} ms even alone")
        # the serving trace, in fleet requests/s
        horizon = int(c.warmup_s + c.max_sim_s) + 2
        if c.trace is not None:
            reps = math.ceil(horizon / max(1, c.trace.duration_s))
            self.fleet_rate = np.tile(c.trace.rate, reps)[:horizon]
        else:
            shape = diurnal_bursty(horizon, c.start_hour, c.trace_shape, c.seed + 7)
            self.fleet_rate = shape.rate * c.load * self.n_serv * self.cap_rps
        # a co-hosting serving pool is sized for the trace's peak (p99.9 of the per-instance rate) with
        # rollout running beside it (one quantum per serving iteration makes requests stay longer)
        peak = float(np.percentile(self.fleet_rate, 99.9)) / self.n_serv
        q = c.quantum_ms / 1e3
        at_peak = serving_tick(
            self.sperf, np.array([peak]), self.prompt_mean, self.output_mean, self.prompt_p99, q, q, 0.0, 1.0, self.alone_kv_tokens
        )
        pool_tokens = min(self.alone_kv_tokens, SERVING_POOL_MARGIN * float(at_peak.batch[0]) * (self.prompt_mean + self.output_mean))
        self.pool_tokens = mem.get("serving_pool_tokens", pool_tokens)
        self.cohost_free_bytes = usable_s - ws - wp - self.pool_tokens * self.kvb_s
        self.can_cohost = self.cohost_free_bytes > 0
        self.dedicated_kv = usable_r - wp
        self.max_rollout_batch = c.max_rollout_batch
        self.turn_p90 = turn_length_quantile(c.rollout, 0.9)
        self.mean_rollout_ctx = mean_context(c.rollout)
        # what a lane GPU-second is worth beside a dedicated one, each at the batch its KV holds at the mean context
        seq = self.mean_rollout_ctx * self.kvb_p
        lane_b = min(float(self.max_rollout_batch), max(0.0, self.cohost_free_bytes) / seq)
        ded_b = max(1.0, min(float(self.max_rollout_batch), self.dedicated_kv / seq))
        self.lane_value = (
            lane_value(
                lane_b,
                float(self.pperf_s.decode_s(max(lane_b, 1.0), self.mean_rollout_ctx)),
                self.tp_s,
                ded_b,
                float(self.pperf_d.decode_s(ded_b, self.mean_rollout_ctx)),
                self.tp_r,
            )
            if lane_b >= 1.0
            else 0.0
        )

    def _init_state(self) -> None:
        c = self.cfg
        self.inst = Instances(self.n_serv, self.n_ded)
        cohosting = self.policy.hosts_policy_on_serving and self.can_cohost
        self.serving_kv_tokens = self.pool_tokens if cohosting else self.alone_kv_tokens
        self.cohosting = cohosting
        # per second of the trace, the most a serving instance's rollout lane can have (None: no bounded lane there)
        self.lane_ceiling = (
            lane_share_ceiling(
                self.policy.executor_policy,
                self.sperf,
                self.fleet_rate / self.n_serv,
                self.prompt_mean,
                self.output_mean,
                self.prompt_p99,
                self.serving_kv_tokens,
            )
            if cohosting and not self.policy.drains_lent
            else None
        )
        for d in range(self.n_serv, self.inst.D):
            self.inst.set_caps(d, self.max_rollout_batch, self.dedicated_kv)
        # the scheduler's own fleet view (leases live there), and its placement candidates as of a tick
        self.fleet = Fleet(SchedulerConfig())
        self.capacity = RolloutCapacity()  # the trainer's view of the same headroom (grpo.early_hand_out)
        for d, eid in enumerate(self.inst.ids):
            role = "dedicated" if self.inst.is_ded[d] else "serving"
            self.fleet.on_heartbeat(
                Heartbeat(
                    service="executor",
                    instance=eid,
                    version="sim",
                    host="sim",
                    pid=0,
                    started_at=0.0,
                    sent_at=0.0,
                    interval_s=1e12,
                    labels={"role": role},
                ),
                now=0.0,
            )
        self.placement_settings = self.fleet.config.placement
        self.cands = CandidateCache(self.fleet)
        # the clock
        self.tick_no = 0
        self.k_sched = max(1, int(round(SCHEDULER_TICK_S / c.dt)))  # ticks per scheduler tick
        # the monitor
        used = self.total_s - max(0.0, self.cohost_free_bytes)
        self.mon = MonitorState(
            monitor_settings(c.slo_ttft_ms, c.slo_tpot_ms, self.max_rollout_batch, int(max(0.0, self.cohost_free_bytes))),
            c.dt,
            self.n_serv,
            self.n_ded,
            max(0.0, float(self.sperf.decode_s(1.0, self.prompt_mean)) * 1e3),
            MetricsSnapshot(
                executor_id="s0",
                at=0.0,
                interval_s=c.dt,
                device=DeviceTelemetry(
                    kind="cuda", name=self.device.name, memory_total_bytes=int(self.total_s), memory_used_bytes=int(max(0.0, used))
                ),
            ),
            "sticky_throughput" in c.what_if,
        )
        # the whole fleet serving alone, second by second (what static sees), for attribution
        alone = serving_tick(
            self.sperf, self.fleet_rate / self.n_serv, self.prompt_mean, self.output_mean, self.prompt_p99, 0.0, 0.0, 0.0, c.dt, self.alone_kv_tokens
        )
        self.alone_bad = (alone.ttft_p99_s > c.slo_ttft_ms / 1e3) | (alone.tpot_p99_s > c.slo_tpot_ms / 1e3) | (alone.queue > 0)
        self.turns = TurnTable(self.inst.D)  # sized per step by the trainer
        self.worker = RolloutWorker()
        self.trainer = TrainerState()
        self.counts = Counters()

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
        self.fleet.on_lease(lease, self.env.now)
        if kind == "revoked" and lease.park_until > self.env.now:
            self.park_device(d, lease.park_until)
        elif kind in ("revoked", "expired"):
            self.revoke_device(d, reason, keep_tokens=self.policy.keep_tokens)
        elif self.cohosting:  # the executor clamps a lease to its rollout pool
            self.inst.set_caps(d, lease.max_rollout_batch, min(float(lease.kv_bytes), max(0.0, self.cohost_free_bytes)))
        self.counts.lease(kind)

    def park_device(self, d: int, until: float) -> None:
        """A burst's revocation (``Lease.park_until``): device d runs and admits nothing, its turns keep
        their place and KV until a new lease (``apply_lease``) resumes them or ``until`` interrupts
        them (``revoke_device``, checked each tick in ``_tick``)."""
        self.inst.set_caps(d, 0, self.inst.kvcap[d])
        self.inst.park_until[d] = until
        self.counts.parks += 1

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
                self.counts.interrupted += 1
                t.events[i].succeed(("interrupted", max(0.0, math.floor(done))))
            else:
                self.counts.aborted += 1
                t.events[i].succeed(("aborted", 0.0))
        t.drop_instance_cache(d)

    def _kv_slots(self, kv_bytes: float) -> int:
        return int(kv_bytes // (self.mean_rollout_ctx * self.kvb_p))

    def _headroom_role(self, d: int, role: ExecutorRole, now: float, running: float = 0.0, queued: float = 0.0, tps: float = 0.0) -> None:
        slots = int(self.inst.slots[d]) if role == "dedicated" else 0
        if role == "dedicated" and "kv_slots" in self.cfg.what_if:
            slots = min(slots, self._kv_slots(self.inst.kvcap[d]))
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
            )
        )

    def _headroom(self, headroom: Headroom) -> None:
        """The monitor's headroom goes to the scheduler's fleet and to the trainer's capacity view."""
        self.fleet.on_headroom(headroom)
        self.capacity.observe(headroom, self.env.now)

    # ------------------------------------------------------------------ the clock
    def _clock(self):
        c, env = self.cfg, self.env
        dt = c.dt
        serving_idx = np.arange(self.n_serv)
        while True:
            now = env.now
            self._tick(now, dt, serving_idx)
            yield env.timeout(dt)

    def _tick(self, now: float, dt: float, serving_idx: np.ndarray) -> None:
        c = self.cfg
        pol = self.policy
        inst, turns, mon, acc = self.inst, self.turns, self.mon, self.counts
        n = self.n_serv
        fleet_rps = float(self.fleet_rate[min(len(self.fleet_rate) - 1, int(now))])
        lent = inst.lent()
        serving_mode = ~lent if pol.drains_lent else np.ones(n, dtype=bool)
        n_active = int(serving_mode.sum())
        per_inst = fleet_rps / max(1, n_active)
        arrivals = np.where(serving_mode, self.rng.poisson(per_inst * dt, n), 0).astype(float)
        # latency from the expected rate (the p99 formulas already hold the Poisson variation);
        # the sampled arrivals feed burst detection and request accounting
        rate = np.where(serving_mode, per_inst, 0.0)
        # rollout running on serving instances, at the start of the tick
        running = turns.state == 2
        br = np.bincount(turns.dev[running], minlength=inst.D)[:n] * turns.bundle if running.any() else np.zeros(n)
        ctx_r = turns.mean_ctx(running)[:n]
        tau_r = self.pperf_s.decode_s(np.maximum(br, 1), np.maximum(ctx_r, 1.0))
        ep = pol.executor_policy
        ready = inst.ready_at[:n] <= now
        active = (br > 0) & (inst.slots[:n] > 0) & ready if (ep is not None and self.cohosting) else np.zeros(n, dtype=bool)
        last_bs = mon.ring["bs"][:, (self.tick_no - 1) % mon.W]
        extra, wait, may = rollout_interference(
            ep, active, tau_r, self.turn_p90, lambda d: executor_signals(now, last_bs[d], inst.prev_iter_ms[d], c.slo_tpot_ms)
        )
        st = serving_tick(self.sperf, rate, self.prompt_mean, self.output_mean, self.prompt_p99, extra, wait, inst.queue, dt, self.serving_kv_tokens)
        inst.queue = np.where(serving_mode, st.queue, 0.0)
        inst.prev_iter_ms = st.iteration_s * 1e3
        slo_ttft, slo_tpot = c.slo_ttft_ms / 1e3, c.slo_tpot_ms / 1e3
        violating = serving_mode & (arrivals > 0) & ((st.ttft_p99_s > slo_ttft) | (st.tpot_p99_s > slo_tpot))
        acc.violations += float(violating.sum()) * dt
        acc.bad_requests += float(arrivals[violating].sum())
        acc.requests += float(arrivals.sum())
        acc.serving_instance_s += float(n_active) * dt
        # the same trace on the whole fleet serving alone (what static sees), for attribution
        acc.violations_alone += float(self.alone_bad[min(len(self.alone_bad) - 1, int(now))]) * n * dt
        # what each instance's rollout lane gets this second
        share = np.zeros(inst.D)
        share[n:] = (inst.ready_at[n:] <= now).astype(float)
        if ep is not None and self.cohosting:
            share[:n] = np.where(ready & (inst.slots[:n] > 0), rollout_share(ep, st, extra, may), 0.0)
        if self.cohosting:
            acc.lent_instance_s += float(lent.sum()) * dt
        if self.turns.N and bool(((self.turns.state == 1) | (self.turns.state == 2)).any()):
            acc.rollout_work_s += dt
            if self.lane_ceiling is not None:
                acc.lane_ceiling_s += float(self.lane_ceiling[min(len(self.lane_ceiling) - 1, int(now))]) * n * dt
        tokens = self._rollout_tick(now, dt, share)
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
            if not pol.is_active(self.fleet.info(inst.ids[d]).lease, now):
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

    def _dedicated_headroom(self, now: float) -> None:
        t, D = self.turns, self.inst.D
        running = t.state == 2
        queued = t.state == 1
        nr = np.bincount(t.dev[running], minlength=D) if running.any() else np.zeros(D, dtype=np.int64)
        nq = np.bincount(t.dev[queued], minlength=D) if queued.any() else np.zeros(D, dtype=np.int64)
        # each dedicated executor's metrics snapshot: rollout tokens/s over the interval, kept when rollout is running
        # (what rose bench e2e averages into calibration.dedicated_rollout_tokens_per_s)
        self.counts.ded_snapshots_tps.extend(self.mon.close_dedicated_interval(nr[self.n_serv :]))
        peak_tps = self.mon.ring_tps.max(axis=1)
        for d in range(self.n_serv, D):
            self._headroom_role(d, "dedicated", now, nr[d] * t.bundle, nq[d] * t.bundle, peak_tps[d])

    # ------------------------------------------------------------------ rollout progress
    def _pol_perf(self, d: np.ndarray, fn: str, *args):
        a = getattr(self.pperf_d, fn)(*args)
        b = getattr(self.pperf_s, fn)(*args)
        return np.where(self.inst.is_ded[d], a, b)

    def _rollout_tick(self, now: float, dt: float, share: np.ndarray) -> np.ndarray:
        inst, t, acc, D = self.inst, self.turns, self.counts, self.inst.D
        tokens: np.ndarray = np.zeros(D)
        if t.N == 0 or not t.state.any():
            return tokens
        bundle, kvb = t.bundle, self.kvb_p
        # --- admission, FIFO per device under the slot and KV caps
        q = np.flatnonzero(t.state == 1)
        if q.size:
            dq = t.dev[q]
            need = bundle * (t.ctx[q] + t.dec_left[q]) * kvb
            never = need > inst.kvcap[dq]
            for i in q[never]:  # can never fit there (or no rollout pool at all): the executor refuses, the worker goes elsewhere
                t.state[i], t.dev[i] = 0, -1
                acc.bounced += 1
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
            adm, da = q[ok], dq[ok]
            if adm.size:
                t.state[adm] = 2
                t.pf_left[adm] = self._pol_perf(da, "prefill_s", bundle * t.pf_tokens[adm], t.pf_cached[adm])
        # --- progress: prefill first (at most half the lane while others decode), then decode
        run = np.flatnonzero(t.state == 2)
        if run.size == 0:
            return tokens
        dr = t.dev[run]
        pf = t.pf_left[run]
        pre = pf > 1e-12
        dec = ~pre
        PF = np.bincount(dr[pre], weights=pf[pre], minlength=D)
        ndec = np.bincount(dr[dec], minlength=D)
        nb = ndec * bundle
        ctx_d = np.bincount(dr[dec], weights=t.ctx[run][dec], minlength=D) / np.maximum(ndec, 1)
        tau = np.where(
            inst.is_ded,
            self.pperf_d.decode_s(np.maximum(nb, 1), np.maximum(ctx_d, 1.0)),
            self.pperf_s.decode_s(np.maximum(nb, 1), np.maximum(ctx_d, 1.0)),
        )
        T = share * dt
        t_pf = np.where(nb > 0, np.minimum(PF, 0.5 * T), np.minimum(PF, T))
        n_it = np.where(nb > 0, (T - t_pf) / tau, 0.0)
        frac = np.where(PF > 0, t_pf / np.maximum(PF, 1e-30), 0.0)
        f = frac[dr]
        new_pf = np.where(pre, np.where(f >= 1.0 - 1e-9, 0.0, pf * (1.0 - f)), 0.0)
        t.pf_left[run] = new_pf
        adv = np.where(dec, n_it[dr], 0.0)
        left = t.dec_left[run]
        step_tokens = np.minimum(left, adv)
        t.dec_left[run] = left - step_tokens
        t.ctx[run] += step_tokens
        tokens = np.bincount(dr, weights=step_tokens * bundle, minlength=D)
        acc.rollout_tokens += float(tokens.sum())
        acc.serving_tokens += float(tokens[: self.n_serv].sum())
        fin_mask = dec & (left - adv <= 1e-9) & (adv > 0)
        if fin_mask.any():
            fins = run[fin_mask]
            frac_t = np.clip(left[fin_mask] / np.maximum(adv[fin_mask], 1e-12), 0.0, 1.0)
            at = now + dt * frac_t
            for i, t_fin in zip(fins, at):
                t.finish(i, kvb)
                t.events[i].succeed(("done", float(t_fin)))
        return tokens

    # ------------------------------------------------------------------ monitor (real detector + headroom)
    def _monitor(self, now: float, serving_mode: np.ndarray, st) -> None:
        pol, m = self.policy, self.mon
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
        q_prev = L(r["queue"][:, last[1]]) if filled > 1 else [0.0] * self.n_serv
        br_now = L(r["br"][:, last[0]])
        tps_peak = L(m.ring_tps[: self.n_serv, long_idx].max(axis=1))
        kv_util = L(np.minimum(1.0, st.batch * (self.prompt_mean + self.output_mean) / max(1.0, self.serving_kv_tokens)))
        util = L(1.0 - np.exp(-st.batch))
        span_s, span_l, span_b, span_r = len(short_idx) * dt, filled * dt, len(base_idx) * dt, len(recent_idx) * dt
        refit = m.refit_due(self.tick_no)
        t, D = self.turns, self.inst.D
        qmask = t.state == 1
        queued = L(np.bincount(t.dev[qmask], minlength=D)) if qmask.any() else [0] * D
        c, bundle = self.cfg, t.bundle
        for d in range(self.n_serv):
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
            found = pol.classify(short, recent, base, int(q_now[d]), int(q_prev[d]), m.burst_cfg, m.head_cfg)
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
                    self.counts.alerts += 1
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
                self.counts.unlendable[re.sub(r"\d+(\.\d+)? ms", "N ms", v.reason.split(";")[0])] += 1
            slots = v.slots if "kv_slots" not in c.what_if else min(v.slots, self._kv_slots(v.kv_bytes))
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
                    rollout_running=int(br_now[d]),
                    rollout_queue=queued[d] * bundle,
                    rollout_tokens_per_s=m.reported_tps(d, tps_peak[d]),
                    device_kind="cuda",
                    device_name=self.device.name,
                    device_memory_bytes=int(self.total_s),
                )
            )

    # ------------------------------------------------------------------ rollout workers and trainer
    def _route(self, tid: str, gid: str, k: int, prompt_tokens: float, prev: str, exclude: list[str], batch: tuple[str, int] = ("", 0)):
        """The scheduler's route handler without its I/O: affinity from the request or the fleet,
        then place_turn over the fleet's candidates (with the batch's unfinished trajectories for the
        tail rule); the fleet records the route. Returns (device, hedge hint s) or None."""
        now = self.env.now
        req = TurnRouteRequest(
            trajectory_id=tid,
            turn_index=k,
            prompt_tokens=int(prompt_tokens),
            previous_executor=prev,
            group_id=gid,
            group_size=self.cfg.rollout.group_size,
            exclude=exclude,
            batch_id=batch[0],
            batch_size=batch[1],
        )
        affinity = req.previous_executor or self.fleet.affinity.get(tid, "")
        cands = self._candidates(now)
        placement = self.policy.place_turn(
            req,
            cands,
            affinity,
            self.placement_settings,
            self.route_rng,
            self._unfinished(req.batch_id, req.batch_size),
            self.fleet.turn_tokens,
            self.cands.revoke_rate,
            self.fleet.model_error,
        )
        if placement is None:
            return None
        self.fleet.on_route(tid, placement.executor_id, now, batch_id=req.batch_id, batch_size=req.batch_size)
        self.fleet.on_prediction(tid, k, placement.role, placement.model_s)
        self._placed(placement.executor_id)
        return self.inst.index[placement.executor_id], placement.hedge_after_s

    def _unfinished(self, batch_id: str, batch_size: int = 0) -> int | None:
        """The fleet's count is of simulated trajectories; each stands for ``bundle`` (as slots and load do)."""
        n = self.fleet.unfinished(batch_id, batch_size)
        return None if n is None else n * self.turns.bundle

    def _candidates(self, now: float) -> list[Candidate]:
        """The scheduler's ``Fleet.candidates``, refreshed once per tick (``CandidateCache``)."""
        return self.cands.get(now, self.tick_no, self.turns.bundle)

    def _placed(self, executor_id: str) -> None:
        self.cands.placed(executor_id, self.turns.bundle)

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
            self.counts.turn_durations.append(finish - started)
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
        self.fleet.on_trajectory(tid, gid, [int(x) for x in batch.gen[i, :turns]])
        for k, tokens, seconds in done_turns:  # the scheduler reads the turn records of a finished trajectory
            self.fleet.on_turn_result(tid, k, tokens, seconds)
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
        retry = self.placement_settings.no_route_retry_s
        while True:
            routed = self._route(tid, gid, k, ctx + done_tokens, prev, exclude, bid)
            if routed is None:
                exclude = []
                yield env.timeout(retry)
                continue
            d, hint = routed
            cached = 0.0
            if k > 0 and done_tokens == 0 and ids[d] == prev:
                if t.cache_dev[i] == d:
                    free = max(0.0, self.inst.kvcap[d] - t.kv_in_use(d, self.kvb_p))
                    p_hit = 1.0 if t.retained[d] <= free else free / max(t.retained[d], 1.0)
                    if self.cache_rng.random() < p_hit:
                        cached = float(ctx - new_tokens)
                if cached:
                    self.counts.prefix_hits += 1
                else:
                    self.counts.prefix_misses += 1
            t.drop_cache(i)
            pending = {i: (self._submit(i, d, ctx + done_tokens - cached, cached, gen - done_tokens, ctx + done_tokens), d)}
            typical = self.worker.typical()
            leased = self.fleet.role_of(ids[d]) != "dedicated"
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
                            self.counts.hedge_wins += 1
                            t.move_cache(slot, i)
                        return value, dd
                    if kind == "interrupted" and slot == i:
                        done_tokens += value
                    failed.append(ids[dd])
                if hedge_at is not None and env.now >= hedge_at and i in pending and len(pending) == 1:
                    primary = ids[pending[i][1]]
                    h = self._hedge_route(tid, gid, k, ctx + done_tokens, primary, prev, env.now - attempt_start, typical, bid)
                    # refused: a turn on leased capacity asks again once its age has doubled (hedging.hedge_ask_again_after)
                    hedge_at = env.now + hedge_ask_again_after(env.now - attempt_start) if h is None and leased else None
                    if h is not None:
                        self.counts.hedges += 1
                        slot = t.N + i
                        pending[slot] = (self._submit(slot, h, ctx + done_tokens, 0.0, gen - done_tokens, ctx + done_tokens), h)
            exclude += [e for e in failed if e not in exclude]  # the worker's exclude list grows until no route is left
            prev = ""

    def _hedge_route(
        self,
        tid: str,
        gid: str,
        k: int,
        prompt_tokens: float,
        primary: str,
        previous: str,
        elapsed: float,
        typical: float,
        bid: tuple[str, int] = ("", 0),
    ) -> int | None:
        """The scheduler's hedge path: should_hedge, then place_turn with hedge=True (prefers dedicated). The request
        is the worker's: the previous turn's executor (its prefix cache; "" for a first turn) and the primary excluded."""
        now = self.env.now
        req = TurnRouteRequest(
            trajectory_id=tid,
            turn_index=k,
            prompt_tokens=int(prompt_tokens),
            previous_executor=previous,
            group_id=gid,
            group_size=self.cfg.rollout.group_size,
            exclude=[primary],
            hedge=True,
            elapsed_s=elapsed,
            typical_turn_s=typical,
            batch_id=bid[0],
            batch_size=bid[1],
        )
        candidates, role = self._candidates(now), self.fleet.role_of(primary)
        worth, _why = self.policy.should_hedge(
            req, self.fleet.group_done.get(gid, 0), self.placement_settings, candidates, self._unfinished(bid[0], bid[1]), role
        )
        if not worth:
            return None
        affinity = req.previous_executor or self.fleet.affinity.get(tid, "")
        placement = self.policy.place_turn(req, candidates, affinity, self.placement_settings, self.route_rng)
        if placement is None:
            return None
        self.fleet.on_route(tid, placement.executor_id, now, hedge=True)
        self._placed(placement.executor_id)
        return self.inst.index[placement.executor_id]

    def _submit(self, i: int, d: int, pf_tokens: float, cached: float, gen_left: float, ctx_now: float):
        """Turn-table row ``i`` goes to instance ``d``; the event its worker waits on."""
        ev = self.env.event()
        self.turns.submit(i, d, ev, pf_tokens, cached, gen_left, ctx_now)
        return ev

    def _next_idle_s(self, batch) -> float:
        """Seconds from the end of this rollout to the next one's start (training + dedicated sync)."""
        c = self.cfg
        train_s = self._train_seconds(batch.tokens())
        return train_s + sync_seconds(self.policy_weight_bytes, "full", c.sync, cross_cluster=False)

    def _critical_paths(self, batch) -> np.ndarray:
        """Per trajectory of ``batch``: the least seconds any placement can roll it out in, its turns in
        sequence, each alone on the fastest instance the policy runs on (batch 1, the whole device,
        its prefix cached) and its tools' latencies between them. No capacity makes a step's rollout
        shorter than its slowest trajectory's (the ceiling's latency bound, ceiling.py)."""
        out = np.zeros(batch.n)
        for i in range(batch.n):
            k = int(batch.turns[i])
            gen = batch.gen[i, :k].astype(float)
            new = np.r_[float(batch.prompt[i]), batch.tool_tokens[i, : k - 1].astype(float)]
            before = np.cumsum(new) + np.r_[0.0, np.cumsum(gen)[:-1]]  # context once a turn's new tokens are in
            cached = before - new
            mid = before + gen / 2.0
            turn_s = np.minimum(
                self.pperf_d.prefill_s(new, cached) + gen * self.pperf_d.decode_s(1.0, mid),
                self.pperf_s.prefill_s(new, cached) + gen * self.pperf_s.decode_s(1.0, mid),
            )
            out[i] = float(turn_s.sum()) + float(batch.tool_s[i, : k - 1].sum())
        return out

    def _batch_shape(self) -> tuple[int, int]:
        c = self.cfg
        inst_kv_tokens = self.dedicated_kv / self.kvb_p
        trajectories = c.trajectories or batch_trajectories(c.rollout, self.n_ded * inst_kv_tokens)
        return trajectories, bundle_size(c.rollout, trajectories, inst_kv_tokens)

    def _train_seconds(self, tokens: float) -> float:
        """Training time of one step's ``tokens``: the measured time per step (calibration), else the FLOPs model."""
        c = self.cfg
        if c.train_s is not None:
            return c.train_s
        return train_seconds(self.pmodel, tokens, self.trainer_gpus, self.device, c.train_mfu)

    def _trainer(self):
        if self.cfg.prefetch_steps > 0 or self.cfg.over_provision > 0:
            yield from self._trainer_pipelined()
            return
        c, env, t = self.cfg, self.env, self.turns
        self.mon.active_from = c.warmup_s - PREWARM_S
        yield env.timeout(c.warmup_s)
        trajectories, bundle = self._batch_shape()
        self.worker.size(env, c.worker_concurrency, bundle)
        wp = self.policy_weight_bytes
        for step in range(c.steps):
            t0 = env.now
            sync_ded = sync_seconds(wp, "full", c.sync, cross_cluster=False)
            sync_srv = sync_seconds(wp, self.policy.serving_sync_mode, c.sync, cross_cluster=True)
            yield env.timeout(sync_ded)  # the batch starts once the dedicated pool has the version
            t_roll = env.now
            self.inst.ready_at[: self.n_serv] = t0 + sync_srv
            batch = sample_batch(c.rollout, trajectories, self.batch_rng, bundle)
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
        wp = self.policy_weight_bytes
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
            self.inst.ready_at[: self.n_serv] = started + sync_srv
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
            if not tr.pipelined:
                self.inst.ready_at[: self.n_serv] = env.now + sync_srv
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
        batch = sample_batch(self.cfg.rollout, trajectories, self.batch_rng, bundle)
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
        steps = tr.steps
        complete = len(steps) == c.steps
        step_s = float(np.mean([s["step_s"] for s in steps])) if steps else float("nan")
        rate = 3600.0 / step_s if steps else 0.0
        rollouts = steps
        if tr.pipelined:
            tr.batches_done_stats()
            rollouts = tr.batch_spans
            if len(steps) >= 2:  # steady state, as rose bench e2e measures it: first to last training step
                step_s = (steps[-1]["done"] - steps[0]["done"]) / (len(steps) - 1)
                rate = 3600.0 / step_s
        rollout_s = float(np.mean([s["rollout_s"] for s in rollouts])) if rollouts else float("nan")
        gen = sum(s["generated"] for s in rollouts)
        roll_total = sum(s["rollout_s"] for s in rollouts)
        sim_s = max(1e-9, self.env.now)
        hits, misses = a.prefix_hits, a.prefix_misses
        lane = a.lane_ceiling_s / (a.rollout_work_s * self.n_serv) if self.lane_ceiling is not None and a.rollout_work_s > 0 else None
        return dict(
            model=c.model,
            device=c.device,
            gpus=c.gpus,
            policy=c.policy,
            complete=complete,
            steps=len(steps),
            serving_instances=self.n_serv,
            serving_tp=self.tp_s,
            dedicated_instances=self.n_ded,
            rollout_tp=self.tp_r,
            rollout_gpus=self.n_ded * self.tp_r,
            trainer_gpus=self.trainer_gpus,
            cohosting=self.cohosting,
            serving_capacity_rps_per_instance=self.cap_rps,
            cohost_free_gb=self.cohost_free_bytes / 1e9,
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
            turn_s_p50=float(np.median(a.turn_durations)) if a.turn_durations else float("nan"),
            dedicated_rollout_tokens_per_s=float(np.mean(a.ded_snapshots_tps)) if a.ded_snapshots_tps else 0.0,
            tail_fraction=sum(s["tail_s"] for s in rollouts) / roll_total if roll_total else 0.0,
            rollout_tokens_on_serving_fraction=a.serving_tokens / max(1.0, a.rollout_tokens),
            lane_share_ceiling=lane,
            rollout_capacity_ceiling=rollout_capacity_ceiling(lane, self.n_serv * self.tp_s, self.n_ded * self.tp_r),
            lane_value=self.lane_value,
            rollout_capacity_ceiling_kv=rollout_capacity_ceiling(lane, self.n_serv * self.tp_s, self.n_ded * self.tp_r, self.lane_value),
            unlendable_reasons=dict(a.unlendable.most_common(3)),
            slo_violations=a.violations,
            slo_violations_serving_alone=a.violations_alone,
            serving_slo_attainment=1.0 - a.bad_requests / max(1.0, a.requests),
            lent_instance_fraction=a.lent_instance_s / max(1e-9, sim_s * self.n_serv),
            leases=dict(granted=a.granted, renewed=a.renewed, revoked=a.revoked, expired=a.expired),
            alerts=a.alerts,
            interrupted_turns=a.interrupted,
            parked_leases=a.parks,
            aborted_turns=a.aborted,
            bounced_turns=a.bounced,
            hedges=a.hedges,
            hedge_wins=a.hedge_wins,
            prefix_hit_rate=hits / (hits + misses) if hits + misses else 0.0,
            simulated_s=sim_s,
        )


def simulate(cfg: SimConfig) -> dict:
    """Run one configuration; the result dict (plus ``timeline`` when recorded)."""
    sim = Simulation(cfg)
    out = sim.run()
    if cfg.record_timeline:
        out["timeline"] = sim.counts.timeline
    return out
