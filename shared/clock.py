"""Emulated time: how many wall seconds one second of an emulated fleet takes (``ROSE_TIME_SCALE``).

An emulated fleet (services/executor/emulated.py) can be larger than its host can run in real time:
its executors' real host work (scheduling, bookkeeping, HTTP, the bus) would fall behind the devices
it emulates. It then runs ``scale`` times slower than real time, and every process of the fleet reads
the one scale from its environment, so that physics and control stay in proportion:

- every duration a service is configured with (a settings field named ``*_s`` or ``*_ms``: SLOs,
  quanta, windows, lease periods, ticks, timeouts) is multiplied by it when loaded (shared/config.py);
- the emulated device's forwards and weight transfers, the emulated environment's tool latencies and
  the emulated trainer's optimizer steps take ``scale`` x their modeled time;
- benches send serving traffic at 1/``scale`` of the trace's rate and divide what they time by it.

What does not scale is the host's own speed: its scheduling and bookkeeping then look ``scale`` times
faster than they are, which is why an emulated run reports its fidelity (how late forwards end) and the
host's CPU. Unset (the default, 1), nothing changes: real devices never read it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

TIME_SCALE_ENV = "ROSE_TIME_SCALE"


def time_scale(env: Mapping[str, str] | None = None) -> float:
    """The scale from ``ROSE_TIME_SCALE`` (1 when unset); a ValueError names a bad value."""
    raw = (os.environ if env is None else env).get(TIME_SCALE_ENV, "").strip()
    if not raw:
        return 1.0
    try:
        scale = float(raw)
    except ValueError:
        scale = math.nan
    if not (math.isfinite(scale) and 0.01 <= scale <= 1000.0):
        raise ValueError(f"{TIME_SCALE_ENV}={raw!r}: wall seconds per emulated second, a number from 0.01 to 1000")
    return scale


def is_duration(field_name: str) -> bool:
    """A settings field that holds a duration: its name ends in ``_s`` or ``_ms`` (a test holds every service's settings to it)."""
    return field_name.endswith(("_s", "_ms"))
