"""``rose bench elastic``: the whole elastic system on real processes and the real bus.

Serving executors take a replayed trace (Poisson arrivals at ``FleetSpec.base_rps`` each, with bursts
of ``burst_factor`` x that rate, staggered per executor) over their OpenAI HTTP API; dedicated
executors take only rollout; the SLO monitor, the scheduler and a rollout worker run as
processes; multi-turn rollout tasks are fed to keep a backlog, alternating affinity and random
routing (the same workload routed both ways in one run). Chaos, once each: ``kill -9`` an
opportunistic executor while it holds a lease mid-rollout (restarted a few seconds later;
serving traffic meanwhile goes to the other serving executors, as a load balancer would), and
a restart of the NATS server. Dedicated executors run at `fleet.DEDICATED_NICE` (see there). Then every published task must come back as a trajectory.

Figures: ``slo_attainment`` (client-measured TTFT and TPOT of every serving request against
the SLO), ``rollout_tokens_per_s``, ``reclaim_latency_ms_p99`` (burst onset on an executor
holding a lease -> the revocation is on the bus: the SLO alert the executor acts on at once,
yielding within one quantum, or the lease revoked in the bucket; ``reclaim_confirmed_ms_p99``
adds the first metrics snapshot showing no rollout computing there (none running and no lease, or
the lease parked: its turns keep their KV and compute nothing), so its resolution is the metrics
interval; ``reclaim_floor_ms_p99`` is onset -> the burst's first serving arrival there,
its first observable evidence, which no detector can beat, ``reclaim_floor_ms_p99_poisson`` the
same floor for Poisson arrivals at the burst rate, ln(100) / rate, and
``reclaim_after_first_arrival_ms_p99`` the detection and bus time after that arrival;
``reclaim_detection_bound_ms_mean`` is the least mean delay any detector of that rate change can
have at one false alarm per hour from arrivals alone, ``detection_delay_bound_ms``; the executor's
detector also sees its queue, which can beat it when a burst outruns capacity;
``burst_false_alarms_per_hour`` counts its alerts outside every burst), lease counts,
``prefix_hit_rate.{affinity,random}`` (later turns whose prompt hit the executor's retained prefix) and
``prefix_reuse`` (of the context the turn before computed, the share found cached: bench/e2e.py ``later_turns``) with
``turn_routing`` (why they missed: the share that stayed where the previous turn ran, the share retried;
and per routing the share of turns on leases and their mean seconds), ``tasks_lost``, and a timeline PNG.

Bursts: each serving executor detects its own (``executor.burst``, shared/bursts.py)
and publishes the alert at once; the monitor's alerts come later from the metrics. Both count as
the revocation signal. ``--burst-factors 3,5`` runs the fleet once per factor (``by_burst_factor``
in the JSON; the top-level figures are the first factor's), and ``--min-bursts N`` makes each run
long enough for N bursts that find a lease held (bursts every BURST_EVERY_S, each executor's lease
re-granted in between), so the p99 has at least N samples: ``reclaim_samples`` says how many. The
planned length assumes half the bursts find a lease; the run then goes on, measuring, until N bursts
that found one have ended (up to MAX_EXTENSION x the plan), because how many do depends on the burst
factor and the host (x5 found 13 in the planned window on the 2-core VM): ``duration_s`` is the window
the run really had, ``planned_duration_s`` the plan.

Auth is on, as in the embedded default (and kept across the NATS restart: the server restarts
with the same config): every process connects with its own service's credentials, the task
feeder stands in for the trainer with the trainer's, and the bench's observer (provisioning,
heartbeats, events) uses the operator's (`cli`). ``auth`` in the JSON is true when a client
without credentials was refused both before the chaos and after the NATS restart.
"""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec

from rose.contracts.registry import EXECUTOR_BURST, EXECUTOR_METRICS, LEASE_EVENT, ROLLOUT_TASK, SLO_ALERT, TRAJECTORY
from rose.contracts.rollout import RolloutTask, Trajectory
from rose.shared.bus import Bus
from rose.shared.config import BusConfig
from rose.shared.launch import ServiceProcess, start_all, stop_all
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.shared.security import OPERATOR, Credentials, init_credentials
from rose.shared.sketch import from_contract

from .bus import refuses_anonymous
from .e2e import later_turns
from .fleet import PROMPTS, FleetSpec, ServingLog, assign_credentials, drive_serving, executor_instances, fleet_processes, p99, serving_trace

