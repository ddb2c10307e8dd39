"""The fleet simulator (engine.py) and the planner (plan.py), driving the services' own decision code."""

from typing import get_args

from rose.contracts.executor import RolloutMode

# The four fleet policies (policies.py says what each is), here so that `rose --help` lists them
# without importing the simulator.
POLICIES = ("static", "naive_share", "elastic_baseline", "rose")
# The model sizes the simulator and the planner know (shared/devices.py MODELS; a test keeps the two alike).
MODEL_SIZES = ("7B", "14B", "32B", "70B")
# The GPU kinds they know (shared/devices.py DEVICES; the same test).
DEVICE_KINDS = ("A100", "H100", "H200")
# How rollout shares a serving instance (contracts/executor.py RolloutMode; sim/sizing.py, sim/co_batched.py)
ROLLOUT_MODES: tuple[str, ...] = get_args(RolloutMode)
