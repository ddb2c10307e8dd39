"""Service processes started by benches and the demo die with their parent, even on kill -9."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from rose.testing.polling import until_sync
from rose.testing.rose_cli import alive

PARENT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from rose.shared.launch import ServiceProcess

    # a service with nowhere to connect: it keeps retrying until something stops it
    proc = ServiceProcess("slo_monitor", "orphan-check", {"NATS_URL": "nats://127.0.0.1:1"}, Path(sys.argv[1])).start()
    print(proc.pid, flush=True)
    time.sleep(600)
    """
)


def test_children_die_when_the_parent_is_killed(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "child.log")], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    until_sync(lambda: not alive(child), 20, "the service's exit after its parent was killed", step=0.1)