SPEC = FleetSpec()
SLO_TTFT_MS, SLO_TPOT_MS = SPEC.slo_ttft_ms, SPEC.slo_tpot_ms
ROLLOUT_TURNS = 4
BACKLOG = 2 * SPEC.worker_concurrency  # unfinished tasks kept queued
CHAOS_KILL_AT = 0.35  # of the duration
CHAOS_NATS_AT = 0.6
RESTART_AFTER_S = 5.0
DRAIN_TIMEOUT_S = 120.0  # after the trace, for every published task to come back
START_TIMEOUT_S = 180.0
RECLAIM_GRACE_S = 2.0  # a revocation later than burst end + this counts as a missed burst
BURST_EVERY_S = 12.0  # with --min-bursts: a burst per executor this often (the lease is re-granted between: cooldown + a calm headroom)
BURST_LEN_S = 2.0
LEASE_FOUND_SHARE = 0.5  # with --min-bursts: plan for at least this share of bursts finding a lease held
MAX_EXTENSION = 3.0  # with --min-bursts: the run may go on to this multiple of the plan until enough samples


@dataclass
class Record:
    """Everything the bench observes, with local receive times."""

    serving: ServingLog = field(default_factory=ServingLog)
    alerts: list[tuple[float, str, str, float]] = field(default_factory=list)  # (t, executor, severity, the monitor's `at`)
    own_bursts: list[tuple[float, str]] = field(default_factory=list)  # (t, executor) of each executor's own burst alert
    lease_events: list[tuple[float, str, str, str]] = field(default_factory=list)  # (at, executor, kind, lease id)
    # (t, executor, ttft p99, rollout running, lease id, parked)
    snapshots: list[tuple[float, str, float, int, str, bool]] = field(default_factory=list)
    trajectories: dict[str, Trajectory] = field(default_factory=dict)
    duplicates: int = 0
    published: dict[str, str] = field(default_factory=dict)  # task id -> routing
    chaos: list[tuple[float, str]] = field(default_factory=list)


async def feed_tasks(bus: Bus, rec: Record, stop: asyncio.Event, seed: int) -> None:
    """Keep BACKLOG unfinished tasks queued, alternating affinity and random routing."""
    n = 0
    while not stop.is_set():
        unfinished = len(rec.published) - len(rec.trajectories)
        while unfinished < BACKLOG:
            routing = "affinity" if n % 2 == 0 else "random"
            task = RolloutTask(
                task_id=f"bench-{seed}-{n}",
                env="conversation",
                prompt=PROMPTS[n % len(PROMPTS)],
                max_turns=ROLLOUT_TURNS,
                group_id=f"bench-{seed}-g{n // 8}",
                group_size=8,
                routing=routing,  # type: ignore[arg-type]
                created_at=time.time(),
                env_args={"max_tokens": str(SPEC.rollout_max_tokens)},
            )
            try:
                await bus.publish(ROLLOUT_TASK, task, msg_id=task.task_id)
            except Exception:  # the server is restarting: try again shortly
                break
            rec.published[task.task_id] = routing
            n += 1
            unfinished += 1
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.25)
        except TimeoutError:
            pass


async def chaos(
    procs: dict[str, ServiceProcess],
    victim: str,
    server: NatsServer,
    down: set[str],
    urls: dict[str, str],
    rec: Record,
    duration_s: float,
    t0: float,
    bus: Bus,
) -> None:
    await asyncio.sleep(max(0.0, t0 + CHAOS_KILL_AT * duration_s - time.time()))
    for _ in range(100):  # wait until the victim holds a lease and runs rollout
        last = [s for s in rec.snapshots if s[1] == victim]
        if last and last[-1][4] and last[-1][3] > 0:
            break
        await asyncio.sleep(0.1)
    down.add(victim)
    procs[victim].kill()
    rec.chaos.append((time.time(), f"kill -9 {victim}"))
    await asyncio.sleep(RESTART_AFTER_S)
    procs[victim].start()
    asyncio.ensure_future(_back_up(procs[victim], bus, down, urls, victim, rec))
    await asyncio.sleep(max(0.0, t0 + CHAOS_NATS_AT * duration_s - time.time()))
    rec.chaos.append((time.time(), "NATS restart"))
    await asyncio.to_thread(server.restart)


async def _back_up(proc: ServiceProcess, bus: Bus, down: set[str], urls: dict[str, str], victim: str, rec: Record) -> None:
    try:
        urls[victim] = (await proc.wait_ready(bus, START_TIMEOUT_S))["http"]  # a new process, a new port
        rec.chaos.append((time.time(), f"{victim} back"))
    finally:
        down.discard(victim)


