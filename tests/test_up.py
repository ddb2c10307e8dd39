"""`rose up` end to end: comes up, `rose status` sees the services, Ctrl-C leaves no process behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

from rose.testing.rose_cli import alive, children, rose, wait_until_up

UP_TIMEOUT_S = 180.0


def test_up_status_and_clean_ctrl_c(tmp_path, models_dir):
    state = tmp_path / "state"
    shutil.copytree(models_dir, state / "models")  # `rose up` would build them on the spot; reuse the session's
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL" and not k.startswith("ROSE_")}
    env.update({"ROSE_STATE_DIR": str(state), "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5", "ROSE_ENGINE__DEVICE": "cpu"})
    with open(tmp_path / "up.log", "w") as out:  # the child keeps its own copy of the descriptor
        up = subprocess.Popen([sys.executable, "-m", "rose.cli.main", "up"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_up(up, tmp_path / "up.log", UP_TIMEOUT_S)
        status = rose("status", "--json", env=env)
        assert status.returncode == 0, status.stdout + status.stderr
        report = json.loads(status.stdout)
        services = {s["service"]: s for s in report["services"]}
        assert services["executor"]["state"] == "ready"
        assert services["executor"]["endpoints"]["http"].startswith("http://127.0.0.1:")
        executor_pid = services["executor"]["pid"]
        up_info = json.loads((state / "up.json").read_text())
        assert up_info["nats_url"] == report["nats_url"]
        table = rose("status", env=env)
        assert "executor" in table.stdout
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
    state = tmp_path / "state"
    shutil.copytree(models_dir, state / "models")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROSE_")}
    env.update({"NATS_URL": nats_server.url, "ROSE_STATE_DIR": str(state), "ROSE_RUNTIME__INSTANCE": "ex-up-external", "ROSE_ENGINE__DEVICE": "cpu"})
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        up = subprocess.Popen([sys.executable, "-m", "rose.cli.main", "up"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_up(up, log, UP_TIMEOUT_S)
        assert json.loads((state / "up.json").read_text())["embedded_nats"] is False
        assert "external" in log.read_text()
        report = json.loads(rose("status", "--json", env=env).stdout)
        assert report["nats_url"] == nats_server.url
        assert "ex-up-external" in {s["instance"] for s in report["services"]}
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            up.kill()
