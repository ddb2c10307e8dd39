"""An emulated fleet of real services: 8-64 GPUs on this box, what `rose bench e2e --emulate` measures.

The executors are emulated accelerators (services/executor/emulated.py), many to a process
(`rose run executor --emulate 16xH100:7B`); everything else is the real thing as its own process on a
real nats-server with per-service credentials: the SLO monitor, the scheduler, the weight publisher, a
rollout worker and the GRPO trainer (whose optimizer step is timed, not run: services/trainer/emulated.py).
The job is the simulator's agentic workload (shared/workload.py, played by shared/agentic/env_emulated.py)
and the serving traffic is the simulator's trace for the same configuration (sim/traces.py), sent over the
executors' OpenAI HTTP API. So the simulator can run the very same configuration beside it
(``EmulatedJob.sim_config``), and where the two disagree one of them is wrong.

Time: the fleet runs ``time_scale`` times slower than real time, every process reading the one scale
(shared/clock.py); what is measured here in wall seconds is turned back into the fleet's seconds
(``rescale``) before any figure is computed, so every figure is in emulated time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec
import numpy as np

from rose.contracts.executor import RolloutMode
from rose.contracts.rollout import TurnRecord
from rose.shared.agentic.env_emulated import WORDS
from rose.shared.clock import TIME_SCALE_ENV
from rose.shared.devices import model_spec
from rose.shared.launch import ServiceProcess
from rose.shared.security import Credentials
from rose.shared.workload import RolloutSpec
from rose.sim.config import PRICED_LORA, as_rollout_mode
from rose.sim.engine import SimConfig, Simulation
from rose.sim.traces import Requests, load_azure_csv, requests_to_trace

from .demo import DEMO_POLICY, Observed
from .fleet import ServingLog, serve_one

STREAM_INTERVAL = 16  # tokens per streamed chunk: TTFT stays exact, the host pays per chunk (http.stream_interval)
SERVING_PREFIX, DEDICATED_PREFIX = "emu-serving", "emu-dedicated"
GIB = float(2**30)


# The emulated runs' default job: the simulator's workload (shared/workload.py: log-normal turns, tokens per turn,
# tool output and latency, one prompt per group) at the scale a run of minutes on this box can finish steps of: turns
# median 3 (5), tokens per turn median 150 (300), tool latency median 0.5 s (1.5 s), everything else as the
# simulator's. The simulator runs the same job beside it; `--workload` changes it.
BENCH_WORKLOAD: dict[str, float] = {
    "turns_median": 3.0,
    "max_turns": 10,
    "gen_median": 150.0,
    "gen_max": 1024,
    "tool_tokens_median": 200.0,
    "tool_tokens_max": 2048,
    "tool_latency_median_s": 0.5,
    "tool_latency_max_s": 10.0,
    "prompt_median": 1000.0,
}


# The simulator's clock for an emulated job: its turns decode ~150 tokens at ~10-15 ms each (~2 s), so the grid's
# 1 s tick (sim/config.py) holds a finished turn's successor back up to a tick for admission and its first decode:
# at 4xH100, 7B, demand 2, async the simulator's static made 139 steps/h at 1 s, 205 at 0.1 s, 212 at 0.05 s and
# 215 at 0.02 s (the running system: 221 with a GPU engine's prefill chunk).
SIM_DT_S = 0.05


@dataclass(frozen=True, kw_only=True)
class EmulatedJob:
    """One configuration, as both the running system and the simulator take it."""

    gpus: int = 16  # serving GPUs (the simulator's `gpus`; the dedicated pool is `dedicated_ratio` x this, beside them)
    device: str = "H100"
    model: str = "7B"  # the serving model
    policy_model: str = ""  # the RL policy (default: the serving model's size)
    dedicated_ratio: float = 0.25
    demand: float = 2.0  # trajectories in flight, in multiples of what the dedicated executors run at once
    mode: str = "async"  # sync: one step of tasks at a time; async: one step handed out ahead (grpo.prefetch_steps 1)
    seed: int = 0
    load: float = 0.35  # mean serving load, a fraction of the fleet's SLO capacity (the simulator's trace)
    time_scale: float = 4.0  # wall seconds per emulated second (shared/clock.py)
    rollout_max_batch: int = 32  # sequences a rollout lane runs at once (engine.rollout_max_batch; the simulator's max_rollout_batch)
    workload: dict[str, float] = field(default_factory=lambda: dict(BENCH_WORKLOAD))  # RolloutSpec fields that differ from its defaults
    slo_ttft_ms: float = 1000.0  # the simulator's defaults
    slo_tpot_ms: float = 100.0
    warmup_s: float = 10.0  # serving only before the trainer starts (emulated seconds)
    trace: str = ""  # an Azure-format serving trace to replay (sim/traces.py), instead of the synthetic one at `load`
    # partial rollouts (grpo.over_provision): a step's batch goes out with this share of its groups more; the trainer takes
    # the first complete groups and carries the rest (the simulator's ``over_provision``, the same share)
    over_provision: float = 0.0
    # two_model: the policy a model of its own beside serving's; co_batched: a LoRA adapter of the serving model (the
    # simulator's priced shape, sim/config.py PRICED_LORA), its rollout rows in serving's own batches on every executor
    rollout_mode: RolloutMode = "two_model"

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode {self.mode!r}: sync or async")
        if self.demand <= 0 or not 0 < self.dedicated_ratio <= 4:
            raise ValueError("demand must be positive and dedicated_ratio in (0, 4]")
        if self.over_provision < 0:
            raise ValueError(f"over_provision must be >= 0, got {self.over_provision}")
        as_rollout_mode(self.rollout_mode)
        if self.rollout_mode == "co_batched" and self.policy != self.model:
            raise ValueError(
                f"a co-batched job's policy is a LoRA adapter of the serving model: policy_model must be {self.model}, not {self.policy}"
            )
        model_spec(self.model)
        model_spec(self.policy_model or self.model)

    @property
    def policy(self) -> str:
        return self.policy_model or self.model

    @property
    def dedicated_gpus(self) -> int:
        return int(round(self.gpus * self.dedicated_ratio))

    def spec(self) -> RolloutSpec:
        return dataclasses.replace(RolloutSpec(), **self.workload)  # type: ignore[arg-type]

    def sim_config(self, policy: str, steps: int = 3) -> SimConfig:
        """This configuration for the simulator (``policy``: static, naive_share, elastic_baseline, rose)."""
        return dataclasses.replace(self._fleet_config(policy, steps), trajectories=self.trajectories_per_step(), worker_concurrency=self.in_flight())

    def _fleet_config(self, policy: str, steps: int = 3) -> SimConfig:
        """The fleet and its traffic as the simulator takes them, before the job's size (which depends on the fleet)."""
        return SimConfig(
            dt=SIM_DT_S,
            model=self.model,
            policy_model=self.policy_model or None,
            device=self.device,
            gpus=self.gpus,
            policy=policy,
            rollout_gpu_ratio=self.dedicated_ratio,
            steps=steps,
            seed=self.seed,
            load=self.load,
            slo_ttft_ms=self.slo_ttft_ms,
            slo_tpot_ms=self.slo_tpot_ms,
            rollout=self.spec(),
            warmup_s=self.warmup_s,
            max_rollout_batch=self.rollout_max_batch,
            prefetch_steps=0 if self.mode == "sync" else 1,
            trace=requests_to_trace(self.trace_requests()) if self.trace else None,
            over_provision=self.over_provision,
            rollout_mode=self.rollout_mode,
        )

    def trace_requests(self) -> Requests:
        """The replayed trace's requests (an Azure-format CSV; a bad file raises TraceError naming the line)."""
        return load_azure_csv(self.trace)

    def sizing(self) -> Simulation:
        """The fleet as the simulator sizes it: instances, memory split, the serving trace (nothing runs)."""
        return Simulation(self._fleet_config("rose"))

    def dedicated_instances(self) -> int:
        return self.sizing().sized.shape.n_ded

    def in_flight(self) -> int:
        """Trajectories in flight: ``demand`` x what the dedicated executors run at once (the worker's concurrency)."""
        sim = self.sizing()
        return max(1, int(round(self.demand * sim.sized.shape.n_ded * self.rollout_max_batch)))

    def trajectories_per_step(self, group_size: int = 8) -> int:
        return max(group_size, math.ceil(self.in_flight() / group_size) * group_size)

    def groups_per_step(self) -> int:
        """GRPO groups a step trains on (grpo.groups_per_step), of the workload's group size."""
        group_size = self.spec().group_size
        return self.trajectories_per_step(group_size) // group_size

    def extra_groups(self) -> int:
        """Groups handed out beyond a step's (grpo.over_provision), as the simulator rounds the share: up."""
        return math.ceil(self.over_provision * self.groups_per_step()) if self.over_provision > 0 else 0