async def observe(bus: Bus, rec: Record, tag: str) -> None:
    async def on_metrics(s, _d):
        p99 = float(from_contract(s.ttft_ms).get_quantile_value(0.99) or 0.0) if s.ttft_ms.count else float("nan")
        rec.snapshots.append((time.time(), s.executor_id, p99, s.rollout_running, s.lease_id, s.rollout_parked))

    async def on_alert(a, _d):
        rec.alerts.append((time.time(), a.executor_id, a.severity, a.at))

    async def on_lease(e, _d):
        rec.lease_events.append((e.at, e.lease.executor_id, e.kind, e.lease.lease_id))

    async def on_trajectory(t, _d):
        if t.task_id in rec.trajectories:
            rec.duplicates += 1
        rec.trajectories[t.task_id] = t

    await bus.subscribe(EXECUTOR_METRICS, on_metrics)
    await bus.subscribe(SLO_ALERT, on_alert)

    async def on_own_burst(a, d):
        if a.severity != "recovered":
            rec.own_bursts.append((time.time(), a.executor_id))
        await on_alert(a, d)

    await bus.subscribe(EXECUTOR_BURST, on_own_burst)  # the executors' own burst alerts
    await bus.consume(LEASE_EVENT, on_lease, durable=f"bench_leases_{tag}")
    await bus.consume(TRAJECTORY, on_trajectory, durable=f"bench_trajectories_{tag}")


def lease_intervals(rec: Record, end: float) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    open_: dict[str, float] = {}
    for at, ex, kind, _ in sorted(rec.lease_events):
        if kind == "granted":
            open_[ex] = at
        elif kind in ("revoked", "expired") and ex in open_:
            out[ex].append((open_.pop(ex), at))
    for ex, start in open_.items():
        out[ex].append((start, end))
    return out


def reclaim(
    rec: Record,
    leases: dict[str, list[tuple[float, float]]],
    arrivals: dict[str, list[float]],
    bursts: list[tuple[float, float, str]] | None = None,
    confirm: bool = True,
) -> dict:
    """Burst onset -> the revocation signal on the bus, per burst that found a lease held; split at
    the burst's first serving arrival on that executor (its first observable evidence): ``floor``
    is onset -> that arrival, which no detector can beat, ``after_first_arrival`` the rest.
    ``bursts`` defaults to every burst of the trace (a run in progress passes those already over);
    ``confirm``: also look for the first idle snapshot after each signal (a scan of every snapshot
    per burst, which a run in progress, counting samples on the loop that drives serving, skips)."""
    signal_ms, confirmed_ms, floor_ms, after_ms, missed = [], [], [], [], 0
    for start, end, ex in rec.serving.bursts if bursts is None else bursts:
        if not any(a <= start < b for a, b in leases.get(ex, [])):
            continue  # nothing lent there at the onset: nothing to reclaim
        first_arrival = next((t for t in arrivals.get(ex, []) if start <= t < end), None)
        if first_arrival is not None:
            floor_ms.append((first_arrival - start) * 1e3)
        signals = [t for t, e, sev, _ in rec.alerts if e == ex and sev != "recovered" and t >= start]
        signals += [at for at, e, kind, _ in rec.lease_events if e == ex and kind == "revoked" and at >= start]
        first = min(signals, default=None)
        if first is None or first > end + RECLAIM_GRACE_S:
            missed += 1
            continue
        signal_ms.append((first - start) * 1e3)
        if first_arrival is not None:
            after_ms.append((first - first_arrival) * 1e3)
        if confirm:
            idle = [t for t, e, _, running, lease, parked in rec.snapshots if e == ex and t >= first and (parked or (running == 0 and not lease))]
            if idle:
                confirmed_ms.append((min(idle) - start) * 1e3)
    return {
        "p99": p99(signal_ms),
        "confirmed_p99": p99(confirmed_ms),
        "samples": len(signal_ms),
        "missed": missed,
        "all_ms": [round(v, 1) for v in signal_ms],
        "floor_p99": p99(floor_ms),
        "after_first_arrival_p99": p99(after_ms),
    }


def near_chaos(start: float, end: float, chaos: list[tuple[float, str]]) -> bool:
    """Whether [start, end] overlaps a chaos step or the RESTART_AFTER_S + 10 s after it (the killed executor
    restarting, the others taking its traffic, clients reconnecting to the restarted server)."""
    return any(start <= at + RESTART_AFTER_S + 10.0 and end >= at for at, _ in chaos)


