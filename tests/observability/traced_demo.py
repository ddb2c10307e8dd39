"""A traced `rose demo`: every span its processes export, received by a real OTLP/HTTP receiver, then checked.

    .venv/bin/python tests/observability/traced_demo.py --out /tmp/traced-demo -- --duration 40 --warm-start-steps 40

(arguments after `--` go to `rose demo`). Prints, and writes to OUT/traces.json (every span: OUT/spans.json):

- broken parent links: spans whose parent is not among the trace's spans;
- root spans started by a periodic message (heartbeats, telemetry snapshots, headroom);
- per rollout task trace: whether it spans trainer -> rollout worker -> scheduler -> executor -> trainer;
- per weight version trace: which executors applied it (every executor of the run, late joiners too).

An operator's check, not a test: the demo takes minutes. The demo's processes inherit the
environment, so `OTEL_EXPORTER_OTLP_ENDPOINT` points them all at the receiver.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from rose.testing.otlp_receiver import otlp_receiver

PERIODIC = ("rose.svc.heartbeat.", "rose.telemetry.", "rose.slo.headroom.")
TASK_PATH = ("rose-trainer", "rose-rollout-worker", "rose-scheduler", "rose-executor")


def _spans(received: list) -> list[dict]:
    out = []
    for message in received:
        for resource in message.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource.resource.attributes}
            for scope in resource.scope_spans:
                for span in scope.spans:
                    out.append(
                        {
                            "service": attrs.get("service.name", ""),
                            "instance": attrs.get("service.instance.id", ""),
                            "name": span.name,
                            "trace": span.trace_id.hex(),
                            "id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(),
                            "start": span.start_time_unix_nano,
                            "end": span.end_time_unix_nano,
                            "attributes": {
                                a.key: (a.value.string_value or a.value.int_value or a.value.double_value or a.value.bool_value)
                                for a in span.attributes
                            },
                        }
                    )
    return out


def analyse(spans: list[dict]) -> dict:
    traces: dict[str, list[dict]] = defaultdict(list)
    for s in spans:
        traces[s["trace"]].append(s)
    broken, periodic_roots, tasks, versions = [], [], [], {}
    executors = {s["instance"] for s in spans if s["service"] == "rose-executor"}
    for members in traces.values():
        ids = {s["id"] for s in members}
        broken += [f"{s['service']}: {s['name']}" for s in members if s["parent"] and s["parent"] not in ids]
        periodic_roots += [s["name"] for s in members if not s["parent"] and any(p in s["name"] for p in PERIODIC)]
        ordered = sorted(members, key=lambda s: s["start"])
        if any(s["name"] == "process rose.rollout.tasks" for s in members):
            services = [s["service"] for s in ordered]
            whole = (
                all(svc in services for svc in TASK_PATH)
                and services[0] == "rose-trainer"
                and any(s["service"] == "rose-trainer" and s["name"].startswith("process rose.rollout.trajectories") for s in members)
            )
            tasks.append(whole)
        for s in members:
            if s["name"] == "weights.publish":
                applied = {a["attributes"].get("rose.executor_id") for a in members if a["name"] == "weights.apply"}
                versions[str(s["attributes"].get("rose.weight_version"))] = sorted(applied)
    return {
        "spans": len(spans),
        "traces": len(traces),
        "broken_parent_links": len(broken),
        "broken_examples": broken[:10],
        "periodic_roots": len(periodic_roots),
        "periodic_root_examples": periodic_roots[:10],
        "task_traces": len(tasks),
        "task_traces_whole": sum(tasks),
        "executors": sorted(executors),
        "weight_versions": versions,
        "weight_versions_reaching_every_executor": sum(1 for v in versions.values() if set(v) >= executors),
        "route_replies_ms": _route_replies(spans),
        "roots_by_name": dict(sorted(_count(s["name"] for s in spans if not s["parent"]).items(), key=lambda kv: -kv[1])[:15]),
    }


def _route_replies(spans: list[dict]) -> dict[str, float]:
    """Where a route reply's time goes: waiting for the scheduler's loop, deciding, and what is left."""
    children: dict[str, list[dict]] = defaultdict(list)
    for s in spans:
        children[s["parent"]].append(s)
    rows = []
    for s in spans:
        if s["name"] == "reply rose.scheduler.route":
            total = (s["end"] - s["start"]) / 1e6
            inside = sum((c["end"] - c["start"]) / 1e6 for c in children[s["id"]] if c["name"] == "scheduler.place")
            cpu = sum(float(c["attributes"].get("rose.span_cpu_ms", 0.0)) for c in children[s["id"]] if c["name"] == "scheduler.place")
            rows.append(
                (
                    total,
                    float(s["attributes"].get("rose.loop_wait_ms", 0.0)),
                    inside,
                    float(s["attributes"].get("rose.handler_ms", 0.0)),
                    float(s["attributes"].get("rose.handler_cpu_ms", 0.0)),
                    cpu,
                )
            )
    if not rows:
        return {}
    rows.sort()

    def pct(values: list[float], q: float) -> float:
        values = sorted(values)
        return round(values[min(len(values) - 1, int(q * len(values)))], 3)

    return {
        "count": len(rows),
        "reply_p50": pct([r[0] for r in rows], 0.5),
        "reply_p99": pct([r[0] for r in rows], 0.99),
        "reply_max": round(rows[-1][0], 3),
        "slowest_loop_wait": round(rows[-1][1], 3),
        "slowest_place": round(rows[-1][2], 3),
        "slowest_unexplained": round(rows[-1][0] - rows[-1][2], 3),
        "loop_wait_p99": pct([r[1] for r in rows], 0.99),
        "slowest_handler": round(rows[-1][3], 3),
        "slowest_handler_cpu": round(rows[-1][4], 3),
        "slowest_place_cpu": round(rows[-1][5], 3),
        "slowest_5": [[round(v, 2) for v in r] for r in rows[-5:]],  # (reply, loop wait, place span, handler, handler CPU, place CPU) ms
    }


def _count(items) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for item in items:
        out[item] += 1
    return out


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="traced-demo", help="the demo's --out, and where traces.json goes")
    parser.add_argument("demo_args", nargs="*", help="arguments for `rose demo` (after --)")
    args = parser.parse_args()
    out = Path(args.out)
    async with otlp_receiver("/v1/traces", ExportTraceServiceRequest) as (endpoint, received):
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_METRICS_EXPORTER": "none", "OTEL_BSP_SCHEDULE_DELAY": "500"}
        command = [sys.executable, "-m", "rose.cli.main", "demo", "--out", str(out), *args.demo_args]
        print("running:", " ".join(command), flush=True)
        proc = await asyncio.create_subprocess_exec(*command, env=env)
        code = await proc.wait()
        await asyncio.sleep(2.0)  # the last batches of spans
    spans = _spans(received)
    report = analyse(spans)
    out.mkdir(parents=True, exist_ok=True)
    (out / "traces.json").write_text(json.dumps(report, indent=2))
    (out / "spans.json").write_text(json.dumps(spans))  # every span, to look at a trace again
    print(json.dumps(report, indent=2))
    return code


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