def build_models(job: EmulatedJob, models: Path) -> Path:
    """The fleet's local models under ``models`` (built once): the tokenizer and the stand-in weights (the emulated
    device prices the emulated model's shapes, emulated.py); a co-batched job's policy an adapter of the stand-in
    serving model in the simulator's priced shape, so real and simulated rows pay the same adapter."""
    from rose.shared.lora import is_adapter_dir
    from rose.shared.models import init_models

    if job.rollout_mode == "co_batched":
        if not is_adapter_dir(models / "policy"):
            init_models(models, 0, lora=PRICED_LORA)
    elif not (models / "policy" / "config.json").exists():
        init_models(models, 0, DEMO_POLICY)
    return models


def process_env(job: EmulatedJob, url: str, models: Path) -> dict[str, str]:
    """What every process of the fleet gets: the bus, the models, the one clock."""
    return {
        "NATS_URL": url,
        "ROSE_MODELS__DIR": str(models),
        "ROSE_RUNTIME__LOG_LEVEL": "WARNING",
        "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "1",
        TIME_SCALE_ENV: f"{job.time_scale:g}",
    }


def executor_names(prefix: str, count: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(count)]


@dataclass(frozen=True)
class ExecutorGroup:
    """One process of emulated executors (`rose run executor --emulate ...`): its arguments, settings and members."""

    name: str
    args: tuple[str, ...]
    env: dict[str, str]
    members: tuple[str, ...]


