"""`rose up --nats-cluster 3`: the compose topology as local processes, end to end.

Light services only (slo_monitor, scheduler: no models), so it stays quick: the cluster comes
up with R3 storage, the services join it, a NATS node is killed and they keep heartbeating,
and Ctrl-C leaves no process behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rose.contracts.registry import STREAMS
from rose.shared.bus import Bus
from rose.shared.config import BusConfig

UP_TIMEOUT_S = 120.0


def _env(state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL" and not k.startswith("ROSE_")}
    env.update({"ROSE_STATE_DIR": str(state), "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5"})
    return env


def _rose(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rose.cli.main", *args], env=env, capture_output=True, text=True, timeout=60)


def _children(pid: int) -> dict[int, str]:
    """Direct children of `pid` with their command names, from /proc."""
    kids = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == pid:
                    kids[int(entry.name)] = (entry / "comm").read_text().strip()
            except (OSError, IndexError, ValueError):
                continue
    return kids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "zombie" in status.read_text())


async def _stream_replicas(url: str, seed_file: str) -> dict[str, int]:
    config = BusConfig(url=url, nkey_seed_file=seed_file, initial_connect_deadline_s=10.0)  # auth is on: the operator's seed
    async with Bus(config, service="tester", instance="up-cluster") as bus:
        return {s.name: (await bus.js.stream_info(s.name)).config.num_replicas for s in STREAMS}


def test_up_with_a_three_node_cluster_survives_a_node_kill(tmp_path):
    state = tmp_path / "state"
    env = _env(state)
    log = tmp_path / "up.log"
    children: dict[int, str] = {}
    with open(log, "w") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "rose.cli.main", "up", "--nats-cluster", "3", "--services", "slo_monitor", "scheduler"],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while "ROSE is up" not in log.read_text():
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        text = log.read_text()
        assert "3-node JetStream cluster" in text and "not every service reported ready" not in text, text

        info = json.loads((state / "up.json").read_text())
        urls = info["nats_url"].split(",")
        assert len(urls) == 3 and info["nats_nodes"] == 3 and info["embedded_nats"] is True
        assert set(asyncio.run(_stream_replicas(info["nats_url"], info["operator_seed_file"])).values()) == {3}

        children = _children(up.pid)
        nats_pids = [pid for pid, name in children.items() if name == "nats-server"]
        assert len(nats_pids) == 3 and len(children) == 5, children

        report = json.loads(_rose("status", "--json", env=env).stdout)
        assert {s["service"] for s in report["services"]} == {"slo_monitor", "scheduler"}

        os.kill(nats_pids[0], signal.SIGKILL)
        killed_at = time.time()
        deadline = time.monotonic() + 45
        while True:  # both services heartbeat again through the remaining two nodes
            status = _rose("status", "--json", env=env)
            beats = json.loads(status.stdout)["services"] if status.returncode == 0 else []
            fresh = {b["service"] for b in beats if b["sent_at"] > killed_at + 1.0}
            if fresh == {"slo_monitor", "scheduler"}:
                break
            assert time.monotonic() < deadline, f"{status.stdout}{status.stderr}\n{log.read_text()}"
            time.sleep(1.0)
        for service in ("slo_monitor", "scheduler"):
            health = _rose("health", service, env=env)
            assert health.returncode == 0, health.stdout + health.stderr  # a failover in progress still answers (live heartbeats)

        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0, log.read_text()
        for pid in children:
            assert not _alive(pid), f"process {pid} ({children[pid]}) survived Ctrl-C"
        assert not (state / "up.json").exists()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        for pid in children:  # only what this `rose up` started, if it could not stop them itself
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_up_refuses_a_cluster_beside_nats_url_and_odd_sizes(tmp_path):
    env = _env(tmp_path / "state")
    both = _rose("up", "--nats-cluster", "3", env={**env, "NATS_URL": "nats://127.0.0.1:1"})
    assert both.returncode == 2 and "NATS_URL" in both.stdout, both.stdout + both.stderr
    too_many = _rose("up", "--nats-cluster", "7", env=env)
    assert too_many.returncode == 2 and "1 to 5" in too_many.stdout, too_many.stdout + too_many.stderr
