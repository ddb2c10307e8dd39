"""A whole ROSE fleet on one machine, and the serving traffic it must protect (benches and `rose demo`).

`rose bench elastic`, `rose bench e2e` and `rose demo` all run the same thing: serving executors
taking a replayed trace over their OpenAI HTTP API (Poisson arrivals with periodic bursts,
staggered per executor), dedicated rollout executors, the SLO monitor, the scheduler and
rollout workers as real processes on the real bus; the demo adds the weight publisher and the
trainer. This module is that shared piece: the processes with their settings, the trace, and
the client that measures TTFT/TPOT as a user would.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from rose.bench.options import BenchOptionsError
from rose.contracts.slo import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS
from rose.shared.launch import ServiceProcess
from rose.shared.security import INSTANCE_TOKENS, Credentials

PROMPTS = ("Tell me about the weather.", "What is a good book?", "Explain the plan.", "How do trains work?", "Describe a city.")
# Dedicated rollout executors stand in for separate hardware; on one shared CPU box they run at a
# lower OS priority so that they do not take the serving executors' cores (a GPU they would not share).
DEDICATED_NICE = 10


@dataclass(frozen=True)
class FleetSpec:
    """The knobs every fleet run shares; defaults are what `rose bench elastic` measures."""

    slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS
    slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS
    base_rps: float = 8.0  # serving arrivals per executor outside bursts
    burst_factor: float = 4.0
    burst_every_s: float = 15.0
    burst_len_s: float = 3.0
    serving_max_tokens: int = 16
    rollout_max_tokens: int = 16
    worker_concurrency: int = 8
    metrics_interval_s: float = 0.1
    serving_kv_mib: int = 32
    rollout_kv_mib: int = 64
    prefix: str = "bench"  # instance names: {prefix}-serving-0, {prefix}-dedicated-0, ...


@dataclass
class ServingLog:
    """Every serving request as the client saw it, and the bursts the trace contained."""

    requests: list[dict] = field(default_factory=list)  # {executor, sent_at, t (finished), ttft_ms, tpot_ms, ok, error (None if ok)}
    bursts: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, executor), unix time

    def met(self, spec: FleetSpec) -> list[bool]:
        return [r["ok"] and r["ttft_ms"] <= spec.slo_ttft_ms and r["tpot_ms"] <= spec.slo_tpot_ms for r in self.requests]

    def attainment(self, spec: FleetSpec) -> float | None:
        met = self.met(spec)
        return sum(met) / len(met) if met else None


def executor_instances(spec: FleetSpec, serving: int, dedicated: int) -> list[str]:
    """The executors' instance names `fleet_processes` gives them: declare them to `init_credentials(instances=...)`
    before the server starts, so that each executor gets a user of its own (`assign_credentials`)."""
    p = spec.prefix
    return [f"{p}-serving-{i}" for i in range(serving)] + [f"{p}-dedicated-{i}" for i in range(dedicated)]


def usable_cpus() -> list[int]:
    """The cores this process may use (its affinity mask: a container's cpuset, taskset), in order."""
    return sorted(os.sched_getaffinity(0))


def device_plan(spec: FleetSpec, serving: int, dedicated: int, cpus: list[int] | None = None) -> dict[str, frozenset[int]]:
    """One core per executor, as if each were its own device: dedicated executors on the first cores,
    serving executors on the next ones (`fleet_processes(devices=...)`); the rest of the fleet floats.

    Why: unpinned, every executor shares every core, so rollout "lent" by a serving executor partly takes
    the dedicated executor's CPU: there is no truly idle capacity to harvest. Pinned, lending uses only
    the cycles of the serving executor's own core, as on separate GPUs. An error if there are fewer cores
    than executors (run unpinned, or with fewer executors).
    """
    cpus = usable_cpus() if cpus is None else cpus
    names = executor_instances(spec, serving, dedicated)
    ordered = names[serving:] + names[:serving]  # dedicated first: they are the static pool
    if len(cpus) < len(ordered):
        raise BenchOptionsError(
            f"pinning {len(ordered)} executors (one core each) needs {len(ordered)} cores, this process may use {len(cpus)} ({cpus}): "
            f"run fewer executors (--serving/--dedicated) or unpinned (--pin none)"
        )
    return {name: frozenset({cpu}) for name, cpu in zip(ordered, cpus)}


def cpu_list(cpus) -> str:
    """A CPU set as /proc/<pid>/status writes Cpus_allowed_list (0-3,6)."""
    cpus = sorted(cpus)
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def process_tree(pid: int) -> list[int]:
    """The process and its descendants (Linux /proc), e.g. an executor and its rollout forward child."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:  # gone meanwhile
            continue
    return out


def tree_cpus(pid: int) -> frozenset[int]:
    """Every core the process or any of its descendants may run on: what a pinned executor really uses."""
    cpus: set[int] = set()
    for p in process_tree(pid):
        try:
            cpus |= os.sched_getaffinity(p)
        except OSError:
            continue
    return frozenset(cpus)


def assign_credentials(procs: dict[str, ServiceProcess], creds: Credentials) -> None:
    """Each process its own NATS credentials: an executor its instance's seed, any other process its service's.

    An executor whose instance was not declared is an error here, not a quiet fall back on the
    shared `executor` seed (with which it could answer or speak for any other executor).
    """
    for proc in procs.values():
        env = creds.env(proc.service, proc.instance)
        if proc.service in INSTANCE_TOKENS and env["ROSE_BUS__NKEY_SEED_FILE"] != str(creds.seed_file(proc.service, proc.instance)):
            raise RuntimeError(
                f"no credentials of {proc.service} instance {proc.instance} in {creds.directory}: "
                f"pass instances={{{proc.service!r}: [...]}} to init_credentials (see executor_instances)"
            )
        proc.env.update(env)


def fleet_processes(
    root: Path,
    url: str,
    models: Path,
    spec: FleetSpec,
    serving: int,
    dedicated: int,
    *,
    worker_env: dict[str, str] | None = None,
    serving_env: dict[str, str] | None = None,
    scheduler_env: dict[str, str] | None = None,
    executor_env: dict[str, str] | None = None,
    devices: dict[str, frozenset[int]] | None = None,
) -> dict[str, ServiceProcess]:
    """Executors, SLO monitor, scheduler and one rollout worker, keyed by instance name (not started).

    `serving_env`, `scheduler_env` and `worker_env` add or override settings of the serving executors,
    the scheduler and the worker (a fleet policy of `rose bench e2e`); `executor_env` of every executor (a LoRA job's
    rollout mode). `devices` pins executors to CPU
    sets (`device_plan`); a pinned dedicated executor has its own core, so it keeps the normal priority."""
    devices = devices or {}
    p = spec.prefix
    names = executor_instances(spec, serving, dedicated)
    env = {"NATS_URL": url, "ROSE_MODELS__DIR": str(models), "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5", "ROSE_RUNTIME__LOG_LEVEL": "WARNING"}
    executor = {
        **env,
        "ROSE_METRICS_INTERVAL_S": str(spec.metrics_interval_s),
        "ROSE_ENGINE__DEVICE": "cpu",
        "ROSE_ENGINE__SERVING_KV_MIB": str(spec.serving_kv_mib),
        "ROSE_ENGINE__ROLLOUT_KV_MIB": str(spec.rollout_kv_mib),
        "ROSE_ENGINE__SLO_TTFT_MS": str(spec.slo_ttft_ms),
        "ROSE_ENGINE__SLO_TPOT_MS": str(spec.slo_tpot_ms),
        **(executor_env or {}),
    }
    procs = {
        name: ServiceProcess(
            "executor", name, {**executor, "ROSE_ROLE": "serving", **(serving_env or {})}, root / f"serving-{i}.log", cpus=devices.get(name)
        )
        for i, name in enumerate(names[:serving])
    }
    procs.update(
        {
            name: ServiceProcess(
                "executor",
                name,
                {**executor, "ROSE_ROLE": "dedicated"},
                root / f"dedicated-{i}.log",
                nice=0 if name in devices else DEDICATED_NICE,
                cpus=devices.get(name),
            )
            for i, name in enumerate(names[serving:])
        }
    )
    procs["monitor"] = ServiceProcess(
        "slo_monitor",
        f"{p}-monitor",
        {
            **env,
            "ROSE_HEADROOM_INTERVAL_S": "0.5",
            "ROSE_HEADROOM__SLO_TTFT_MS": str(spec.slo_ttft_ms),
            "ROSE_HEADROOM__SLO_TPOT_MS": str(spec.slo_tpot_ms),
            "ROSE_BURSTS__WINDOW_S": "0.25",
            "ROSE_WINDOWS__LONG_S": "10",
        },
        root / "monitor.log",
    )
    procs["scheduler"] = ServiceProcess(
        "scheduler",
        f"{p}-scheduler",
        {
            **env,
            "ROSE_TICK_S": "0.25",
            "ROSE_LEASES__TTL_S": "6",
            "ROSE_LEASES__RENEW_BEFORE_S": "3",
            "ROSE_LEASES__COOLDOWN_S": "4",
            **(scheduler_env or {}),
        },
        root / "scheduler.log",
    )
    procs["worker"] = ServiceProcess(
        "rollout_worker",
        f"{p}-worker",
        {
            **env,
            "ROSE_CONCURRENCY": str(spec.worker_concurrency),
            "ROSE_ACK_WAIT_S": "20",
            "ROSE_TURNS__MAX_TOKENS": str(spec.rollout_max_tokens),
            "ROSE_TURNS__GENERATE_TIMEOUT_S": "20",
            **(worker_env or {}),
        },
        root / "worker.log",
    )
    return procs


def serving_trace(executors: list[str], duration_s: float, spec: FleetSpec, seed: int, log: ServingLog, t0: float) -> list[tuple[float, str]]:
    """(seconds from t0, executor) of every serving arrival; bursts (recorded in `log`) staggered across executors."""
    rng = np.random.default_rng(seed)
    out: list[tuple[float, str]] = []
    for i, ex in enumerate(executors):
        offset = 5.0 + i * spec.burst_every_s / max(1, len(executors))
        start = offset
        while start < duration_s:
            log.bursts.append((t0 + start, t0 + min(duration_s, start + spec.burst_len_s), ex))
            start += spec.burst_every_s
        t = 0.0
        while True:
            in_burst = t >= offset and (t - offset) % spec.burst_every_s < spec.burst_len_s
            t += rng.exponential(1.0 / (spec.base_rps * (spec.burst_factor if in_burst else 1.0)))
            if t >= duration_s:
                break
            out.append((t, ex))
    return sorted(out)


async def serve_one(
    session: aiohttp.ClientSession, url: str, ex: str, prompt: str | list[int], max_tokens: int, log: ServingLog, temperature: float = 0.0
) -> None:
    """One streamed completion; TTFT and TPOT as the client sees them. TPOT is the time from the first chunk
    to the last over the tokens between them (the usage chunk counts them), so an executor that streams
    several tokens per chunk (`http.stream_interval`) is measured the same."""
    sent, sent_at = time.monotonic(), time.time()
    times: list[float] = []
    tokens = 0
    ok = False
    error = None
    try:
        body = {
            "model": "rose-serving",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                if b'"usage"' in line and b'"choices": []' in line:
                    tokens = int(json.loads(line[6:])["usage"]["completion_tokens"])
                else:
                    times.append(time.monotonic())
            ok = resp.status == 200 and bool(times)
            if not ok:
                error = f"HTTP {resp.status}" if resp.status != 200 else "no token streamed"
    except (TimeoutError, aiohttp.ClientError) as e:
        ok, error = False, f"{type(e).__name__}: {e}"[:200]
    ttft = (times[0] - sent) * 1e3 if times else float("inf")
    gaps = (tokens or len(times)) - 1
    tpot = (times[-1] - times[0]) * 1e3 / gaps if len(times) > 1 and gaps > 0 else 0.0
    log.requests.append({"executor": ex, "sent_at": sent_at, "t": time.time(), "ttft_ms": ttft, "tpot_ms": tpot, "ok": ok, "error": error})


async def drive_serving(
    trace: list[tuple[float, str]], urls: dict[str, str], down: set[str], spec: FleetSpec, log: ServingLog, t0_mono: float, seed: int
) -> None:
    """Replay the trace; a request for an executor that is down goes to another (the load balancer's job)."""
    rng = random.Random(seed)
    pending: set[asyncio.Task] = set()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30.0)) as session:
        for at, ex in trace:
            delay = t0_mono + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            target = ex if ex not in down else next((e for e in urls if e not in down), ex)
            task = asyncio.ensure_future(serve_one(session, urls[target], target, rng.choice(PROMPTS), spec.serving_max_tokens, log))
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            await asyncio.wait(pending, timeout=30.0)


def p99(values: list[float]) -> float | None:
    return float(np.percentile(values, 99)) if values else None
