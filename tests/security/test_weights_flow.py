"""The weight path with auth on: trainer SDK -> weight_publisher service -> executor, each with its own credentials.

Covers every right the path needs (staging upload, publish request, shards and manifests,
pruning old versions, the executor's reads and its applied events) and that none is refused.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from rose.client import WeightsClient
from rose.services.weight_publisher.config import PublisherSettings, WeightPublisherConfig
from rose.services.weight_publisher.main import run
from rose.shared.bus import Bus
from rose.shared.config import RuntimeConfig
from rose.shared.weight_signing import generate_keypair
from rose.shared.weight_sync import WeightFollower
from rose.testing.polling import retrying

TIMEOUT = 20.0


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": (torch.randn(64, 32, generator=g) * 0.02).to(torch.bfloat16) for i in range(3)}


class _Executor:
    def __init__(self) -> None:
        self.state = _state(0)

    async def apply(self, update: dict[str, torch.Tensor], version: int) -> float:
        for name, tensor in update.items():
            self.state[name].copy_(tensor)
        return 0.0


async def test_trainer_publisher_executor_with_their_own_credentials(as_user, operator, tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="rose.bus")
    key = generate_keypair(tmp_path / "keys")
    config = WeightPublisherConfig(
        bus=as_user("weight_publisher"),
        runtime=RuntimeConfig(instance="wp-sec", heartbeat_interval_s=0.5, metrics_port=-1),
        publisher=PublisherSettings(shard_bytes=8192, keyframe_interval=2, keep_keyframes=1, signing_key_file=str(key.private)),
    )
    service = asyncio.create_task(run(config))
    executor = _Executor()
    try:
        async with (
            Bus(as_user("executor"), service="executor", instance="ex-sec") as ex_bus,
            Bus(as_user("trainer"), service="trainer", instance="tr-sec") as trainer,
        ):
            follower = WeightFollower(ex_bus, model="policy-sec", apply=executor.apply)
            await follower.start(executor.state, None)
            async with WeightsClient(trainer, "policy-sec") as weights:
                for version in range(1, 6):  # keyframes at 1, 3, 5: the older ones are pruned
                    state = _state(100 + version)
                    # staged through the object store; the service may still be starting
                    await retrying(
                        lambda state=state, version=version: weights.publish(state, version), Exception, 15, f"publishing version {version}"
                    )
                    assert (await weights.published(version, timeout=TIMEOUT)).version == version
                    assert await follower.wait_for_version(version, TIMEOUT) == version
                    assert all(torch.equal(executor.state[n], state[n]) for n in state)
            await follower.stop()
    finally:
        service.cancel()
        await asyncio.wait([service], timeout=10)
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert refused == []
    info = await operator.js.stream_info("ROSE_WEIGHT_MANIFESTS", subjects_filter="rose.weights.manifest.policy-sec.>")
    assert min(int(s.rsplit(".", 1)[1]) for s in info.state.subjects) >= 3  # pruned by the publisher
