"""The compose cluster as the check sees it from the host: its addresses, what crosses its bus, serving traffic, its dashboards.

`Seen` accumulates what `observe` hears on the bus (tasks, trajectories, weight versions published
and applied, training steps) and does `rose bench faults`'s accounting over it; `ServingLoad` is
production traffic to the serving executors while the check runs.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field

from check_common import DEPLOY

EXECUTORS = {"executor-1": 18001, "executor-2": 18002, "executor-dedicated": 18003}
SERVING = ["executor-1", "executor-2"]  # ROSE_ROLE=serving: production traffic first (ServingLoad)
NATS_URL = "nats://127.0.0.1:14222,nats://127.0.0.1:14223,nats://127.0.0.1:14224"
PROMETHEUS = "http://127.0.0.1:19090"
# Every port host-network.yml listens on (NATS client, route and monitor ports, executors, services'
# /metrics, Prometheus): free before the check starts (tests/deploy/test_compose_host.py).
LISTEN_PORTS = [14222, 14223, 14224, 16222, 16223, 16224, 18222, 18223, 18224, *EXECUTORS.values(), *range(19101, 19107), 19090]


@dataclass
class Seen:
    published: set[str] = field(default_factory=set)
    trajectories: set[str] = field(default_factory=set)
    duplicates: int = 0
    manifests: set[int] = field(default_factory=set)
    keyframes: set[int] = field(default_factory=set)  # versions published as a keyframe (a full state)
    applied: list[tuple[str, int, int]] = field(default_factory=list)  # (executor, version, versions behind)
    steps: list[tuple[float, str, int, int]] = field(default_factory=list)  # (t, run id, step, version)

    def versions_lost(self, executors: Iterable[str], upto: int | None = None) -> list[int]:
        """Published versions (up to `upto`) some executor neither applied nor folded into a later one (a catch-up)."""
        lost: set[int] = set()
        wanted = {v for v in self.manifests if upto is None or v <= upto}
        for ex in executors:
            covered: set[int] = set()
            for e, v, behind in self.applied:
                if e == ex:
                    covered.update(range(v - behind, v + 1))
            lost |= wanted - covered
        return sorted(lost)

    def versions_never_applied(self) -> list[int]:
        """`rose bench faults`'s accounting: published versions that no executor applied, directly or on its
        way to a later one. (An executor restarted after a kill joins at the latest keyframe, a full state
        that carries every earlier version, and applies the deltas after it: the versions between the
        one it held and the keyframe are folded into the keyframe, not applied one by one.)"""
        covered: set[int] = set()
        for _, v, behind in self.applied:
            covered.update(range(v - behind, v + 1))
        return sorted(self.manifests - covered)

    def folded_into_keyframes(self, executor: str) -> tuple[list[int], list[int]]:
        """Of the versions `executor` neither applied nor had in a chain it applied: (those before a keyframe it
        joined at, which carries them; the others, truly skipped)."""
        joined = [v - behind for e, v, behind in self.applied if e == executor and v - behind in self.keyframes]
        rest = self.versions_lost([executor])
        folded = [v for v in rest if any(v < k for k in joined)]
        return folded, [v for v in rest if v not in folded]

    def executors_behind(self, executors: Iterable[str]) -> dict[str, int]:
        """Executors whose newest applied version is not the newest published one (-1: none applied)."""
        newest = max(self.manifests, default=0)
        last = {ex: max((v for e, v, _ in self.applied if e == ex), default=-1) for ex in executors}
        return {ex: v for ex, v in last.items() if v < newest}

    def last_step(self) -> int:
        return self.steps[-1][2] if self.steps else 0


async def observe(bus, seen: Seen, tag: str) -> None:
    from rose.contracts.registry import AGENT_TASK, ROLLOUT_TASK, TRAINING_STEP, TRAJECTORY, WEIGHT_APPLIED, WEIGHT_MANIFEST

    async def on_task(t, _d):
        seen.published.add(t.task_id)

    async def on_trajectory(t, _d):
        if t.task_id in seen.trajectories:
            seen.duplicates += 1
        seen.trajectories.add(t.task_id)

    async def on_manifest(m, _d):
        seen.manifests.add(m.version)
        if m.kind == "keyframe":
            seen.keyframes.add(m.version)

    async def on_applied(a, _d):
        seen.applied.append((a.executor_id, a.version, a.versions_behind))

    async def on_step(s, _d):
        seen.steps.append((time.time(), s.run_id, s.step, s.version))

    await bus.subscribe(ROLLOUT_TASK, on_task)
    await bus.subscribe(AGENT_TASK, on_task)
    await bus.consume(TRAJECTORY, on_trajectory, durable=f"check_traj_{tag}")
    await bus.consume(WEIGHT_MANIFEST, on_manifest, durable=f"check_manifests_{tag}")
    await bus.consume(WEIGHT_APPLIED, on_applied, durable=f"check_applied_{tag}")
    await bus.consume(TRAINING_STEP, on_step, durable=f"check_steps_{tag}")


class ServingLoad:
    """Production traffic while the check runs (from `rose status` to the metrics): a short completion to
    each serving executor in turn, about one a second, with the official `openai` client. The cluster
    serves while it trains, as it is meant to; the serving dashboard's latency and request series come
    from these. Failures (an executor killed) are counted, not retried."""

    def __init__(self, model: str, every_s: float = 1.0) -> None:
        self.model, self.every_s = model, every_s
        self.ok = dict.fromkeys(SERVING, 0)
        self.failed = dict.fromkeys(SERVING, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="serving-load", daemon=True)

    def _run(self) -> None:
        import openai

        clients = {n: openai.OpenAI(base_url=f"http://127.0.0.1:{EXECUTORS[n]}/v1", api_key="unused", timeout=20, max_retries=0) for n in SERVING}
        i = 0
        while not self._stop.is_set():
            name = SERVING[i % len(SERVING)]
            i += 1
            try:
                clients[name].completions.create(model=self.model, prompt=f"{i % 7} + {i % 5} =", max_tokens=8)
                self.ok[name] += 1
            except Exception:
                self.failed[name] += 1
            self._stop.wait(self.every_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> dict[str, dict[str, int]]:
        self._stop.set()
        self._thread.join(30)
        return {"ok": dict(self.ok), "failed": dict(self.failed)}


def http_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - 127.0.0.1 only
        return json.loads(r.read())


async def stream_counts(bus) -> dict[str, int]:
    """Messages in every JetStream stream (the operator may read every stream's info)."""
    return {info.config.name: info.state.messages for info in await bus.js.streams_info()}


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:`port`."""
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def dashboard_queries() -> list[tuple[str, str]]:
    """(dashboard file, PromQL) of every panel target of every Grafana dashboard in the repo."""
    out = []

    def walk(name: str, panel: dict) -> None:
        for target in panel.get("targets") or []:
            if target.get("expr"):
                out.append((name, target["expr"]))
        for child in panel.get("panels") or []:
            walk(name, child)

    for path in sorted((DEPLOY / "grafana/dashboards").glob("*.json")):
        walk(path.name, json.loads(path.read_text()))
    return out
