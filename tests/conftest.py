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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The `slow` tests (a whole fleet as processes, minutes each) first, the rest in collection order.

    ./scripts/test hands xdist whole modules (`--dist loadscope`: a module's fixtures, often real
    processes, start once, on one worker) in this order (`--no-loadscope-reorder`), so the longest
    units start first and the short ones fill in around them instead of a fleet test starting last.
    (`--dist loadgroup` with `xdist_group` markers does not group on pytest 9: xdist 3.8 tags the
    group onto `item._nodeid`, which pytest 9's `Item.nodeid` no longer reads.)"""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
