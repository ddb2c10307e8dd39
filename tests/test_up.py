"""`rose up` end to end: comes up with auth on, `rose status` sees the services, Ctrl-C leaves no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest

from rose.cli.service_table import ON_DEMAND_SERVICES, SERVICE_MODULES
from rose.shared.security import USERS
from rose.testing.rose_cli import alive, children, rose, wait_until_up

UP_TIMEOUT_S = 180.0


@pytest.mark.slow
def test_up_with_auth_on_status_and_a_clean_ctrl_c(tmp_path, models_dir):
    """`rose up` as a user runs it (auth on, the default): every service reaches ready on its own credentials (the
    executor on its instance's), nothing is refused, no seed leaks into a config or a log; `rose status` sees them;
    Ctrl-C leaves no process behind. One fleet for all of it: a second `rose up` costs the suite ~20 s."""
    state = tmp_path / "state"
    shutil.copytree(models_dir, state / "models")  # `rose up` would build them on the spot; reuse the session's
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL" and not k.startswith("ROSE_")}
    env.update({"ROSE_STATE_DIR": str(state), "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5", "ROSE_ENGINE__DEVICE": "cpu"})
    log = tmp_path / "up.log"
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        up = subprocess.Popen([sys.executable, "-m", "rose.cli.main", "up"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_up(up, log, UP_TIMEOUT_S)
        assert "not every service reported ready" not in log.read_text(), log.read_text()
        status = rose("status", "--json", env=env)
        assert status.returncode == 0, status.stdout + status.stderr
        report = json.loads(status.stdout)
        services = {s["service"]: s for s in report["services"]}
        assert {name for name, s in services.items() if s["state"] == "ready"} == set(SERVICE_MODULES) - set(ON_DEMAND_SERVICES)
        assert services["executor"]["endpoints"]["http"].startswith("http://127.0.0.1:")
        executor_pid = services["executor"]["pid"]
        up_info = json.loads((state / "up.json").read_text())
        assert up_info["nats_url"] == report["nats_url"]
        table = rose("status", env=env)
        assert "executor" in table.stdout

        security = state / "security"
        assert stat.S_IMODE(os.stat(security).st_mode) == 0o700
        seeds = {u: (security / f"{u}.nk").read_text().strip() for u in USERS}
        assert all(stat.S_IMODE(os.stat(security / f"{u}.nk").st_mode) == 0o600 for u in USERS)
        server_conf = (state / "nats" / "nats-server.conf").read_text()
        assert "authorization" in server_conf and not any(seed in server_conf for seed in seeds.values())
        # the executor runs under a fixed instance name, on that instance's own key
        executor = services["executor"]
        own = security / f"executor@{executor['instance']}.nk"
        assert stat.S_IMODE(os.stat(own).st_mode) == 0o600 and f"# executor@{executor['instance']}\n" in server_conf
        raw_environ = Path(f"/proc/{executor_pid}/environ").read_text()
        environ = dict(line.split("=", 1) for line in raw_environ.split("\0") if "=" in line)
        assert environ["ROSE_BUS__NKEY_SEED_FILE"] == str(own) and environ["ROSE_RUNTIME__INSTANCE"] == executor["instance"]

        async def anonymous() -> None:
            await nats.connect(report["nats_url"], allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)

        with pytest.raises(nats.errors.Error):
            asyncio.run(anonymous())
        time.sleep(2.0)  # a few heartbeats and lease rounds on the bus
        nats_log = (state / "logs" / "nats-server.log").read_text()
        violations = [line for line in nats_log.splitlines() if "Violation" in line and "authentication" not in line]
        assert violations == [], violations[:5]
        for service_log in (state / "logs").glob("*.log"):
            text = service_log.read_text(errors="replace")
            assert not any(seed in text for seed in seeds.values()), service_log
            assert "NATS refused" not in text, (service_log, text[-2000:])

        kids = children(up.pid)  # nats-server and every service
        assert executor_pid in kids and len(kids) >= 2
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        for pid in kids:
            assert not alive(pid), f"process {pid} survived Ctrl-C"
        assert not (state / "up.json").exists()
    finally:
        if up.poll() is None:
            up.kill()


def test_up_uses_nats_url_instead_of_starting_a_server(tmp_path, models_dir, nats_server):
    """Only the executor (`--services`): what is checked is where the services connect, and the fleet above ran
    every service already (the other four cost the suite their start-up, the rollout worker's importing torch)."""
    state = tmp_path / "state"
    shutil.copytree(models_dir, state / "models")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROSE_")}
    env.update({"NATS_URL": nats_server.url, "ROSE_STATE_DIR": str(state), "ROSE_RUNTIME__INSTANCE": "ex-up-external", "ROSE_ENGINE__DEVICE": "cpu"})
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        up = subprocess.Popen([sys.executable, "-m", "rose.cli.main", "up", "--services", "executor"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_up(up, log, UP_TIMEOUT_S)
        assert json.loads((state / "up.json").read_text())["embedded_nats"] is False
        assert "external" in log.read_text()
        report = json.loads(rose("status", "--json", env=env).stdout)
        assert report["nats_url"] == nats_server.url
        assert {(s["service"], s["instance"]) for s in report["services"]} >= {("executor", "ex-up-external")}
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            up.kill()