def executor_groups(job: EmulatedJob, serving_env: dict[str, str] | None = None) -> list[ExecutorGroup]:
    """The fleet's executors as two groups, serving and dedicated, sized and set up as the simulator sizes
    them (instances, serving pool, lendable KV, a dedicated instance's KV; shared/devices.py). The settings
    name no bus or clock: the caller adds its own (``process_env``)."""
    sim = job.sizing()
    fleet = f"{job.model}+{job.policy}"
    executor = {
        "ROSE_METRICS_INTERVAL_S": "1",
        "ROSE_ENGINE__SLO_TTFT_MS": f"{job.slo_ttft_ms:g}",
        "ROSE_ENGINE__SLO_TPOT_MS": f"{job.slo_tpot_ms:g}",
        "ROSE_ENGINE__SERVING_MAX_BATCH": "256",  # the simulator's serving engine (sim/coserve.py MAX_SERVING_BATCH)
        "ROSE_ENGINE__ROLLOUT_MAX_BATCH": str(job.rollout_max_batch),
        "ROSE_HTTP__STREAM_INTERVAL": str(STREAM_INTERVAL),
        "ROSE_EMULATION__SERVING_KV_GIB": f"{sim.sized.memory.pool_tokens * sim.sized.memory.kvb_s / GIB:.6f}",
    }
    serving = tuple(executor_names(SERVING_PREFIX, sim.sized.shape.n_serv))
    dedicated = tuple(executor_names(DEDICATED_PREFIX, sim.sized.shape.n_ded))
    return [
        ExecutorGroup(
            SERVING_PREFIX,
            ("--emulate", f"{job.gpus}x{job.device}:{fleet}", "--role", "serving", "--instance-prefix", SERVING_PREFIX),
            {
                **executor,
                "ROSE_EMULATION__ROLLOUT_KV_GIB": f"{max(sim.sized.memory.cohost_free_bytes, 2**20) / GIB:.6f}",
                "ROSE_ENGINE__ROLLOUT_MODE": job.rollout_mode,
                **(serving_env or {}),
            },
            serving,
        ),
        ExecutorGroup(
            DEDICATED_PREFIX,
            ("--emulate", f"{job.dedicated_gpus}x{job.device}:{fleet}", "--role", "dedicated", "--instance-prefix", DEDICATED_PREFIX),
            # no serving batches to ride in: a LoRA policy runs folded into the instance's copy of the base (as the simulator prices it)
            {**executor, "ROSE_EMULATION__ROLLOUT_KV_GIB": f"{sim.sized.memory.dedicated_kv / GIB:.6f}", "ROSE_ENGINE__ROLLOUT_MODE": "two_model"},
            dedicated,
        ),
    ]