def slo_misses_in_context(rec: Record, leases: dict[str, list[tuple[float, float]]], t0: float) -> dict:
    """Every serving request that failed or missed the SLO, with where its executor stood when it was sent:
    ``chaos`` (in flight at a chaos step or sent within RESTART_AFTER_S + 10 s after one), ``burst`` (from a
    burst's onset on that executor to RECLAIM_GRACE_S after its end), ``lease`` (a rollout lease held: rollout
    beside serving), else ``calm``. Says whose a miss is: a fault's, a burst's, lent capacity's, or the fleet's own.

    A fault comes first: a killed executor's traffic goes to the others until it is back, so a burst then meets
    the fleet's traffic on fewer executors (2026-12-06, x5: 35 of 38 misses were sent 10-11 s after a kill -9, the
    killed executor still restarting, in a burst on the survivor that reached 96.6 requests/s; other bursts 30-70)."""

    def context(r: dict) -> str:
        at, ex = r["sent_at"], r["executor"]
        if near_chaos(at, r["t"], rec.chaos):
            return "chaos"
        if any(start <= at <= end + RECLAIM_GRACE_S for start, end, e in rec.serving.bursts if e == ex):
            return "burst"
        if any(a <= at < b for a, b in leases.get(ex, [])):
            return "lease"
        return "calm"

    missed = [r for r, ok in zip(rec.serving.requests, rec.serving.met(SPEC)) if not ok]
    records = [
        {
            "sent_s": round(r["sent_at"] - t0, 3),
            "executor": r["executor"],
            "context": context(r),
            "ttft_ms": round(r["ttft_ms"], 1) if r["ok"] else None,
            "tpot_ms": round(r["tpot_ms"], 2) if r["ok"] else None,
            "error": r.get("error"),
        }
        for r in missed
    ]
    by_context = {c: sum(m["context"] == c for m in records) for c in ("burst", "lease", "chaos", "calm")}
    return {"by_context": by_context, "records": records}


def samples_so_far(rec: Record, arrivals: dict[str, list[float]], now: float) -> int:
    """Reclaim samples from the bursts already over (their grace for a late signal included), as the run goes."""
    over = [b for b in rec.serving.bursts if b[1] + RECLAIM_GRACE_S < now]
    return int(reclaim(rec, lease_intervals(rec, now), arrivals, over, confirm=False)["samples"])


def false_alarms_per_hour(rec: Record, executors: list[str], window_s: float) -> float:
    """The executors' own burst alerts outside every burst of theirs (onset to end + RECLAIM_GRACE_S), per
    executor-hour of trace: what the detector's speed is bought with (each one revokes a lease)."""
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for start, end, ex in rec.serving.bursts:
        spans[ex].append((start, end + RECLAIM_GRACE_S))
    false = sum(1 for t, ex in rec.own_bursts if not any(a <= t <= b for a, b in spans[ex]))
    return false / max(1e-9, window_s * max(1, len(executors)) / 3600.0)


def detection_delay_bound_ms(base_rps: float, factor: float, false_alarm_every_s: float = 3600.0) -> float:
    """Asymptotic lower bound on the mean delay of any detector of a Poisson rate step base -> factor x base
    that raises a false alarm at most once per ``false_alarm_every_s`` (Lorden; CUSUM attains it):
    threshold h = ln(false_alarm_every_s x I), delay = h / I, with I the information the burst's
    arrivals carry per second, rate1 ln(rate1 / rate0) - (rate1 - rate0) nats/s. At 8 req/s x3 it is
    about a second: a p99 of tens of milliseconds after the first arrival is beyond every detector."""
    rate0, rate1 = base_rps, base_rps * factor
    info = rate1 * math.log(rate1 / rate0) - (rate1 - rate0)
    return math.log(false_alarm_every_s * info) / info * 1e3


def poisson_first_arrival_p99_ms(rate_rps: float) -> float:
    """The p99 wait from a rate change to the first arrival at the new rate: P(none in t) = exp(-rate t) = 1 %."""
    return math.log(100.0) / rate_rps * 1e3


def prefix_figures(rec: Record) -> dict[str, dict[str, float | None]]:
    """The later turns' prefix figures (bench/e2e.py ``later_turns``), each per routing: ``prefix_hit_rate`` and
    ``prefix_reuse``. One ``later_turns`` per routing: it matches every later turn's prompt against the turn before."""
    later = {k: later_turns([t for t in rec.trajectories.values() if t.routing == k]) for k in ("affinity", "random")}
    return {figure: {k: v[figure] for k, v in later.items()} for figure in ("prefix_hit_rate", "prefix_reuse")}


