"""A real executor process (`rose run executor`) on the test NATS server, shared by this folder's tests."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from rose.contracts.registry import SERVICE_REGISTRY
from rose.shared.bus import Bus
from rose.shared.provisioning import provision

EXECUTOR_ID = "ex-svc-test"
START_TIMEOUT_S = 120.0


@pytest.fixture(scope="session")
async def executor(nats_server, bus_config, models_dir, tmp_path_factory):
    """Start the executor, wait for its 'ready' heartbeat; yields (executor_id, http base URL)."""
    logs = tmp_path_factory.mktemp("executor-logs") / "executor.log"
    env = {
        **os.environ,
        "NATS_URL": nats_server.url,
        "ROSE_MODELS__DIR": str(models_dir),
        "ROSE_RUNTIME__INSTANCE": EXECUTOR_ID,
        "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5",
        "ROSE_METRICS_INTERVAL_S": "0.5",
        "ROSE_ENGINE__DEVICE": "cpu",
        "ROSE_ENGINE__SERVING_KV_MIB": "16",
        "ROSE_ENGINE__ROLLOUT_KV_MIB": "16",
    }
    with open(logs, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rose.cli.main", "run", "executor"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        async with Bus(bus_config, service="tests", instance="exec-fixture") as bus:
            await provision(bus.js)
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                beat = await bus.kv_get(SERVICE_REGISTRY, service="executor", instance=EXECUTOR_ID)
                if beat is not None and beat.state == "ready":
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"executor did not come up:\n{logs.read_text()[-3000:]}")
                await asyncio.sleep(0.2)
        yield EXECUTOR_ID, beat.endpoints["http"]
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()

