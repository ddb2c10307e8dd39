"""`rose run weight_publisher --config FILE`: publishes policy weight versions for the executors."""

from __future__ import annotations

from rose.shared.service import ServiceRuntime, service_main

from .config import WeightPublisherConfig
from .service import WeightPublisher


async def run(config: WeightPublisherConfig) -> None:
    runtime = ServiceRuntime("weight_publisher", bus=config.bus, runtime=config.runtime, load=lambda: publisher.load())
    publisher = WeightPublisher(runtime.bus, config.publisher)
    async with runtime as rt:
        await publisher.start()
        rt.ready()
        await rt.wait_for_shutdown()
        await publisher.stop()


def main(argv: list[str]) -> int:
    return service_main(argv, service="weight_publisher", description=__doc__ or "", config_cls=WeightPublisherConfig, run=run)
