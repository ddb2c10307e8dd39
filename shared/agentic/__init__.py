"""Agentic environments and tools: what the rollout workers run and the trainer scripts experts from.

They live in the common runtime, not in a service, because two services need the same
definitions (the worker steps episodes through them; the trainer builds tasks and expert
warm-start traces from them) and no service imports another. `agentic_envs` registers the
built-in tool environments (arithmetic, code, search QA); users `envs.register` their own.
"""
