"""Shared fixtures: a real nats-server with JetStream on a random port and a temp store dir."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rose.contracts.registry import ROLLOUT_TASK
from rose.shared.bus import Bus
from rose.shared.config import BusConfig
from rose.shared.nats_server import NatsServer
from rose.shared.provisioning import provision
from rose.shared.tracing import setup_tracing


@pytest.fixture(scope="session", autouse=True)
def spans() -> InMemorySpanExporter:
    """Spans of this test process, recorded in memory (installed before anything else traces)."""
    exporter = InMemorySpanExporter()
    setup_tracing("tests", "tests-1", extra_processors=[SimpleSpanProcessor(exporter)])
    return exporter


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory):
    with NatsServer(tmp_path_factory.mktemp("nats")) as server:
        yield server


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory):
    """Tiny real models (serving + policy, Qwen2, real tokenizer) built once per test run."""
    from rose.shared.models import init_models

    root = tmp_path_factory.mktemp("models")
    init_models(root, seed=0)
    return root


@pytest.fixture(scope="session")
def bus_config(nats_server: NatsServer) -> BusConfig:
    return BusConfig(url=nats_server.url, initial_connect_deadline_s=10.0, request_timeout_s=5.0)


@pytest.fixture
async def bus(bus_config: BusConfig):
    async with Bus(bus_config, service="tester", instance="tester-1") as b:
        await provision(b.js)
        yield b


@pytest.fixture
async def task_queue(bus: Bus):
    """The shared server's task stream with no consumer on it, before and after the test: it is a work
    queue (one consumer per subject), and the tests of one xdist worker share one server."""

    assert ROLLOUT_TASK.stream is not None
    stream = ROLLOUT_TASK.stream.name

    async def clear() -> None:
        for info in await bus.js.consumers_info(stream):
            await bus.js.delete_consumer(stream, info.name)

    await clear()
    yield bus
    await clear()


# Fleet tests (every service as a process, measured inside a fixed window) starve each other when two
# run at once on two cores. Keeping them on one xdist worker needs `xdist_group` markers applied
# before xdist's own collection hook reads them (`@pytest.hookimpl(tryfirst=True)`); a marker added
# by a plain hook here is read too late and ignored. One worker for all of them is ~1,300 s of
# serial fleet time on this machine, over the suite's budget: the fleets must get shorter first.
