"""Every bad input the issue names -> a WeightFailed with its kind and reason; nothing applied, old weights kept."""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest

from rose.contracts.registry import WEIGHT_MANIFEST, WEIGHTS_OBJECTS
from rose.services.weight_publisher.config import PublisherSettings
from rose.services.weight_publisher.versions import ModelVersions
from rose.shared import weight_store
from rose.shared.weight_store import WeightStore
from rose.shared.weight_sync import WeightFollower
from rose.testing.polling import until
from rose.testing.weights import Executor, as_sources, craft, make_state, rl_step, same

SETTINGS = PublisherSettings(shard_bytes=1 << 20, keyframe_interval=100)
TIMEOUT = 10.0


class Setup:
    """Version 1 applied everywhere; version 2 staged (stored, not announced) for the test to spoil."""

    def __init__(self, bus, follower_bus, model: str, events) -> None:
        self.bus, self.follower_bus, self.model, self.events = bus, follower_bus, model, events
        self.pub = ModelVersions(model, bus, WeightStore(bus.js, WEIGHTS_OBJECTS.bucket), SETTINGS)
        self.v1 = make_state(11)
        self.v2 = rl_step(self.v1, 12)

    async def start(self, **follower_kw) -> None:
        self.v1_manifest = await self.pub.publish(as_sources(self.v1), 1)
        self.executor = Executor(self.v1, 1)
        self.follower = WeightFollower(self.follower_bus, model=self.model, apply=self.executor.apply, **follower_kw)
        await self.follower.start(self.executor.state, 1)
        self.staged = await self.pub.stage(as_sources(self.v2), 2)

    async def announce(self, manifest) -> None:
        await self.bus.publish(WEIGHT_MANIFEST, manifest, model=self.model, kind=manifest.kind, version=str(manifest.version))

    def failures(self):
        return [e for e in self.events.failed if e.model == self.model]

    async def expect_refused(self, kind: str, count: int = 1) -> None:
        await until(lambda: len(self.failures()) >= count)
        await asyncio.sleep(0.1)  # let any (wrong) apply land before checking that none did
        failures = self.failures()
        assert {f.kind for f in failures} == {kind}, failures
        assert all(f.reason and f.kept_version == 1 and f.executor_id == "ex-test" for f in failures)
        assert self.executor.calls == [] and self.follower.version == 1
        assert same(self.executor.state, self.v1)

    async def recovers(self) -> None:
        """A good version after the bad one is taken (from a keyframe when the chain is broken)."""
        good = await self.pub.publish(as_sources(rl_step(self.v2, 13)), 3, keyframe=True)
        assert await self.follower.wait_for_version(good.version, TIMEOUT) == 3

    async def stop(self) -> None:
        await self.follower.stop()


@pytest.fixture
async def setup(bus, follower_bus, model_name, events):
    s = Setup(bus, follower_bus, model_name, events)
    yield s
    await s.stop()


def _object(manifest) -> tuple[str, int]:
    shard = next(s for s in manifest.shards if s.object_name)
    return shard.object_name, shard.wire_bytes


