"""Fixtures for the weight-sync tests."""

from __future__ import annotations

import itertools
import os

import pytest

from rose.contracts.registry import WEIGHT_APPLIED, WEIGHT_FAILED
from rose.shared.bus import Bus
from rose.testing.weights import Events

_models = itertools.count()


@pytest.fixture
def model_name() -> str:
    return f"m{next(_models)}-{os.getpid()}"


@pytest.fixture
async def events(bus) -> Events:
    ev = Events()
    await bus.subscribe(WEIGHT_APPLIED, ev.on_applied)
    await bus.subscribe(WEIGHT_FAILED, ev.on_failed)
    return ev


@pytest.fixture
async def follower_bus(bus_config):
    """The executor's own connection."""
    async with Bus(bus_config, service="executor", instance="ex-test") as b:
        yield b
