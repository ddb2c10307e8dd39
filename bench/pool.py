"""``rose bench pool``: does a co-hosting serving instance's KV pool, sized as ``rose plan`` and the simulator size it, hold
its traffic on the real engine?

The pool is ``sim/sizing.py serving_pool_tokens``: what the requests in flight hold at p99.9 of instants, at a
Poisson rate, with the trace's request sizes and rollout running beside serving. That is a model, and the
planner lends the rest of the instance's memory on it, so it needs a check that can fail. This bench replays
Poisson arrivals with the trace's own request sizes on emulated serving instances (the real engine: continuous
batching, paged blocks, two lanes, quanta, the SLO guard; a saturating rollout backlog under a lease beside
serving; only the device's time is modeled, by the step model the simulator uses) at each ``--loads`` fraction
of one instance's SLO capacity. At a load, every pool in ``--pool-scales`` (x the derived pool) and an
instance's whole KV (``unbounded``: the baseline, serving alone's pool) take the same arrivals at once, one engine
each. Per run: TTFT p99 and the requests over the SLO, the serving KV held (p99.9 and peak of 20 samples a
second) against the derived pool, how often the pool was nearly full, the rollout tokens/s beside it, and the
forward lag (how late emulated forwards ended: the host kept up or the figures measure the host).

The derived pool passes at a load when its run misses the SLO no more often than the unbounded baseline's (one
request of slack: arrivals are shared, the engines are not) and it held at most its own size; a pool scaled below
it should show misses the baseline does not, or the bench could not tell a small pool from a sized one.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rose.bench.e2e_emulated import LAG_P99_TARGET
from rose.bench.emulated import prompt_ids
from rose.bench.options import BenchOptionsError
from rose.services.executor.device import EmulatedDevice
from rose.services.executor.emulated import EmulationSpec
from rose.services.executor.engine import Engine, EngineConfig
from rose.services.executor.protocol import EngineSampling, GenerationRequest, InvalidRequest, RolloutRejected, WorkClass
from rose.shared.devices import model_spec
from rose.sim.config import SimConfig
from rose.sim.coserve import MAX_SERVING_BATCH
from rose.sim.sizing import SizedFleet, serving_pool_tokens, size_fleet
from rose.sim.traces import load_azure_csv, requests_to_trace

SAMPLE_S = 0.05  # how often a run reads its serving pool's blocks (emulated seconds)
FULL_SHARE = 0.95  # a pool this full makes the next long prompt wait for a request to finish
ROLLOUT_TURN_TOKENS = 256  # a rollout backlog turn: long enough that the lane always has a forward to run
UNBOUNDED = "unbounded"


@dataclass(frozen=True, kw_only=True)
class PoolCheck:
    """One serving instance and its traffic, as ``rose plan`` and ``rose bench sim`` size it."""

    device: str = "H100"
    serving_model: str = "70B"
    policy_model: str = "7B"
    loads: tuple[float, ...] = (0.3, 0.6)  # fractions of one instance's SLO capacity (serving alone)
    pool_scales: tuple[float, ...] = (0.5, 1.0)  # x the derived pool; an unbounded baseline always runs beside
    duration_s: float = 120.0  # emulated seconds of arrivals per load
    drain_s: float = 30.0  # emulated seconds the requests still in flight after the last arrival have to finish
    seed: int = 0
    trace: str = ""  # an Azure-format CSV whose request sizes to replay (default: the simulator's synthetic sizes)
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 100.0
    quantum_ms: float = 10.0
    rollout_inflight: int = 32  # rollout sequences kept submitted beside serving (the lane's batch)
    time_scale: float = 1.0  # wall seconds per emulated second (shared/clock.py)

    def __post_init__(self) -> None:
        model_spec(self.serving_model)
        model_spec(self.policy_model)
        if not self.loads or any(not 0 < x <= 1.5 for x in self.loads):
            raise BenchOptionsError(f"loads must be in (0, 1.5] (fractions of SLO capacity), got {list(self.loads)}")
        if any(s <= 0 for s in self.pool_scales):
            raise BenchOptionsError(f"pool scales must be positive, got {list(self.pool_scales)}")
        if self.duration_s <= 0 or self.drain_s < 0 or self.time_scale <= 0 or self.rollout_inflight < 1:
            raise BenchOptionsError("duration_s and time_scale must be positive, drain_s not negative, rollout_inflight at least 1")

    def sized(self) -> SizedFleet:
        """The instance as the simulator sizes it (one serving instance; the dedicated pool is not used here)."""
        return size_fleet(
            SimConfig(
                model=self.serving_model,
                policy_model=self.policy_model,
                device=self.device,
                gpus=64,
                n_serving=1,
                n_dedicated=1,
                seed=self.seed,
                slo_ttft_ms=self.slo_ttft_ms,
                slo_tpot_ms=self.slo_tpot_ms,
                quantum_ms=self.quantum_ms,
                trace=requests_to_trace(load_azure_csv(self.trace)) if self.trace else None,
            )
        )


@dataclass(frozen=True)
class Arrival:
    at_s: float  # emulated seconds from the run's start
    prompt_tokens: int
    output_tokens: int


def arrivals(rate: float, duration_s: float, sizes: tuple[np.ndarray, np.ndarray], seed: int) -> list[Arrival]:
    """Poisson arrivals at ``rate``, each one of the trace's requests (prompt, output tokens) drawn uniformly."""
    rng = np.random.default_rng(seed)
    n = int(rng.poisson(rate * duration_s))
    at = np.sort(rng.uniform(0.0, duration_s, n))
    pick = rng.integers(0, len(sizes[0]), n)
    return [Arrival(float(t), max(1, int(sizes[0][i])), max(1, int(sizes[1][i]))) for t, i in zip(at, pick)]


