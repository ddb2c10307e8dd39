"""Driving the `rose` command as a user would, for the `rose up` tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rose.testing.polling import until_sync


def rose(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rose.cli.main", *args], env=env, capture_output=True, text=True, timeout=timeout)


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "zombie" in status.read_text())


def wait_until_up(up: subprocess.Popen, log: Path, timeout: float) -> str:
    """Until `rose up` says it is up; fails with its log if it exits first or takes longer than `timeout`."""
    until_sync(lambda: "ROSE is up" in log.read_text() or up.poll() is not None, timeout, f"`rose up` ready (log: {log})")
    text = log.read_text()
    assert up.poll() is None, text
    return text


def children(pid: int) -> dict[int, str]:
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
