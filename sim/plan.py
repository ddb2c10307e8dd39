"""``rose plan``: how much rollout a serving fleet can lend, hour by hour, and at what SLO risk.

For every minute of the trace (Azure LLM inference format, traces.py; rates smoothed over a
window holding ~20 requests, at least a minute, so that scaling a sparse trace up does not
turn its Poisson noise into bursts) the fleet's serving instances (devices.py sizing) each see
1/n of the traffic. Per minute:

- the serving model (coserve.py) gives p99 TTFT / TPOT at the minute's mean rate and at its
  peak (its busiest 10 s when the trace has >= 5 requests per 10 s, else its mean; plus the
  p99 of Poisson noise at one instance);
- the monitor's own ``assess`` (services/slo_monitor/headroom.py) decides, from those
  figures and a step model fitted by its ``fit_step_model``, whether the instance is
  lendable, how many rollout slots and how much KV it lends;
- where lendable, the executor's ``rose`` policy gives the rollout lane its share of the
  device (coserve.rollout_share) and the rollout batch is what the lent KV holds at the mean
  agentic context (rollouts.py): lendable tokens/s = share x batch / step time;
- SLO risk: the share of minutes whose peak second breaks the SLO with rollout running
  (``with rollout``) and without it (``alone``: the fleet is short of capacity then anyway).

An hour's lendable throughput is also given as the dedicated rollout GPUs that produce as
many tokens/s (a dedicated instance with its whole KV).

Expected speedup per rollout demand (``speedup_by_demand``): the fleet simulator (engine.py,
the services' own decisions) runs the RL job on this fleet with a dedicated pool of
``dedicated_ratio`` x the serving GPUs, under this trace (smoothed as above, scaled, starting at
its busiest hour: the hour lending has least to give), for each demand level (trajectories per
step as a multiple of what the dedicated pool runs at once), static against rose, synchronous
RL. Lending does not pay where rose is under ``PAYS_FROM`` x static (the reason is the
simulator's: the batch fits the dedicated pool, no lease was granted, or leased turns were
interrupted by bursts), and in the hours where no minute is lendable. Each level also gives
``speedup_ceiling``, what the fleet's rollout capacity allows at most (ceiling.py): a speedup far
under it means the placement leaves capacity unused, one near it that more needs more lanes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from rich.console import Group

from rose.services.executor.policies import make_policy
from rose.services.slo_monitor.headroom import assess, fit_step_model
from rose.services.slo_monitor.windows import WindowStats
from rose.shared.devices import DeviceSpec, ModelSpec, Roofline, model_spec, parse_fleet, rollout_tp, serving_tp, usable_bytes
from rose.shared.workload import RolloutSpec, mean_context

from . import ROLLOUT_MODES
from .ceiling import share_of_gain, speedup_ceiling_over
from .co_batched import co_batch_plan
from .config import MAX_ROLLOUT_BATCH, SimConfig, as_rollout_mode
from .coserve import ServingTick, rollout_share, serving_tick, slo_capacity_rps
from .policies import executor_signals, monitor_settings, serving_snapshot
from .sizing import co_batched_pool_tokens, serving_pool_tokens
from .traces import Trace, load_azure_csv, requests_to_trace

TARGET_PEAK_LOAD = 0.45  # --scale auto: the busiest hour's mean at this share of the fleet's SLO capacity
DEMANDS = (1.0, 2.0, 4.0)
PAYS_FROM = 1.05  # rose at least this x static: lending pays (below: within the simulator's step-to-step noise)
BIN_MINUTES = (1, 2, 5, 10, 15, 30, 60, 120, 180, 360)  # the table's bin: the first that gives at most MAX_ROWS rows
MAX_ROWS = 24  # a day in hours, an hour in 5-minute bins: one screen
TABLE_COLUMNS = 80  # the tables fit a terminal this wide (or a pipe: rich's default width)
TWO_MODEL, CO_BATCHED = ROLLOUT_MODES


def bin_minutes(minutes: int) -> int:
    """The table's bin for a trace of ``minutes``: minutes for a trace of an hour, hours for a day."""
    return next((b for b in BIN_MINUTES if math.ceil(minutes / b) <= MAX_ROWS), BIN_MINUTES[-1])


def _stats(ttft_ms: float, tpot_ms: float, rate: float, batch: float, kv_util: float) -> WindowStats:
    return WindowStats(
        span_s=60.0,
        snapshots=60,
        ttft_p99_ms=ttft_ms,
        tpot_p99_ms=tpot_ms,
        ttft_count=rate * 60,
        arrival_rate_rps=rate,
        arrivals=int(rate * 60),
        serving_queue=0,
        serving_running_peak=int(math.ceil(batch)),
        rollout_tokens_per_s_peak=0.0,
        kv_utilisation=kv_util,
        compute_utilisation=0.0,
    )


