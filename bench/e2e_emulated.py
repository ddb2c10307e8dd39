"""`rose bench e2e --emulate 16xH100 --model 7B`: the policies through the real services on emulated GPUs,
with the simulator on the same configuration beside them.

Each policy runs the emulated fleet (bench/emulated.py) for the same emulated window and seed: serving
traffic from the first second, the trainer from ``warmup_s`` on, until ``duration`` emulated seconds
(or ``until_steps`` steps). The policies differ only as in `rose bench e2e` (bench/e2e.py POLICY_ENV).
They run side by side (``side_by_side``, the default), each with its own nats-server and fleet: an
emulated device computes nothing, so a 4-GPU fleet leaves most of this box idle, and the fidelity
figures below say whether the two together still kept up. After the window the trainer stops and the
run drains only until every task handed out is back or still in the task queue (late, not lost).
Then the simulator runs every policy on the same configuration for as many steps (and at several seeds,
for the spread a few steps' rate has), and the JSON holds both:

- per policy, what `rose bench e2e` reports (RL steps per hour, rollout time per step, serving SLO
  attainment, tokens on leases, trajectories lost, ...), all in emulated time;
- ``emulation``: device, models, time scale, executors per process;
- ``sim``: the simulator's figures per policy; ``sim_vs_real``: their ratios (real / sim);
- ``fidelity`` per policy: ``forward_lag_p99`` (how late emulated forwards ended, in percent of their
  planned time), the box's CPU utilization over the window, and ``starved``: whether the host kept up
  (lag p99 <= 5 % and CPU <= 70 %), and by how much it did not; the CPU is the whole box's (other
  policies' fleets and anything else running included), ``fleet_cpu_cores`` this policy's own processes;
- ``wall_phases_s`` per policy: where the wall time went (start, warm-up, trainer start, window, drain, stop);
- ``sim_vs_real.*.how``: how each side got there (the tail, tokens on leases, prefix hits, hedges, turn times,
  the dedicated executor's tokens/s), real beside simulated, printed as a second table.

Under each policy's report folder, in emulated time, for reading a run after it: ``trajectories.jsonl`` (every
trajectory observed, its turns with where they ran and what they found cached), ``placements.jsonl`` (every
placement decision with its predicted seconds) and ``snapshots.jsonl`` (every executor metrics snapshot).

A live table shows each run as it goes; a PNG plots rollout tokens per second by executor role over time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from rose.contracts.executor import LatencySketch
from rose.contracts.registry import LEASE_EVENT, PLACEMENT
from rose.contracts.rollout import PlacementEvent
from rose.services.scheduler.placement import rule_key
from rose.shared.bus import Bus
from rose.shared.config import BusConfig
from rose.shared.launch import ServiceProcess, start_all, stop_all
from rose.shared.models import load_tokenizer
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.shared.security import OPERATOR, Credentials, init_credentials
from rose.shared.sketch import from_contract, new_sketch
from rose.shared.task_queue import still_queued
from rose.sim.engine import simulate

from .demo import Observed, observe, summarize, trajectories_delivered
from .e2e import DRAINS_LENT, POLICIES, POLICY_ENV, Extra, _fmt, _ratio, policy_figures, run_ratios
from .emulated import (
    DEDICATED_PREFIX,
    SERVING_PREFIX,
    EmulatedJob,
    build_models,
    drive_serving,
    fleet_processes,
    rescale,
    serving_requests,
    trainer_process,
)
from .fleet import FleetSpec

START_TIMEOUT_S = 300.0  # wall: twenty executors load their models in one process
LAG_P99_TARGET = 5.0  # percent of a forward: the emulation kept up (issue 44's fidelity bar)
CPU_TARGET = 0.70  # the box's CPU over the window: headroom left for the host's own jitter
SIM_SEEDS = 8  # the simulator's steps per hour at this many seeds from the job's: the spread a few steps' rate has
SIM_FIGURES = ("rl_steps_per_hour", "rollout_s_per_step", "serving_slo_attainment", "rollout_tokens_on_serving_fraction", "staleness_mean")
# how each side got there, real beside simulated (the real run's name, the simulator's): where they part, one of them is wrong
HOW_FIGURES = (
    ("tail_s_per_step", "tail_s_per_step"),
    ("harvested_fraction", "rollout_tokens_on_serving_fraction"),
    ("prefix_hit_rate", "prefix_hit_rate"),
    ("prefix_reuse", "prefix_reuse"),
    ("hedged_turns", "hedges"),
    ("hedge_wins", "hedge_wins"),
    ("turn_s_p50", "turn_s_p50"),
    ("dedicated_rollout_tokens_per_s", "dedicated_rollout_tokens_per_s"),
)


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole box since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields)


def lag_p99(snapshots: list[dict], start: float, end: float) -> float | None:
    """p99 lateness of the emulated forwards between ``start`` and ``end`` (executors' own clocks), percent."""
    merged = new_sketch()
    for s in snapshots:
        lag = s.get("forward_lag")
        if isinstance(lag, LatencySketch) and lag.count and start <= s["at"] <= end:
            merged.merge(from_contract(lag))
    p99 = merged.get_quantile_value(0.99) if merged.count else None
    return None if p99 is None else float(p99)


def fidelity(snapshots: list[dict], start: float, end: float, cpu: float) -> dict:
    lag = lag_p99(snapshots, start, end)
    short = [f"forward lag p99 {lag:.1f} % > {LAG_P99_TARGET:g} %"] if lag is not None and lag > LAG_P99_TARGET else []
    short += [f"CPU {cpu:.0%} > {CPU_TARGET:.0%}"] if cpu > CPU_TARGET else []
    return {"forward_lag_p99_percent": lag, "cpu_utilization": cpu, "starved": bool(short), "starved_by": "; ".join(short)}


def rescale_snapshots(snapshots: list[dict], t0: float, scale: float) -> list[dict]:
    """Executor metrics in emulated time: instants and intervals over ``scale``, rates and TPOT accordingly."""
    return [
        {
            **s,
            "at": t0 + (s["at"] - t0) / scale,
            "interval_s": s["interval_s"] / scale,
            "tpot_ms": s["tpot_ms"] / scale if s["tpot_ms"] is not None else None,
            "rollout_tokens_per_s": s["rollout_tokens_per_s"] * scale,
        }
        for s in snapshots
    ]


def placement_rules(placements: list[PlacementEvent]) -> dict[str, int]:
    """Placements by the executor's role and the rule that made them ("serving: leased"), as the simulator counts
    them (sim/routing.py ``Router.rules``), most first."""
    return dict(Counter(rule_key("serving" if SERVING_PREFIX in e.executor_id else "dedicated", e.rule) for e in placements).most_common())


def rule_shares(counts: dict[str, int] | None) -> dict[str, float]:
    """Each rule's share of the placements: the real run and the simulator place different numbers of turns."""
    total = sum((counts or {}).values())
    return {rule: n / total for rule, n in (counts or {}).items()} if total else {}


def rescale_placements(placements: list[PlacementEvent], t0: float, scale: float) -> list[PlacementEvent]:
    """Placement decisions in emulated time: the instant and the predicted seconds over ``scale``."""
    return [msgspec.structs.replace(e, at=t0 + (e.at - t0) / scale, predicted_s=e.predicted_s / scale, model_s=e.model_s / scale) for e in placements]


def live_view(policy: str, job: EmulatedJob, obs: Observed, elapsed_wall: float, phase: str, cpu: float | None) -> Group:
    k = job.time_scale
    now = time.time()
    recent = [u for t in list(obs.trajectories.values()) for u in t.turns if u.finished_at >= now - 10.0 * k]
    by_role = {"serving": 0, "dedicated": 0}
    for u in recent:
        by_role["serving" if SERVING_PREFIX in u.executor_id else "dedicated"] += len(u.token_ids)
    held = {}
    for _, ex, kind in sorted(obs.lease_events):
        held[ex] = kind in ("granted", "renewed")
    table = Table(title=f"rose bench e2e --emulate · {policy} · {phase} · {elapsed_wall / k:.0f} emulated s (x{k:g} slower than real time)")
    for col in ("RL steps", "reward", "rollout tok/s serving | dedicated", "serving leases held", "SLO attainment", "trajectories back", "CPU"):
        table.add_column(col, justify="right")
    att = obs.serving.attainment(FleetSpec(slo_ttft_ms=job.slo_ttft_ms * k, slo_tpot_ms=job.slo_tpot_ms * k))
    table.add_row(
        str(len(obs.steps)),
        _fmt(obs.steps[-1].reward_mean if obs.steps else None),
        f"{by_role['serving'] / 10:.0f} | {by_role['dedicated'] / 10:.0f}",
        str(sum(1 for ex, h in held.items() if h and SERVING_PREFIX in ex)),
        _fmt(att, ".3f"),
        f"{len(obs.published & set(obs.trajectories))}/{len(obs.published)}",
        "-" if cpu is None else f"{cpu:.0%}",
    )
    return Group(table)


class Board:
    """The live view of every policy running at once: one table each, in one rich ``Live``."""

    def __init__(self, live: Live | None = None) -> None:
        self.live = live
        self.views: dict[str, Group] = {}

    def update(self, policy: str, view: Group) -> None:
        self.views[policy] = view
        if self.live is not None:
            self.live.update(Group(*self.views.values()))


def process_cpu_s(pids: list[int]) -> float:
    """CPU seconds the processes ``pids`` (and their children they waited for) have used so far (/proc/PID/stat)."""
    tick = float(os.sysconf("SC_CLK_TCK"))
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        total += sum(float(x) for x in fields[11:15]) / tick  # utime, stime, cutime, cstime
    return total


async def drain(bus: Bus, obs: Observed, deadline_s: float, on_tick) -> tuple[set[str], float]:
    """After the trainer stopped: until every task handed out is back or still in the task queue (late, not lost;
    shared/task_queue.py), at most ``deadline_s`` wall seconds. A task neither back nor queued keeps it waiting
    (its trajectory may be on the wire, or it is lost). Returns (the late tasks, wall seconds it took)."""
    started = time.monotonic()
    late: set[str] = set()
    while True:
        missing = obs.published - set(obs.trajectories)
        if not missing:
            return set(), time.monotonic() - started
        late = await still_queued(bus, missing)
        if not (missing - late - set(obs.trajectories)) or time.monotonic() - started >= deadline_s:
            return late, time.monotonic() - started
        await asyncio.sleep(1.0)
        on_tick()


@dataclass
class RunRecorders:
    """What a policy's run records off its bus as it goes: the fleet's events (``obs``), the monitor's snapshots and
    the lent capacity (``extra``), why each lease ended, and every placement decision."""

    obs: Observed
    extra: Extra
    lease_reasons: Counter[str] = field(default_factory=Counter)  # "revoked: <reason>" (SLO guard, alert, ...) or "expired"
    placements: list[PlacementEvent] = field(default_factory=list)


async def record_run(bus: Bus, policy: str) -> RunRecorders:
    rec = RunRecorders(Observed(), Extra(policy in DRAINS_LENT))
    await observe(bus, rec.obs)
    await rec.extra.subscribe(bus, rec.obs)

    async def on_lease(e, _d) -> None:
        if e.kind in ("revoked", "expired"):
            rec.lease_reasons[f"{e.kind}: {re.sub(r'[0-9.]+', 'N', e.reason or e.lease.reason or '-')}"] += 1

    async def on_placement(e: PlacementEvent, _d) -> None:
        rec.placements.append(e)

    await bus.subscribe(LEASE_EVENT, on_lease)
    await bus.subscribe(PLACEMENT, on_placement)
    return rec


async def start_bus(state: Path, executors: list[str]) -> tuple[Credentials, NatsServer, Bus]:
    """A policy's own nats-server with auth on (credentials for the fleet's executors) and the run's connection to it,
    the streams provisioned."""
    (state / "logs").mkdir(parents=True, exist_ok=True)
    creds = init_credentials(state / "security", instances={"executor": executors})
    server = NatsServer(state / "nats", log_file=state / "logs" / "nats-server.log", extra_config=creds.server_config()).start()
    bus = Bus(
        BusConfig(url=server.url, initial_connect_deadline_s=20.0, nkey_seed_file=str(creds.seed_file(OPERATOR))), service="cli", instance="emu"
    )
    await bus.connect()
    await provision(bus.js)
    return creds, server, bus


@dataclass(frozen=True)
class RunWindow:
    """A run's measured window: its wall start (``t0``, epoch s), time scale ``k`` (wall s per emulated s), when the
    trainer started (wall s after ``t0``) and the window ended (epoch s), the box's and the fleet's CPU use over it."""

    t0: float
    k: float
    trained_from: float
    end_wall: float
    cpu: float
    fleet_cpu: float

    @property
    def end(self) -> float:
        """The window's end in emulated time (epoch s)."""
        return self.t0 + (self.end_wall - self.t0) / self.k


def run_figures(
    job: EmulatedJob,
    duration_s: float,
    out: Path,
    rec: RunRecorders,
    window: RunWindow,
    executors: dict[str, str],
    trainer: ServiceProcess,
    late: set[str],
    ended_early: bool,
) -> dict:
    """A policy's figures in emulated time, its fidelity, and its records written under ``out`` for reading later.
    Lost and late come from one view of what is missing: a task still queued when the queue was read may have
    delivered its trajectory since (subtracting one count from the other once read -1 lost)."""
    t0, k, end = window.t0, window.k, window.end
    eobs = rescale(rec.obs, t0, k)
    rec.extra.snapshots = rescale_snapshots(rec.extra.snapshots, t0, k)
    params = {
        "seed": job.seed,
        "duration_s": duration_s,
        "job": {"trainer": {key: value for key, value in trainer.env.items() if key.startswith(("ROSE_GRPO", "ROSE_TASKS", "ROSE_EMULATION"))}},
        "trainer_ended_early": ended_early,
    }
    summary = summarize(eobs, executors, t0 + job.warmup_s, end, params, FleetSpec(slo_ttft_ms=job.slo_ttft_ms, slo_tpot_ms=job.slo_tpot_ms))
    figures = policy_figures(summary, eobs, rec.extra)
    figures["fidelity"] = fidelity(rec.extra.snapshots, t0, end, window.cpu)
    figures["fidelity"]["fleet_cpu_cores"] = window.fleet_cpu  # this policy's processes and nats-server over its window, in cores
    missing = eobs.published - set(eobs.trajectories)
    late = late & missing
    figures["trajectories_late"] = len(late)  # still in the task queue after the drain (a worker holds it, or it waits)
    figures["trajectories_lost"] = len(missing - late)
    figures["trainer_ended_early"] = ended_early
    if ended_early:
        figures["trainer_log_tail"] = trainer.log_tail(1500)
    figures["report"] = str(out)
    # every trajectory observed, in emulated time, for reading a run after it (which turn ran where, what it cached)
    (out / "trajectories.jsonl").write_bytes(b"".join(msgspec.json.encode(t) + b"\n" for t in eobs.trajectories.values()))
    (out / "snapshots.jsonl").write_bytes(b"".join(msgspec.json.encode(x) + b"\n" for x in rec.extra.snapshots))
    (out / "placements.jsonl").write_bytes(b"".join(msgspec.json.encode(e) + b"\n" for e in rescale_placements(rec.placements, t0, k)))
    figures["placement_rules"] = placement_rules(rec.placements)
    figures["tokens_by_role_over_time"] = tokens_by_role(eobs, t0, end)
    figures["lease_end_reasons"] = dict(rec.lease_reasons.most_common())
    # every TrainingStep (emulated seconds from the trainer's start): what a step trained on and when it was reported
    figures["step_events"] = [
        {
            "step": e.step,
            "at_s": round(e.at - (t0 + window.trained_from / k), 2),
            "trajectories": e.trajectories,
            "trained_sequences": e.trained_sequences,
            "train_s": round(e.train_s, 3),
            "publish_s": round(e.publish_s, 3),
        }
        for e in eobs.steps
    ]
    return figures


async def run_policy(
    job: EmulatedJob,
    policy: str,
    root: Path,
    models: Path,
    duration_s: float,
    console: Console,
    until_steps: int | None,
    drain_s: float,
    board: Board | None = None,
) -> dict:
    """One policy's run; its figures (emulated time), fidelity and where its logs are. After the window the trainer
    stops and the run waits, at most ``drain_s`` (wall), until every trajectory handed out is back or still in the
    task queue (late); one that is neither is lost."""
    k = job.time_scale
    board = board or Board()
    state = root / policy / "state"
    logs = state / "logs"  # start_bus makes it
    sim = job.sizing()
    serving = [f"{SERVING_PREFIX}-{i}" for i in range(sim.sized.shape.n_serv)]
    dedicated = [f"{DEDICATED_PREFIX}-{i}" for i in range(sim.sized.shape.n_ded)]
    creds, server, bus = await start_bus(state, serving + dedicated)
    rec = await record_run(bus, policy)
    obs, extra = rec.obs, rec.extra
    procs = fleet_processes(logs, server.url, models, creds, job, POLICY_ENV[policy], job.in_flight())
    trainer = trainer_process(logs, server.url, models, creds, job, state)
    # the trainer starts with the fleet (its interpreter and imports take tens of seconds on a busy box) and waits for its
    # policy's files (shared/models.py wait_for_files), which appear here at the warm-up's end: then it loads and hands out
    gate = state / "trainer-policy"
    gate.unlink(missing_ok=True)  # a rerun into the same folder
    trainer.env["ROSE_MODELS__POLICY_DIR"] = str(gate)
    everything = [*procs.values(), trainer]
    tokenizer = load_tokenizer(models / "serving")
    phases: dict[str, float] = {}  # wall seconds of each part of the run: where the time goes
    began = time.monotonic()

    def mark(phase: str, since: float) -> float:
        now = time.monotonic()
        phases[phase] = round(now - since, 1)
        return now

    try:
        console.print(f"{policy}: starting {len(serving)} serving and {len(dedicated)} dedicated emulated executors and the services ...")
        started = time.monotonic()
        trainer.start()
        await start_all(bus, list(procs.values()), START_TIMEOUT_S)
        endpoints = await procs[SERVING_PREFIX].wait_members_ready(bus, 10.0)
        urls = {name: e["http"] for name, e in endpoints.items()}
        console.print(f"{policy}: fleet ready in {time.monotonic() - started:.0f} s")
        mark("start", began)
        requests = serving_requests(job, job.warmup_s + duration_s + 600.0)
        t0, t0_mono = time.time(), time.monotonic()
        cpu0 = cpu_times()
        driver = asyncio.ensure_future(drive_serving(requests, urls, extra.drained, obs.serving, t0_mono, k, tokenizer, job.seed))
        cpu_now: float | None = None
        last_cpu = cpu0
        phase_now = "warm-up"

        def show() -> None:
            board.update(policy, live_view(policy, job, obs, time.monotonic() - t0_mono, phase_now, cpu_now))

        async def wait_until(wall_s: float, stop_at_steps: int | None = None) -> None:
            nonlocal cpu_now, last_cpu
            while time.monotonic() - t0_mono < wall_s and not (stop_at_steps and len(obs.steps) >= stop_at_steps):
                await asyncio.sleep(1.0)
                busy, total = cpu_times()
                cpu_now = (busy - last_cpu[0]) / max(1.0, total - last_cpu[1])
                last_cpu = (busy, total)
                show()
                if trainer.process is not None and not trainer.alive():
                    return

        show()
        await wait_until(job.warmup_s * k)
        at = mark("warmup", t0_mono)
        gate.symlink_to(models / "policy", target_is_directory=True)
        await trainer.wait_ready(bus, START_TIMEOUT_S)
        at = mark("trainer_start", at)
        phase_now = "training"
        pids = [p.pid for p in everything if p.process is not None] + ([server.process.pid] if server.process is not None else [])
        fleet_cpu0, window_mono = process_cpu_s(pids), time.monotonic()
        trained_from = time.monotonic() - t0_mono  # the window runs from the trainer's start, whatever it took to start
        await wait_until(trained_from + duration_s * k, until_steps)
        window_end = time.time()
        fleet_cpu = (process_cpu_s(pids) - fleet_cpu0) / max(1e-9, time.monotonic() - window_mono)
        at = mark("window", at)
        busy, total = cpu_times()
        cpu = (busy - cpu0[0]) / max(1.0, total - cpu0[1])
        ended_early = not trainer.alive()
        phase_now = "draining"
        del requests[next((i for i, r in enumerate(requests) if r.at_s * k > time.monotonic() - t0_mono), len(requests)) :]

        async def stop_trainer_and_drain() -> None:
            at = time.monotonic()
            await asyncio.to_thread(trainer.stop)  # no new tasks; those handed out must come back or still be queued
            at = mark("trainer_stop", at)
            await drain(bus, obs, drain_s, show)
            mark("task_drain", at)

        async def serving_finishes() -> None:
            await driver  # the serving requests sent in the window finish
            mark("serving_drain", drain_from)

        drain_from = time.monotonic()
        await asyncio.gather(stop_trainer_and_drain(), serving_finishes())
        await asyncio.sleep(2.0)  # the last events in flight
        late = await still_queued(bus, obs.published - set(obs.trajectories))  # not back but still queued: late, not lost
        await trajectories_delivered(bus)  # the trajectories of the tasks the queue let go: in obs, or lost
        mark("drain", at)
        window = RunWindow(t0=t0, k=k, trained_from=trained_from, end_wall=window_end, cpu=cpu, fleet_cpu=fleet_cpu)
        executors = {name: "serving" for name in serving} | {name: "dedicated" for name in dedicated}
        figures = run_figures(job, duration_s, root / policy, rec, window, executors, trainer, late, ended_early)
        figures["wall_phases_s"] = phases
        return figures
    finally:
        stopping = time.monotonic()
        await asyncio.to_thread(stop_all, everything)
        await bus.close()
        server.stop()
        phases["stop"] = round(time.monotonic() - stopping, 1)


async def run_side_by_side(
    job: EmulatedJob, policies: list[str], root: Path, models: Path, duration_s: float, console: Console, until_steps: int | None, drain_s: float
) -> dict[str, dict]:
    """Every policy's run at once (one is one at a time), each its own NATS and fleet on the same seed and trace,
    under one live view; ``wall_s`` per policy from the start of all."""
    started = time.monotonic()
    with Live(Group(), console=console, refresh_per_second=1, transient=False) as live:
        board = Board(live)

        async def one(policy: str) -> dict:
            figures = await run_policy(job, policy, root, models, duration_s, console, until_steps, drain_s, board)
            figures["wall_s"] = time.monotonic() - started
            return figures

        results = await asyncio.gather(*(one(p) for p in policies))
    return dict(zip(policies, results))


def tokens_by_role(obs: Observed, t0: float, end: float, width: float = 5.0) -> dict:
    """Rollout tokens per second by executor role, in ``width``-second bins of emulated time (the PNG's data)."""
    bins = max(1, int((end - t0) / width) + 1)
    series: dict[str, list[float]] = {"serving": [0.0] * bins, "dedicated": [0.0] * bins}
    for t in obs.trajectories.values():
        for u in t.turns:
            i = int((u.finished_at - t0) / width)
            if 0 <= i < bins:
                series["serving" if SERVING_PREFIX in u.executor_id else "dedicated"][i] += len(u.token_ids) / width
    return {"bin_s": width, **series}


def sim_figures(job: EmulatedJob, policy: str, steps: int, seeds: int = SIM_SEEDS) -> dict:
    """The simulator on this configuration for as many steps as the real run took (a rate needs two), at the
    job's seed, and the spread of its steps per hour over ``seeds`` seeds from it: a rate from a few steps of a
    long-tailed workload varies by seed, and the real run's batches are another draw of the same workload."""
    cfg = job.sim_config(policy, steps=max(2, steps))
    r = simulate(cfg)
    keys = SIM_FIGURES + tuple(sim for _, sim in HOW_FIGURES) + ("placement_rules",)
    out = {key: r.get(key) for key in keys} | {"steps": r.get("steps"), "simulated_s": r.get("simulated_s")}
    rates = [r["rl_steps_per_hour"]] + [simulate(dataclasses.replace(cfg, seed=job.seed + i))["rl_steps_per_hour"] for i in range(1, seeds)]
    seeds_used = [job.seed + i for i in range(seeds)]
    out["rl_steps_per_hour_by_seed"] = {"seeds": seeds_used, "mean": float(np.mean(rates)), "min": min(rates), "max": max(rates)}
    return out


def run_emulated_e2e(
    *,
    out_json: str,
    job: EmulatedJob,
    policies: list[str] | None = None,
    duration_s: float = 120.0,
    until_steps: int | None = None,
    model_dir: str | None = None,
    console: Console | None = None,
    drain_s: float | None = None,
    side_by_side: bool = True,
) -> dict:
    console = console or Console()
    drain = drain_s if drain_s is not None else max(60.0, 30.0 * job.time_scale)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a timeout stops the fleet, not orphans it
    chosen = [p for p in POLICIES if p in (policies or ("static", "rose"))]
    unknown = sorted(set(policies or ()) - set(POLICIES))
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    path = Path(out_json).resolve()
    root = path.parent / f"{path.stem}-runs"
    models = Path(model_dir).resolve() if model_dir else root / ("models-lora" if job.rollout_mode == "co_batched" else "models")
    console.print(f"the local models (tokenizer, stand-in weights) under {models} ...")
    build_models(job, models)
    sim = job.sizing()
    result: dict = {
        "emulation": {
            "device": job.device,
            "model": job.model,
            "policy_model": job.policy,
            "rollout_mode": job.rollout_mode,
            "gpus": job.gpus,
            "dedicated_gpus": job.dedicated_gpus,
            "serving_instances": sim.sized.shape.n_serv,
            "serving_tp": sim.sized.shape.tp_s,
            "dedicated_instances": sim.sized.shape.n_ded,
            "dedicated_tp": sim.sized.shape.tp_r,
            "time_scale": job.time_scale,
            "executors_per_process": {"serving": sim.sized.shape.n_serv, "dedicated": sim.sized.shape.n_ded},
            "cpus": len(os.sched_getaffinity(0)),
        },
        "job": {
            "mode": job.mode,
            "demand": job.demand,
            "dedicated_ratio": job.dedicated_ratio,
            "load": job.load,
            "seed": job.seed,
            "trajectories_per_step": job.trajectories_per_step(),
            "trajectories_in_flight": job.in_flight(),
            "rollout_max_batch": job.rollout_max_batch,
            "over_provision": job.over_provision,
            "extra_groups": job.extra_groups(),
            "workload": job.workload,
            "slo_ttft_ms": job.slo_ttft_ms,
            "slo_tpot_ms": job.slo_tpot_ms,
            "duration_s": duration_s,
            "warmup_s": job.warmup_s,
            "until_steps": until_steps,
            "drain_s": drain,
        },
        # every policy's fleet at once, each with its own nats-server, on the same seed and trace: they share the box's CPU
        "side_by_side": side_by_side and len(chosen) > 1,
        "policies": {},
        "sim": {},
        "sim_vs_real": {},
    }
    began = time.monotonic()
    if side_by_side:
        console.rule(
            f"[bold]{' and '.join(chosen)}[/bold] side by side (a NATS and a fleet each): {duration_s:.0f} emulated s on "
            f"{job.gpus}x{job.device} ({job.model}), x{job.time_scale:g} slower"
        )
        runs = asyncio.run(run_side_by_side(job, chosen, root, models, duration_s, console, until_steps, drain))
    else:
        runs = {}
        for policy in chosen:
            console.rule(f"[bold]{policy}[/bold]: {duration_s:.0f} emulated s on {job.gpus}x{job.device} ({job.model}), x{job.time_scale:g} slower")
            runs.update(asyncio.run(run_side_by_side(job, [policy], root, models, duration_s, console, until_steps, drain)))
    for policy in chosen:
        figures = runs[policy]
        result["policies"][policy] = figures
        started = time.monotonic()
        result["sim"][policy] = sim_figures(job, policy, int(figures.get("steps") or 0))
        result["sim"][policy]["wall_s"] = time.monotonic() - started
        real, simulated = figures, result["sim"][policy]
        result["sim_vs_real"][policy] = {key: _ratio(real.get(key), simulated.get(key)) for key in ("rl_steps_per_hour", "rollout_s_per_step")}
        result["sim_vs_real"][policy]["how"] = how_figures(real, simulated)
        # the same rules placed the turns on both sides (placement.py RULES): how often each fired, real beside simulated
        real_rules, sim_rules = rule_shares(real.get("placement_rules")), rule_shares(simulated.get("placement_rules"))
        result["sim_vs_real"][policy]["placement_rule_shares"] = {
            rule: {"real": real_rules.get(rule, 0.0), "sim": sim_rules.get(rule, 0.0)} for rule in sorted(set(real_rules) | set(sim_rules))
        }
        spread = simulated["rl_steps_per_hour_by_seed"]
        result["sim_vs_real"][policy] |= {
            "rl_steps_per_hour_vs_seed_mean": _ratio(real.get("rl_steps_per_hour"), spread["mean"]),
            "rl_steps_per_hour_within_seed_range": spread["min"] <= (real.get("rl_steps_per_hour") or 0.0) <= spread["max"],
        }
    p = result["policies"]
    result["wall_s"] = time.monotonic() - began
    result["speedup_vs_static"], result["rollout_time_ratio_vs_elastic"] = run_ratios(p)
    result["sim_speedup_vs_static"] = _ratio(
        result["sim"].get("rose", {}).get("rl_steps_per_hour"), result["sim"].get("static", {}).get("rl_steps_per_hour")
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    result["plot"] = str(plot(result, path.with_suffix(".png")))
    path.write_text(json.dumps(result, indent=2, default=float))
    print_table(result, console)
    console.print(f"JSON: {path}; plot: {result['plot']}; per-policy logs under {root}")
    return result


def how_figures(real: dict, simulated: dict) -> dict[str, dict[str, float | None]]:
    """``HOW_FIGURES`` as {name: {"real": ..., "sim": ...}}; the real run keeps some under ``calibration``."""
    out = {}
    for real_key, sim_key in HOW_FIGURES:
        value = real.get(real_key, real.get("calibration", {}).get(real_key))
        out[real_key] = {"real": value, "sim": simulated.get(sim_key)}
    return out


def sim_range(sim: dict) -> str:
    spread = sim.get("rl_steps_per_hour_by_seed")
    return f" ({spread['min']:.0f}-{spread['max']:.0f})" if spread else ""


def print_table(result: dict, console: Console) -> None:
    e = result["emulation"]
    table = Table(
        title=f"rose bench e2e --emulate {e['gpus']}x{e['device']} --model {e['model']}: {result['job']['mode']}, demand "
        f"{result['job']['demand']:g}, dedicated {result['job']['dedicated_ratio']:g} (emulated time, x{e['time_scale']:g} slower than real)"
    )
    for col in (
        "policy",
        "RL steps/h",
        "x static",
        "sim steps/h (seeds)",
        "real/sim",
        "rollout s/step",
        "SLO attainment",
        "on serving",
        "lost",
        "lag p99",
        "CPU",
    ):
        table.add_column(col, justify="left" if col == "policy" else "right")
    static = result["policies"].get("static", {})
    for name, f in result["policies"].items():
        fid = f["fidelity"]
        table.add_row(
            name,
            _fmt(f["rl_steps_per_hour"], ".0f"),
            _fmt(_ratio(f["rl_steps_per_hour"], static.get("rl_steps_per_hour"))),
            _fmt(result["sim"][name].get("rl_steps_per_hour"), ".0f") + sim_range(result["sim"][name]),
            _fmt(result["sim_vs_real"][name]["rl_steps_per_hour"]),
            _fmt(f["rollout_s_per_step"], ".1f"),
            _fmt(f["serving_slo_attainment"], ".3f"),
            _fmt(f["harvested_fraction"], ".0%"),
            str(f["trajectories_lost"]) + (f" ({f['trajectories_late']} late)" if f.get("trajectories_late") else ""),
            "-" if fid["forward_lag_p99_percent"] is None else f"{fid['forward_lag_p99_percent']:.1f} %",
            f"{fid['cpu_utilization']:.0%}" + (" starved" if fid["starved"] else ""),
        )
    console.print(table)
    how = Table(title="how each side got there: real (simulator, seed 0)")
    how.add_column("policy", justify="left")
    for real_key, _ in HOW_FIGURES:
        how.add_column(real_key.replace("_", " "), justify="right")
    for name in result["policies"]:
        cells = result["sim_vs_real"][name]["how"]
        how.add_row(name, *(f"{_fmt(c['real'], '.3g')} ({_fmt(c['sim'], '.3g')})" for c in cells.values()))
    console.print(how)
    for name, f in result["policies"].items():
        phases = ", ".join(f"{k} {v:.0f}" for k, v in f.get("wall_phases_s", {}).items())
        fid = f["fidelity"]
        console.print(
            f"{name}: {f['steps']} steps, {f['trajectories_lost']} lost, {f.get('trajectories_late', 0)} late; its processes "
            f"{fid.get('fleet_cpu_cores', 0.0):.2f} cores; wall s: {phases}; done {f['wall_s']:.0f} s from the start"
        )
    together = "side by side" if result.get("side_by_side") else "one at a time"
    console.print(f"{len(result['policies'])} policies {together}: {result['wall_s'] / 60:.1f} wall minutes")
    console.print(
        f"rose vs static: {_fmt(result['speedup_vs_static'])}x RL steps/h (simulator on the same configuration: "
        f"{_fmt(result['sim_speedup_vs_static'])}x); rose vs elastic_baseline: {_fmt(result['rollout_time_ratio_vs_elastic'])}x rollout time"
    )


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = result["policies"]
    fig, axes = plt.subplots(len(p), 1, figsize=(11, 2.8 * len(p)), sharex=True, squeeze=False)
    for ax, (name, f) in zip(axes[:, 0], p.items()):
        data = f["tokens_by_role_over_time"]
        x = np.arange(len(data["serving"])) * data["bin_s"]
        ax.stackplot(x, data["dedicated"], data["serving"], labels=["dedicated executors", "serving executors (leases)"], alpha=0.8)
        ax.set_ylabel(f"{name}\nrollout tok/s")
        ax.legend(loc="upper left", fontsize=7)
    axes[-1, 0].set_xlabel("emulated seconds since the serving trace began (the trainer starts after the warm-up)")
    e = result["emulation"]
    fig.suptitle(
        f"rollout tokens by executor role, {e['gpus']}x{e['device']} emulated ({e['model']}); rose/static {_fmt(result['speedup_vs_static'])}x"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