def derived_pool(check: PoolCheck, fleet: SizedFleet, rate: float) -> float:
    """The serving pool (tokens) the one definition gives at ``rate`` (what ``rose plan`` and the grid use)."""
    shape, traffic, memory = fleet.shape, fleet.traffic, fleet.memory
    return serving_pool_tokens(
        shape.sperf,
        rate,
        traffic.prompt_mean,
        traffic.output_mean,
        traffic.prompt_p99,
        check.quantum_ms / 1e3,
        memory.alone_kv_tokens,
        traffic.request_sizes,
    )


def emulation(check: PoolCheck, fleet: SizedFleet, pool_tokens: float, rollout_kv_bytes: float) -> EmulationSpec:
    return EmulationSpec(
        device=check.device,
        serving_model=check.serving_model,
        policy_model=check.policy_model,
        tp=fleet.shape.tp_s,
        dedicated=False,
        serving_kv_bytes=int(pool_tokens * fleet.memory.kvb_s),
        rollout_kv_bytes=int(max(rollout_kv_bytes, 1 << 20)),
        quantum_s=check.quantum_ms / 1e3 * check.time_scale,
        time_scale=check.time_scale,
    )


async def run_instance(engine: Engine, requests: list[Arrival], check: PoolCheck, rollout_prompt: int, t0: float) -> dict:
    """One engine through the arrivals, a rollout backlog beside; figures in emulated time."""
    k = check.time_scale
    serving_pool = engine.work_for(WorkClass.SERVING).pool
    tokenizer = engine.tokenizer_for(WorkClass.SERVING)
    rng = random.Random(check.seed)
    held: list[float] = []
    rollout_tokens = 0
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            held.append(serving_pool.used_blocks * serving_pool.block_size)
            await asyncio.sleep(SAMPLE_S * k)

    async def rollout(lane: int) -> None:
        nonlocal rollout_tokens
        prompt = tuple(prompt_ids(tokenizer, rollout_prompt, random.Random(lane)))
        turn = 0
        while not stop.is_set():
            request = GenerationRequest(
                request_id=f"r{lane}-{turn}",
                work_class=WorkClass.ROLLOUT,
                prompt_token_ids=prompt,
                sampling=EngineSampling(max_tokens=ROLLOUT_TURN_TOKENS, ignore_eos=True, seed=lane * 100003 + turn),
                trajectory_id=f"r{lane}",  # each turn the same context: cached after the first, decode from then on
                stream=False,
            )
            try:
                result = await engine.submit(request).result()
            except RolloutRejected:  # the lease ended: the run is over
                return
            rollout_tokens += len(result.token_ids)
            turn += 1

    deadline = t0 + (check.duration_s + check.drain_s) * k
    unfinished = 0

    async def serve(i: int, a: Arrival) -> tuple[float, float, float]:
        nonlocal unfinished
        delay = t0 + a.at_s * k - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        request = GenerationRequest(
            request_id=f"s{i}",
            work_class=WorkClass.SERVING,
            prompt_token_ids=tuple(prompt_ids(tokenizer, a.prompt_tokens, rng)),
            sampling=EngineSampling(max_tokens=a.output_tokens, ignore_eos=True),
            stream=False,
        )
        try:
            handle = engine.submit(request)
        except InvalidRequest:  # longer than the whole pool: refused, as a serving engine refuses it
            return a.at_s, math.inf, math.inf
        try:
            result = await asyncio.wait_for(asyncio.shield(handle.result()), timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:  # still queued or decoding when the window closed: aborted, judged on what it got
            unfinished += 1
            handle.cancel()
            result = await handle.result()
        ttft_ms = result.timings.ttft_ms if result.token_ids else result.timings.total_ms  # never a first token: its whole wait
        return a.at_s, ttft_ms / k, result.timings.tpot_ms / k

    sampler = asyncio.ensure_future(sample())
    lanes = [asyncio.ensure_future(rollout(j)) for j in range(check.rollout_inflight)]
    served = await asyncio.gather(*(serve(i, a) for i, a in enumerate(requests)))
    window_s = (time.monotonic() - t0) / k
    stop.set()
    engine.control.abort()  # the backlog's turns in flight end now ("abort"); none starts after `stop`
    await asyncio.gather(sampler, *lanes)  # a backlog lane ends on its aborted turn or a refused one
    device = engine.device
    assert isinstance(device, EmulatedDevice), device  # run_load builds every engine on an emulated device
    lag = device.accelerator.lag.take()
    lag_p99 = lag.get_quantile_value(0.99) if lag.count else None
    ttft = np.array([s[1] for s in served]) if served else np.zeros(0)
    tpot = np.array([s[2] for s in served]) if served else np.zeros(0)
    misses = int(np.sum((ttft > check.slo_ttft_ms) | (tpot > check.slo_tpot_ms)))
    refused = int(np.sum(np.isinf(ttft)))
    ttft = ttft[np.isfinite(ttft)]
    tpot = tpot[np.isfinite(tpot)]
    pool_tokens = serving_pool.num_blocks * serving_pool.block_size
    held_a = np.array(held) if held else np.zeros(1)
    return {
        "pool_tokens": pool_tokens,
        "requests": len(served),
        "slo_misses": misses,
        "slo_attainment": 1.0 - misses / max(1, len(served)),
        "refused": refused,  # requests longer than the whole pool (counted in slo_misses)
        "unfinished": unfinished,  # aborted when the window closed (judged on their wait and tokens so far)
        "ttft_p50_ms": float(np.percentile(ttft, 50)) if len(ttft) else None,
        "ttft_p99_ms": float(np.percentile(ttft, 99)) if len(ttft) else None,
        "tpot_p99_ms": float(np.percentile(tpot, 99)) if len(tpot) else None,
        "held_p999_tokens": float(np.quantile(held_a, 0.999)),
        "held_max_tokens": float(held_a.max()),
        "nearly_full_share": float(np.mean(held_a >= FULL_SHARE * pool_tokens)),
        "rollout_tokens_per_s": rollout_tokens / max(window_s, 1e-9),
        "forward_lag_p99_percent": None if lag_p99 is None else float(lag_p99),
        "ttft_ms": [round(float(x), 1) for x in ttft],
    }


async def run_load(check: PoolCheck, fleet: SizedFleet, paths, load: float) -> dict:
    """Every pool of one load at once (one engine each), on the same arrivals."""
    rate = load * fleet.traffic.cap_rps
    derived = derived_pool(check, fleet, rate)
    memory = fleet.memory
    rollout_kv = memory.cohost_free_bytes + (memory.pool_tokens - derived) * memory.kvb_s  # the sizing's split, at this pool
    pools: dict[str, float] = {f"{s:g}x": s * derived for s in check.pool_scales}
    pools[UNBOUNDED] = memory.alone_kv_tokens
    sizes = fleet.traffic.request_sizes or (np.array([fleet.traffic.prompt_mean]), np.array([fleet.traffic.output_mean]))
    requests = arrivals(rate, check.duration_s, sizes, check.seed + int(round(load * 1000)))
    k = check.time_scale
    engines = {}
    spec = {name: emulation(check, fleet, tokens, rollout_kv) for name, tokens in pools.items()}
    for name in pools:
        config = EngineConfig(
            device=f"emulated:{check.device}",
            emulation=spec[name],
            serving_max_batch=MAX_SERVING_BATCH,
            rollout_max_batch=check.rollout_inflight,
            quantum_ms=check.quantum_ms * k,
            slo_ttft_ms=check.slo_ttft_ms * k,
            slo_tpot_ms=check.slo_tpot_ms * k,
            seed=check.seed,
        )
        engines[name] = Engine.from_dirs(str(paths.serving), str(paths.policy), config)
    try:
        for name, engine in engines.items():
            engine.start()
            engine.set_rollout_lease(spec[name].rollout_kv_bytes, time.monotonic() + 10 * (check.duration_s + 60) * k)
        rollout_prompt = int(fleet.mean_rollout_ctx)
        t0 = time.monotonic()
        results = await asyncio.gather(*(run_instance(e, requests, check, rollout_prompt, t0) for e in engines.values()))
    finally:
        for engine in engines.values():
            await engine.stop()
    runs = dict(zip(engines, results))
    base = runs[UNBOUNDED]
    sized = runs.get("1x")
    verdict = None
    if sized is not None:
        verdict = sized["slo_misses"] <= base["slo_misses"] + 1 and sized["held_max_tokens"] <= sized["pool_tokens"]
    return {
        "load": load,
        "rate_rps": rate,
        "derived_pool_tokens": derived,
        "held_p999_unbounded_over_derived": base["held_p999_tokens"] / derived if derived > 0 else None,
        "derived_pool_holds": verdict,
        "runs": runs,
    }


def run_pool_bench(check: PoolCheck, out_json: str, models_dir: str = "") -> dict:
    from rose.shared.models import POLICY_DIRNAME, SERVING_DIRNAME, ModelPaths, init_models

    fleet = check.sized()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rose-pool-") as tmp:
        root = Path(models_dir) if models_dir else Path(tmp)
        paths = ModelPaths(root / SERVING_DIRNAME, root / POLICY_DIRNAME) if models_dir else init_models(root, seed=0)
        loads = []
        for load in check.loads:
            print(f"load {load:g} of SLO capacity ({load * fleet.traffic.cap_rps:.2f} req/s): {check.duration_s:g} emulated s ...", flush=True)
            row = asyncio.run(run_load(check, fleet, paths, load))
            print_load(row)
            loads.append(row)
    verdicts = [r["derived_pool_holds"] for r in loads if r["derived_pool_holds"] is not None]
    derived_holds = None if not verdicts else all(verdicts)  # None when --pool-scales leaves the derived pool (1) out
    lags = [run["forward_lag_p99_percent"] for r in loads for run in r["runs"].values() if run["forward_lag_p99_percent"] is not None]
    starved = any(lag > LAG_P99_TARGET for lag in lags)
    result = {
        "settings": {
            "device": check.device,
            "serving_model": check.serving_model,
            "policy_model": check.policy_model,
            "serving_tp": fleet.shape.tp_s,
            "slo_capacity_rps": fleet.traffic.cap_rps,
            "whole_pool_tokens": fleet.memory.alone_kv_tokens,
            "duration_s": check.duration_s,
            "seed": check.seed,
            "trace": check.trace or "synthetic",
            "slo_ttft_ms": check.slo_ttft_ms,
            "slo_tpot_ms": check.slo_tpot_ms,
            "time_scale": check.time_scale,
        },
        "loads": loads,
        "derived_pool_holds": derived_holds,
        "starved": starved,
        "wall_s": time.monotonic() - started,
    }
    if lags:
        late = f"the host woke late; before trusting a TTFT near the SLO, rerun with --time-scale > {check.time_scale:g}"
        print(f"forward lag p99 up to {max(lags):.0f} % of a forward (target {LAG_P99_TARGET:g} %): " + ("the host kept up" if not starved else late))
    holds = {None: "not run (add 1 to --pool-scales)", True: "holds at every load", False: "DOES NOT hold"}[derived_holds]
    print(f"the derived pool: {holds}; JSON {out_json}")
    Path(out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(out_json).write_text(json.dumps(result, indent=1))
    plot(result, str(Path(out_json).with_suffix(".png")))
    return result


def print_load(row: dict) -> None:
    print(f"  derived pool {row['derived_pool_tokens']:,.0f} tokens; held p99.9 with the whole KV: {row['runs'][UNBOUNDED]['held_p999_tokens']:,.0f}")
    head = ("pool", "tokens", "requests", "over SLO", "TTFT p99", "held p99.9", "peak", "full", "rollout", "lag p99")
    widths = (10, 9, 8, 9, 9, 10, 9, 5, 8, 7)
    print("  " + " ".join(f"{h:>{w}}" for h, w in zip(head, widths)))
    for name, r in row["runs"].items():
        lag = "-" if r["forward_lag_p99_percent"] is None else f"{r['forward_lag_p99_percent']:.1f}%"
        print(
            f"  {name:>10} {r['pool_tokens']:>9,.0f} {r['requests']:>8} {r['slo_misses']:>4} {1 - r['slo_attainment']:>4.1%}"
            f" {r['ttft_p99_ms'] or 0:>7.0f}ms {r['held_p999_tokens']:>10,.0f} {r['held_max_tokens']:>9,.0f}"
            f" {r['nearly_full_share']:>5.0%} {r['rollout_tokens_per_s']:>6.0f}/s {lag:>7}"
        )
    if row["derived_pool_holds"] is not None:
        print(f"  the derived pool {'holds' if row['derived_pool_holds'] else 'DOES NOT hold'} at load {row['load']:g}", flush=True)


def plot(result: dict, path: str) -> None:
    """TTFT (sorted, as a CDF) per pool, one panel per load, the SLO marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = result["loads"]
    fig, axes = plt.subplots(1, len(loads), figsize=(5.5 * len(loads), 4), squeeze=False)
    slo = result["settings"]["slo_ttft_ms"]
    for ax, row in zip(axes[0], loads):
        for name, run in row["runs"].items():
            t = np.sort(run["ttft_ms"])
            if len(t):
                ax.plot(t, np.arange(1, len(t) + 1) / len(t), label=f"{name} ({run['pool_tokens']:,.0f} tokens)")
        ax.axvline(slo, color="k", ls="--", lw=0.8, label="TTFT SLO")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (emulated ms)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"load {row['load']:g} ({row['rate_rps']:.2f} req/s)")
        ax.legend(fontsize=7)
    s = result["settings"]
    fig.suptitle(f"rose bench pool: {s['serving_model']} serving + {s['policy_model']} policy on {s['serving_tp']}x{s['device']} (emulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def exit_code(result: dict) -> int:
    return 1 if result["derived_pool_holds"] is False else 0
