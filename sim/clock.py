"""The simulation's clock (engine.py ticks it)."""

from __future__ import annotations

SCHEDULER_TICK_S = 0.5  # the scheduler's lease planning (services/scheduler/config.py tick_s)


class Clock:
    """The tick count and the cadences the clock runs the control plane at.

    It exists because the parts that act as of a tick read one count: the monitor's windows (a ring indexed by it), the
    router's candidates (refreshed once a tick) and the rollout worker's turns, which route between ticks. The clock
    (``Simulation._tick``) advances it once a tick, after recording the tick's figures.
    """

    def __init__(self, dt: float) -> None:
        self.dt = dt  # seconds per tick (SimConfig.dt)
        self.ticks = 0
        self.k_sched = max(1, int(round(SCHEDULER_TICK_S / dt)))  # ticks per scheduler tick