@dataclass(frozen=True)
class PlannedFleet:
    """The fleet ``plan`` sizes: its serving instances (TP ``tp_s``, each the serving model and a policy copy) and
    dedicated ones (TP ``tp_r``), their step models, the trace's request sizes (mean prompt, mean output, p99 prompt
    tokens), a serving instance's KV pool with no policy copy beside it (tokens) and its SLO capacity (req/s)."""

    device: DeviceSpec
    serving: ModelSpec
    policy: ModelSpec
    tp_s: int
    tp_r: int
    n: int  # serving instances
    sperf: Roofline  # the serving model on a serving instance
    pperf_s: Roofline  # the policy on a serving instance
    pperf_d: Roofline  # the policy on a dedicated instance
    sizes: tuple[float, float, float]
    alone_tokens: float
    cap: float


@dataclass(frozen=True)
class TraceLoad:
    """The trace as ``plan`` reads it: smoothed over ``window`` seconds (fleet req/s per second), scaled by ``factor``,
    and per serving instance its mean and peak rate per minute and its rate per second."""

    minutes: int
    window: int
    smooth: np.ndarray
    hourly_mean: list[float]
    factor: float
    rate_mean: np.ndarray
    rate_peak: np.ndarray
    instance_rate: np.ndarray


@dataclass(frozen=True)
class MinuteLending:
    """Per minute of the trace: whether the monitor lends, the fleet's lendable rollout tokens/s, the SLO risk with
    rollout and serving alone (``alone_peak``: serving alone at the minute's peak), and the monitor's first reasons
    not to lend (minutes per reason)."""

    lendable: np.ndarray
    tokens_per_s: np.ndarray
    risk_with: np.ndarray
    risk_alone: np.ndarray
    alone_peak: ServingTick
    reasons: dict[str, int]


