"""Traces and metrics of a real fleet: executor, SLO monitor, scheduler, weight publisher and rollout
worker, each started by its own `run(config)` in this process (so the `spans` fixture sees every
span), on a nats-server of their own. The fixture drives one serving request over HTTP, one
rollout task, one failing task, one weight publish and one SLO alert, then scrapes every
service's advertised metrics endpoint. The tests check the three traces end to end and that
every Grafana dashboard query names a metric these services really exported.
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
from polling import until
import torch
from opentelemetry import propagate
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from rose.client import PublishFailedError, WeightsClient
from rose.contracts.lease import Lease
from rose.contracts.registry import LEASE, ROLLOUT_TASK, ROUTE_TURN, SERVICE_REGISTRY, SLO_ALERT, TRAJECTORY, WEIGHT_APPLIED, WEIGHT_FAILED, WEIGHT_PUBLISH, WEIGHTS_STAGING_OBJECTS
from rose.contracts.rollout import RolloutTask, ToolCall, TurnRecord, TurnRouteRequest
from rose.contracts.slo import SloAlert
from rose.contracts.weights import WeightPublishRequest
from rose.services.executor import main as executor_main
from rose.services.executor.config import EngineSettings, ExecutorConfig, ModelsConfig
from rose.services.rollout_worker import main as worker_main
from rose.services.rollout_worker.config import RolloutWorkerConfig, TurnSettings
from rose.services.rollout_worker.telemetry import RolloutMetrics
from rose.services.scheduler import main as scheduler_main
from rose.services.scheduler.config import LeaseSettings, SchedulerConfig
from rose.services.slo_monitor import main as monitor_main
from rose.services.slo_monitor.config import SloMonitorConfig
from rose.services.slo_monitor.telemetry import MonitorMetrics
from rose.services.weight_publisher import main as publisher_main
from rose.services.weight_publisher.config import WeightPublisherConfig
from rose.shared.bus import Bus
from rose.shared.config import BusConfig, RuntimeConfig
from rose.shared.models import POLICY_DIRNAME, PolicyModelRef, load_model
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.shared.tracing import tracer
from rose.shared.weight_store import WeightStore

DASHBOARDS = Path(__file__).resolve().parents[2] / "deploy" / "compose" / "grafana" / "dashboards"
START_TIMEOUT_S = 120.0
STEP_TIMEOUT_S = 60.0
EXECUTOR = "obs-ex"
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


@pytest.fixture(scope="module")
async def observed(tmp_path_factory, models_dir, spans) -> Observed:
    root = tmp_path_factory.mktemp("observability")
    server = NatsServer(root / "nats").start()
    bus_cfg = BusConfig(url=server.url, initial_connect_deadline_s=10.0, drain_timeout_s=2.0)

    def runtime(name: str) -> RuntimeConfig:
        return RuntimeConfig(instance=SERVICES[name], heartbeat_interval_s=0.3)

    configs = {
        "executor": ExecutorConfig(
            bus=bus_cfg, runtime=runtime("executor"), models=ModelsConfig(dir=str(models_dir)),
            engine=EngineSettings(device="cpu", serving_kv_mib=16, rollout_kv_mib=16), metrics_interval_s=0.2,
        ),
        "slo_monitor": SloMonitorConfig(bus=bus_cfg, runtime=runtime("slo_monitor"), headroom_interval_s=0.3),
        "scheduler": SchedulerConfig(bus=bus_cfg, runtime=runtime("scheduler"), tick_s=0.2, leases=LeaseSettings(ttl_s=30.0, renew_before_s=10.0, cooldown_s=60.0)),
        "weight_publisher": WeightPublisherConfig(bus=bus_cfg, runtime=runtime("weight_publisher")),
        "rollout_worker": RolloutWorkerConfig(
            bus=bus_cfg, runtime=runtime("rollout_worker"), models=PolicyModelRef(dir=str(models_dir)),
            turns=TurnSettings(max_tokens=4, hedge=False), concurrency=1,
        ),
    }
    mains = {"executor": executor_main, "slo_monitor": monitor_main, "scheduler": scheduler_main, "weight_publisher": publisher_main, "rollout_worker": worker_main}
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
        async with aiohttp.ClientSession() as http, http.post(f"{endpoints['executor']['http']}/v1/completions", json={**body, "model": "nope"}) as r:
            assert r.status == 404  # counted as an HTTP error

        # 2. a rollout task (two turns), and a task for an unknown environment (a failed trajectory)
        task_id = f"obs-{uuid.uuid4().hex[:8]}"
        with tracer().start_as_current_span("test.trainer_tasks") as root_span:
            await bus.publish(ROLLOUT_TASK, RolloutTask(task_id=task_id, env="conversation", prompt="hello", max_turns=2, env_args={"turns": "2"}))
        rollout_trace = root_span.get_span_context().trace_id
        await bus.publish(ROLLOUT_TASK, RolloutTask(task_id=f"{task_id}-bad", env="no_such_env", prompt="x"))
        await until(lambda: _has(trajectories, {task_id, f"{task_id}-bad"}), STEP_TIMEOUT_S, "both trajectories")
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

        # What no tiny model or quiet test triggers on its own, recorded by the services' own metric classes:
        # a burst found by the monitor, and a tool call made by the policy.
        MonitorMetrics().alert(SloAlert(executor_id=EXECUTOR, at=time.time(), severity="burst", reason="recorded directly"))
        RolloutMetrics().trajectory("arithmetic", "completed", [
            TurnRecord(turn_index=0, prompt_token_ids=[1], token_ids=[2], logprobs=[-0.1], policy_version=1, executor_id=EXECUTOR,
                       tool_calls=[ToolCall(tool="calculator", arguments="1+1", result="2")])
        ])
        await asyncio.sleep(0.6)  # one more telemetry interval and headroom round

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
        yield Observed(finished, serving_trace, rollout_trace, weights_trace, len(trajectory.turns), endpoints, scrapes, exported)
    finally:
        for name in reversed(list(tasks)):
            tasks[name].cancel()
            await asyncio.wait([tasks[name]], timeout=15)
        await bus.close()
        server.stop()


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
    assert len(executor_turns) >= len(turns)
    for span in executor_turns:
        assert span.attributes["rose.executor_id"] == EXECUTOR and span.attributes["rose.outcome"] == "ok"
        assert {"rollout.turn", "rollout.episode", "reply rose.executor.{executor_id}.generate"} <= set(_ancestors(span, by_id))
    assert names.count("scheduler.place") >= len(turns)
    assert "send rose.rollout.trajectories.{status}" in names


def test_weight_publish_is_one_trace_to_the_executors_apply(observed):
    spans = _trace(observed, observed.weights_trace)
    by_id = {s.context.span_id: s for s in spans}
    publish = [s for s in spans if s.name == "weights.publish"]
    apply = [s for s in spans if s.name == "weights.apply"]
    assert len(publish) == 1 and publish[0].attributes["rose.weight_version"] == 1
    assert "reply rose.weights.publish.{model}" in _ancestors(publish[0], by_id)
    assert len(apply) == 1 and apply[0].attributes["rose.executor_id"] == EXECUTOR and apply[0].attributes["rose.outcome"] == "applied"
    assert "weights.publish" in _ancestors(apply[0], by_id)
    applied_event = [s for s in spans if s.name == "send rose.events.weights.applied.{executor_id}"]
    assert applied_event and "weights.apply" in _ancestors(applied_event[0], by_id)


def test_metric_names_follow_conventions(observed):
    ours = {n for n in observed.exported if n.startswith("rose_")}
    assert {"rose_executor_ttft_seconds_bucket", "rose_executor_tpot_seconds_bucket", "rose_scheduler_leases_total", "rose_rollout_trajectories_total",
            "rose_weight_publisher_version_wire_bytes", "rose_weights_applied_total", "rose_slo_ttft_p99_seconds"} <= ours
    families = {f.name: f.type for text in observed.scrapes.values() for f in text_string_to_metric_families(text) if f.name.startswith("rose_")}
    for name, kind in families.items():
        if kind == "counter":
            assert f"{name}_total" in ours, name
        if kind == "histogram":
            assert name.endswith("_seconds"), f"histogram {name} is not in seconds"
        assert not re.search(r"_ms\b|_milliseconds", name), name


PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "rate", "irate", "increase", "delta", "deriv", "histogram_quantile", "by", "without", "on", "ignoring",
    "group_left", "group_right", "and", "or", "unless", "offset", "bool", "topk", "bottomk", "clamp_min", "clamp_max", "abs", "vector", "scalar",
    "time", "label_replace", "max_over_time", "min_over_time", "avg_over_time", "last_over_time", "changes", "resets", "le", "sort", "sort_desc",
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


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows
    return out


def test_metric_name_extraction():
    expr = 'histogram_quantile(0.99, sum by (le, executor) (rate(rose_executor_ttft_seconds_bucket{executor=~"$executor"}[$__rate_interval]))) / on() group_left max(rose_slo_ttft_target_seconds)'
    assert metric_names(expr) == {"rose_executor_ttft_seconds_bucket", "rose_slo_ttft_target_seconds"}


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
