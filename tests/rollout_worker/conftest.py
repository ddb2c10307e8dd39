"""A whole elastic fleet as real processes on its own nats-server (so a test may restart it):
a serving executor, a dedicated executor, the SLO monitor, the scheduler and a rollout worker."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

from rose.contracts.registry import TRAJECTORY
from rose.shared.bus import Bus
from rose.shared.config import BusConfig
from rose.shared.launch import ServiceProcess, start_all, stop_all
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.testing.fleet import DEDICATED, SERVING, WORKER

START_TIMEOUT_S = 120.0

COMMON = {"ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5"}
EXECUTOR = {
    "ROSE_METRICS_INTERVAL_S": "0.2",
    "ROSE_ENGINE__DEVICE": "cpu",
    "ROSE_ENGINE__SERVING_KV_MIB": "16",
    "ROSE_ENGINE__ROLLOUT_KV_MIB": "32",
}
SCHEDULER = {"ROSE_TICK_S": "0.2", "ROSE_LEASES__TTL_S": "4", "ROSE_LEASES__RENEW_BEFORE_S": "2", "ROSE_LEASES__COOLDOWN_S": "1"}
MONITOR = {"ROSE_HEADROOM_INTERVAL_S": "0.3"}
WORKER_ENV = {
    "ROSE_CONCURRENCY": "4",
    "ROSE_ACK_WAIT_S": "10",
    "ROSE_TURNS__MAX_TOKENS": "8",
    "ROSE_TURNS__GENERATE_TIMEOUT_S": "15",
}


@dataclass
class Fleet:
    server: NatsServer
    bus: Bus
    procs: dict[str, ServiceProcess]
    trajectories: list = field(default_factory=list)

    def proc(self, name: str) -> ServiceProcess:
        return self.procs[name]

    async def restart(self, name: str) -> None:
        p = self.procs[name]
        p.stop()
        p.start()
        await p.wait_ready(self.bus, START_TIMEOUT_S)

    async def wait_trajectories(self, task_ids: set[str], timeout: float) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        while True:
            got = {t.task_id: t for t in self.trajectories if t.task_id in task_ids}
            if set(got) == task_ids or time.monotonic() > deadline:
                return got
            await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
async def fleet(tmp_path_factory, models_dir):
    root = tmp_path_factory.mktemp("elastic")
    server = NatsServer(root / "nats").start()
    env = {"NATS_URL": server.url, "ROSE_MODELS__DIR": str(models_dir), **COMMON}
    procs = {
        "serving": ServiceProcess("executor", SERVING, {**env, **EXECUTOR, "ROSE_ROLE": "serving"}, root / "serving.log"),
        "dedicated": ServiceProcess("executor", DEDICATED, {**env, **EXECUTOR, "ROSE_ROLE": "dedicated"}, root / "dedicated.log"),
        "monitor": ServiceProcess("slo_monitor", "mon-e2e", {**env, **MONITOR}, root / "monitor.log"),
        "scheduler": ServiceProcess("scheduler", "sched-e2e", {**env, **SCHEDULER}, root / "scheduler.log"),
        "worker": ServiceProcess("rollout_worker", WORKER, {**env, **WORKER_ENV}, root / "worker.log"),
    }
    bus = Bus(BusConfig(url=server.url, initial_connect_deadline_s=10.0, drain_timeout_s=2.0), service="tests", instance="e2e")
    await bus.connect()
    await provision(bus.js)
    state = Fleet(server, bus, procs)

    async def collect(trajectory, _d):
        state.trajectories.append(trajectory)

    await bus.consume(TRAJECTORY, collect, durable="tests_e2e_trajectories")
    try:
        await start_all(bus, list(procs.values()), START_TIMEOUT_S)
        yield state
    finally:
        stop_all(list(procs.values()))
        await bus.close()
        server.stop()