def plan(
    trace_path: str,
    fleet: str,
    model: str,
    slo_ttft_ms: float = 1000.0,
    slo_tpot_ms: float = 100.0,
    scale: str | float = "auto",
    quantum_ms: float = 10.0,
    demands=DEMANDS,
    dedicated_ratio: float = 0.25,
    policy_model: str | None = None,
    rollout_modes: tuple[str, ...] | None = None,
) -> dict:
    """``model`` is the serving fleet's (a company's product model); ``policy_model`` the RL policy trained beside it
    (default: the same size), as the simulator takes them (sim/sizing.py). ``rollout_modes`` (sim.ROLLOUT_MODES): the
    modes to plan; default both where the policy can be a LoRA adapter of the serving model (the same size), else
    two-model."""
    n_gpus, device = parse_fleet(fleet)
    serving_spec, policy_spec = model_spec(model), model_spec(policy_model or model)
    modes = _modes(rollout_modes, serving_spec, policy_spec)
    req = load_azure_csv(trace_path)
    trace = requests_to_trace(req)
    f = _size_fleet((fleet, n_gpus, device), serving_spec, policy_spec, req, trace, slo_ttft_ms, slo_tpot_ms)
    load = _trace_load(trace, f, scale)
    prompt, output, p99 = f.sizes
    # serving pool sized for the trace's peak as the simulator sizes it, the rest of HBM after both models is the rollout pool
    peak = float(np.percentile(load.instance_rate, 99.9))
    pool_tokens = serving_pool_tokens(f.sperf, peak, prompt, output, p99, quantum_ms / 1e3, f.alone_tokens, trace.request_sizes)
    free = usable_bytes(f.device, f.tp_s) - serving_spec.weight_bytes - policy_spec.weight_bytes - pool_tokens * serving_spec.kv_bytes_per_token
    lend = _lending_by_minute(f, load, pool_tokens, free, slo_ttft_ms, slo_tpot_ms, quantum_ms)
    ctx = mean_context(RolloutSpec())
    ded_kv = usable_bytes(f.device, f.tp_r) - policy_spec.weight_bytes
    ded_batch = min(MAX_ROLLOUT_BATCH, int(ded_kv // (ctx * policy_spec.kv_bytes_per_token)))
    ded_tps = ded_batch / float(f.pperf_d.decode_s(ded_batch, ctx))
    co_batched = None
    if CO_BATCHED in modes:  # the same lendable minutes, rows of serving's iterations from a pool without a policy copy
        cfg = SimConfig(model=serving_spec.name, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, quantum_ms=quantum_ms)
        co_batched = _co_batched_lending(cfg, f.sperf, f.n, f.sizes, load.rate_mean, lend.lendable, peak, f.alone_tokens, trace.request_sizes)
    binned = partial(_binned, f=f, load=load, lend=lend, start_s=trace.start_s, ded_tps=ded_tps, co_batched=co_batched)
    start_hour = int(trace.start_s // 3600)
    hours = [{k: v for k, v in row.items() if k != "start"} | {"hour": (start_hour + h) % 24} for h, row in enumerate(binned(60))]
    demand = []
    if demands:
        busiest = int(np.argmax(load.hourly_mean)) * 3600
        rate = np.roll(load.smooth * load.factor, -busiest)
        sim_trace = Trace(rate, np.full(len(rate), prompt), np.full(len(rate), output), p99, trace.start_s + busiest, "plan", trace.request_sizes)
        # the simulation runs on the pool sized here, for the whole trace's peak (its window alone has a lower one)
        demand = speedup_by_demand(
            sim_trace,
            fleet,
            model,
            slo_ttft_ms,
            slo_tpot_ms,
            demands,
            dedicated_ratio,
            policy_model=policy_spec.name,
            serving_pool_tokens=pool_tokens,
            rollout_modes=modes,
        )
    no_lend_hours = [h["hour"] for h in hours if h["lendable_fraction"] == 0.0]
    width = bin_minutes(load.minutes)
    return {
        "speedup_by_demand": demand,
        "dedicated_ratio": dedicated_ratio,
        "rollout_modes": list(modes),
        # the demand levels where no mode pays, and the hours where no minute is lendable
        "lending_does_not_pay": {"demand_levels": [d["rollout_demand"] for d in demand if d["mode_that_pays"] is None], "hours": no_lend_hours},
        "trace": str(trace_path),
        "trace_requests": int(len(req.times_s)),
        "scale": load.factor,
        "scale_rule": "auto: busiest hour at 45 % of SLO capacity" if scale == "auto" else "given",
        "fleet": fleet,
        "model": serving_spec.name,  # the serving model
        "policy_model": policy_spec.name,
        "serving_instances": f.n,
        "serving_tp": f.tp_s,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "slo_capacity_rps_per_instance": f.cap,
        "serving_pool_tokens_per_instance": pool_tokens,
        "rollout_pool_gb_per_instance": max(0.0, free) / 1e9,
        # co-batched: a serving instance hosts the adapter, not a policy copy; its pool holds serving's longer iterations
        **({"co_batched": {k: v for k, v in co_batched.items() if k != "tokens_per_s"}} if co_batched else {}),
        "smoothing_window_s": load.window,
        "dedicated_instance_tokens_per_s": ded_tps,
        "dedicated_tp": f.tp_r,
        "not_lendable_minutes": lend.reasons,
        "hours": hours,
        "bin_minutes": width,  # the table's and the plot's bins (hours for a day, minutes for an hour)
        "bins": binned(width),
        "note": "a model, not a measurement: roofline step times (shared/devices.py) and the monitor's own headroom rules",
    }


def _size_fleet(
    gpus: tuple[str, int, DeviceSpec], serving: ModelSpec, policy: ModelSpec, req, trace: Trace, slo_ttft_ms: float, slo_tpot_ms: float
) -> PlannedFleet:
    """The fleet ``plan`` plans for: ``gpus`` (the fleet as given, its GPUs and their kind) in serving instances that
    hold both models, the trace's request sizes and one instance's SLO capacity serving alone."""
    fleet, n_gpus, device = gpus
    tp_s, tp_r = serving_tp(serving, policy, device), rollout_tp(policy, device)
    n = n_gpus // tp_s
    if n < 1:
        raise ValueError(
            f"{serving.name} serving beside a {policy.name} policy on {fleet}: one serving instance needs {tp_s} GPUs "
            "(serving model + policy copy in 65 % of HBM)"
        )
    sperf, pperf_s, pperf_d = Roofline(device, serving, tp_s), Roofline(device, policy, tp_s), Roofline(device, policy, tp_r)
    prompt, output = float(np.mean(req.context)), float(np.mean(req.generated))
    p99 = float(trace.prompt_p99)
    alone_tokens = (usable_bytes(device, tp_s) - serving.weight_bytes) / serving.kv_bytes_per_token  # serving's KV per token
    cap = slo_capacity_rps(sperf, prompt, output, p99, slo_ttft_ms / 1e3, slo_tpot_ms / 1e3, alone_tokens)
    return PlannedFleet(device, serving, policy, tp_s, tp_r, n, sperf, pperf_s, pperf_d, (prompt, output, p99), alone_tokens, cap)


def _trace_load(trace: Trace, f: PlannedFleet, scale: str | float) -> TraceLoad:
    """The trace's rates per minute and instance (module doc): smoothed, scaled (``auto``: the busiest hour at
    ``TARGET_PEAK_LOAD`` of the fleet's SLO capacity), each minute's mean and peak."""
    minutes = max(1, len(trace.rate) // 60)
    # smooth over a window holding ~20 requests (>= 1 minute): scaling up a sparse trace must not
    # turn its Poisson noise into bursts that are not there
    window = int(np.clip(20.0 / max(1e-9, float(trace.rate.mean())), 60, 3600))
    smooth = np.convolve(trace.rate, np.ones(window) / window, mode="same") if window > 60 else trace.rate
    per_min = smooth[: minutes * 60].reshape(minutes, 60)
    hourly_mean = [float(per_min[i : i + 60].mean()) for i in range(0, minutes, 60)]
    if scale == "auto":
        factor = TARGET_PEAK_LOAD * f.n * f.cap / max(1e-9, max(hourly_mean))
    else:
        factor = float(scale)
    rate_mean = per_min.mean(axis=1) * factor / f.n  # per instance
    # the minute's busiest 10 s (when the trace is dense enough to tell); no Poisson noise on top: serving_tick's
    # p99 TTFT already waits for a Poisson arrival's queue, as the simulator's monitor reads it (noise at one
    # instance's rate on top, +2.33 sigma, counted it twice: at 70B TP4, ~2 req/s, it was most of the peak)
    per10 = per_min.reshape(minutes, 6, 10).mean(axis=2)
    dense = float(per10.mean()) * 10 >= 5.0
    rate_peak = (per10.max(axis=1) if dense else per_min.mean(axis=1)) * factor / f.n
    instance_rate = smooth[: minutes * 60] * factor / f.n
    return TraceLoad(minutes, window, smooth, hourly_mean, factor, rate_mean, rate_peak, instance_rate)


def _lending_by_minute(
    f: PlannedFleet, load: TraceLoad, pool_tokens: float, free: float, slo_ttft_ms: float, slo_tpot_ms: float, quantum_ms: float
) -> MinuteLending:
    """Per minute: the monitor's ``assess`` on the minute's figures (serving alone at its peak, with a step model
    fitted as the monitor fits one) decides whether an instance lends, and how much; where it does, the executor's
    ``rose`` policy gives the lane its share of the mean minute, and the peak second with rollout gives the SLO risk."""
    prompt, output, p99 = f.sizes
    kvb = f.policy.kv_bytes_per_token  # the policy's (rollout's) KV per token
    _, _, hcfg = monitor_settings(slo_ttft_ms, slo_tpot_ms, MAX_ROLLOUT_BATCH, int(max(0.0, free)))
    latest = serving_snapshot(f.device.name, f.tp_s * f.device.hbm_bytes, free, kvb)
    ctx = mean_context(RolloutSpec())
    ep = make_policy("rose", quantum_ms=quantum_ms)
    step_model = _step_model(f, ctx, quantum_ms, slo_tpot_ms)
    rate_mean, rate_peak = load.rate_mean, load.rate_peak
    alone_mean = serving_tick(f.sperf, rate_mean, prompt, output, p99, 0.0, 0.0, 0.0, 60.0, pool_tokens)
    alone_peak = serving_tick(f.sperf, rate_peak, prompt, output, p99, 0.0, 0.0, 0.0, 1.0, f.alone_tokens)
    lend_tps = np.zeros(load.minutes)
    lendable = np.zeros(load.minutes, dtype=bool)
    risk_with = np.zeros(load.minutes, dtype=bool)
    reasons: dict[str, int] = {}
    for i in range(load.minutes):
        ap = alone_peak
        win = _stats(
            float(ap.ttft_p99_s[i]) * 1e3,
            float(ap.tpot_p99_s[i]) * 1e3,
            float(rate_mean[i]),
            float(ap.batch[i]),
            float(alone_mean.batch[i]) * (prompt + output) / max(1.0, pool_tokens),
        )
        v = assess(win, win, step_model, latest, hcfg, alerting=False)
        if not v.lendable:
            key = v.reason.split(";")[0].split(" ")[0]
            reasons[key] = reasons.get(key, 0) + 1
            continue
        batch = min(v.slots, int(v.kv_bytes // (ctx * kvb)))
        if batch < 1:
            continue
        lendable[i] = True
        tau_r = float(f.pperf_s.decode_s(batch, ctx))
        q = min(quantum_ms / 1e3, tau_r)
        may = ep.may_run_rollout(executor_signals(0.0, float(alone_mean.batch[i]), float(alone_mean.iteration_s[i]) * 1e3, slo_tpot_ms))
        sm = serving_tick(f.sperf, rate_mean[i : i + 1], prompt, output, p99, q if may else 0.0, q if may else 0.0, 0.0, 60.0, pool_tokens)
        share = float(rollout_share(ep, sm, np.array([q if may else 0.0]), np.array([may]))[0])
        lend_tps[i] = f.n * share * batch / tau_r
        sp = serving_tick(f.sperf, rate_peak[i : i + 1], prompt, output, p99, q if may else 0.0, q if may else 0.0, 0.0, 1.0, pool_tokens)
        risk_with[i] = bool(sp.ttft_p99_s[0] > slo_ttft_ms / 1e3 or sp.tpot_p99_s[0] > slo_tpot_ms / 1e3 or sp.queue[0] > 0)
    risk_alone = (alone_peak.ttft_p99_s > slo_ttft_ms / 1e3) | (alone_peak.tpot_p99_s > slo_tpot_ms / 1e3) | (alone_peak.queue > 0)
    return MinuteLending(lendable, lend_tps, risk_with, risk_alone, alone_peak, reasons)


def _step_model(f: PlannedFleet, ctx: float, quantum_ms: float, slo_tpot_ms: float):
    """The step model the monitor would fit: serving iteration (+ the rollout quantum) over batch compositions."""
    prompt, output, _ = f.sizes
    obs = []
    for bs in (1, 8, 32, 64):
        for br in (0, 8, 32):
            q = min(quantum_ms / 1e3, float(f.pperf_s.decode_s(max(br, 1), ctx))) if br else 0.0
            obs.append((float(bs), float(br), 1e3 * (float(f.sperf.decode_s(bs, prompt + output / 2)) + q)))
    return fit_step_model(obs, slo_tpot_ms / 4)


def _binned(
    width: int, *, f: PlannedFleet, load: TraceLoad, lend: MinuteLending, start_s: float, ded_tps: float, co_batched: dict | None
) -> list[dict]:
    """The per-minute figures over bins of ``width`` minutes (the last one may be shorter)."""
    rows = []
    for lo in range(0, load.minutes, width):
        sl = slice(lo, min(load.minutes, lo + width))
        tps = float(lend.tokens_per_s[sl].mean())
        co_tps = {"rollout_tokens_per_s_co_batched": float(co_batched["tokens_per_s"][sl].mean())} if co_batched else {}
        at = int(start_s) + 60 * lo
        rows.append(
            {
                "hour": (at // 3600) % 24,
                "start": f"{(at // 3600) % 24:02d}:{(at // 60) % 60:02d}",
                "minutes": sl.stop - sl.start,
                "requests_per_s": float(load.rate_mean[sl].mean() * f.n),
                "load_of_slo_capacity": float(load.rate_mean[sl].mean() / f.cap),
                "lendable_fraction": float(lend.lendable[sl].mean()),
                "rollout_tokens_per_s": tps,
                "dedicated_gpu_equivalent": tps / ded_tps * f.tp_r if ded_tps > 0 else 0.0,
                "ttft_p99_ms_peak": float(min(lend.alone_peak.ttft_p99_s[sl].max() * 1e3, 1e9)),
                "slo_risk_alone": float(lend.risk_alone[sl].mean()),
                "slo_risk_with_rollout": float(np.mean(lend.risk_with[sl] | lend.risk_alone[sl])),
                **co_tps,
            }
        )
    return rows


def _modes(asked: tuple[str, ...] | None, serving: ModelSpec, policy: ModelSpec) -> tuple[str, ...]:
    """The rollout modes to plan: those asked, else both where the policy can be a LoRA adapter of the serving model
    (the same size), else two-model; co-batched with another policy is refused, saying why."""
    modes = tuple(asked or (ROLLOUT_MODES if policy == serving else (TWO_MODEL,)))
    if CO_BATCHED in modes and policy != serving:
        raise ValueError(
            f"co-batched rollout runs the policy as a LoRA adapter of the serving model: a {policy.name} policy beside "
            f"{serving.name} serving plans two-model only (drop co_batched, or give the policy the serving model's size)"
        )
    return modes


def _co_batched_lending(
    cfg: SimConfig,
    sperf: Roofline,
    n: int,
    sizes: tuple[float, float, float],
    rate_mean: np.ndarray,
    lendable: np.ndarray,
    peak: float,
    alone_tokens: float,
    request_sizes,
) -> dict:
    """Co-batched mode's lending over the trace's minutes (``plan``): a serving instance's pool sized with the rows its
    lent KV holds riding serving's iterations at the peak (sizing.py ``co_batched_pool_tokens``), and per lendable
    minute the fleet's rollout tokens/s from those rows (co_batched.py ``co_batch_plan``, at the mean agentic context)."""
    m = sperf.model
    adapter = m.lora_params(cfg.lora) * m.bytes_per_param
    room = usable_bytes(sperf.device, sperf.tp) - m.weight_bytes - adapter
    ctx = mean_context(RolloutSpec())
    seq = ctx * m.kv_bytes_per_token
    pool = co_batched_pool_tokens(cfg, sperf, peak, sizes, alone_tokens, request_sizes, (room, m.kv_bytes_per_token, seq))
    free = room - pool * m.kv_bytes_per_token
    rows = int(min(MAX_ROLLOUT_BATCH, max(0.0, free) / seq))
    tokens = np.zeros(len(rate_mean))
    if rows >= 1 and lendable.any():
        plan = co_batch_plan(
            sperf,
            cfg.lora,
            rate_mean[lendable],
            sizes[0],
            sizes[1],
            sizes[2],
            0.0,
            60.0,
            pool,
            rows=rows,
            rows_ctx=ctx,
            prefill_tokens=0,
            prefill_cached=0.0,
            slo_tpot_s=cfg.slo_tpot_ms / 1e3,
            quantum_s=cfg.quantum_ms / 1e3,
        )
        tokens[lendable] = n * plan.per_second()[0]
    return {
        "serving_pool_tokens_per_instance": pool,
        "rollout_pool_gb_per_instance": max(0.0, free) / 1e9,
        "lora_rank": cfg.lora.rank,
        "tokens_per_s": tokens,
        "rollout_tokens_per_s_mean": float(tokens.mean()),
    }


def speedup_by_demand(
    trace: Trace,
    fleet: str,
    model: str,
    slo_ttft_ms: float,
    slo_tpot_ms: float,
    demands=DEMANDS,
    dedicated_ratio: float = 0.25,
    steps: int = 2,
    seed: int = 0,
    policy_model: str | None = None,
    serving_pool_tokens: float | None = None,
    rollout_modes: tuple[str, ...] = (TWO_MODEL,),
) -> list[dict]:
    """Static against rose in the fleet simulator for each rollout demand (module doc), in each of ``rollout_modes``;
    ``trace`` in fleet req/s; ``serving_pool_tokens``: a serving instance's pool (None: sized from the simulated window,
    sizing.py; a co-batched instance's own pool is always sized so: it holds what serving's longer iterations keep).

    Each level carries the first mode's figures, that mode named (``rollout_mode``), every other mode's under its name,
    and which mode pays (``mode_that_pays``: rose at least ``PAYS_FROM`` x its static, the most RL steps/h of those) by
    how much over the other's rose (``over_other_mode``)."""
    level = partial(
        _level,
        trace=trace,
        fleet=fleet,
        model=model,
        slo=(slo_ttft_ms, slo_tpot_ms),
        dedicated_ratio=dedicated_ratio,
        steps=steps,
        seed=seed,
        policy_model=policy_model,
        serving_pool_tokens=serving_pool_tokens,
    )
    out = []
    for demand in demands:
        levels = {mode: level(demand, mode) for mode in rollout_modes}
        first, *others = rollout_modes
        entry = {"rollout_demand": demand, "dedicated_ratio": dedicated_ratio, **levels[first], "rollout_mode": first}
        entry.update({mode: levels[mode] for mode in others})
        paying = [m for m in rollout_modes if levels[m]["pays"]]
        best = max(paying, key=lambda m: levels[m]["rose_rl_steps_per_hour"]) if paying else None
        rivals = [levels[m]["rose_rl_steps_per_hour"] for m in rollout_modes if m != best and levels[m].get("rose_rl_steps_per_hour")]
        entry["mode_that_pays"] = best
        entry["over_other_mode"] = levels[best]["rose_rl_steps_per_hour"] / max(rivals) if best and rivals else None
        out.append(entry)
    return out


def _level(
    demand: float,
    mode: str,
    *,
    trace: Trace,
    fleet: str,
    model: str,
    slo: tuple[float, float],
    dedicated_ratio: float,
    steps: int,
    seed: int,
    policy_model: str | None,
    serving_pool_tokens: float | None,
) -> dict:
    """One demand level in one rollout mode: static's and rose's runs, what lending buys and why (``speedup_by_demand``)."""
    from dataclasses import replace

    from rose.shared.devices import DEVICES

    from .engine import Infeasible, SimConfig, simulate

    n_gpus, device = parse_fleet(fleet)
    kind = next(k for k, d in DEVICES.items() if d is device)
    pool = {"serving_pool_tokens": serving_pool_tokens} if serving_pool_tokens is not None and mode == TWO_MODEL else None
    runs = {}
    try:
        for policy in ("static", "rose"):
            cfg = SimConfig(
                model=model,
                policy_model=policy_model,
                device=kind,
                gpus=n_gpus,
                policy=policy,
                trace=trace,
                rollout=replace(RolloutSpec(), oversubscription=demand),
                rollout_gpu_ratio=dedicated_ratio,
                slo_ttft_ms=slo[0],
                slo_tpot_ms=slo[1],
                steps=steps,
                seed=seed,
                memory=pool,
                rollout_mode=as_rollout_mode(mode),
            )
            runs[policy] = simulate(cfg)
    except Infeasible as exc:
        return {"speedup": None, "pays": False, "why": str(exc)}
    st, ro = runs["static"], runs["rose"]
    speedup = ro["rl_steps_per_hour"] / st["rl_steps_per_hour"] if st["rl_steps_per_hour"] > 0 else None
    ceiling = speedup_ceiling_over(st, ro["rollout_capacity_ceiling"], pipelined=False)
    priced = speedup_ceiling_over(st, ro["rollout_capacity_ceiling_kv"], pipelined=False)
    pays = speedup is not None and speedup >= PAYS_FROM
    where = "as rows of serving's iterations" if mode != TWO_MODEL else "on leases"
    if pays:
        why = f"{ro['rollout_tokens_on_serving_fraction']:.0%} of the rollout tokens ran {where}"
    elif not ro["cohosting"]:
        beside = "the policy" if mode == TWO_MODEL else "a rollout pool"
        why = f"a serving instance has no memory left for {beside} beside the serving model and its pool"
    elif ro["leases"]["granted"] == 0:
        why = "no lease granted: the monitor never found headroom (" + (", ".join(ro["unlendable_reasons"]) or "-") + ")"
    elif ro["rollout_tokens_on_serving_fraction"] < 0.05:
        why = "the batch fits the dedicated pool: placement kept turns there (a leased turn would have been slower)"
    else:
        why = (
            f"leases made {ro['rollout_tokens_on_serving_fraction']:.0%} of the tokens, but the step is bound by its tail "
            f"({ro['tail_fraction']:.0%} after 90 % of trajectories) and {ro['interrupted_turns']} turns interrupted by bursts"
        )
    return {
        "trajectories_per_step": st["trajectories_per_step"],
        "static_rl_steps_per_hour": st["rl_steps_per_hour"],
        "rose_rl_steps_per_hour": ro["rl_steps_per_hour"],
        "speedup": speedup,
        "speedup_ceiling": ceiling,  # what the fleet's rollout capacity allows at most (ceiling.py)
        "speedup_ceiling_kv": priced,  # the same with a lane priced at the lent KV's batch (an estimate)
        "share_of_priced_gain": share_of_gain(speedup, priced),  # (speedup - 1) / (speedup_ceiling_kv - 1)
        "rose_slo_violations": ro["slo_violations"],
        "rollout_tokens_on_serving_fraction": ro["rollout_tokens_on_serving_fraction"],
        "rollout_pool_gb_per_instance": ro["cohost_free_gb"],
        "pays": pays,
        "why": why,
    }


def models_label(result: dict) -> str:
    """ "7B" when the policy is the serving model's size, else "70B serving, 7B policy"."""
    serving, policy = result["model"], result.get("policy_model", result["model"])
    return serving if policy == serving else f"{serving} serving, {policy} policy"


def _risk(x: float) -> str:
    return "low" if x < 0.01 else ("medium" if x < 0.1 else "high")


def _plot(path: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hrs = result["bins"]
    x = list(range(len(hrs)))
    labels = [h["start"] for h in hrs]
    fig, (a, b) = plt.subplots(2, 1, figsize=(max(8, 0.4 * len(hrs) + 3), 6), sharex=True)
    a.plot(x, [h["requests_per_s"] for h in hrs], marker="o", label="serving req/s")
    a.axhline(result["slo_capacity_rps_per_instance"] * result["serving_instances"], color="red", ls="--", label="SLO capacity")
    a.set_ylabel("requests/s")
    a.legend(fontsize=8)
    colors = {"low": "tab:green", "medium": "tab:orange", "high": "tab:red"}
    b.bar(x, [h["rollout_tokens_per_s"] for h in hrs], color=[colors[_risk(h["slo_risk_with_rollout"])] for h in hrs])
    b.set_ylabel("lendable rollout tok/s")
    b.set_xticks(x, labels, rotation=90 if len(hrs) > 12 else 0)
    b.set_xlabel(f"start of each {result['bin_minutes']}-minute bin (bar colour: SLO risk with rollout, green low / orange medium / red high)")
    fig.suptitle(f"rose plan: {models_label(result)} on {result['fleet']} ({result['serving_instances']} instances of TP{result['serving_tp']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plan_tables(result: dict, fleet: str, width: int) -> Group:
    """The plan as a terminal shows it: the binned table, the figures under it, the speedup per demand
    with its reasons as numbered notes below, all within ``TABLE_COLUMNS`` (a narrower terminal is told
    how wide the tables are)."""
    from rich import box
    from rich.console import Group
    from rich.table import Table

    unit = f"{result['bin_minutes'] // 60} h" if result["bin_minutes"] >= 60 else f"{result['bin_minutes']} min"
    table = Table(
        title=f"rose plan: {models_label(result)} on {fleet}, SLO TTFT {result['slo_ttft_ms']:g} ms / TPOT {result['slo_tpot_ms']:g} ms "
        f"(trace x{result['scale']:.3g}; bins of {unit})",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for col in (
        "from",
        "req/s",
        "load",
        "lend-\nable",
        "rollout\ntok/s",
        "≈ ded.\nGPUs",
        "TTFT p99\nms, peak",
        "risk\nalone",
        "risk w/\nrollout",
    ):
        table.add_column(col, justify="right")
    for b in result["bins"]:
        table.add_row(
            b["start"],
            f"{b['requests_per_s']:.1f}",
            f"{b['load_of_slo_capacity']:.0%}",
            f"{b['lendable_fraction']:.0%}",
            f"{b['rollout_tokens_per_s']:.0f}",
            f"{b['dedicated_gpu_equivalent']:.1f}",
            f"{b['ttft_p99_ms_peak']:.0f}" if b["ttft_p99_ms_peak"] < 60_000 else "overload",
            f"{b['slo_risk_alone']:.0%}",
            f"{b['slo_risk_with_rollout']:.0%}",
        )
    parts: list = [
        table,
        "risk: the share of minutes whose busiest second breaks the SLO, serving alone and with rollout "
        "(low under 1 %, high from 10 %); lendable: the share of minutes the monitor lends",
    ]
    parts.append(
        f"{result['serving_instances']} serving instances; SLO capacity {result['slo_capacity_rps_per_instance']:.1f} req/s each; "
        f"rollout pool {result['rollout_pool_gb_per_instance']:.0f} GB each; "
        f"not lendable (minutes, monitor's first reason): {result['not_lendable_minutes'] or '-'}"
    )
    if "co_batched" in result:
        co = result["co_batched"]
        parts.append(
            f"co-batched (the policy a rank-{co['lora_rank']} LoRA adapter of the serving model, its sequences rows of serving's "
            f"iterations): rollout pool {co['rollout_pool_gb_per_instance']:.0f} GB each (no policy copy; serving's pool holds "
            f"its longer iterations), {co['rollout_tokens_per_s_mean']:.0f} rollout tok/s at the mean"
        )
    notes: list[str] = []
    if result["speedup_by_demand"]:
        first = result["speedup_by_demand"][0].get("rollout_mode", TWO_MODEL).replace("_", "-")
        dt = Table(
            title=f"expected RL speedup (rose / static, synchronous, {first}; dedicated pool {result['dedicated_ratio']:g} x the serving "
            "GPUs; from the busiest hour)",
            box=box.SIMPLE_HEAD,
        )
        for col in ("demand", "traj./\nstep", "static\nsteps/h", "rose\nsteps/h", "speedup", "ceiling\n(lent KV)", "share\ntaken", "pays", "why"):
            dt.add_column(col, justify="right")
        for d in result["speedup_by_demand"]:
            notes.append(d["why"])
            note = f"[{len(notes)}]"
            if d["speedup"] is None:
                dt.add_row(f"{d['rollout_demand']:g}x", "-", "-", "-", "-", "-", "-", "no", note)
                continue
            dt.add_row(
                f"{d['rollout_demand']:g}x",
                str(d["trajectories_per_step"]),
                f"{d['static_rl_steps_per_hour']:.2f}",
                f"{d['rose_rl_steps_per_hour']:.2f}",
                f"{d['speedup']:.2f}x",
                "-" if d["speedup_ceiling"] is None else f"{d['speedup_ceiling']:.2f}x ({d['speedup_ceiling_kv']:.2f}x)",
                "-" if d["share_of_priced_gain"] is None else f"{d['share_of_priced_gain']:.0%}",  # of the priced gain
                "yes" if d["pays"] else "no",
                note,
            )
        parts += [dt, *(f"[{i}] {why}" for i, why in enumerate(notes, 1))]
        if len(result.get("rollout_modes", [])) > 1:
            parts.append(_modes_table(result))
    nope = result["lending_does_not_pay"]
    parts.append(
        f"lending does not pay: at demand {', '.join(f'{x:g}x' for x in nope['demand_levels']) or '-'}; "
        f"in hours {', '.join(f'{h:02d}' for h in nope['hours']) or '-'} (no minute lendable)"
    )
    if width < TABLE_COLUMNS:
        parts.append(f"(the tables are {TABLE_COLUMNS} columns wide: a wider terminal, or COLUMNS={TABLE_COLUMNS}, shows them whole)")
    return Group(*parts)


def _modes_table(result: dict):
    """Per demand level, each mode's rose / static, which mode pays and by how much over the other's rose."""
    from rich import box
    from rich.table import Table

    modes = result["rollout_modes"]
    table = Table(title="which mode pays: rose / static in each mode, the paying mode's rose over the other's", box=box.SIMPLE_HEAD)
    for col in ("demand", *(m.replace("_", "-") for m in modes), "pays", "by"):
        table.add_column(col, justify="right")
    for d in result["speedup_by_demand"]:
        levels = [d if m == d.get("rollout_mode", TWO_MODEL) else d.get(m, {}) for m in modes]
        speedups = ["-" if lv.get("speedup") is None else f"{lv['speedup']:.2f}x" for lv in levels]
        pays = (d["mode_that_pays"] or "neither").replace("_", "-")
        by = "-" if d["over_other_mode"] is None else f"{d['over_other_mode']:.2f}x"
        table.add_row(f"{d['rollout_demand']:g}x", *speedups, pays, by)
    return table


def run_plan(
    *,
    trace: str,
    fleet: str,
    model: str,
    slo_ttft_ms: float,
    slo_tpot_ms: float,
    scale: str,
    out_json: str | None,
    console,
    demands=DEMANDS,
    dedicated_ratio: float = 0.25,
    policy_model: str | None = None,
    rollout_modes: tuple[str, ...] | None = None,
) -> dict:
    result = plan(
        trace,
        fleet,
        model,
        slo_ttft_ms,
        slo_tpot_ms,
        scale if scale == "auto" else float(scale),
        demands=demands,
        dedicated_ratio=dedicated_ratio,
        policy_model=policy_model,
        rollout_modes=rollout_modes,
    )
    console.print(plan_tables(result, fleet, console.width))
    out = Path(out_json or "bench-out/plan.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    _plot(out.with_suffix(".png"), result)
    console.print(f"wrote {out} and {out.with_suffix('.png')}")
    return result
