"""Traces and metrics of a real fleet: executor, SLO monitor, scheduler, weight publisher and rollout
worker, each started by its own `run(config)` in this process (so the `spans` fixture sees every
span), on a nats-server of their own. The fixture drives one serving request over HTTP, one
rollout task, one failing task, one weight publish and one SLO alert, then scrapes every
service's advertised metrics endpoint (once right after start, once at the end). The tests check
the three traces end to end, that every counter a Grafana panel queries exists from start (at 0),
that every panel's every selector has a series at the end, and that each service reads exactly the
channels the registry (and so docs/subjects.md) lists it as a consumer of.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import torch
from opentelemetry import propagate
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from rose.client import PublishFailedError, WeightsClient
from rose.contracts.lease import Lease
from rose.contracts.registry import (
    CHANNELS,
    LEASE,
    ROLLOUT_TASK,
    ROUTE_TURN,
    SERVICE_REGISTRY,
    SLO_ALERT,
    TRAJECTORY,
    WEIGHT_APPLIED,
    WEIGHT_FAILED,
    WEIGHT_PUBLISH,
    WEIGHTS_STAGING_OBJECTS,
    Kind,
)
from rose.contracts.rollout import RolloutTask, TurnRouteRequest
from rose.contracts.slo import SloAlert
from rose.contracts.weights import WeightPublishRequest
from rose.services.executor import main as executor_main
from rose.services.executor.config import EngineSettings, ExecutorConfig, ModelsConfig
from rose.services.rollout_worker import main as worker_main
from rose.services.rollout_worker.config import RolloutWorkerConfig
from rose.services.scheduler import main as scheduler_main
from rose.services.scheduler.config import LeaseSettings, SchedulerConfig
from rose.services.slo_monitor import main as monitor_main
from rose.services.slo_monitor.config import SloMonitorConfig
from rose.services.weight_publisher import main as publisher_main
from rose.services.weight_publisher.config import WeightPublisherConfig
from rose.shared.bus import Bus
from rose.shared.config import BusConfig, RuntimeConfig
from rose.shared.models import POLICY_DIRNAME, PolicyModelRef, load_model
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.shared.tracing import tracer
from rose.shared.turns.settings import TurnSettings
from rose.shared.weight_store import WeightStore
from rose.shared.weight_sync import WeightFollower
from rose.testing.polling import until, within

DASHBOARDS = Path(__file__).resolve().parents[2] / "deploy" / "compose" / "grafana" / "dashboards"
START_TIMEOUT_S = 120.0
STEP_TIMEOUT_S = 60.0
EXECUTOR = "obs-ex"
LATE_EXECUTOR = "obs-late"
SERVICES = {"executor": EXECUTOR, "slo_monitor": "obs-mon", "scheduler": "obs-sched", "weight_publisher": "obs-wp", "rollout_worker": "obs-worker"}


@dataclass
class Observed:
    spans: list[ReadableSpan]
    serving_trace: int
    rollout_trace: int
    weights_trace: int
    trajectory_turns: int
    endpoints: dict[str, dict[str, str]]
    scrapes: dict[str, str]
    exported: set[str] = field(default_factory=set)
    healthy: str = ""  # every service's /metrics after good work only (served, rolled out, published), before any fault
    reads: dict[str, set[str]] = field(default_factory=dict)  # service -> registry channels its bus read


@pytest.fixture(scope="module")
async def observed(tmp_path_factory, models_dir, spans) -> Observed:
    root = tmp_path_factory.mktemp("observability")
    server = NatsServer(root / "nats").start()
    bus_cfg = BusConfig(url=server.url, initial_connect_deadline_s=10.0, drain_timeout_s=2.0)

    def runtime(name: str) -> RuntimeConfig:
        return RuntimeConfig(instance=SERVICES[name], heartbeat_interval_s=0.3)

    configs = {
        "executor": ExecutorConfig(
            bus=bus_cfg,
            runtime=runtime("executor"),
            models=ModelsConfig(dir=str(models_dir)),
            engine=EngineSettings(device="cpu", serving_kv_mib=16, rollout_kv_mib=16),
            metrics_interval_s=0.2,
        ),
        "slo_monitor": SloMonitorConfig(bus=bus_cfg, runtime=runtime("slo_monitor"), headroom_interval_s=0.3),
        "scheduler": SchedulerConfig(
            bus=bus_cfg, runtime=runtime("scheduler"), tick_s=0.2, leases=LeaseSettings(ttl_s=30.0, renew_before_s=10.0, cooldown_s=60.0)
        ),
        "weight_publisher": WeightPublisherConfig(bus=bus_cfg, runtime=runtime("weight_publisher")),
        "rollout_worker": RolloutWorkerConfig(
            bus=bus_cfg,
            runtime=runtime("rollout_worker"),
            models=PolicyModelRef(dir=str(models_dir)),
            turns=TurnSettings(max_tokens=4, hedge=False),
            concurrency=1,
        ),
    }
    mains = {
        "executor": executor_main,
        "slo_monitor": monitor_main,
        "scheduler": scheduler_main,
        "weight_publisher": publisher_main,
        "rollout_worker": worker_main,
    }
    buses: list[Bus] = []  # every service's bus, to read back which channels it read (the Bus records them)
    connect = Bus.connect

    async def recording_connect(self: Bus) -> None:
        buses.append(self)
        await connect(self)

    Bus.connect = recording_connect  # type: ignore[method-assign]
    tasks = {name: asyncio.create_task(mains[name].run(cfg), name=f"obs-{name}") for name, cfg in configs.items()}
    bus = Bus(bus_cfg, service="tests", instance="obs-tests")
    try:
        await bus.connect()
        await provision(bus.js)

        async def all_ready():
            for name, task in tasks.items():
                if task.done():
                    raise RuntimeError(f"{name} exited: {task.exception()!r}")
            beats = [await bus.kv_get(SERVICE_REGISTRY, service=s, instance=i) for s, i in SERVICES.items()]
            return all(b is not None and b.state == "ready" for b in beats) and beats

        beats = await until(all_ready, START_TIMEOUT_S, "every service ready")
        endpoints = {b.service: dict(b.endpoints) for b in beats}

        async def leased() -> Lease | None:
            lease = await bus.kv_get(LEASE, executor_id=EXECUTOR)
            return lease if lease is not None and lease.state == "active" else None

        await until(leased, STEP_TIMEOUT_S, "a lease granted to the executor")

        trajectories: dict[str, object] = {}

        async def on_trajectory(t, _d):
            trajectories[t.task_id] = t

        await bus.subscribe(TRAJECTORY, on_trajectory)
        applied: list[object] = []

        async def on_applied(event, _d):
            applied.append(event)

        await bus.subscribe(WEIGHT_APPLIED, on_applied, executor_id=EXECUTOR)
        refused: list[object] = []

        async def on_refused(event, _d):
            refused.append(event)

        await bus.subscribe(WEIGHT_FAILED, on_refused, executor_id=EXECUTOR)

        # 1. a serving request over HTTP, continuing the caller's trace
        with tracer().start_as_current_span("test.serving_client", kind=SpanKind.CLIENT) as client_span:
            headers: dict[str, str] = {}
            propagate.inject(headers)
            body = {"model": "rose-serving", "prompt": "2+3=", "max_tokens": 4, "temperature": 0}
            async with aiohttp.ClientSession() as http, http.post(f"{endpoints['executor']['http']}/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
        serving_trace = client_span.get_span_context().trace_id

        # 2. a rollout task (two turns), and a task for an unknown environment (a failed trajectory)
        task_id = f"obs-{uuid.uuid4().hex[:8]}"
        with tracer().start_as_current_span("test.trainer_tasks") as root_span:
            await bus.publish(ROLLOUT_TASK, RolloutTask(task_id=task_id, env="conversation", prompt="hello", max_turns=2, env_args={"turns": "2"}))
        rollout_trace = root_span.get_span_context().trace_id
        await until(lambda: _has(trajectories, {task_id}), STEP_TIMEOUT_S, "the trajectory")
        trajectory = trajectories[task_id]
        assert trajectory.status == "completed", trajectory.reason

        # 3. a weight version published through the SDK, applied by the executor
        state = {k: v.clone() for k, v in load_model(models_dir / POLICY_DIRNAME).state_dict().items()}
        first = next(iter(state))
        state[first] += 1e-3
        async with WeightsClient(bus, "policy") as weights:
            with tracer().start_as_current_span("test.trainer_publish") as publish_span:
                await weights.publish(state, version=1)
            await weights.published(1, timeout=STEP_TIMEOUT_S)
            weights_trace = publish_span.get_span_context().trace_id
            await until(lambda: _true(applied), STEP_TIMEOUT_S, "WeightApplied from the executor")
            # an executor joining late catches up to v1: its apply belongs to v1's trace too
            late_state = load_model(models_dir / POLICY_DIRNAME).state_dict()

            async def keep(update, version):
                return 0.0

            late = WeightFollower(bus, model="policy", apply=keep, executor_id=LATE_EXECUTOR)
            await late.start(late_state, 0)
            assert late.version == 1
            await late.stop()
            # the services export on their telemetry interval, each in its own process: every panel's gauges and counters
            healthy = await _scrape_once_shown(endpoints, [s for s in _dashboard_selectors() if not s[2].endswith("_bucket")])
            # now the faults: an HTTP error, a task for an unknown environment (a failed trajectory)
            async with (
                aiohttp.ClientSession() as http,
                http.post(f"{endpoints['executor']['http']}/v1/completions", json={**body, "model": "nope"}) as r,
            ):
                assert r.status == 404  # counted as an HTTP error
            await bus.publish(ROLLOUT_TASK, RolloutTask(task_id=f"{task_id}-bad", env="no_such_env", prompt="x"))
            await until(lambda: _has(trajectories, {f"{task_id}-bad"}), STEP_TIMEOUT_S, "the failed trajectory")
            # a version with a tensor the policy does not have: published, refused by the executor
            await weights.publish({**state, "bogus.weight": torch.zeros(4)}, version=2)
            await weights.published(2, timeout=STEP_TIMEOUT_S)
            await until(lambda: _true(refused), STEP_TIMEOUT_S, "WeightFailed from the executor")
            # a staged object that is not safetensors: the publisher fails the version
            await WeightStore(bus.js, WEIGHTS_STAGING_OBJECTS.bucket).put("obs-junk", b"not safetensors")
            request = WeightPublishRequest(request_id="obs-r3", model="policy", version=3, source="object", object_name="obs-junk")
            await bus.request(WEIGHT_PUBLISH, request, model="policy")
            with pytest.raises(PublishFailedError):
                await weights.published(3, timeout=STEP_TIMEOUT_S)

        # 4. an SLO alert: the scheduler revokes the lease
        await bus.publish(SLO_ALERT, SloAlert(executor_id=EXECUTOR, at=time.time(), severity="burst", reason="test burst"), executor_id=EXECUTOR)
        await until(lambda: _not(leased), STEP_TIMEOUT_S, "the lease revoked")
        nowhere = await bus.request(ROUTE_TURN, TurnRouteRequest(trajectory_id="obs-unroutable", turn_index=0, prompt_tokens=1))
        assert nowhere.executor_id == "", nowhere  # the only executor has no lease now

        # a histogram of a rare event (the revocation's reclaim) has its first series once the scheduler exports again
        await _scrape_once_shown(endpoints, [s for s in _dashboard_selectors() if s[2].endswith("_bucket")])
        scrapes = {}
        async with aiohttp.ClientSession() as http:
            for service, eps in endpoints.items():
                async with http.get(eps["metrics"]) as r:
                    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                    scrapes[service] = await r.text()
            async with http.get(f"{endpoints['executor']['http']}/metrics") as r:
                scrapes["executor_http"] = await r.text()
        finished = list(spans.get_finished_spans())
        exported = {sample.name for text in scrapes.values() for family in text_string_to_metric_families(text) for sample in family.samples}
        reads: dict[str, set[str]] = {}
        for b in buses:
            if b.service in SERVICES:
                reads.setdefault(b.service, set()).update(b.reads)
        yield Observed(
            finished, serving_trace, rollout_trace, weights_trace, len(trajectory.turns), endpoints, scrapes, exported, healthy=healthy, reads=reads
        )
    finally:
        Bus.connect = connect  # type: ignore[method-assign]
        for name in reversed(list(tasks)):
            tasks[name].cancel()
            await asyncio.wait([tasks[name]], timeout=15)
        await bus.close()
        server.stop()


async def _scrape_all(endpoints: dict[str, dict[str, str]]) -> str:
    texts = []
    async with aiohttp.ClientSession() as http:
        for eps in endpoints.values():
            async with http.get(eps["metrics"]) as r:
                texts.append(await r.text())
    return "\n".join(texts)


async def _scrape_once_shown(endpoints: dict[str, dict[str, str]], shown: list[tuple[str, str, str, list[tuple[str, str, str]]]]) -> str:
    """Every service's /metrics once each of these panel selectors has a series, or the last scrape after
    STEP_TIMEOUT_S: the test that reads it then names the panels still without one."""
    last = ""

    async def all_shown() -> bool:
        nonlocal last
        last = await _scrape_all(endpoints)
        have = _series(last)
        return all(any(n == name and _matches(labels, matchers) for n, labels in have) for _, _, name, matchers in shown)

    await within(all_shown, STEP_TIMEOUT_S, step=0.2)
    return last


def _series(text: str) -> list[tuple[str, dict[str, str]]]:
    return [(sample.name, sample.labels) for family in text_string_to_metric_families(text) for sample in family.samples]


async def _has(d: dict, keys: set[str]) -> bool:
    return keys <= set(d)


async def _true(items: list) -> bool:
    return bool(items)


async def _not(predicate) -> bool:
    return not await predicate()


def _trace(observed: Observed, trace_id: int) -> list[ReadableSpan]:
    return [s for s in observed.spans if s.context.trace_id == trace_id]


def _ancestors(span: ReadableSpan, by_id: dict[int, ReadableSpan]) -> list[str]:
    names = []
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        names.append(span.name)
    return names


def test_every_service_advertises_a_metrics_endpoint(observed):
    for service, eps in observed.endpoints.items():
        assert eps.get("metrics", "").endswith("/metrics"), (service, eps)
        assert "target_info" in observed.scrapes[service]
    assert "rose_executor_ttft_seconds_bucket" in observed.scrapes["executor_http"]  # the executor's own /metrics serves the same registry


def test_serving_request_is_one_trace_through_the_executor(observed):
    spans = _trace(observed, observed.serving_trace)
    by_name = {s.name: s for s in spans}
    server = by_name["POST /v1/completions"]
    assert server.kind == SpanKind.SERVER and server.parent is not None
    assert by_name["test.serving_client"].context.span_id == server.parent.span_id
    assert server.attributes["http.response.status_code"] == 200 and server.attributes["rose.executor_id"] == EXECUTOR
    work = by_name["executor.serving"]
    assert work.parent.span_id == server.context.span_id
    assert work.attributes["gen_ai.usage.output_tokens"] >= 1 and work.attributes["rose.ttft_ms"] > 0
    assert [e.name for e in work.events] == ["scheduled", "first_token"]


def test_rollout_task_is_one_trace_through_every_turn_and_executor(observed):
    spans = _trace(observed, observed.rollout_trace)
    by_id = {s.context.span_id: s for s in spans}
    names = [s.name for s in spans]
    episodes = [s for s in spans if s.name == "rollout.episode"]
    turns = [s for s in spans if s.name == "rollout.turn"]
    executor_turns = [s for s in spans if s.name == "executor.rollout"]
    assert len(episodes) == 1 and episodes[0].attributes["rose.status"] == "completed"
    assert "process rose.rollout.tasks" in _ancestors(episodes[0], by_id)
    assert len(turns) == observed.trajectory_turns == 2
    for span in turns:  # the worker's side of a turn: waiting for an executor to be lent, asking the scheduler
        assert span.attributes["rose.lease_wait_ms"] >= 0 and span.attributes["rose.route_ms"] > 0
    assert len(executor_turns) >= len(turns)
    for span in executor_turns:
        assert span.attributes["rose.executor_id"] == EXECUTOR and span.attributes["rose.outcome"] == "ok"
        assert {"rollout.turn", "rollout.episode", "reply rose.executor.{executor_id}.generate"} <= set(_ancestors(span, by_id))
        # where the turn's time went, for a dashboard to stack: admission, engine queue, prefill, decode
        split = [span.attributes[k] for k in ("rose.admit_ms", "rose.queue_ms", "rose.prefill_ms", "rose.decode_ms")]
        assert all(v >= 0 for v in split) and sum(split[1:]) == pytest.approx(span.attributes["rose.total_ms"], rel=1e-6, abs=1e-6)
    assert names.count("scheduler.place") >= len(turns)
    for span in spans:
        if span.name == "scheduler.place":  # what a slow route reply spent deciding, and the CPU it had meanwhile
            assert span.attributes["rose.candidates"] >= 1 and span.attributes["rose.place_ms"] >= 0 and span.attributes["rose.span_cpu_ms"] >= 0
        if span.name.startswith("reply "):  # the wait before its handler ran, the handler's wall and CPU time
            assert (
                span.attributes["rose.loop_wait_ms"] >= 0 and span.attributes["rose.handler_ms"] >= 0 and span.attributes["rose.handler_cpu_ms"] >= 0
            )
    assert "send rose.rollout.trajectories.{status}" in names


def test_traces_have_no_broken_parent_links_and_no_periodic_roots(observed):
    """Each of the three traces is whole (every parent recorded), and no heartbeat, telemetry snapshot or
    headroom started a trace (they are untraced unless ROSE_TRACE_PERIODIC is set)."""
    for trace_id in (observed.serving_trace, observed.rollout_trace, observed.weights_trace):
        spans = _trace(observed, trace_id)
        ids = {s.context.span_id for s in spans}
        roots = [s for s in spans if s.parent is None]
        assert len(roots) == 1 and roots[0].name.startswith("test."), [s.name for s in roots]
        broken = [s.name for s in spans if s.parent is not None and s.parent.span_id not in ids]
        assert not broken, broken
    periodic = ("rose.svc.heartbeat.", "rose.telemetry.", "rose.slo.headroom.")
    assert not [s.name for s in observed.spans if any(p in s.name for p in periodic)]


def test_weight_publish_is_one_trace_to_the_executors_apply(observed):
    spans = _trace(observed, observed.weights_trace)
    by_id = {s.context.span_id: s for s in spans}
    publish = [s for s in spans if s.name == "weights.publish"]
    apply = [s for s in spans if s.name == "weights.apply"]
    assert len(publish) == 1 and publish[0].attributes["rose.weight_version"] == 1
    assert "reply rose.weights.publish.{model}" in _ancestors(publish[0], by_id)
    assert sorted(s.attributes["rose.executor_id"] for s in apply) == sorted([EXECUTOR, LATE_EXECUTOR])  # the late joiner's catch-up too
    for span in apply:
        assert span.attributes["rose.outcome"] == "applied" and span.attributes["rose.weight_version"] == 1
        assert {"weights.publish", "weights.client_publish", "test.trainer_publish"} <= set(_ancestors(span, by_id))
    assert next(s for s in apply if s.attributes["rose.executor_id"] == LATE_EXECUTOR).attributes["rose.catch_up"] is True
    applied_events = [s for s in spans if s.name == "send rose.events.weights.applied.{executor_id}"]
    assert len(applied_events) == 2 and all("weights.apply" in _ancestors(e, by_id) for e in applied_events)


def test_metric_names_follow_conventions(observed):
    ours = {n for n in observed.exported if n.startswith("rose_")}
    assert {
        "rose_executor_ttft_seconds_bucket",
        "rose_executor_tpot_seconds_bucket",
        "rose_scheduler_leases_total",
        "rose_rollout_trajectories_total",
        "rose_weight_publisher_version_wire_bytes",
        "rose_weights_applied_total",
        "rose_slo_ttft_p99_seconds",
    } <= ours
    families = {f.name: f.type for text in observed.scrapes.values() for f in text_string_to_metric_families(text) if f.name.startswith("rose_")}
    for name, kind in families.items():
        if kind == "counter":
            assert f"{name}_total" in ours, name
        if kind == "histogram":
            assert name.endswith("_seconds"), f"histogram {name} is not in seconds"
        assert not re.search(r"_ms\b|_milliseconds", name), name


PROMQL_WORDS = {
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "rate",
    "irate",
    "increase",
    "delta",
    "deriv",
    "histogram_quantile",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "offset",
    "bool",
    "topk",
    "bottomk",
    "clamp_min",
    "clamp_max",
    "abs",
    "vector",
    "scalar",
    "time",
    "label_replace",
    "max_over_time",
    "min_over_time",
    "avg_over_time",
    "last_over_time",
    "changes",
    "resets",
    "le",
    "sort",
    "sort_desc",
}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers outside label matchers, strings, ranges and grouping clauses."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # grouping labels
    expr = re.sub(r"\$\w+|\$\{[^}]*\}", "", expr)  # Grafana variables
    names = set(re.findall(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w]*\s*\()", expr))
    return {n for n in names if n not in PROMQL_WORDS and not re.fullmatch(r"\d.*|e\d*", n)}


MATCHER_RE = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """Each metric selector of a PromQL expression: its name and label matchers (label, op, value)."""
    out = []
    for name in sorted(metric_names(expr)):
        for m in re.finditer(rf"(?<![\w:]){re.escape(name)}(?![\w:])\s*(\{{[^}}]*\}})?", expr):
            out.append((name, MATCHER_RE.findall(m.group(1) or "")))
    return out


def _matches(labels: dict[str, str], matchers: list[tuple[str, str, str]]) -> bool:
    """Whether a series' labels satisfy the matchers (a Grafana variable matches anything: its `All`)."""
    for label, op, value in matchers:
        if "$" in value:
            continue
        have = labels.get(label, "")
        hit = have == value if op in ("=", "!=") else re.fullmatch(value, have) is not None
        if hit != (op in ("=", "=~")):
            return False
    return True


