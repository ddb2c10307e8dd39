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
import stat
import subprocess
import sys
import time
from pathlib import Path

from rose.contracts.registry import STREAMS
from rose.shared.bus import Bus
from rose.shared.config import BusConfig
from rose.shared.security import CLUSTER_INCLUDE
from rose.testing.polling import until_sync
from rose.testing.rose_cli import alive, children, rose, wait_until_up

UP_TIMEOUT_S = 120.0


def _env(state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL" and not k.startswith("ROSE_")}
    env.update({"ROSE_STATE_DIR": str(state), "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5"})
    return env


async def _stream_replicas(url: str, seed_file: str) -> dict[str, int]:
    config = BusConfig(url=url, nkey_seed_file=seed_file, initial_connect_deadline_s=10.0)  # auth is on: the operator's seed
    async with Bus(config, service="tester", instance="up-cluster") as bus:
        return {s.name: (await bus.js.stream_info(s.name)).config.num_replicas for s in STREAMS}


def test_up_with_a_three_node_cluster_survives_a_node_kill(tmp_path):
    state = tmp_path / "state"
    env = _env(state)
    log = tmp_path / "up.log"
    kids: dict[int, str] = {}
    with open(log, "w") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "rose.cli.main", "up", "--nats-cluster", "3", "--services", "slo_monitor", "scheduler"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        text = wait_until_up(up, log, UP_TIMEOUT_S)
        assert "3-node JetStream cluster" in text and "not every service reported ready" not in text, text

        for node in ("nats-1", "nats-2", "nats-3"):  # routes authenticated, as in compose: the password only in the 0600 include
            conf = (state / "nats-cluster-3" / node / "nats-server.conf").read_text()
            assert f'include "../../security/{CLUSTER_INCLUDE}"' in conf and "nats-route://" not in conf, conf
        assert stat.S_IMODE(os.stat(state / "security" / CLUSTER_INCLUDE).st_mode) == 0o600
        assert "cluster routes authenticated" in text

        info = json.loads((state / "up.json").read_text())
        urls = info["nats_url"].split(",")
        assert len(urls) == 3 and info["nats_nodes"] == 3 and info["embedded_nats"] is True
        assert set(asyncio.run(_stream_replicas(info["nats_url"], info["operator_seed_file"])).values()) == {3}

        kids = children(up.pid)
        nats_pids = [pid for pid, name in kids.items() if name == "nats-server"]
        assert len(nats_pids) == 3 and len(kids) == 5, kids

        report = json.loads(rose("status", "--json", env=env).stdout)
        assert {s["service"] for s in report["services"]} == {"slo_monitor", "scheduler"}

        os.kill(nats_pids[0], signal.SIGKILL)
        killed_at = time.time()

        def fresh_beats() -> bool:  # both services heartbeat again through the remaining two nodes
            status = rose("status", "--json", env=env)
            beats = json.loads(status.stdout)["services"] if status.returncode == 0 else []
            return {b["service"] for b in beats if b["sent_at"] > killed_at + 1.0} == {"slo_monitor", "scheduler"}

        until_sync(fresh_beats, 45, f"fresh heartbeats after the node kill (log: {log})", step=1.0)
        for service in ("slo_monitor", "scheduler"):
            health = rose("health", service, env=env)
            assert health.returncode == 0, health.stdout + health.stderr  # a failover in progress still answers (live heartbeats)

        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0, log.read_text()
        for pid in kids:
            assert not alive(pid), f"process {pid} ({kids[pid]}) survived Ctrl-C"
        assert not (state / "up.json").exists()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        for pid in kids:  # only what this `rose up` started, if it could not stop them itself
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_up_refuses_a_cluster_beside_nats_url_and_odd_sizes(tmp_path):
    env = _env(tmp_path / "state")
    both = rose("up", "--nats-cluster", "3", env={**env, "NATS_URL": "nats://127.0.0.1:1"})
    assert both.returncode == 2 and "NATS_URL" in both.stdout, both.stdout + both.stderr
    too_many = rose("up", "--nats-cluster", "7", env=env)
    assert too_many.returncode == 2 and "1 to 5" in too_many.stdout, too_many.stdout + too_many.stderr
