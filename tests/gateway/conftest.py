"""A gateway in the test process on the shared nats-server, before a stand-in scheduler and executor
(testing/gateway.py), started once per module; the agents it runs are the examples in examples/agents."""

from __future__ import annotations

import pytest

from rose.services.gateway.chat import ChatFormat
from rose.shared.bus import Bus
from rose.shared.models import load_tokenizer
from rose.shared.provisioning import provision
from rose.testing.gateway import StandInFleet


@pytest.fixture(scope="module")
async def gw_bus(bus_config):
    async with Bus(bus_config, service="tester", instance="tester-gateway") as bus:
        await provision(bus.js)
        yield bus


@pytest.fixture(scope="module")
def fmt(models_dir) -> ChatFormat:
    return ChatFormat(load_tokenizer(models_dir / "policy"))


@pytest.fixture(scope="module")
async def fleet(gw_bus, fmt) -> StandInFleet:
    fleet = StandInFleet(fmt)
    await fleet.start(gw_bus)
    return fleet
