"""Fixtures the trainer's tests share."""

from __future__ import annotations

import pytest

from rose.testing.agentic import save_tiny_policy


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory, models_dir):
    """A tiny policy saved like any HF model directory (the trainer loads it as it would a real one)."""
    return save_tiny_policy(tmp_path_factory.mktemp("tiny"), models_dir)
