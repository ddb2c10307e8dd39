"""`rose up` with auth on (the default): every service reaches ready on its own credentials (the executor on
its instance's), nothing is refused."""

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
from rose.testing.rose_cli import rose, wait_until_up

UP_TIMEOUT_S = 180.0


@pytest.mark.slow
def test_up_runs_every_service_with_its_own_credentials(tmp_path, models_dir):
    state = tmp_path / "state"
    shutil.copytree(models_dir, state / "models")
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL" and not k.startswith("ROSE_")}
    env.update({"ROSE_STATE_DIR": str(state), "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5", "ROSE_ENGINE__DEVICE": "cpu"})
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        up = subprocess.Popen([sys.executable, "-m", "rose.cli.main", "up"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_up(up, log, UP_TIMEOUT_S)
        assert "not every service reported ready" not in log.read_text(), log.read_text()
        status = rose("status", "--json", env=env)
        assert status.returncode == 0, status.stdout + status.stderr
        report = json.loads(status.stdout)
        ready = {s["service"] for s in report["services"] if s["state"] == "ready"}
        assert ready == set(SERVICE_MODULES) - set(ON_DEMAND_SERVICES)

        security = state / "security"
        assert stat.S_IMODE(os.stat(security).st_mode) == 0o700
        seeds = {u: (security / f"{u}.nk").read_text().strip() for u in USERS}
        assert all(stat.S_IMODE(os.stat(security / f"{u}.nk").st_mode) == 0o600 for u in USERS)
        server_conf = (state / "nats" / "nats-server.conf").read_text()
        assert "authorization" in server_conf and not any(seed in server_conf for seed in seeds.values())

        # the executor runs under a fixed instance name, on that instance's own key
        (executor,) = [s for s in report["services"] if s["service"] == "executor"]
        own = security / f"executor@{executor['instance']}.nk"
        assert stat.S_IMODE(os.stat(own).st_mode) == 0o600 and f"# executor@{executor['instance']}\n" in server_conf
        raw_environ = Path(f"/proc/{executor['pid']}/environ").read_text()
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

        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            up.kill()