def _dashboard_selectors() -> list[tuple[str, str, str, list[tuple[str, str, str]]]]:
    """(dashboard file, panel title, metric, matchers) of every selector of every panel query."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for panel in _panels(json.loads(path.read_text())):
            for target in panel.get("targets", []):
                out += [(path.name, panel.get("title", ""), name, matchers) for name, matchers in selectors(target["expr"])]
    return out


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows
    return out


def test_metric_name_extraction():
    expr = (
        'histogram_quantile(0.99, sum by (le, executor) (rate(rose_executor_ttft_seconds_bucket{executor=~"$executor"}[$__rate_interval]))) / '
        "on() group_left max(rose_slo_ttft_target_seconds)"
    )
    assert metric_names(expr) == {"rose_executor_ttft_seconds_bucket", "rose_slo_ttft_target_seconds"}
    expr = 'sum(rate(rose_x_total{outcome="hit",executor=~"$executor"}[5m])) / sum(rate(rose_x_total[5m]))'
    assert selectors(expr) == [("rose_x_total", [("outcome", "=", "hit"), ("executor", "=~", "$executor")]), ("rose_x_total", [])]
    assert _matches({"outcome": "hit", "executor": "a"}, selectors(expr)[0][1]) and not _matches({"outcome": "miss"}, selectors(expr)[0][1])


def test_every_panel_selector_has_a_series_on_a_healthy_fleet(observed):
    """A fleet that served, rolled out and published, with no fault yet: every panel's every selector
    has a series, so no panel says "No data" where the truth is 0 (counters of rare events, e.g.
    unroutable turns, tool calls, alerts and failures, are exported at 0 from the start).

    A histogram of a rare event (reclaim latency) has no series before its first observation:
    the SDK exports none, and a quantile of nothing is rightly "No data". Those are checked on the
    final scrape, after the fixture's faults (a lease revoked: a reclaim)."""

    healthy, final = _series(observed.healthy), _series("\n".join(observed.scrapes.values()))
    empty = [
        (f, title, name, matchers)
        for f, title, name, matchers in _dashboard_selectors()
        if not any(n == name and _matches(labels, matchers) for n, labels in (final if name.endswith("_bucket") else healthy))
    ]
    assert not empty, "panels with no series: " + "; ".join(f"{f}: {title!r} {name}{matchers}" for f, title, name, matchers in empty)


