"""Benchmarks (`rose bench ...`) and the demo: real fleets, measured against a baseline in the same run."""
