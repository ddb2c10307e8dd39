"""A real nats-server with the generated per-service permissions, provisioned by the operator user."""

from __future__ import annotations

import pytest

from rose.shared.bus import Bus
from rose.shared.config import BusConfig
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.shared.security import OPERATOR, Credentials, init_credentials


@pytest.fixture(scope="session")
def credentials(tmp_path_factory: pytest.TempPathFactory) -> Credentials:
    return init_credentials(tmp_path_factory.mktemp("security") / "creds")


@pytest.fixture(scope="session")
def secured_server(tmp_path_factory: pytest.TempPathFactory, credentials: Credentials):
    with NatsServer(tmp_path_factory.mktemp("nats-secured"), extra_config=credentials.server_config()) as server:
        yield server


@pytest.fixture
def as_user(secured_server: NatsServer, credentials: Credentials):
    """`as_user("executor")`: a Bus config carrying that user's seed."""
    return lambda user: BusConfig(
        url=secured_server.url, nkey_seed_file=str(credentials.seed_file(user)), initial_connect_deadline_s=10.0, request_timeout_s=10.0
    )


@pytest.fixture
async def operator(as_user):
    async with Bus(as_user(OPERATOR), service="cli", instance="ops") as bus:
        await provision(bus.js)
        yield bus
