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


# Whole fleets (every service as a process, a trainer, a serving trace) measure throughput inside a
# fixed window: two of them at once on a 2-core machine starve each other (a demo made no GRPO step
# in 30 s beside another fleet). Under pytest-xdist (`--dist loadgroup`, ./scripts/test) they run
# one after another on one worker, while the other worker takes the lighter tests.
FLEET_MODULES = ("test_demo.py", "test_bench_e2e.py", "test_bench_faults.py", "test_rollout_e2e.py", "test_up_auth.py", "test_trainer_resume.py")


def _in_fleet(item: pytest.Item) -> bool:
    return item.path.name in FLEET_MODULES or item.name == "test_bench_coserve_fields"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fleet tests share one worker; every other module stays on one worker as well, so that its
    module-scoped fixtures (stand-in servers, trained models) are built once, and tests that share
    them see each other's effects in file order, as they do without xdist."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group("fleet" if _in_fleet(item) else str(item.path.relative_to(config.rootpath))))
