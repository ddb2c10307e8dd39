"""The services that exist: the one table `rose up`, `rose run`, `rose health` and the deploy files read.

Each module has ``main(argv) -> int``. A module of its own (no imports) so the supervisor (up.py)
and the commands' arguments (up_args.py, run.py, health.py) read it without importing each other.
"""

from __future__ import annotations

# Services that exist; `rose up` starts these and `rose run NAME` runs one in the foreground.
SERVICE_MODULES: dict[str, str] = {
    "executor": "rose.services.executor.main",
    "slo_monitor": "rose.services.slo_monitor.main",
    "scheduler": "rose.services.scheduler.main",
    "rollout_worker": "rose.services.rollout_worker.main",
    "weight_publisher": "rose.services.weight_publisher.main",
    "trainer": "rose.services.trainer.main",
    "gateway": "rose.services.gateway.main",
}
# Started by `rose run NAME` only, not by a plain `rose up` (the trainer drives an RL job of its own; the gateway
# runs the agent an RL job names).
ON_DEMAND_SERVICES = ("trainer", "gateway")
# `rose run executor --emulate COUNTxKIND:MODEL`: many emulated executors in one process (services/executor/group.py).
EMULATED_EXECUTORS_MODULE = "rose.services.executor.group"
