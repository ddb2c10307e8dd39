"""`rose health`, the containers' healthcheck: what counts as healthy, and clear answers when not."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from rose.cli.health import _heartbeat_problem
from rose.contracts.service import Heartbeat
from rose.shared.nats_server import NatsServer, free_port


def _beat(*, service="scheduler", instance="scheduler-1", host="box", age=0.0, state="ready", interval=1.0) -> Heartbeat:
    now = time.time()
    return Heartbeat(
        service=service, instance=instance, version="0", host=host, pid=1, started_at=now - 60, sent_at=now - age,
        interval_s=interval, state=state, load={}, endpoints={}, labels={},
    )


def test_a_fresh_ready_heartbeat_is_healthy():
    assert _heartbeat_problem([_beat()], "scheduler", None, None) is None
    assert _heartbeat_problem([_beat()], "scheduler", "scheduler-1", "box") is None


def test_missing_stale_or_not_ready_is_unhealthy_with_the_reason():
    assert "no heartbeat from executor" in _heartbeat_problem([_beat()], "executor", None, None)
    assert "on host other" in _heartbeat_problem([_beat()], "scheduler", None, "other")  # --local in another container
    assert "stale" in _heartbeat_problem([_beat(age=10.0)], "scheduler", None, None)
    assert "starting, not ready" in _heartbeat_problem([_beat(state="starting")], "scheduler", None, None)
    # one ready instance among others is enough when no instance is named
    assert _heartbeat_problem([_beat(state="draining", instance="a"), _beat(instance="b")], "scheduler", None, None) is None


def _rose(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROSE_") and k != "NATS_URL"}
    return subprocess.run([sys.executable, "-m", "rose.cli.main", *args], capture_output=True, text=True, timeout=60, env=env)


def test_cli_exit_codes():
    assert _rose("health").returncode == 2  # neither a service nor --http
    closed = free_port()
    down = _rose("health", "scheduler", "--nats-url", f"nats://127.0.0.1:{closed}", "--timeout", "1")
    assert down.returncode == 1 and "cannot reach NATS" in down.stdout, down.stdout + down.stderr
    http = _rose("health", "--http", f"http://127.0.0.1:{closed}/healthz", "--timeout", "1")
    assert http.returncode == 1 and "unreachable" in http.stdout, http.stdout + http.stderr


def test_http_check_against_a_real_nats_monitor(tmp_path):
    """nats-server's own /healthz, as the compose NATS nodes are checked."""
    monitor = free_port()
    with NatsServer(tmp_path / "nats", monitor_port=monitor):
        ok = _rose("health", "--http", f"http://127.0.0.1:{monitor}/healthz")
        assert ok.returncode == 0 and "healthy" in ok.stdout, ok.stdout + ok.stderr