def test_every_dashboard_query_names_an_exported_metric(observed):
    files = sorted(DASHBOARDS.glob("*.json"))
    assert files, f"no dashboards under {DASHBOARDS}"
    checked = 0
    for path in files:
        dashboard = json.loads(path.read_text())
        for variable in dashboard.get("templating", {}).get("list", []):
            if variable.get("type") == "query":
                assert variable["datasource"]["uid"] == "prometheus", f"{path.name}: variable {variable['name']}"
                metric = re.fullmatch(r"label_values\((\w+),\s*\w+\)", variable["definition"])
                assert metric and metric.group(1) in observed.exported, f"{path.name}: variable {variable['name']} reads {variable['definition']!r}"
        for panel in _panels(dashboard):
            if panel.get("type") == "row":
                continue
            targets = panel.get("targets", [])
            assert targets, f"{path.name}: panel {panel.get('title')!r} has no query"
            assert panel["datasource"]["uid"] == "prometheus", f"{path.name}: panel {panel.get('title')!r}"
            for target in targets:
                assert target.get("datasource", panel["datasource"])["uid"] == "prometheus"
                names = metric_names(target["expr"])
                assert names, f"{path.name}: panel {panel.get('title')!r}: no metric in {target['expr']!r}"
                missing = names - observed.exported
                assert not missing, f"{path.name}: panel {panel.get('title')!r} queries {sorted(missing)}, which no service exported"
                checked += 1
    assert checked >= 10


def registry_reads(service: str) -> set[str]:
    """The channels the registry lists `service` as a consumer of (object stores are read through the store, not a bus channel)."""
    return {c.name for c in CHANNELS if service in c.consumers and c.kind is not Kind.OBJECTS}


def test_each_service_reads_exactly_what_the_registry_says(observed):
    """Who really subscribes (recorded by each service's Bus while it ran: subscribe, consume, serve, KV
    watch and reads), against the registry's consumers, from which docs/subjects.md's table is
    generated (`python -m rose.contracts.subjects_table`) and the services' NATS rights derived. A KV
    bucket only this service writes, read back (the scheduler's leases), is its own state, not consumed
    (rose.shared.security grants that read to the sole publisher)."""
    assert set(observed.reads) == set(SERVICES)
    for service, reads in observed.reads.items():
        own = {c.name for c in CHANNELS if c.kind is Kind.KV and c.publishers == (service,)}
        assert reads - own == registry_reads(service) - own, (
            f"{service}: reads but is no consumer of {sorted(reads - own - registry_reads(service))}; "
            f"listed as a consumer of but never read {sorted(registry_reads(service) - own - reads)}"
        )
