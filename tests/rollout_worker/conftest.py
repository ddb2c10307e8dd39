"""A whole elastic fleet as real processes on its own nats-server (so a test may restart it):
a serving executor, a dedicated executor, the SLO monitor, the scheduler, a rollout worker and a
rollout gateway (running GATEWAY_AGENT for each agent task)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from rose.contracts.registry import TRAJECTORY
from rose.shared.bus import Bus
from rose.shared.config import BusConfig
from rose.shared.launch import ServiceProcess, start_all, stop_all
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.testing.fleet import DEDICATED, GATEWAY, SERVING, WORKER
from rose.testing.polling import within

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
# An agent that takes four turns whatever the policy says (a user nudge after each answer), slowly enough that a
# gateway killed mid-episode leaves turns checkpointed, then posts its reward; deterministic given the answers.
GATEWAY_AGENT = """
import json, os, sys, time, urllib.request
import openai

client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
messages = [{"role": "user", "content": sys.argv[1]}]
for _ in range(4):
    reply = client.chat.completions.create(model="rose-policy", messages=messages).choices[0].message
    messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "Go on."}]
    time.sleep(0.4)
request = urllib.request.Request(os.environ["ROSE_EPISODE_URL"] + "/reward", data=json.dumps({"reward": 1.0}).encode(),
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
urllib.request.urlopen(request).read()
"""
GATEWAY_ENV = {"ROSE_CONCURRENCY": "4", "ROSE_ACK_WAIT_S": "6", "ROSE_TURNS__MAX_TOKENS": "8", "ROSE_TURNS__GENERATE_TIMEOUT_S": "15"}
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
        """The trajectories of `task_ids` published within `timeout`: all of them, or those that came."""

        def got() -> dict[str, object]:
            return {t.task_id: t for t in self.trajectories if t.task_id in task_ids}

        await within(lambda: set(got()) == task_ids, timeout, step=0.2)
        return got()


@pytest.fixture(scope="module")
async def fleet(tmp_path_factory, models_dir):
    root = tmp_path_factory.mktemp("elastic")
    server = NatsServer(root / "nats").start()
    env = {"NATS_URL": server.url, "ROSE_MODELS__DIR": str(models_dir), **COMMON}
    (root / "agent.py").write_text(GATEWAY_AGENT)
    gateway = {**env, **GATEWAY_ENV, "ROSE_AGENT__SCRIPT": str(root / "agent.py"), "ROSE_AGENT__LOGS_DIR": str(root / "agents")}
    procs = {
        "serving": ServiceProcess("executor", SERVING, {**env, **EXECUTOR, "ROSE_ROLE": "serving"}, root / "serving.log"),
        "dedicated": ServiceProcess("executor", DEDICATED, {**env, **EXECUTOR, "ROSE_ROLE": "dedicated"}, root / "dedicated.log"),
        "monitor": ServiceProcess("slo_monitor", "mon-e2e", {**env, **MONITOR}, root / "monitor.log"),
        "scheduler": ServiceProcess("scheduler", "sched-e2e", {**env, **SCHEDULER}, root / "scheduler.log"),
        "worker": ServiceProcess("rollout_worker", WORKER, {**env, **WORKER_ENV}, root / "worker.log"),
        "gateway": ServiceProcess("gateway", GATEWAY, gateway, root / "gateway.log"),
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
