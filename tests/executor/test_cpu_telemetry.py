"""The CPU device's utilization: the executor's rollout forwards run in a child process, and a pinned
executor's device is the core it is pinned to, so both belong in the figure (`rose bench e2e` reads it
to say how busy the dedicated device was)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import json, os, subprocess, sys, time
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core: the device, as `rose bench e2e` pins it
from rose.services.executor.device import CpuDevice
busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # the forward child, always computing
try:
    time.sleep(0.3)
    with_child, alone = CpuDevice(), CpuDevice()
    with_child.telemetry(busy.pid), alone.telemetry()
    time.sleep(1.0)  # this process sleeps: only the child computes
    a, b = with_child.telemetry(busy.pid), alone.telemetry()
    print(json.dumps({"with_child": a.utilization, "alone": b.utilization, "name": a.name}))
finally:
    busy.kill()
"""


def test_utilization_counts_the_forward_child_over_the_pinned_cores():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["name"] == "cpu x1"  # the cores it may run on, not the host's
    assert r["alone"] < 0.1  # the parent alone slept
    # the child had the core (alone, most of it; beside a loaded box's other work, still a good share):
    # counted over one core, not over the host's cores and not left out
    assert r["with_child"] > 0.3 and r["with_child"] > 3 * r["alone"]