def turn_routing(rec: Record, serving: list[str]) -> dict[str, dict[str, float | int]]:
    """Per routing. Why a later turn missed its prefix: ``stayed``, the share that ran where the trajectory's previous
    turn ran (placement kept it home); ``retried``, the share that took more than one attempt (an executor refused it,
    failed, or was revoked under it: the first attempt's cache does not count), and ``retried_outside_chaos``, those
    that ran clear of the chaos steps (``near_chaos``): what revocations and refusals cost, not the kill -9 and the
    NATS restart the bench injects. ``to_lease``, ``to_dedicated`` and ``between_leases``: the moves by the two
    executors' roles (a dedicated home left for a lease; a lease left, revoked or no longer the sooner, for the
    dedicated pool; one lease for another). Of the moves off a lease, those whose lease ended (revoked or expired):
    ``left_lease_ended_before``, between the previous turn's start and this one's (placement found it gone, or
    revoked lately), and ``left_lease_ended_during``, while this turn ran (its first attempt there was parked by the
    burst and a hedge won on the dedicated pool): the bench's bursts forced those, placement did not choose them.
    And what its turns cost, every turn
    counted: ``on_leases``, the share that ran on a serving executor, ``turn_s_mean``, their mean seconds. The run's
    rollout tokens/s is about the tasks it runs at once x a turn's tokens / the mean turn time over both routings, so
    random's turns weigh on it as much as placement's."""
    ended: dict[str, list[float]] = defaultdict(list)
    for at, ex, kind, _ in rec.lease_events:
        if kind in ("revoked", "expired"):
            ended[ex].append(at)

    def left_ended(prev, turn, during: bool) -> bool:
        a, b = (turn.started_at, turn.finished_at) if during else (prev.started_at, turn.started_at)
        return prev.executor_id in serving and prev.executor_id != turn.executor_id and any(a < at <= b for at in ended[prev.executor_id])

    out: dict[str, dict[str, float | int]] = {}
    for routing in ("affinity", "random"):
        turns = [t.turns for t in rec.trajectories.values() if t.routing == routing]
        pairs = [(prev, turn) for ts in turns for prev, turn in zip(ts, ts[1:])]
        every = [turn for ts in turns for turn in ts]
        n, m = max(1, len(pairs)), max(1, len(every))
        out[routing] = {
            "turns": len(pairs),
            "stayed": sum(turn.executor_id == prev.executor_id for prev, turn in pairs) / n,
            "retried": sum(turn.attempts > 1 for _, turn in pairs) / n,
            "retried_outside_chaos": sum(turn.attempts > 1 and not near_chaos(turn.started_at, turn.finished_at, rec.chaos) for _, turn in pairs) / n,
            **{
                kind: sum(
                    prev.executor_id != turn.executor_id and (prev.executor_id in serving, turn.executor_id in serving) == roles
                    for prev, turn in pairs
                )
                / n
                for kind, roles in (("to_lease", (False, True)), ("to_dedicated", (True, False)), ("between_leases", (True, True)))
            },
            "left_lease_ended_before": sum(left_ended(prev, turn, during=False) for prev, turn in pairs) / n,
            "left_lease_ended_during": sum(left_ended(prev, turn, during=True) for prev, turn in pairs) / n,
            "on_leases": sum(turn.executor_id in serving for turn in every) / m,
            "turn_s_mean": sum(turn.finished_at - turn.started_at for turn in every) / m,
        }
    return out


