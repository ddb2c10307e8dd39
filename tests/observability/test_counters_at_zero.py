"""Counters that dashboards and alerts read start at 0 in a service process of its own.

In a real executor process the `Telemetry` is made before the service runtime installs the meter
provider: a measurement added then goes to the OpenTelemetry API's proxy and is lost (the
executors' `http_errors` never appeared in the compose cluster's Prometheus). The in-process fleet
of tests/observability/test_fleet_observability.py cannot see this: its provider is installed
before any executor starts. So: a fresh interpreter, in the order `services/executor/main.py` uses.
"""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
from rose.services.executor.telemetry import Telemetry
from rose.shared.metrics import exposition, setup_metrics

telemetry = Telemetry(engine=None, executor_id="", role="serving", interval_s=1.0)  # before the runtime, as main.run does
setup_metrics("executor", "executor-7")  # what ServiceRuntime does on entry
telemetry.bind("executor-7")
print(exposition().decode())
"""


def test_an_executors_http_errors_counter_is_exported_at_zero_before_any_error():
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, check=True).stdout
    lines = [line for line in out.splitlines() if line.startswith("rose_executor_http_errors_total{")]
    assert lines and 'executor="executor-7"' in lines[0] and lines[0].endswith(" 0.0"), out[-2000:]
