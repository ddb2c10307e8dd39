"""The fleet a simulation runs on, sized once from its ``SimConfig`` (engine.py runs over it).

``size_fleet`` turns a configuration into the figures that never change during a run: which
models on which device, how many instances of which tensor-parallel width (``FleetShape``), how
each instance's memory divides between weights, the serving pool and rollout (``MemorySplit``),
and the serving traffic it carries (``ServingTraffic``). ``serving_setup`` adds what depends on
the fleet policy too: whether rollout co-hosts on serving instances, the serving KV pool that
leaves, and the serving-alone baseline.

The rollout mode (``SimConfig.rollout_mode``) changes what a serving instance hosts beside the serving model:
two-model, a copy of the policy; co-batched (co_batched.py), only the policy's LoRA adapter, so it lends the HBM the
policy's weights took in two-model mode too, less the adapter, and its serving pool holds what its requests hold while
rollout rows ride their iterations. The instances' widths are the same in both modes (``serving_tp`` sizes for the
serving model and a policy copy): the serving fleet is the same machine in every row. They live here, apart from the engine's changing state,
because the planner's questions (does this model fit this fleet, how large is the lane) are
these figures alone, and because the engine reads them everywhere and writes them nowhere.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from rose.shared.devices import DEVICES, DeviceSpec, MeasuredSteps, ModelSpec, Roofline, model_spec, rollout_tp, serving_tp, usable_bytes
from rose.shared.errors import RoseError
from rose.shared.workload import mean_context, turn_length_quantile

from . import ROLLOUT_MODES
from .ceiling import lane_value
from .co_batched import AdaptedSteps, co_batch_plan
from .config import SimConfig
from .coserve import lane_share_ceiling, serving_tick, slo_capacity_rps
from .policies import FleetPolicy
from .traces import diurnal_bursty

SERVING_POOL_QUANTILE = 0.999  # a co-hosting serving pool holds every request in flight at this share of instants, at the peak rate
POOL_SNAPSHOTS = 20_000  # instants drawn to read that quantile (at p99.9: the 20 largest decide it)
# Rounds that settle a co-batched instance's serving pool against the rows it lends (``co_batched_pool_tokens``): a
# larger pool lends fewer rows, fewer rows stretch serving's iterations less, a damped swing; at 7B-70B on 16 H100s the
# larger of the last two rounds' pools is the same from the fourth round on (tests/sim/test_co_batched.py)
SETTLE_ROUNDS = 4

# a model's step times on one instance (``SimConfig.perf`` gives measured ones; a co-batched job's policy: the base + adapter)
StepTimes = Roofline | MeasuredSteps | AdaptedSteps


class Infeasible(RoseError, ValueError):
    """This model does not fit this fleet (the reason says why)."""


@dataclass(frozen=True, eq=False)
class FleetShape:
    """The models, the device and the instances: ``n_serv`` serving instances of ``tp_s`` GPUs (the
    serving model and a copy of the policy), ``n_ded`` dedicated rollout instances of ``tp_r``, the
    trainer's GPUs, and the step times of each model where it runs."""

    smodel: ModelSpec  # the serving model
    pmodel: ModelSpec  # the policy
    device: DeviceSpec
    tp_s: int
    tp_r: int
    n_serv: int
    n_ded: int
    trainer_gpus: float
    sperf: StepTimes  # the serving model on a serving instance
    pperf_s: StepTimes  # the policy on a serving instance
    pperf_d: StepTimes  # the policy on a dedicated instance


@dataclass(frozen=True, eq=False)
class MemorySplit:
    """Bytes per instance: the weights, KV bytes per token of each model, the serving KV pool when
    rollout co-hosts (``pool_tokens``) or not (``alone_kv_tokens``), what a serving instance has left
    to lend (``cohost_free_bytes``) and what a dedicated one holds for rollout KV."""

    policy_weight_bytes: float  # what a new policy version ships (two-model: the policy's weights; co-batched: its adapter)
    fold_bytes: float  # co-batched: the adapted weights a dedicated instance copies over its host link to fold a version in
    kvb_s: float  # serving KV bytes per token
    kvb_p: float  # policy KV bytes per token
    total_s: float  # a serving instance's HBM
    alone_kv_tokens: float  # a serving instance's KV pool with no policy copy beside it
    pool_tokens: float  # a co-hosting serving instance's KV pool
    cohost_free_bytes: float  # left for rollout on a co-hosting serving instance (negative: none)
    can_cohost: bool
    dedicated_kv: float  # rollout KV bytes on a dedicated instance