def plot(path: Path, rec: Record, serving: list[str], leases, t0: float, end: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(serving), 1, figsize=(12, 3.2 * len(serving)), sharex=True, squeeze=False)
    for ax, ex in zip(axes[:, 0], serving):
        reqs = [r for r in rec.serving.requests if r["executor"] == ex]
        ax.scatter(
            [r["t"] - t0 for r in reqs],
            [min(max(r["ttft_ms"], 1.0), 5 * SLO_TTFT_MS) for r in reqs],
            s=4,
            c="tab:blue",
            label="serving TTFT (client; failed at top)",
        )
        snaps = [s for s in rec.snapshots if s[1] == ex and s[2] == s[2]]
        ax.plot([s[0] - t0 for s in snaps], [s[2] for s in snaps], lw=0.8, c="tab:cyan", label="TTFT p99 per interval")
        ax.axhline(SLO_TTFT_MS, c="red", ls="--", lw=1, label="TTFT SLO")
        for a, b in leases.get(ex, []):
            ax.axvspan(a - t0, b - t0, color="tab:green", alpha=0.15)
        for a, b, e in rec.serving.bursts:
            if e == ex:
                ax.axvspan(a - t0, b - t0, color="tab:orange", alpha=0.25)
        for t, e, sev, _ in rec.alerts:
            if e == ex:
                ax.axvline(t - t0, c="tab:red" if sev != "recovered" else "tab:gray", lw=0.6, alpha=0.6)
        for t, what in rec.chaos:
            ax.axvline(t - t0, c="black", lw=1.2)
            ax.text(t - t0, ax.get_ylim()[1] * 0.9, what, fontsize=7, rotation=90, va="top")
        ax.set_ylabel(f"{ex}\nTTFT ms")
        ax.set_yscale("log")
        ax.set_ylim(1.0, 6 * SLO_TTFT_MS)
    axes[0, 0].legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds (green: lease held, orange: serving burst, red lines: SLO alerts)")
    fig.suptitle("ROSE elastic: leases vs serving latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def start_nats(root: Path, executors: list[str] | None = None) -> tuple[Credentials, NatsServer]:
    """This run's credentials (a user per executor instance in `executors`) and its nats-server with their
    permissions (`restart()` keeps the config, auth included)."""
    creds = init_credentials(root / "security", instances={"executor": executors or []})
    return creds, NatsServer(root / "nats", log_file=root / "nats-server.log", extra_config=creds.server_config()).start()


def connect_as(creds: Credentials, url: str, service: str, instance: str) -> Bus:
    """A bench-side Bus (not connected) with `service`'s credentials: `cli` to observe and provision, `trainer` to feed tasks."""
    return Bus(BusConfig(url=url, initial_connect_deadline_s=20.0, nkey_seed_file=str(creds.seed_file(service))), service=service, instance=instance)


async def _run(
    out: Path,
    seed: int,
    executors: int,
    dedicated: int,
    burst_factor: float,
    duration_s: float,
    model_dir: str | None,
    console,
    spec: FleetSpec = SPEC,
    min_samples: int = 0,
) -> dict:
    """One fleet run: ``duration_s`` of trace, or with ``min_samples`` as long as it takes (up to
    MAX_EXTENSION x ``duration_s``) for that many bursts that found a lease held to be over."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from rose.shared.models import init_models

    root = Path(tempfile.mkdtemp(prefix="rose-bench-elastic-"))
    models = Path(model_dir) if model_dir else root / "models"
    if not (models / "policy" / "config.json").exists():
        init_models(models, seed=0)
    creds, server = start_nats(
        root, executor_instances(SPEC, executors, dedicated)
    )  # auth on, as in production: each process (executor) its own NKey
    auth = await refuses_anonymous(server.url)
    bus = connect_as(creds, server.url, OPERATOR, f"bench-{seed}")  # observes and provisions
    await bus.connect()
    await provision(bus.js)
    feeder_bus = connect_as(creds, server.url, "trainer", f"bench-feeder-{seed}")  # publishes tasks, as the trainer does
    await feeder_bus.connect()
    rec = Record()
    await observe(bus, rec, f"{seed}_{int(time.time())}")
    procs = fleet_processes(root, server.url, models, SPEC, executors, dedicated)
    assign_credentials(procs, creds)
    for proc in procs.values():
        proc.env["ROSE_STATE_DIR"] = str(root)  # this run's own weight-signing keys and state, never ./.rose
    serving = [n for n in procs if n.startswith("bench-serving-")]
    try:
        console.print(f"starting {len(procs)} processes (logs in {root}) ...")
        await start_all(bus, list(procs.values()), START_TIMEOUT_S)
        urls = {n: (await procs[n].wait_ready(bus, 10.0))["http"] for n in serving}
        t0, t0_mono = time.time(), time.monotonic()
        max_s = duration_s * (MAX_EXTENSION if min_samples else 1.0)
        trace = serving_trace(serving, max_s, replace(spec, burst_factor=burst_factor), seed, rec.serving, t0)
        arrivals: dict[str, list[float]] = defaultdict(list)
        for offset, ex in trace:
            arrivals[ex].append(t0 + offset)
        down: set[str] = set()
        stop = asyncio.Event()
        feeder = asyncio.ensure_future(feed_tasks(feeder_bus, rec, stop, seed))
        chaos_task = asyncio.ensure_future(chaos(procs, serving[0], server, down, urls, rec, duration_s, t0, bus)) if serving else None
        driver = asyncio.ensure_future(drive_serving(trace, urls, down, SPEC, rec.serving, t0_mono, seed))
        with Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=console, transient=True
        ) as progress:
            bar = progress.add_task("trace", total=duration_s, status="")
            samples = 0
            while (elapsed := time.monotonic() - t0_mono) < max_s and (elapsed < duration_s or samples < min_samples):
                await asyncio.sleep(0.5)
                granted = sum(1 for e in rec.lease_events if e[2] == "granted")
                samples = samples_so_far(rec, arrivals, time.time()) if min_samples else 0
                progress.update(
                    bar,
                    total=max(duration_s, elapsed),
                    completed=elapsed,
                    status=(
                        f"serving {len(rec.serving.requests)} req | leases {granted} | alerts {len(rec.alerts)} | trajectories "
                        f"{len(rec.trajectories)}/{len(rec.published)}" + (f" | reclaim samples {samples}/{min_samples}" if min_samples else "")
                    ),
                )
            window_s = time.monotonic() - t0_mono
            cut = next((i for i, (at, _) in enumerate(trace) if at > window_s), len(trace))
            del trace[cut:]  # the driver iterates this list: it sends what is due and returns
            rec.serving.bursts[:] = [(a, min(b, t0 + window_s), ex) for a, b, ex in rec.serving.bursts if a <= t0 + window_s]
            stop.set()
            await feeder
            if chaos_task:
                await chaos_task
            await driver
            window_end = time.time()
            drain = progress.add_task("drain", total=len(rec.published), status="")
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while len(set(rec.published) & set(rec.trajectories)) < len(rec.published) and time.monotonic() < deadline:
                progress.update(drain, completed=len(set(rec.published) & set(rec.trajectories)), status="waiting for every task's trajectory")
                await asyncio.sleep(0.5)
        end = time.time()
        auth = auth and await refuses_anonymous(server.url)  # still on after the NATS restart
        params = dict(seed=seed, executors=executors, dedicated=dedicated, burst_factor=burst_factor, planned_duration_s=duration_s)
        return _report(out, rec, serving, t0, window_end, end, window_end - t0, params, auth, arrivals, console)
    finally:
        stop_all(list(procs.values()))
        await feeder_bus.close()
        await bus.close()
        server.stop()


def _report(
    out: Path,
    rec: Record,
    serving: list[str],
    t0: float,
    window_end: float,
    end: float,
    duration_s: float,
    params: dict,
    auth: bool,
    arrivals: dict[str, list[float]],
    console,
) -> dict:
    met = rec.serving.met(SPEC)
    misses = {
        "failed": sum(not r["ok"] for r in rec.serving.requests),
        "ttft": sum(r["ok"] and r["ttft_ms"] > SLO_TTFT_MS for r in rec.serving.requests),
        "tpot": sum(r["ok"] and r["tpot_ms"] > SLO_TPOT_MS for r in rec.serving.requests),
    }
    leases = lease_intervals(rec, end)
    rl = reclaim(rec, leases, arrivals)
    tokens = [(turn.finished_at, len(turn.token_ids), turn.executor_id) for t in rec.trajectories.values() for turn in t.turns]
    in_window = [n for at, n, _ in tokens if t0 <= at <= window_end]
    on_serving = sum(n for _, n, ex in tokens if ex.startswith("bench-serving-"))
    lost = sorted(set(rec.published) - set(rec.trajectories))
    failed = sum(1 for t in rec.trajectories.values() if t.status != "completed")
    png = out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(png, rec, serving, leases, t0, end)
    dump = out.with_suffix(".trajectories.jsonl")  # every turn, to read the routing figures again
    dump.write_bytes(b"".join(msgspec.json.encode(t) + b"\n" for t in rec.trajectories.values()))
    result = {
        **params,
        "duration_s": duration_s,
        "slo": {"ttft_ms": SLO_TTFT_MS, "tpot_ms": SLO_TPOT_MS},
        "serving_requests": len(rec.serving.requests),
        "slo_attainment": (sum(met) / len(met)) if met else None,
        "slo_misses": misses,
        "slo_misses_in_context": slo_misses_in_context(rec, leases, t0),
        "serving_ttft_p99_ms": p99([r["ttft_ms"] for r in rec.serving.requests if r["ok"]]),
        "serving_tpot_p99_ms": p99([r["tpot_ms"] for r in rec.serving.requests if r["ok"]]),
        "rollout_tokens_per_s": sum(in_window) / max(1e-9, window_end - t0),
        "harvested_fraction": on_serving / max(1, sum(n for _, n, _ in tokens)),
        "reclaim_latency_ms_p99": rl["p99"],
        "reclaim_confirmed_ms_p99": rl["confirmed_p99"],
        "reclaim_samples": rl["samples"],
        "reclaim_floor_ms_p99": rl["floor_p99"],
        "reclaim_floor_ms_p99_poisson": poisson_first_arrival_p99_ms(SPEC.base_rps * params["burst_factor"]),
        "reclaim_after_first_arrival_ms_p99": rl["after_first_arrival_p99"],
        "reclaim_detection_bound_ms_mean": detection_delay_bound_ms(SPEC.base_rps, params["burst_factor"]),
        "burst_false_alarms_per_hour": false_alarms_per_hour(rec, serving, window_end - t0),
        "bursts_missed": rl["missed"],
        "reclaim_latency_ms_all": rl["all_ms"],
        "leases_granted": sum(1 for e in rec.lease_events if e[2] == "granted"),
        "leases_renewed": sum(1 for e in rec.lease_events if e[2] == "renewed"),
        "leases_revoked": sum(1 for e in rec.lease_events if e[2] == "revoked"),
        "leases_expired": sum(1 for e in rec.lease_events if e[2] == "expired"),
        "slo_alerts": len([a for a in rec.alerts if a[2] != "recovered"]),
        "alert_bus_latency_ms_p99": p99([(t - at) * 1e3 for t, _, sev, at in rec.alerts if sev != "recovered"]),
        **prefix_figures(rec),
        "turn_routing": turn_routing(rec, serving),
        "tasks_published": len(rec.published),
        "tasks_lost": len(lost),
        "trajectories_failed": failed,
        "trajectories_duplicated": rec.duplicates,
        "chaos": [what for _, what in rec.chaos],
        "timeline_png": str(png),
        "trajectories_jsonl": str(dump),
        "lease_events": sorted(rec.lease_events),  # (at, executor, kind, lease id): with the dump, turn_routing again
        "auth": auth,
    }
    out.write_text(json.dumps(result, indent=2))
    from rich.table import Table

    table = Table(title="rose bench elastic")
    table.add_column("figure")
    table.add_column("value")
    for key in (
        "slo_attainment",
        "slo_misses",
        "rollout_tokens_per_s",
        "harvested_fraction",
        "reclaim_latency_ms_p99",
        "reclaim_floor_ms_p99",
        "reclaim_floor_ms_p99_poisson",
        "reclaim_after_first_arrival_ms_p99",
        "reclaim_detection_bound_ms_mean",
        "burst_false_alarms_per_hour",
        "reclaim_confirmed_ms_p99",
        "alert_bus_latency_ms_p99",
        "bursts_missed",
        "leases_granted",
        "leases_revoked",
        "prefix_hit_rate",
        "prefix_reuse",
        "turn_routing",
        "tasks_published",
        "tasks_lost",
        "timeline_png",
    ):
        value = result[key]
        table.add_row(key, json.dumps(value) if not isinstance(value, float) else f"{value:.4g}")
        if key == "slo_misses":
            table.add_row("slo_misses_in_context", json.dumps(result["slo_misses_in_context"]["by_context"]))
    console.print(table)
    console.print(f"JSON: {out}")
    return result


def duration_for(min_bursts: int, executors: int) -> float:
    """Seconds of trace that give ``min_bursts`` bursts finding a lease held, if LEASE_FOUND_SHARE of them do."""
    per_executor = math.ceil(min_bursts / max(1, executors) / LEASE_FOUND_SHARE)
    return 5.0 + per_executor * BURST_EVERY_S


@dataclass(frozen=True, kw_only=True)
class ElasticOptions:
    """What a `rose bench elastic` run measures: ``executors`` serving and ``dedicated`` rollout executors under
    ``duration_s`` of bursty trace (``seed``), one fleet run per burst factor (``burst_factors``, else
    ``burst_factor``); with ``min_bursts`` the bursts come every BURST_EVERY_S and the trace is long enough for that
    many to find a lease held."""

    seed: int = 0
    executors: int = 2
    dedicated: int = 1
    burst_factor: float = 3.0
    burst_factors: tuple[float, ...] | None = None
    min_bursts: int = 0
    duration_s: float = 90.0


def run_elastic_bench(options: ElasticOptions, out_json: str, model_dir: str | None = None, console=None) -> dict:
    """Each burst factor's fleet run; its result, or with several the first's and each one's key figures (written to
    ``out_json``, each run's beside it). ``model_dir``: models to reuse (default: tiny models built on the spot)."""
    from rich.console import Console

    console = console or Console()
    seed, executors, dedicated, duration_s, min_bursts = options.seed, options.executors, options.dedicated, options.duration_s, options.min_bursts
    spec, factors = SPEC, list(options.burst_factors or [options.burst_factor])
    if min_bursts:
        spec = replace(SPEC, burst_every_s=BURST_EVERY_S, burst_len_s=BURST_LEN_S)
        duration_s = max(duration_s, duration_for(min_bursts, executors))
    out = Path(out_json)
    results = {}
    for factor in factors:
        path = out if len(factors) == 1 else out.with_name(f"{out.stem}-x{factor:g}{out.suffix}")
        results[factor] = asyncio.run(_run(path, seed, executors, dedicated, factor, duration_s, model_dir, console, spec, min_bursts))
    if len(factors) == 1:
        return results[factors[0]]
    keys = (
        "slo_attainment",
        "reclaim_after_first_arrival_ms_p99",
        "reclaim_detection_bound_ms_mean",
        "burst_false_alarms_per_hour",
        "reclaim_latency_ms_p99",
        "reclaim_samples",
        "duration_s",
        "bursts_missed",
        "tasks_lost",
        "rollout_tokens_per_s",
        "alert_bus_latency_ms_p99",
        "serving_ttft_p99_ms",
    )
    combined = {
        **results[factors[0]],
        "min_bursts": min_bursts,
        "by_burst_factor": {
            f"{f:g}": {**{k: r[k] for k in keys}, "json": str(out.with_name(f"{out.stem}-x{f:g}{out.suffix}"))} for f, r in results.items()
        },
    }
    combined["tasks_lost"] = sum(r["tasks_lost"] for r in results.values())
    out.write_text(json.dumps(combined, indent=2))
    from rich.table import Table

    table = Table(title="rose bench elastic: by burst factor")
    for col in ("factor", *keys):
        table.add_column(col, justify="right")
    for f, r in results.items():
        table.add_row(f"{f:g}", *(json.dumps(r[k]) if not isinstance(r[k], float) else f"{r[k]:.4g}" for k in keys))
    console.print(table)
    console.print(f"JSON: {out}")
    return combined