def monitor_env(job: EmulatedJob) -> dict[str, str]:
    """The SLO monitor's settings for this fleet: the SLO, and the caps the simulator gives it (sim/policies.py monitor_settings)."""
    sim = job.sizing()
    return {
        "ROSE_HEADROOM__SLO_TTFT_MS": f"{job.slo_ttft_ms:g}",
        "ROSE_HEADROOM__SLO_TPOT_MS": f"{job.slo_tpot_ms:g}",
        "ROSE_HEADROOM__MAX_ROLLOUT_SLOTS": str(job.rollout_max_batch),
        "ROSE_HEADROOM__MAX_LEND_KV_BYTES": str(int(max(0.0, sim.sized.memory.cohost_free_bytes))),
    }


def fleet_processes(
    logs: Path, url: str, models: Path, creds: Credentials, job: EmulatedJob, policy_env: dict[str, dict[str, str]], in_flight: int
) -> dict[str, ServiceProcess]:
    """The fleet's processes (not started): two executor groups (serving, dedicated), the SLO monitor, the
    scheduler and a rollout worker. ``policy_env`` adds settings per part, as `rose bench e2e` does."""
    base = process_env(job, url, models)
    procs = {
        g.name: ServiceProcess("executor", g.name, {**base, **g.env}, logs / f"{g.name}.log", args=g.args, members=g.members)
        for g in executor_groups(job, policy_env.get("serving"))
    }
    procs["monitor"] = ServiceProcess("slo_monitor", "emu-monitor", {**base, **monitor_env(job)}, logs / "monitor.log")
    procs["scheduler"] = ServiceProcess("scheduler", "emu-scheduler", {**base, **policy_env.get("scheduler", {})}, logs / "scheduler.log")
    procs["worker"] = ServiceProcess(
        "rollout_worker", "emu-worker", {**base, "ROSE_CONCURRENCY": str(in_flight), **policy_env.get("worker", {})}, logs / "worker.log"
    )
    procs["publisher"] = ServiceProcess("weight_publisher", "emu-publisher", base, logs / "weight_publisher.log")
    for proc in procs.values():
        # an executor group authenticates as its first member; group.py takes each member's own seed beside it
        proc.env.update(creds.env(proc.service, proc.members[0] if proc.members else proc.instance))
    return procs


def trainer_process(logs: Path, url: str, models: Path, creds: Credentials, job: EmulatedJob, state: Path) -> ServiceProcess:
    """The GRPO trainer of the emulated job: the simulator's workload, its optimizer step timed for the policy
    on the simulator's trainer GPUs, no warm start (an emulated job learns nothing; it measures the system)."""
    sim = job.sizing()
    spec = job.spec()
    env = {
        **process_env(job, url, models),
        "ROSE_RUN_ID": f"emu-{job.seed}",
        "ROSE_TASKS__ENVS": '["emulated"]',
        "ROSE_TASKS__SEED": str(job.seed),
        "ROSE_TASKS__MAX_TURNS": str(spec.max_turns),
        "ROSE_TASKS__WORKLOAD": json.dumps(job.workload),
        "ROSE_SFT__STEPS": "0",
        "ROSE_GRPO__GROUP_SIZE": str(spec.group_size),
        "ROSE_GRPO__GROUPS_PER_STEP": str(job.groups_per_step()),
        "ROSE_GRPO__PREFETCH_STEPS": "0" if job.mode == "sync" else "1",
        "ROSE_GRPO__MAX_STALENESS": "2",
        "ROSE_GRPO__OVER_PROVISION": str(job.extra_groups()),
        "ROSE_EMULATION__DEVICE": job.device,
        "ROSE_EMULATION__MODEL": job.policy,
        "ROSE_EMULATION__GPUS": f"{sim.sized.shape.trainer_gpus:g}",
        "ROSE_PUBLISH__STAGING_DIR": str(state / "staging"),
        "ROSE_STATE_DIR": str(state),
        **creds.env("trainer"),
    }
    return ServiceProcess("trainer", "emu-trainer", env, logs / "trainer.log")


# ---- serving traffic ----------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    at_s: float  # emulated seconds from the trace's start
    prompt_tokens: int
    output_tokens: int