@dataclass(frozen=True, eq=False)
class ServingTraffic:
    """The serving trace, in fleet requests/s per second of the run, its request sizes, and what
    one serving instance serves within the SLO alone."""

    prompt_mean: float
    output_mean: float
    prompt_p99: float
    cap_rps: float  # SLO capacity of one serving instance alone
    fleet_rate: np.ndarray
    request_sizes: tuple[np.ndarray, np.ndarray] | None  # (prompt, output tokens) of the trace's requests (None: the means)


@dataclass(frozen=True, eq=False)
class SizedFleet:
    """Everything ``size_fleet`` fixes, plus the rollout figures derived from it."""

    shape: FleetShape
    memory: MemorySplit
    traffic: ServingTraffic
    max_rollout_batch: int  # sequences per rollout engine
    turn_p90: float  # the rollout's p90 turn length (tokens)
    mean_rollout_ctx: float  # the rollout's mean context (tokens)
    lane_value: float  # a lane GPU-second's rollout worth beside a dedicated one's (ceiling.py)

    def kv_slots(self, kv_bytes: float) -> int:
        """Rollout sequences ``kv_bytes`` of KV hold at the mean rollout context."""
        return int(kv_bytes // (self.mean_rollout_ctx * self.memory.kvb_p))


@dataclass(frozen=True, eq=False)
class ServingSetup:
    """How serving runs under the fleet policy: whether rollout co-hosts on serving instances, the
    serving KV pool that leaves them, per second of the trace the most a lane can have (None: no
    bounded lane), and the seconds in which the whole fleet serving alone violates the SLO (what
    static sees, for attribution)."""

    cohosting: bool
    kv_tokens: float  # a serving instance's KV pool (tokens) under this policy
    lane_ceiling: np.ndarray | None
    alone_bad: np.ndarray
    co_batched: bool = False  # rollout rides serving's own iterations (co_batched.py), not a lane of its own


def serving_pool_tokens(
    perf: StepTimes,
    rate: float,
    prompt: float,
    output: float,
    prompt_p99: float,
    quantum_s: float,
    kv_tokens_cap: float,
    request_sizes: tuple[np.ndarray, np.ndarray] | None,
) -> float:
    """The KV tokens a co-hosting serving instance's pool needs: what its requests in flight hold at
    ``SERVING_POOL_QUANTILE`` of instants, ``rate`` requests/s arriving (Poisson), rollout running beside them
    (one ``quantum_s`` per iteration makes each request stay longer; co-batched: what its rows add to a decode
    iteration); at most ``kv_tokens_cap``.

    M/G/inf, as ``serving_tick``'s mean batch has it (Little's law): the number in flight is Poisson with that
    mean; a request in flight is one of ``request_sizes`` (prompt, output tokens; None: every request the
    means), drawn in proportion to its life (the prefill, then its output at the iteration's pace), holding its
    prompt and the part of its output decoded so far. Why not a margin over the mean batch (1.25 x batch x
    (prompt + output) before): replaying Poisson arrivals with the Azure-format sample's sizes, that pool was
    0.41-0.91 of the p99.9 held (0.41 at a 70B TP4 instance's 6 requests in flight, where a full pool makes a
    request wait for one of few to finish); the planner's (the same at a rate 2.33 sigma above the peak) was
    1.45-6.1 of it (docs/benchmarks.md, 2026-12-06)."""
    sizes_key = None if request_sizes is None else hashlib.blake2b(b"".join(np.ascontiguousarray(a).tobytes() for a in request_sizes)).digest()
    key = (perf, rate, prompt, output, prompt_p99, quantum_s, kv_tokens_cap, sizes_key)
    if key in _POOL_TOKENS:  # a grid sizes the same instance for every policy and seed: 0.4 s each
        return _POOL_TOKENS[key]
    t = serving_tick(perf, np.array([rate]), prompt, output, prompt_p99, quantum_s, quantum_s, 0.0, 1.0, kv_tokens_cap)
    batch = float(t.batch[0])
    if rate <= 0 or batch <= 0:
        return _POOL_TOKENS.setdefault(key, 0.0)
    prompts, outputs = request_sizes if request_sizes is not None else (np.array([prompt]), np.array([output]))
    prompts, outputs = np.asarray(prompts, dtype=float), np.maximum(np.asarray(outputs, dtype=float), 1.0)
    prefill_s = float(perf.prefill_s(prompt))
    per_token_s = max(1e-9, batch / rate - prefill_s) / float(outputs.mean())  # the mean life is batch / rate
    life = prefill_s + outputs * per_token_s
    rng = np.random.default_rng(0)
    in_flight = rng.poisson(batch, POOL_SNAPSHOTS)
    drawn = rng.choice(len(life), size=int(in_flight.sum()), p=life / life.sum())
    since = rng.random(len(drawn)) * life[drawn]  # how long ago each arrived
    held = prompts[drawn] + np.clip((since - prefill_s) / per_token_s, 0.0, outputs[drawn])
    totals = np.bincount(np.repeat(np.arange(POOL_SNAPSHOTS), in_flight), weights=held, minlength=POOL_SNAPSHOTS)
    return _POOL_TOKENS.setdefault(key, min(kv_tokens_cap, float(np.quantile(totals, SERVING_POOL_QUANTILE))))


_POOL_TOKENS: dict[tuple, float] = {}


def size_fleet(c: SimConfig) -> SizedFleet:
    """The fleet ``c`` describes; raises ``Infeasible`` where its models do not fit it."""
    smodel, pmodel = model_spec(c.model), model_spec(c.policy_model or c.model)
    if c.rollout_mode not in ROLLOUT_MODES:
        raise ValueError(f"rollout mode {c.rollout_mode!r}: choose one of {', '.join(ROLLOUT_MODES)}")
    co_batched = c.rollout_mode == "co_batched"
    if co_batched and pmodel != smodel:
        raise Infeasible(
            f"co-batched rollout runs the policy as a LoRA adapter of the serving model: a {pmodel.name} policy beside "
            f"{smodel.name} serving runs two-model only (or give the policy the serving model's size, {smodel.name})"
        )
    device = DEVICES[c.device]
    tp_s, tp_r = serving_tp(smodel, pmodel, device), rollout_tp(pmodel, device)
    n_serv = c.n_serving if c.n_serving is not None else c.gpus // tp_s
    ded_gpus = int(round(c.gpus * c.rollout_gpu_ratio))
    n_ded = c.n_dedicated if c.n_dedicated is not None else ded_gpus // tp_r
    if n_serv < 1:
        raise Infeasible(f"{c.model} on {c.gpus}x{c.device}: a serving instance needs TP{tp_s} (serving model + policy copy in 65 % of HBM)")
    if n_ded < 1:
        raise Infeasible(f"{c.model}: the dedicated pool ({ded_gpus} GPUs) is smaller than one TP{tp_r} rollout instance")
    trainer_gpus = max(1.0, c.gpus * c.trainer_gpu_ratio)
    sperf: StepTimes
    pperf_s: StepTimes
    pperf_d: StepTimes
    if c.perf is not None:
        sperf, pperf_s, pperf_d = c.perf
    else:
        sperf = Roofline(device, smodel, tp_s)
        pperf_s = Roofline(device, pmodel, tp_s)
        pperf_d = Roofline(device, pmodel, tp_r)
    # co-batched: on a serving instance the policy is the serving model's base with its adapter on every token it
    # computes; a dedicated instance has no serving rows to share a batch with and runs the adapter folded into its copy
    # of the base (services/executor/weights.py MergedAdapterWeights), at the base's cost: its price is a fold per version
    if co_batched:
        pperf_s = AdaptedSteps(pperf_s, c.lora)
    if c.trace is not None:
        prompt_mean = float(np.mean(c.trace.prompt_mean))
        output_mean = float(np.mean(c.trace.output_mean))
        prompt_p99 = float(c.trace.prompt_p99)
    else:
        prompt_mean, output_mean, prompt_p99 = c.trace_shape.sizes.means()
    mem = c.memory or {}
    ws = mem.get("serving_weight_bytes", smodel.weight_bytes)
    wp = mem.get("policy_weight_bytes", pmodel.weight_bytes)
    kvb_s = mem.get("kvb_serving", smodel.kv_bytes_per_token)
    kvb_p = mem.get("kvb_policy", pmodel.kv_bytes_per_token)
    usable_s = mem.get("usable_serving", usable_bytes(device, tp_s))
    usable_r = mem.get("usable_dedicated", usable_bytes(device, tp_r))
    total_s = mem.get("total_serving", tp_s * device.hbm_bytes)
    alone_kv_tokens = max(1.0, (usable_s - ws) / kvb_s)
    slo_ttft, slo_tpot = c.slo_ttft_ms / 1e3, c.slo_tpot_ms / 1e3
    cap_rps = slo_capacity_rps(sperf, prompt_mean, output_mean, prompt_p99, slo_ttft, slo_tpot, alone_kv_tokens)
    if cap_rps <= 0:
        raise Infeasible(f"{c.model} on {tp_s}x{c.device}: no load meets TTFT {c.slo_ttft_ms:g} ms / TPOT {c.slo_tpot_ms:g} ms even alone")
    # the serving trace, in fleet requests/s
    horizon = int(c.warmup_s + c.max_sim_s) + 2
    if c.trace is not None:
        reps = math.ceil(horizon / max(1, c.trace.duration_s))
        fleet_rate = np.tile(c.trace.rate, reps)[:horizon]
        sizes = c.trace.request_sizes
    else:
        trace = diurnal_bursty(horizon, c.start_hour, c.trace_shape, c.seed + 7)
        fleet_rate = trace.rate * c.load * n_serv * cap_rps
        sizes = trace.request_sizes
    # a co-hosting serving pool is sized for the trace's peak (p99.9 of the per-instance rate)
    peak = float(np.percentile(fleet_rate, 99.9)) / n_serv
    adapter_bytes = pmodel.lora_params(c.lora) * pmodel.bytes_per_param if co_batched else 0.0
    beside = adapter_bytes if co_batched else wp  # what a serving instance hosts beside the serving model
    mean_rollout_ctx = mean_context(c.rollout)
    if "serving_pool_tokens" in mem:  # measured (calibration) or given (the planner's, for the whole trace)
        pool_tokens = mem["serving_pool_tokens"]
    elif co_batched:
        lend = (usable_s - ws - beside, kvb_s, mean_rollout_ctx * kvb_p)
        pool_tokens = co_batched_pool_tokens(c, sperf, peak, (prompt_mean, output_mean, prompt_p99), alone_kv_tokens, sizes, lend)
    else:
        pool_tokens = serving_pool_tokens(sperf, peak, prompt_mean, output_mean, prompt_p99, c.quantum_ms / 1e3, alone_kv_tokens, sizes)
    cohost_free_bytes = usable_s - ws - beside - pool_tokens * kvb_s
    dedicated_kv = usable_r - wp  # (a folded adapter takes no room of its own)
    max_rollout_batch = c.max_rollout_batch
    # what a lane GPU-second is worth beside a dedicated one, each at the batch its KV holds at the mean context
    seq = mean_rollout_ctx * kvb_p
    lane_b = min(float(max_rollout_batch), max(0.0, cohost_free_bytes) / seq)
    ded_b = max(1.0, min(float(max_rollout_batch), dedicated_kv / seq))
    value = (
        lane_value(
            lane_b,
            float(pperf_s.decode_s(max(lane_b, 1.0), mean_rollout_ctx)),
            tp_s,
            ded_b,
            float(pperf_d.decode_s(ded_b, mean_rollout_ctx)),
            tp_r,
        )
        if lane_b >= 1.0
        else 0.0
    )
    return SizedFleet(
        shape=FleetShape(smodel, pmodel, device, tp_s, tp_r, n_serv, n_ded, trainer_gpus, sperf, pperf_s, pperf_d),
        memory=MemorySplit(
            adapter_bytes if co_batched else wp,  # what a version ships
            pmodel.adapted_weight_bytes(c.lora) / tp_r if co_batched else 0.0,
            kvb_s,
            kvb_p,
            total_s,
            alone_kv_tokens,
            pool_tokens,
            cohost_free_bytes,
            cohost_free_bytes > 0,
            dedicated_kv,
        ),
        traffic=ServingTraffic(prompt_mean, output_mean, prompt_p99, cap_rps, fleet_rate, sizes),
        max_rollout_batch=max_rollout_batch,
        turn_p90=turn_length_quantile(c.rollout, 0.9),
        mean_rollout_ctx=mean_rollout_ctx,
        lane_value=value,
    )


def co_batched_pool_tokens(
    c: SimConfig,
    perf: StepTimes,
    peak: float,
    sizes: tuple[float, float, float],
    kv_tokens_cap: float,
    request_sizes: tuple[np.ndarray, np.ndarray] | None,
    lend: tuple[float, float, float],
) -> float:
    """A co-batched serving instance's pool (``serving_pool_tokens``), with what the rollout rows its lent KV holds
    add to serving's iterations at the ``peak`` rate (co_batched.py ``co_batch_plan``). The two depend on each other:
    a larger pool lends fewer rows, fewer rows stretch serving's iterations less; ``SETTLE_ROUNDS`` rounds from the
    two-model lane's quantum. ``sizes``: mean prompt, mean output and p99 prompt; ``lend``: (the instance's bytes
    after its weights, serving KV bytes per token, a rollout sequence's KV at the mean context)."""
    prompt, output, prompt_p99 = sizes
    room, kvb_s, seq = lend
    ctx = mean_context(c.rollout)
    extra = c.quantum_ms / 1e3
    pool = last = 0.0
    for _ in range(SETTLE_ROUNDS):
        last, pool = pool, serving_pool_tokens(perf, peak, prompt, output, prompt_p99, extra, kv_tokens_cap, request_sizes)
        rows = int(min(c.max_rollout_batch, max(0.0, room - pool * kvb_s) / seq))
        plan = co_batch_plan(perf, c.lora, np.array([peak]), prompt, output, prompt_p99, 0.0, 1.0, pool, rows=rows, rows_ctx=ctx, **_plan_settings(c))
        extra = float(plan.extra_s[0])
    return max(pool, last)  # whole rows can leave two pools ~1 % apart in turn: the larger keeps serving's side


def _plan_settings(c: SimConfig) -> dict:
    """``co_batch_plan``'s keywords for a lane at full rows with no prefill waiting (sizing, the lane ceiling)."""
    return dict(prefill_tokens=0, prefill_cached=0.0, slo_tpot_s=c.slo_tpot_ms / 1e3, quantum_s=c.quantum_ms / 1e3)


def co_batched_lane_shares(c: SimConfig, fleet: SizedFleet, kv_tokens: float, guarded: bool) -> np.ndarray:
    """Per second of the trace, a co-batched serving instance's rollout tokens/s at the rows its lent KV holds at the
    mean rollout context (``co_batch_plan``, every row ready), over those rows decoding alone on the instance: what
    ``lane_shares`` is in two-model mode, so that the ceilings (ceiling.py) price it the same way."""
    shape, memory, traffic = fleet.shape, fleet.memory, fleet.traffic
    rows = int(min(fleet.max_rollout_batch, max(0.0, memory.cohost_free_bytes) / (fleet.mean_rollout_ctx * memory.kvb_p)))
    rate = traffic.fleet_rate / shape.n_serv
    if rows < 1:
        return np.zeros(rate.shape)
    sizes = (traffic.prompt_mean, traffic.output_mean, traffic.prompt_p99)
    plan = co_batch_plan(
        shape.sperf, c.lora, rate, *sizes, 0.0, 1.0, kv_tokens, rows=rows, rows_ctx=fleet.mean_rollout_ctx, guarded=guarded, **_plan_settings(c)
    )
    row_tokens, _, _ = plan.per_second()
    return row_tokens / (rows / float(shape.pperf_s.decode_s(rows, fleet.mean_rollout_ctx)))


def lane_shares(fleet: SizedFleet, executor_policy, kv_tokens: float) -> np.ndarray | None:
    """Per second of the trace, the most a serving instance's rollout lane can have beside serving under
    ``executor_policy`` with a serving pool of ``kv_tokens`` (``coserve.lane_share_ceiling``; None: no bounded lane)."""
    shape, traffic = fleet.shape, fleet.traffic
    return lane_share_ceiling(
        executor_policy, shape.sperf, traffic.fleet_rate / shape.n_serv, traffic.prompt_mean, traffic.output_mean, traffic.prompt_p99, kv_tokens
    )


def serving_setup(c: SimConfig, fleet: SizedFleet, policy: FleetPolicy) -> ServingSetup:
    """How ``policy`` runs serving on ``fleet``, and the same trace on the fleet serving alone."""
    shape, memory, traffic = fleet.shape, fleet.memory, fleet.traffic
    cohosting = policy.hosts_policy_on_serving and memory.can_cohost
    serving_kv_tokens = memory.pool_tokens if cohosting else memory.alone_kv_tokens
    co_batched = cohosting and c.rollout_mode == "co_batched"
    if not cohosting or policy.drains_lent:
        lane_ceiling = None
    elif co_batched:  # rose's guard bounds the rows; naive_share's equal priority puts every row in every iteration
        lane_ceiling = co_batched_lane_shares(c, fleet, serving_kv_tokens, guarded=policy.name != "naive_share")
    else:
        lane_ceiling = lane_shares(fleet, policy.executor_policy, serving_kv_tokens)
    # the whole fleet serving alone, second by second (what static sees), for attribution
    alone = serving_tick(
        shape.sperf,
        traffic.fleet_rate / shape.n_serv,
        traffic.prompt_mean,
        traffic.output_mean,
        traffic.prompt_p99,
        0.0,
        0.0,
        0.0,
        c.dt,
        memory.alone_kv_tokens,
    )
    alone_bad = (alone.ttft_p99_s > c.slo_ttft_ms / 1e3) | (alone.tpot_p99_s > c.slo_tpot_ms / 1e3) | (alone.queue > 0)
    return ServingSetup(cohosting, serving_kv_tokens, lane_ceiling, alone_bad, co_batched)
