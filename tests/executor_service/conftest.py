"""A real executor process (`rose run executor`) on the test NATS server, shared by this folder's tests."""

from __future__ import annotations

import pytest

from rose.shared.bus import Bus
from rose.shared.launch import ServiceProcess
from rose.shared.provisioning import provision

EXECUTOR_ID = "ex-svc-test"
START_TIMEOUT_S = 120.0


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory):
    """ROSE_STATE_DIR of this folder's services: the weight publisher makes its signing key pair in
    `keys/` there on first use, and the executor trusts the `.pub` it finds there (the embedded default)."""
    return tmp_path_factory.mktemp("state")


@pytest.fixture(scope="session")
async def executor(nats_server, bus_config, models_dir, tmp_path_factory, state_dir):
    """Start the executor, wait for its 'ready' heartbeat; yields (executor_id, http base URL)."""
    env = {
        "NATS_URL": nats_server.url,
        "ROSE_STATE_DIR": str(state_dir),
        "ROSE_MODELS__DIR": str(models_dir),
        "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5",
        "ROSE_METRICS_INTERVAL_S": "0.5",
        "ROSE_ENGINE__DEVICE": "cpu",
        "ROSE_ENGINE__SERVING_KV_MIB": "16",
        "ROSE_ENGINE__ROLLOUT_KV_MIB": "16",
    }
    proc = ServiceProcess("executor", EXECUTOR_ID, env, tmp_path_factory.mktemp("executor-logs") / "executor.log").start()
    try:
        async with Bus(bus_config, service="tests", instance="exec-fixture") as bus:
            await provision(bus.js)
            endpoints = await proc.wait_ready(bus, START_TIMEOUT_S)
        yield EXECUTOR_ID, endpoints["http"]
    finally:
        proc.stop()