async def test_truncated_chunk(setup, bus, monkeypatch):
    monkeypatch.setattr(weight_store, "REPLICA_LAG_S", 0.3)  # the missing half never comes: refused after the replicas' grace
    await setup.start()
    name, size = _object(setup.staged.manifest)
    data = bytes(await WeightStore(bus.js, WEIGHTS_OBJECTS.bucket).get(name))
    await craft(bus.js, name, [data[: size // 2]], size=size, digest_of=data)
    await setup.announce(setup.staged.manifest)
    await setup.expect_refused("corrupt", count=2)  # the first try, then one refetch
    assert "truncated" in setup.failures()[0].reason
    assert [f.next_step for f in setup.failures()] == ["refetch", "wait_keyframe"]
    await setup.recovers()


async def test_corrupted_chunk(setup, bus):
    await setup.start()
    name, size = _object(setup.staged.manifest)
    data = bytearray(await WeightStore(bus.js, WEIGHTS_OBJECTS.bucket).get(name))
    original = bytes(data)
    data[size // 2] ^= 0x10
    await craft(bus.js, name, [bytes(data)], size=size, digest_of=original)
    await setup.announce(setup.staged.manifest)
    await setup.expect_refused("corrupt", count=2)
    await setup.recovers()


async def test_wrong_digest(setup):
    await setup.start(refetch_attempts=0)
    shard = setup.staged.manifest.shards[0]
    bad = msgspec.structs.replace(shard, sha256="0" * 64)
    await setup.announce(msgspec.structs.replace(setup.staged.manifest, shards=[bad, *setup.staged.manifest.shards[1:]]))
    await setup.expect_refused("digest")
    await setup.recovers()


async def test_missing_base(setup):
    await setup.start()
    spoiled = msgspec.structs.replace(setup.staged.manifest, base_version=0, version=2)
    spoiled = msgspec.structs.replace(spoiled, shards=[msgspec.structs.replace(s, base_version=0) for s in spoiled.shards])
    await setup.announce(spoiled)
    await until(lambda: len(setup.failures()) >= 1)
    first = setup.failures()[0]
    assert first.kind == "missing_base" and first.next_step == "catch_up" and "delta on 0" in first.reason
    await asyncio.sleep(0.2)
    assert setup.executor.calls == [] and same(setup.executor.state, setup.v1)
    await setup.recovers()


async def test_older_version(setup):
    await setup.start()
    await setup.announce(setup.staged.manifest)
    assert await setup.follower.wait_for_version(2, TIMEOUT) == 2
    await setup.announce(setup.v1_manifest)
    await until(lambda: len(setup.failures()) >= 1)
    assert setup.failures()[0].kind == "stale" and "not newer" in setup.failures()[0].reason
    assert setup.follower.version == 2 and same(setup.executor.state, setup.v2)


async def test_unknown_tensor(setup):
    await setup.start()
    m = setup.staged.manifest
    extra = msgspec.structs.replace(m.tensors[0], name="not.in.the.model")
    await setup.announce(msgspec.structs.replace(m, tensors=[*m.tensors, extra]))
    await setup.expect_refused("unknown_tensor")
    assert "not.in.the.model" in setup.failures()[0].reason
    await setup.recovers()


async def test_wrong_shape(setup):
    await setup.start()
    m = setup.staged.manifest
    wrong = msgspec.structs.replace(m.tensors[0], shape=[t * 2 for t in m.tensors[0].shape])
    await setup.announce(msgspec.structs.replace(m, tensors=[wrong, *m.tensors[1:]]))
    await setup.expect_refused("shape")
    await setup.recovers()


async def test_oversized_shard(setup):
    await setup.start(max_shard_bytes=SETTINGS.shard_bytes)
    m = setup.staged.manifest
    huge = msgspec.structs.replace(m.shards[0], decoded_bytes=64 << 30)
    await setup.announce(msgspec.structs.replace(m, shards=[huge, *m.shards[1:]]))
    await setup.expect_refused("oversized")
    await setup.recovers()


async def test_an_object_bigger_than_its_manifest_says(setup, bus):
    await setup.start()
    name, size = _object(setup.staged.manifest)
    padded = bytes(await WeightStore(bus.js, WEIGHTS_OBJECTS.bucket).get(name)) + os.urandom(4096)
    await WeightStore(bus.js, WEIGHTS_OBJECTS.bucket).put(name, padded)
    await setup.announce(setup.staged.manifest)
    await setup.expect_refused("oversized")
    await setup.recovers()


async def test_the_executor_refusing_keeps_the_old_version(setup):
    await setup.start()
    setup.executor.refuse = True
    await setup.announce(setup.staged.manifest)
    await until(lambda: len(setup.failures()) >= 1)
    assert setup.failures()[0].kind == "apply" and "refused by the test executor" in setup.failures()[0].reason
    assert setup.follower.version == 1 and same(setup.executor.state, setup.v1)