def serving_requests(job: EmulatedJob, duration_s: float) -> list[Request]:
    """The serving traffic: a replayed trace's own requests (``job.trace``), or the simulator's synthetic trace
    for this configuration as requests, Poisson arrivals at the trace's fleet rate of each second with sizes
    from its log-normal sizes (sim/traces.py RequestSizes)."""
    if job.trace:
        r = job.trace_requests()
        keep = r.times_s < duration_s
        return [Request(float(t), max(1, int(c)), max(1, int(g))) for t, c, g in zip(r.times_s[keep], r.context[keep], r.generated[keep])]
    sim = job.sizing()
    rng = np.random.default_rng([job.seed, 3])
    out: list[Request] = []
    for second in range(int(math.ceil(duration_s))):
        n = int(rng.poisson(float(sim.sized.traffic.fleet_rate[second % len(sim.sized.traffic.fleet_rate)])))
        if not n:
            continue
        prompts, outputs = sim.cfg.trace_shape.sizes.sample(rng, n)
        for at, p, o in zip(np.sort(rng.uniform(second, second + 1, n)), prompts, outputs):
            out.append(Request(float(at), int(p), int(o)))
    return out


def prompt_ids(tokenizer, n: int, rng: random.Random) -> list[int]:
    """``n`` token ids of ordinary words (the emulated engine only counts them)."""
    ids = [tokenizer.convert_tokens_to_ids("Ġ" + w) for w in WORDS]
    ids = [i for i in ids if isinstance(i, int) and i >= 0] or [5]
    return [rng.choice(ids) for _ in range(n)]


async def drive_serving(
    requests: list[Request], urls: dict[str, str], drained: set[str], log: ServingLog, t0_mono: float, scale: float, tokenizer, seed: int
) -> None:
    """Send the trace at 1/``scale`` of its rate, each request to a serving executor picked at random (the
    simulator's Poisson split), never to one a load balancer drains (an elastic baseline's lent executor)."""
    rng = random.Random(seed)
    pending: set[asyncio.Task] = set()
    names = sorted(urls)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600.0)) as session:
        for r in requests:
            delay = t0_mono + r.at_s * scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            choices = [n for n in names if n not in drained] or names
            target = rng.choice(choices)
            task = asyncio.ensure_future(
                serve_one(session, urls[target], target, prompt_ids(tokenizer, r.prompt_tokens, rng), r.output_tokens, log, 1.0)
            )
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            await asyncio.wait(pending, timeout=120.0 * scale)


# ---- from wall time to the fleet's time --------------------------------------------------


def rescale(obs: Observed, t0: float, scale: float) -> Observed:
    """``obs`` with every instant moved to ``t0 + (t - t0) / scale`` and every duration divided by ``scale``:
    what the fleet saw, in its own (emulated) seconds."""
    if scale == 1.0:
        return obs

    def at(t: float) -> float:
        return t0 + (t - t0) / scale

    def turn(u: TurnRecord) -> TurnRecord:
        return msgspec.structs.replace(u, started_at=at(u.started_at), finished_at=at(u.finished_at))

    out = Observed()
    out.serving.requests = [
        {**r, **{k: at(r[k]) for k in ("sent_at", "t") if k in r}, "ttft_ms": r["ttft_ms"] / scale, "tpot_ms": r["tpot_ms"] / scale}
        for r in obs.serving.requests
    ]
    out.serving.bursts = [(at(a), at(b), e) for a, b, e in obs.serving.bursts]
    out.snapshots = [(at(t), e, q / scale, r, lease) for t, e, q, r, lease in obs.snapshots]
    out.lease_events = [(at(t), e, k) for t, e, k in obs.lease_events]
    out.alerts = [(at(t), e, s) for t, e, s in obs.alerts]
    out.published = set(obs.published)
    out.trajectories = {
        k: msgspec.structs.replace(
            t, finished_at=at(t.finished_at), created_at=at(t.created_at) if t.created_at else 0.0, turns=[turn(u) for u in t.turns]
        )
        for k, t in obs.trajectories.items()
    }
    out.manifests = dict(obs.manifests)
    out.applied = dict(obs.applied)
    out.steps = [msgspec.structs.replace(s, at=at(s.at), train_s=s.train_s / scale, publish_s=s.publish_s / scale) for s in obs.steps]
    return out
