"""The fleet simulator (engine.py) and the planner (plan.py), driving the services' own decision code."""

# The four fleet policies (policies.py says what each is), here so that `rose --help` lists them
# without importing the simulator.
POLICIES = ("static", "naive_share", "elastic_baseline", "rose")
