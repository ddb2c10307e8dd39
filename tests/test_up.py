"""`rose up` end to end: comes up, `rose status` sees the services, Ctrl-C leaves no process behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

UP_TIMEOUT_S = 180.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "zombie" in status.read_text())


def _rose(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rose.cli.main", *args], env=env, capture_output=True, text=True, timeout=60)


def test_up_status_and_clean_ctrl_c(tmp_path, models_dir):
    state = tmp_path / "state"
    shutil.copytree(models_dir, state / "models")  # `rose up` would build them on the spot; reuse the session's
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL" and not k.startswith("ROSE_")}
    env.update({"ROSE_STATE_DIR": str(state), "ROSE_RUNTIME__HEARTBEAT_INTERVAL_S": "0.5", "ROSE_ENGINE__DEVICE": "cpu"})
    out = open(tmp_path / "up.log", "w")
    up = subprocess.Popen([sys.executable, "-m", "rose.cli.main", "up"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while "ROSE is up" not in (tmp_path / "up.log").read_text():
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.3)
        status = _rose("status", "--json", env=env)
        assert status.returncode == 0, status.stdout + status.stderr
        report = json.loads(status.stdout)
        services = {s["service"]: s for s in report["services"]}
        assert services["executor"]["state"] == "ready"
        assert services["executor"]["endpoints"]["http"].startswith("http://127.0.0.1:")
        executor_pid = services["executor"]["pid"]
        up_info = json.loads((state / "up.json").read_text())
        assert up_info["nats_url"] == report["nats_url"]
        table = _rose("status", env=env)
        assert "executor" in table.stdout
        children = _children(up.pid)  # nats-server and every service
        assert executor_pid in children and len(children) >= 2

        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        for pid in children:
            assert not _alive(pid), f"process {pid} survived Ctrl-C"
        assert not (state / "up.json").exists()
    finally:
        if up.poll() is None:
            up.kill()
        out.close()


def test_up_uses_nats_url_instead_of_starting_a_server(tmp_path, models_dir, nats_server):
    state = tmp_path / "state"
    shutil.copytree(models_dir, state / "models")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROSE_")}
    env.update({"NATS_URL": nats_server.url, "ROSE_STATE_DIR": str(state), "ROSE_RUNTIME__INSTANCE": "ex-up-external", "ROSE_ENGINE__DEVICE": "cpu"})
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        up = subprocess.Popen([sys.executable, "-m", "rose.cli.main", "up"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while "ROSE is up" not in log.read_text():
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        assert json.loads((state / "up.json").read_text())["embedded_nats"] is False
        assert "external" in log.read_text()
        report = json.loads(_rose("status", "--json", env=env).stdout)
        assert report["nats_url"] == nats_server.url
        assert "ex-up-external" in {s["instance"] for s in report["services"]}
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            up.kill()


def _children(pid: int) -> list[int]:
    """Pids of the direct children of `pid`, from /proc."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                kids.append(int(entry.name))
    return kids
