"""`rose demo`: a real RL job on co-elastic capacity, end to end, on this machine, in about five minutes.

Everything runs as it would in production, as separate processes on the real bus (an embedded
nats-server): two serving executors taking a replayed serving trace with bursts over their
OpenAI API, one dedicated rollout executor, the SLO monitor, the scheduler, the weight
publisher, a rollout worker and the reference GRPO trainer. The trainer warm-starts a tiny
policy on expert traces, then runs GRPO on arithmetic-with-a-calculator episodes that the
scheduler places on the dedicated executor and, under leases, on the serving executors'
spare capacity; each step's weights go out as deltas and the executors apply them between
iterations. The demo only watches (the bus events any user can subscribe to) and drives the
serving clients, then writes `summary.json` and plots.

With `--agent PATH` the trainer hands its tasks to the rollout gateway instead of the rollout worker,
and the gateway runs the agent at PATH for each (examples/agents: a loop over the `openai` client,
an OpenAI Agents SDK agent), unchanged but for its base URL and key: the same job, the same warm
start, the same reward (the arithmetic environment's reward function, scoring the agent's answer),
with an external agent in place of the built-in environment.

Timeline: build the models (tokenizer + two small Qwen2 models, seconds) -> start the fleet
-> the trainer's warm start (until it hands out its first tasks; how long depends on the
machine, so it is not part of the window) -> `duration` seconds of serving trace and GRPO
training -> stop the trainer -> drain (every task handed out must come back as a trajectory)
-> report.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from rose.contracts.registry import (
    AGENT_TASK,
    EXECUTOR_METRICS,
    LEASE_EVENT,
    ROLLOUT_TASK,
    SLO_ALERT,
    TRAINING_STEP,
    TRAJECTORY,
    WEIGHT_APPLIED,
    WEIGHT_MANIFEST,
)
from rose.contracts.rollout import Trajectory
from rose.contracts.training import TrainingStep
from rose.contracts.weights import WeightManifest
from rose.shared.bus import Bus
from rose.shared.config import BusConfig
from rose.shared.launch import ServiceProcess, start_all, stop_all
from rose.shared.lora import DEFAULT_LORA, is_adapter_dir, read_adapter
from rose.shared.models import DEMO_POLICY_SHAPE, init_models
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.shared.security import OPERATOR, init_credentials
from rose.shared.sketch import from_contract
from rose.shared.workload import LORA_TRAINER, ROLLOUT_DOMINATED_JOB, TRAINER

from .fleet import (
    DEDICATED_NICE,
    FleetSpec,
    ServingLog,
    assign_credentials,
    cpu_list,
    drive_serving,
    executor_instances,
    fleet_processes,
    p99,
    serving_trace,
    tree_cpus,
)

DEFAULT_DURATION_S = 140.0  # the GRPO window, after the warm start; with start-up, warm start and drain about 5 minutes
DEFAULT_OUT = "report"
# A policy this small learns the tool format from a short warm start and improves under GRPO
# within a few dozen steps on a CPU, while the serving model is the default one (`rose models init --preset demo`).
DEMO_POLICY = DEMO_POLICY_SHAPE
SPEC = FleetSpec(prefix="demo", burst_factor=3.0, worker_concurrency=32, rollout_max_tokens=16)
START_TIMEOUT_S = 240.0
WARM_START_TIMEOUT_S = 600.0
DRAIN_TIMEOUT_S = 60.0
RECENT_S = 10.0  # the live table's window
SPARK = "▁▂▃▄▅▆▇█"


@dataclass
class Observed:
    """What the demo sees on the bus and from its serving clients (local receive times)."""

    serving: ServingLog = field(default_factory=ServingLog)
    snapshots: list[tuple[float, str, float, int, str]] = field(default_factory=list)  # (t, executor, ttft p99, rollout running, lease id)
    lease_events: list[tuple[float, str, str]] = field(default_factory=list)  # (at, executor, kind)
    alerts: list[tuple[float, str, str]] = field(default_factory=list)  # (t, executor, severity)
    published: set[str] = field(default_factory=set)  # task ids handed out
    trajectories: dict[str, Trajectory] = field(default_factory=dict)  # task id -> Trajectory
    manifests: dict[int, WeightManifest] = field(default_factory=dict)  # version -> WeightManifest
    applied: dict[str, int] = field(default_factory=dict)  # executor -> live policy version
    steps: list[TrainingStep] = field(default_factory=list)  # in order


TRAJECTORY_CONSUMER = "demo_trajectories"  # the observer's durable consumer of the trajectory stream


async def trajectories_delivered(bus: Bus, timeout_s: float = 10.0) -> bool:
    """Wait until the observer's consumer has delivered every trajectory the stream holds (False: not within
    ``timeout_s``). A worker publishes a trajectory before it acknowledges the task, so once a task the work
    queue no longer holds (``shared/task_queue.py``) is past this, its trajectory is observed or it is lost:
    counting before it once called a trajectory in delivery lost."""
    assert TRAJECTORY.stream is not None
    deadline = time.monotonic() + timeout_s
    while True:
        info = await bus.js.consumer_info(TRAJECTORY.stream.name, TRAJECTORY_CONSUMER)
        if not info.num_pending and not info.num_ack_pending:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.2)


async def observe(bus: Bus, obs: Observed) -> None:
    """Subscribe to the public events (what a user's own dashboard would do)."""

    async def on_metrics(s, _d):
        q = float(from_contract(s.ttft_ms).get_quantile_value(0.99) or 0.0) if s.ttft_ms.count else float("nan")
        obs.snapshots.append((time.time(), s.executor_id, q, s.rollout_running, s.lease_id))

    async def on_lease(e, _d):
        obs.lease_events.append((e.at, e.lease.executor_id, e.kind))

    async def on_alert(a, _d):
        obs.alerts.append((time.time(), a.executor_id, a.severity))

    async def on_task(t, _d):
        obs.published.add(t.task_id)

    async def on_trajectory(t, _d):
        obs.trajectories.setdefault(t.task_id, t)

    async def on_manifest(m, _d):
        obs.manifests[m.version] = m

    async def on_applied(a, _d):
        obs.applied[a.executor_id] = max(a.version, obs.applied.get(a.executor_id, 0))

    async def on_step(s, _d):
        obs.steps.append(s)

    await bus.subscribe(EXECUTOR_METRICS, on_metrics)
    await bus.subscribe(ROLLOUT_TASK, on_task)  # core subscription beside the workers' work queue
    await bus.subscribe(AGENT_TASK, on_task)  # and the gateways' (`rose demo --agent`)
    await bus.consume(LEASE_EVENT, on_lease, durable="demo_leases")
    await bus.consume(SLO_ALERT, on_alert, durable="demo_alerts")
    await bus.consume(TRAJECTORY, on_trajectory, durable=TRAJECTORY_CONSUMER)
    await bus.consume(WEIGHT_MANIFEST, on_manifest, durable="demo_manifests")
    await bus.consume(WEIGHT_APPLIED, on_applied, durable="demo_applied")
    await bus.consume(TRAINING_STEP, on_step, durable="demo_steps")


# ---- the live table -------------------------------------------------------------------


def _turns(obs: Observed):
    for t in list(obs.trajectories.values()):
        yield from t.turns


def lease_holders(obs: Observed) -> dict[str, bool]:
    held: dict[str, bool] = {}
    for _, ex, kind in sorted(obs.lease_events):
        held[ex] = kind in ("granted", "renewed")
    return held


def spark(values: list[float]) -> str:
    return "".join(SPARK[min(len(SPARK) - 1, max(0, int(v * len(SPARK))))] for v in values[-40:])


def live_view(obs: Observed, executors: dict[str, str], elapsed: float, duration: float, phase: str, label: str = "ROSE demo") -> Group:
    now = time.time()
    table = Table(
        title=f"{label} · {phase} · {elapsed:.0f}/{duration:.0f} s · serving latency and rollout tokens/s over the last {RECENT_S:.0f} s",
        expand=False,
    )
    for col in ("executor", "role", "TTFT p99", "SLO met", "lease", "tok/s", "policy"):
        table.add_column(col, justify="left" if col in ("executor", "role") else "right", no_wrap=True)
    held = lease_holders(obs)
    recent_tokens: dict[str, int] = defaultdict(int)
    for turn in _turns(obs):
        if turn.finished_at >= now - RECENT_S:
            recent_tokens[turn.executor_id] += len(turn.token_ids)
    for ex, role in executors.items():
        reqs = [r for r in obs.serving.requests if r["executor"] == ex and r["t"] >= now - RECENT_S]
        q = p99([r["ttft_ms"] for r in reqs if r["ok"]])
        met = [r["ok"] and r["ttft_ms"] <= SPEC.slo_ttft_ms and r["tpot_ms"] <= SPEC.slo_tpot_ms for r in reqs]
        slo = f"{sum(met) / len(met):.1%}" if met else "-"
        colour = "green" if q is not None and q <= SPEC.slo_ttft_ms else "red" if q is not None else "white"
        table.add_row(
            ex,
            role,
            f"[{colour}]{q:.0f} ms[/{colour}]" if q is not None else "-",
            slo,
            "[green]held[/green]" if held.get(ex) else "-",
            f"{recent_tokens.get(ex, 0) / RECENT_S:.0f}",
            f"v{obs.applied.get(ex, 0)}",
        )
    rewards = [s.reward_mean for s in obs.steps]
    last = obs.steps[-1] if obs.steps else None
    done = len(obs.published & set(obs.trajectories))
    failed = sum(1 for t in obs.trajectories.values() if t.status != "completed")
    lines = Table.grid(padding=(0, 2))
    lines.add_row(
        "serving SLO",
        f"TTFT ≤ {SPEC.slo_ttft_ms:.0f} ms, TPOT ≤ {SPEC.slo_tpot_ms:.0f} ms; attainment so far {obs.serving.attainment(SPEC) or 0:.2%} of "
        f"{len(obs.serving.requests)} requests",
    )
    lines.add_row(
        "training",
        f"step {last.step if last else 0}, policy v{last.version if last else 0}, reward {rewards[-1] if rewards else 0:.2f}  {spark(rewards)}",
    )
    lines.add_row("trajectories", f"{done}/{len(obs.published)} back, {failed} failed; weight versions {len(obs.manifests)}")
    return Group(table, lines)


# ---- the run --------------------------------------------------------------------------


def trainer_settings(seed: int, warm_start_steps: int | None = None) -> dict[str, str]:
    """The demo trainer's settings for one run: TRAINER, the task seed and, when given, a shorter or
    longer warm start (the suite runs the whole job with fewer SFT steps: learning is not what it checks)."""
    steps = {} if warm_start_steps is None else {"ROSE_SFT__STEPS": str(warm_start_steps)}
    return {**TRAINER, "ROSE_TASKS__SEED": str(seed), **steps}


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """One run of the demo's RL job (``run_job``): what `rose demo` takes, and what `rose bench e2e` and `rose bench trl`
    change.

    `env` adds settings per part ({"serving": ..., "scheduler": ..., "worker": ...}, see fleet.fleet_processes).
    `warm_start_steps` replaces the trainer's SFT steps (TRAINER's ROSE_SFT__STEPS) when given.
    `job` overrides TRAINER settings (`rose bench e2e` runs ROLLOUT_DOMINATED_JOB); `devices` pins
    executors to CPU sets (fleet.device_plan). Both are written in the summary's `job`.
    `until_steps` ends the window early once the trainer has taken that many GRPO steps (the
    run is then as long as the job needs, at most `duration_s`).
    `agent`: the tasks go to the rollout gateway, which runs this agent script for each (no rollout worker).
    `trl`: Hugging Face TRL's GRPOTrainer is the trainer (bench/trl_trainer.py), from the policy warm-started
    before the fleet starts (`warm_start_steps`, default the demo's; 0: the policy as it is).
    `lora`: the policy is a LoRA adapter of the serving model, the serving model warm-started when the models are
    built (`warm_start_steps`), and every executor co-batches its rollout rows into serving's batches.
    `models_dir`: models to reuse (default: built under the run's directory). `label` titles the live table.
    """

    duration_s: float = DEFAULT_DURATION_S
    seed: int = 0
    models_dir: Path | None = None
    serving: int = 2
    dedicated: int = 1
    warm_start_steps: int | None = None
    until_steps: int | None = None
    agent: Path | None = None
    trl: bool = False
    lora: bool = False
    label: str = "ROSE demo"
    env: dict[str, dict[str, str]] | None = None
    job: dict[str, str] | None = None
    devices: dict[str, frozenset[int]] | None = None

    def trainer(self) -> dict[str, str]:
        """The trainer's settings: TRAINER and the run's own; a LoRA job's adapter trains from the warm base, no warm
        start of its own, at the LoRA lr (LORA_TRAINER)."""
        return {
            **trainer_settings(self.seed, None if self.lora else self.warm_start_steps),
            **(LORA_TRAINER if self.lora else {}),
            **(self.job or {}),
            **({"ROSE_TASKS__AGENT": "true"} if self.agent else {}),
        }

    def part_env(self) -> dict[str, dict[str, str]]:
        """The settings each part adds (`env`). A LoRA job's serving executors co-batch its rollout rows into serving's
        batches; its dedicated executor, with no serving batches to ride in, runs the adapter folded into its own copy
        of the base (the two-model mode, the default: services/executor/weights.py MergedAdapterWeights)."""
        env = dict(self.env or {})
        if self.lora:
            env["serving"] = {**env.get("serving", {}), "ROSE_ENGINE__ROLLOUT_MODE": "co_batched"}
        return env


@dataclass
class JobFleet:
    """A run's fleet: the embedded nats-server, the observer's bus, the job's processes (started by ``run_window``) and
    each executor's role."""

    server: NatsServer
    bus: Bus
    procs: dict[str, ServiceProcess]
    models: Path
    logs: Path

    @property
    def executors(self) -> dict[str, str]:
        """Each executor's role: serving or dedicated."""
        return {
            name: ("serving" if "-serving-" in name else "dedicated")
            for name, proc in self.procs.items()
            if name.startswith(f"{SPEC.prefix}-") and proc.service == "executor"
        }

    async def close(self) -> None:
        await asyncio.to_thread(stop_all, list(self.procs.values()))
        await self.bus.close()
        self.server.stop()


@dataclass(frozen=True)
class Window:
    """The training window: when it began (wall clock) and ended, how long the trainer's warm start before it took, why
    the trainer ended it early ("": it did not), and each executor's CPU set at its end."""

    t0: float
    end: float
    warm_start_s: float
    trainer_exit: str
    devices_seen: dict[str, str]


async def run_job(
    out: Path,
    options: JobOptions,
    console: Console,
    *,
    drained: set[str] | None = None,
    on_bus: Callable[[Bus, Observed], Awaitable[None]] | None = None,
    obs: Observed | None = None,
) -> dict:
    """The demo's RL job (``options``) on a fresh fleet; returns the summary (also written under `out`).

    `rose bench e2e` runs it under other fleet policies (`JobOptions.env`): `drained` is the set of serving executors
    the load balancer sends no traffic to (the caller may change it during the run), `on_bus` adds subscriptions
    beside the observer's, `obs` receives what is observed.
    """
    obs = obs if obs is not None else Observed()
    fleet = await job_fleet(out, options, console, obs, on_bus)
    try:
        window = await run_window(fleet, options, console, obs, drained if drained is not None else set())
        await asyncio.sleep(1.0)  # the last events in flight
        params = dict(
            seed=options.seed,
            duration_s=options.duration_s,
            warm_start_s=window.warm_start_s,
            until_steps=options.until_steps,
            trainer_exit=window.trainer_exit,
            serving_executors=options.serving,
            dedicated_executors=options.dedicated,
            job=job_description(options.trainer(), options.job, window.devices_seen, pinned=bool(options.devices)),
            agent=str(options.agent) if options.agent else None,
            trainer="trl" if options.trl else "rose",
            policy=policy_description(fleet.models / "policy"),
        )
        return write_report(out, obs, fleet.executors, window.t0, window.end, params, console)
    finally:
        await fleet.close()


async def job_fleet(
    out: Path, options: JobOptions, console: Console, obs: Observed, on_bus: Callable[[Bus, Observed], Awaitable[None]] | None
) -> JobFleet:
    """Set up: the models (built once under `out`), auth on as in production (each process its own NKey, each executor
    one of its own instance), an embedded nats-server, the observer's subscriptions, the job's processes (not started)."""
    state = out / "state"
    shutil.rmtree(state, ignore_errors=True)
    (state / "logs").mkdir(parents=True)
    models = options.models_dir or out / ("models-lora" if options.lora else "models")
    job = {**TRAINER, **(options.job or {})}
    await build_models(models, console, lora=options.lora, trl=options.trl, job=job, warm_start_steps=options.warm_start_steps)
    creds = init_credentials(state / "security", instances={"executor": executor_instances(SPEC, options.serving, options.dedicated)})
    server = NatsServer(state / "nats", log_file=state / "logs" / "nats-server.log", extra_config=creds.server_config()).start()
    bus = Bus(
        BusConfig(url=server.url, initial_connect_deadline_s=20.0, nkey_seed_file=str(creds.seed_file(OPERATOR))),
        service="cli",
        instance=f"demo-{options.seed}",
    )
    await bus.connect()
    await provision(bus.js)
    await observe(bus, obs)
    if on_bus is not None:
        await on_bus(bus, obs)
    trainer = options.trainer()
    procs = job_processes(
        state,
        server.url,
        models,
        creds,
        SPEC,
        options.serving,
        options.dedicated,
        trainer,
        devices=options.devices,
        agent=options.agent,
        **{f"{part}_env": e for part, e in options.part_env().items()},
    )
    if options.trl:
        from .trl_trainer import trl_trainer  # the integration's process, only when asked for

        procs["trainer"] = trl_trainer(procs["trainer"], trainer, models / "policy")
    return JobFleet(server, bus, procs, models, state / "logs")


async def run_window(fleet: JobFleet, options: JobOptions, console: Console, obs: Observed, drained: set[str]) -> Window:
    """Run: start the fleet, wait out the trainer's warm start, then `duration_s` of serving trace and GRPO training (or
    until `until_steps`), stop the trainer and drain: every task handed out must come back as a trajectory."""
    procs, executors, duration, label = fleet.procs, fleet.executors, options.duration_s, options.label
    serving = [n for n, role in executors.items() if role == "serving"]
    console.print(f"starting {len(procs)} services on {fleet.server.url} (logs in {fleet.logs}) ...")
    started = time.monotonic()
    await start_all(fleet.bus, list(procs.values()), START_TIMEOUT_S)
    urls = {n: (await procs[n].wait_ready(fleet.bus, 10.0))["http"] for n in serving}
    console.print(f"fleet ready in {time.monotonic() - started:.0f} s")
    warm_start_s = await wait_for_warm_start(obs, procs["trainer"], console)
    console.print(f"the trainer's warm start took {warm_start_s:.0f} s; {duration:.0f} s of serving trace and GRPO follow")
    t0, t0_mono = time.time(), time.monotonic()
    trace = serving_trace(serving, duration, SPEC, options.seed, obs.serving, t0)
    driver = asyncio.ensure_future(drive_serving(trace, urls, drained, SPEC, obs.serving, t0_mono, options.seed))
    trainer_exit = ""  # why the trainer ended the job before the window did ("": it did not)
    with Live(live_view(obs, executors, 0, duration, "training", label), console=console, refresh_per_second=2, transient=False) as live:
        while time.monotonic() - t0_mono < duration and not (options.until_steps and len(obs.steps) >= options.until_steps):
            await asyncio.sleep(0.5)
            live.update(live_view(obs, executors, time.monotonic() - t0_mono, duration, "training", label))
            if not procs["trainer"].alive():  # the job ended (e.g. degenerate rewards): the window ends with it, reported
                trainer_exit = exit_reason(procs["trainer"].log_tail(4000))
                console.print(f"[yellow]the trainer ended the job after {time.monotonic() - t0_mono:.0f} s: {trainer_exit}[/yellow]")
                break
        # the CPU sets the executors' process trees really had (fleet.tree_cpus: the rollout forward child included)
        devices_seen = {n: cpu_list(tree_cpus(procs[n].pid)) for n in executors if procs[n].alive()}
        await asyncio.to_thread(procs["trainer"].stop)  # no new tasks; the ones handed out must still come back
        window_end = time.time()
        cut = next((i for i, (at, _) in enumerate(trace) if at > time.monotonic() - t0_mono), len(trace))
        del trace[cut:]  # ended early (until_steps): the driver iterates this list, sends what is due and returns
        obs.serving.bursts[:] = [b for b in obs.serving.bursts if b[0] <= window_end]  # only the bursts the window saw
        await driver
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while not obs.published <= set(obs.trajectories) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            live.update(live_view(obs, executors, time.monotonic() - t0_mono, duration, "draining", label))
    return Window(t0, window_end, warm_start_s, trainer_exit, devices_seen)


async def build_models(models: Path, console: Console, *, lora: bool, trl: bool, job: dict[str, str], warm_start_steps: int | None) -> None:
    """The job's models under ``models``, built once and reused after: the tokenizer, the serving model and the
    demo's tiny policy; with ``lora`` the serving model takes the demo policy's shape, is warm-started on expert traces
    (a production serving model is a trained model) and the policy is a LoRA adapter of it (``rose models init
    --preset demo --lora``). TRL's trainer has no warm start of its own: the reference trainer's, on the policy in place."""
    steps = int(TRAINER["ROSE_SFT__STEPS"]) if warm_start_steps is None else warm_start_steps
    if lora:
        if not is_adapter_dir(models / "policy"):
            console.print(f"building the models under {models} (tokenizer, a warm-started serving model, a LoRA adapter of it) ...")
            report = await asyncio.to_thread(build_lora_models, models, job, steps)
            console.print(f"serving model warm-started: {steps} steps, expert NLL/token {report.nll_before:.3f} -> {report.nll_after:.3f}")
        return
    if not (models / "policy" / "config.json").exists():
        console.print(f"building the models under {models} (tokenizer, serving model, tiny policy) ...")
        await asyncio.to_thread(init_models, models, 0, DEMO_POLICY)
    if trl and steps:
        from .trl_trainer import warm_start_policy  # the integration's process, only when asked for

        console.print(f"warm-starting the policy for TRL ({steps} supervised steps on expert traces) ...")
        await asyncio.to_thread(warm_start_policy, models / "policy", job, steps)


def build_lora_models(models: Path, job: dict[str, str], warm_start_steps: int):
    """`rose models init --preset demo --lora --warm-start-steps N` for the demo's job: its report (the warm start's NLL)."""
    import msgspec

    from rose.services.trainer.config import TrainerConfig
    from rose.services.trainer.main import tool_envs
    from rose.services.trainer.sft import warm_start_base
    from rose.shared.config import load_config

    paths = init_models(models, 0, preset="demo", lora=DEFAULT_LORA)
    config = load_config(TrainerConfig, env=job)
    return warm_start_base(paths, tool_envs(config.tasks), msgspec.structs.replace(config.sft, steps=warm_start_steps), DEFAULT_LORA)


def policy_description(policy_dir: Path) -> dict:
    """What the summary says of the policy: a model of its own, or a LoRA adapter (its shape) co-batched with serving on
    the serving executors and folded into its base on the dedicated one (``JobOptions.part_env``)."""
    if not is_adapter_dir(policy_dir):
        return {"kind": "model", "rollout_mode": "two_model", "dedicated_rollout_mode": "two_model"}
    shape = read_adapter(policy_dir).shape
    return {
        "kind": "lora",
        "rank": shape.rank,
        "alpha": shape.alpha,
        "targets": list(shape.targets),
        "rollout_mode": "co_batched",
        "dedicated_rollout_mode": "two_model",
    }


def exit_reason(log_tail: str) -> str:
    """Why a service ended, from its log's tail: its last ERROR line (else its last line)."""
    lines = [line for line in log_tail.strip().splitlines() if line.strip()]
    errors = [line for line in lines if " ERROR " in line or "Error" in line]
    return (errors or lines or ["(no log)"])[-1][-300:]


def job_description(trainer: dict[str, str], overrides: dict[str, str] | None, devices: dict[str, str], *, pinned: bool) -> dict:
    """What the summary says of the job: the trainer's settings, which of them differ from the demo's
    (TRAINER), what `rose bench e2e` changes (its job is rollout-dominated), and each executor's CPU set
    as observed at the end of the window (its process tree's affinity; pinned: one core per executor)."""
    return {
        "trainer": trainer,
        "differs_from_demo": dict(overrides or {}),
        "bench_e2e_differs_from_demo": ROLLOUT_DOMINATED_JOB,
        "bench_e2e_fleet": "executors pinned one core each (--pin auto); serving executors: the demo's 2, at most the cores left after the "
        "dedicated ones",
        "pinned": pinned,
        "devices": devices,
    }


def job_processes(
    state: Path,
    url: str,
    models: Path,
    creds,
    spec: FleetSpec,
    serving: int,
    dedicated: int,
    trainer: dict[str, str],
    *,
    devices: dict[str, frozenset[int]] | None = None,
    agent: Path | None = None,
    **fleet_env: dict[str, str],
) -> dict[str, ServiceProcess]:
    """The RL job's processes (not started): the fleet, the weight publisher and the trainer, each with
    its own credentials (an executor: its instance's, which `creds` must hold, see fleet.executor_instances)
    and this run's state dir (its weight-signing keys; never ./.rose).

    `trainer` is the trainer's settings (TRAINER plus the run's own); `fleet_env` goes to `fleet_processes`.
    `agent`: a rollout gateway running this agent script replaces the rollout worker.
    """
    logs = state / "logs"
    procs = fleet_processes(logs, url, models, spec, serving, dedicated, devices=devices, **fleet_env)
    base = {"NATS_URL": url, "ROSE_MODELS__DIR": str(models), "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5", "ROSE_RUNTIME__LOG_LEVEL": "INFO"}
    # The trainer and the publisher stand in for the training cluster: like the dedicated executor,
    # they run at a lower OS priority so that they do not take the serving executors' cores.
    procs["publisher"] = ServiceProcess("weight_publisher", f"{spec.prefix}-publisher", base, logs / "weight_publisher.log", nice=DEDICATED_NICE)
    trainer_env = {
        **base,
        "ROSE_RUN_ID": f"{spec.prefix}-{trainer.get('ROSE_TASKS__SEED', '0')}",
        "ROSE_PUBLISH__STAGING_DIR": str(state / "staging"),
        **trainer,
    }
    procs["trainer"] = ServiceProcess("trainer", f"{spec.prefix}-trainer", trainer_env, logs / "trainer.log", nice=DEDICATED_NICE)
    if agent is not None:
        del procs["worker"]
        gateway = {
            **base,
            "ROSE_AGENT__SCRIPT": str(agent),
            "ROSE_AGENT__LOGS_DIR": str(logs / "agents"),
            "ROSE_CONCURRENCY": str(spec.worker_concurrency),
            "ROSE_TURNS__MAX_TOKENS": str(spec.rollout_max_tokens),
            "ROSE_TURNS__GENERATE_TIMEOUT_S": "20",
        }
        procs["gateway"] = ServiceProcess("gateway", f"{spec.prefix}-gateway", gateway, logs / "gateway.log")
    assign_credentials(procs, creds)
    for proc in procs.values():
        proc.env["ROSE_STATE_DIR"] = str(state)
    return procs


# ---- the report -----------------------------------------------------------------------


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def reward_ends(rewards: list[float]) -> tuple[float | None, float | None]:
    """Mean reward of the first and the last 20 % of steps (at least one step each)."""
    if not rewards:
        return None, None
    k = max(1, round(0.2 * len(rewards)))
    return _mean(rewards[:k]), _mean(rewards[-k:])


def summarize(obs: Observed, executors: dict[str, str], t0: float, window_end: float, params: dict, spec: FleetSpec = SPEC) -> dict:
    turns = list(_turns(obs))
    window = max(1e-9, window_end - t0)
    tokens_in_window = sum(len(t.token_ids) for t in turns if t0 <= t.finished_at <= window_end)
    total = sum(len(t.token_ids) for t in turns)
    harvested = sum(len(t.token_ids) for t in turns if executors.get(t.executor_id) == "serving")
    rewards = [s.reward_mean for s in obs.steps]
    first, last = reward_ends(rewards)
    deltas = [m for v, m in sorted(obs.manifests.items()) if not m.keyframe]
    lost = sorted(obs.published - set(obs.trajectories))
    requests = obs.serving.requests
    return {
        **params,
        "serving": {
            "slo": {"ttft_ms": spec.slo_ttft_ms, "tpot_ms": spec.slo_tpot_ms},
            "requests": len(requests),
            "slo_attainment": obs.serving.attainment(spec),
            "failed": sum(not r["ok"] for r in requests),
            "ttft_misses": sum(r["ok"] and r["ttft_ms"] > spec.slo_ttft_ms for r in requests),
            "tpot_misses": sum(r["ok"] and r["tpot_ms"] > spec.slo_tpot_ms for r in requests),
            "ttft_p99_ms": p99([r["ttft_ms"] for r in requests if r["ok"]]),
            "tpot_p99_ms": p99([r["tpot_ms"] for r in requests if r["ok"]]),
            "bursts": len(obs.serving.bursts),
            "slo_alerts": sum(1 for a in obs.alerts if a[2] != "recovered"),
        },
        "rollout": {
            "tokens_per_s": tokens_in_window / window,
            "harvested_fraction": harvested / total if total else 0.0,
            "tokens": total,
            "tokens_by_executor": {ex: sum(len(t.token_ids) for t in turns if t.executor_id == ex) for ex in sorted({t.executor_id for t in turns})},
            "leases_granted": sum(1 for e in obs.lease_events if e[2] == "granted"),
            "leases_revoked": sum(1 for e in obs.lease_events if e[2] == "revoked"),
        },
        "weights": {
            "versions": len(obs.manifests),
            "wire_ratio": (sum(m.wire_bytes for m in deltas) / sum(m.full_bytes for m in deltas)) if deltas else None,
            "bytes_by_version": {
                str(v): {"wire": m.wire_bytes, "full": m.full_bytes, "keyframe": m.keyframe} for v, m in sorted(obs.manifests.items())
            },
            "applied": dict(obs.applied),
        },
        "training": {
            "steps": len(obs.steps),
            "reward_first": first,
            "reward_last": last,
            "reward_margin": (last - first) if first is not None and last is not None else None,
            "rewards": [round(r, 4) for r in rewards],
            "stale_dropped": obs.steps[-1].stale_dropped if obs.steps else 0,
        },
        "trajectories": {
            "published": len(obs.published),
            "returned": len(obs.published & set(obs.trajectories)),
            "failed": sum(1 for t in obs.trajectories.values() if t.status != "completed"),
            "lost": len(lost),
            "lost_ids": lost[:20],
        },
    }


async def wait_for_warm_start(obs: Observed, trainer: ServiceProcess, console: Console) -> float:
    """Seconds until the trainer hands out its first tasks (its warm start is done), so that the window
    measures GRPO on co-elastic capacity, not this machine's speed at supervised warm-up."""
    started = time.monotonic()
    with console.status("the trainer warm-starts (supervised steps on expert traces) ..."):
        while not obs.published:
            if not trainer.alive():
                raise RuntimeError(f"the trainer exited during its warm start:\n{trainer.log_tail()}")
            if time.monotonic() - started > WARM_START_TIMEOUT_S:
                raise RuntimeError(f"no task from the trainer within {WARM_START_TIMEOUT_S:.0f} s of its start:\n{trainer.log_tail()}")
            await asyncio.sleep(0.25)
    return time.monotonic() - started


def write_report(out: Path, obs: Observed, executors: dict[str, str], t0: float, window_end: float, params: dict, console: Console) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(obs, executors, t0, window_end, params)
    summary["plots"] = plot_all(out, obs, executors, t0, window_end)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    write_samples(out / "samples.jsonl", obs)
    table = Table(title="rose demo: summary")
    table.add_column("figure")
    table.add_column("value", justify="right")
    s = summary
    for name, value in (
        ("serving.slo_attainment", s["serving"]["slo_attainment"]),
        ("serving.requests", s["serving"]["requests"]),
        ("rollout.tokens_per_s", s["rollout"]["tokens_per_s"]),
        ("rollout.harvested_fraction", s["rollout"]["harvested_fraction"]),
        ("weights.versions", s["weights"]["versions"]),
        ("weights.wire_ratio", s["weights"]["wire_ratio"]),
        ("training.steps", s["training"]["steps"]),
        ("training.reward_first", s["training"]["reward_first"]),
        ("training.reward_last", s["training"]["reward_last"]),
        ("trajectories.lost", s["trajectories"]["lost"]),
    ):
        table.add_row(name, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    console.print(f"report: {out / 'summary.json'} and {len(summary['plots'])} plots in {out}")
    return summary


def write_samples(path: Path, obs: Observed, n: int = 10) -> None:
    """The first and last `n` trajectories, readable: what the policy wrote, where, on which version."""
    done = sorted((t for t in obs.trajectories.values() if t.status == "completed"), key=lambda t: t.finished_at)
    with path.open("w") as f:
        for t in done[:n] + done[-n:]:
            turns = [
                {"text": u.text, "observation": u.observation, "finish": u.finish_reason, "version": u.policy_version, "executor": u.executor_id}
                for u in t.turns
            ]
            f.write(json.dumps({"task_id": t.task_id, "reward": t.reward, "turns": turns}) + "\n")


def plot_all(out: Path, obs: Observed, executors: dict[str, str], t0: float, end: float) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(name)

    serving = [ex for ex, role in executors.items() if role == "serving"]
    fig, axes = plt.subplots(len(serving), 1, figsize=(11, 3 * len(serving)), sharex=True, squeeze=False)
    for ax, ex in zip(axes[:, 0], serving):
        reqs = [r for r in obs.serving.requests if r["executor"] == ex]
        ax.scatter(
            [r["t"] - t0 for r in reqs],
            [min(max(r["ttft_ms"], 1.0), 5 * SPEC.slo_ttft_ms) for r in reqs],
            s=4,
            label="TTFT per request (failed at top)",
        )
        ax.axhline(SPEC.slo_ttft_ms, color="red", ls="--", lw=1, label="TTFT SLO")
        for a, b, e in obs.serving.bursts:
            if e == ex:
                ax.axvspan(a - t0, b - t0, color="tab:orange", alpha=0.2)
        ax.set_yscale("log")
        ax.set_ylabel(f"{ex}\nTTFT ms")
    axes[0, 0].legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds (orange: serving bursts)")
    fig.suptitle("serving latency vs SLO")
    save(fig, "latency_vs_slo.png")

    fig, ax = plt.subplots(figsize=(11, 1 + 0.6 * len(executors)))
    names = list(executors)
    open_: dict[str, float] = {}
    for at, ex, kind in sorted(obs.lease_events):
        if ex not in names:
            continue
        if kind == "granted":
            open_[ex] = at
        elif kind in ("revoked", "expired") and ex in open_:
            start = open_.pop(ex)
            ax.barh(names.index(ex), at - start, left=start - t0, color="tab:green" if executors[ex] == "serving" else "tab:blue")
    for ex, start in open_.items():
        ax.barh(names.index(ex), end - start, left=start - t0, color="tab:green" if executors[ex] == "serving" else "tab:blue")
    for t, ex, sev in obs.alerts:
        if ex in names and sev != "recovered":
            ax.plot([t - t0], [names.index(ex)], "r|", ms=14)
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("seconds (bars: rollout lease held; red ticks: SLO alerts)")
    ax.set_title("lease timeline")
    save(fig, "lease_timeline.png")

    fig, ax = plt.subplots(figsize=(11, 3.5))
    width = 5.0
    bins = max(1, int((end - t0) / width) + 1)
    for ex in names:
        counts = [0] * bins
        for turn in _turns(obs):
            if turn.executor_id == ex and t0 <= turn.finished_at < t0 + bins * width:
                counts[int((turn.finished_at - t0) / width)] += len(turn.token_ids)
        ax.plot([i * width for i in range(bins)], [c / width for c in counts], label=ex)
    ax.set_xlabel("seconds")
    ax.set_ylabel("rollout tokens/s")
    ax.legend(fontsize=7)
    ax.set_title("rollout throughput by executor")
    save(fig, "rollout_throughput.png")

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot([s.step for s in obs.steps], [s.reward_mean for s in obs.steps], marker=".")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward of the step's groups")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("reward curve")
    save(fig, "reward_curve.png")

    fig, ax = plt.subplots(figsize=(8, 3.5))
    versions = sorted(obs.manifests)
    ax.bar(
        versions,
        [obs.manifests[v].wire_bytes / 1e6 for v in versions],
        color=["tab:red" if obs.manifests[v].keyframe else "tab:blue" for v in versions],
    )
    ax.set_xlabel("policy version (red: keyframe, blue: delta)")
    ax.set_ylabel("MB on the wire")
    ax.set_title("bytes per weight version")
    save(fig, "weight_bytes.png")
    return written


def run_demo(options: JobOptions, out: str = DEFAULT_OUT, console: Console | None = None) -> dict:
    """`rose demo`: the job in `out` (its paths resolved), its live table titled with what differs from the demo."""
    console = console or Console()
    what = f" · agent {options.agent.name}" if options.agent else " · TRL's GRPOTrainer" if options.trl else ""
    what += " · LoRA policy, co-batched" if options.lora else ""
    resolved = replace(
        options,
        models_dir=options.models_dir.resolve() if options.models_dir else None,
        agent=options.agent.resolve() if options.agent else None,
        label=f"ROSE demo{what}",
    )
    return asyncio.run(run_job(Path(out).resolve(), resolved, console))
