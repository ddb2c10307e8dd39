"""ROSE: rollout on serving GPUs by cooperative elasticity."""

__version__ = "0.1.0"
