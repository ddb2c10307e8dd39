"""The weight_publisher service started in-process, driven by the trainer SDK, followed by an executor."""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors
import pytest

from rose.client import PublishFailedError, WeightsClient
from rose.contracts.registry import MANIFESTS_STREAM, WEIGHT_MANIFEST, WEIGHT_PUBLISH, WEIGHT_PUBLISH_FAILED, WEIGHTS_STAGING_OBJECTS
from rose.contracts.weights import VERSION_NOT_NEWER, WeightPublishFailed, WeightPublishRequest
from rose.services.weight_publisher import service as publisher_module
from rose.services.weight_publisher.config import PublisherSettings, WeightPublisherConfig
from rose.services.weight_publisher.main import run
from rose.shared.bus import Bus, RemoteError
from rose.shared.config import RuntimeConfig
from rose.shared.weight_layout import save_safetensors
from rose.shared.weight_store import WeightStore
from rose.shared.weight_sync import WeightFollower
from rose.testing.polling import retrying
from rose.testing.weights import Executor, make_state, rl_step, same

TIMEOUT = 15.0


@pytest.fixture
async def publisher_service(bus_config):
    config = WeightPublisherConfig(
        bus=bus_config,
        runtime=RuntimeConfig(instance="wp-test", heartbeat_interval_s=0.5),
        publisher=PublisherSettings(shard_bytes=8192, keyframe_interval=3),
    )
    task = asyncio.create_task(run(config))
    yield task
    task.cancel()
    await asyncio.wait([task], timeout=10)


async def _publish_once_up(client, source, version: int):
    """``client.publish`` retried while the publisher service is still starting (up to 10 s); its acceptance."""
    return await retrying(lambda: client.publish(source, version), Exception, 10, "publishing (the service still starting)")


async def test_sdk_publish_then_published_then_applied(publisher_service, bus, follower_bus, model_name, tmp_path):
    states = {1: make_state(21)}
    executor = Executor(make_state(0), None)
    follower = WeightFollower(follower_bus, model=model_name, apply=executor.apply)
    await follower.start(executor.state, None)
    try:
        async with (
            WeightsClient(bus, model_name) as staged_via_objects,
            WeightsClient(bus, model_name, staging_dir=tmp_path / "stage") as staged_via_path,
        ):
            await asyncio.sleep(0.5)  # the service's endpoint is up once it has announced itself; retry until then
            for version in range(1, 6):
                states.setdefault(version, rl_step(states.get(version - 1, states[1]), version))
                if version == 4:  # a safetensors file on a shared path
                    client, source = staged_via_path, save_safetensors(states[version], tmp_path / "v4.safetensors")
                else:
                    client, source = (staged_via_objects if version % 2 else staged_via_path), states[version]
                accepted = await _publish_once_up(client, source, version)
                assert accepted.version == version
                manifest = await client.published(version, timeout=TIMEOUT)
                assert manifest.version == version and manifest.keyframe == (version in (1, 4))
                assert await follower.wait_for_version(version, TIMEOUT) == version
                assert same(executor.state, states[version])
            assert list((tmp_path / "stage").iterdir()) == []  # staged files are removed once read
            # A version that is not newer is refused at once, with the reason.
            with pytest.raises(RemoteError, match="not newer") as refused:
                await staged_via_path.publish(states[5], 5)
            assert refused.value.code == "400"  # a client error: answered, not dead-lettered
            assert refused.value.reason == VERSION_NOT_NEWER and refused.value.data["latest"] >= 5  # what a trainer branches on
            # A path the publisher cannot read is refused too.
            with pytest.raises(RemoteError, match="does not exist"):
                await staged_via_path.publish(tmp_path / "nowhere", 6)
            # A staged object that is not safetensors fails after acceptance: the client hears why.
            await WeightStore(bus.js, WEIGHTS_STAGING_OBJECTS.bucket).put("junk", b"not safetensors at all")
            await bus.request(
                WEIGHT_PUBLISH,
                WeightPublishRequest(request_id="r7", model=model_name, version=7, source="object", object_name="junk"),
                model=model_name,
            )
            with pytest.raises(PublishFailedError, match="safetensors"):
                await staged_via_objects.published(7, timeout=TIMEOUT)
    finally:
        await follower.stop()


async def test_a_failed_version_does_not_stall_the_versions_after_it(publisher_service, bus, bus_config, model_name):
    """A version whose staged object is gone fails, reported once (one WeightPublishFailed); the next two
    publishes go through (the failed number asked for again, then the next) as deltas against the last
    good version, and every executor applies both."""
    states = {1: make_state(31)}
    states[2] = rl_step(states[1], 2)
    states[3] = rl_step(states[2], 3)
    failures: list[WeightPublishFailed] = []
    await bus.subscribe(WEIGHT_PUBLISH_FAILED, lambda f, _d: asyncio.sleep(0, failures.append(f)), model=model_name)
    async with Bus(bus_config, service="executor", instance="ex-a") as bus_a, Bus(bus_config, service="executor", instance="ex-b") as bus_b:
        executors = [Executor(make_state(0), None), Executor(make_state(0), None)]
        followers = [WeightFollower(b, model=model_name, apply=e.apply) for b, e in zip((bus_a, bus_b), executors)]
        for follower, executor in zip(followers, executors):
            await follower.start(executor.state, None)
        try:
            async with WeightsClient(bus, model_name) as weights:
                await _publish_once_up(weights, states[1], 1)
                await weights.published(1, timeout=TIMEOUT)
                # v2: accepted, then its staged object is missing when the publisher reads it
                await bus.request(
                    WEIGHT_PUBLISH,
                    WeightPublishRequest(request_id="gone", model=model_name, version=2, source="object", object_name="gone"),
                    model=model_name,
                )
                with pytest.raises(PublishFailedError, match="gone"):
                    await weights.published(2, timeout=TIMEOUT)
                for version in (2, 3):  # v2 again (its source fixed), then v3
                    await weights.publish(states[version], version)
                    manifest = await weights.published(version, timeout=TIMEOUT)
                    assert manifest.base_version == version - 1 and not manifest.keyframe  # a delta against the last good version
                    for follower in followers:
                        assert await follower.wait_for_version(version, TIMEOUT) == version
                    for executor in executors:
                        assert same(executor.state, states[version])
            assert [(f.version, f.request_id) for f in failures] == [(2, "gone")]  # reported once
            assert all(f.stats.failed == 0 and f.stats.applied == 3 for f in followers)
        finally:
            for follower in followers:
                await follower.stop()


async def test_a_version_hit_by_a_jetstream_outage_is_announced_once_it_answers(publisher_service, bus, model_name, monkeypatch):
    """A node of a 3-node cluster killed: JetStream answers 503 "temporarily unavailable" during the leader
    election (docker compose, scripts/compose-check). The publisher stages and announces the version again
    instead of failing it; an announce that was stored but whose ack was lost adds no second manifest."""
    monkeypatch.setattr(publisher_module, "TRANSIENT_BACKOFF_S", (0.05, 0.2))
    real_publish = Bus.publish
    attempts: list[str] = []

    async def publish(self, channel, message, *, msg_id=None, **tokens):
        if channel is WEIGHT_MANIFEST and tokens.get("version") == "2" and len(attempts) < 2:
            if not attempts:
                attempts.append("unavailable")
                raise nats.js.errors.ServiceUnavailableError(code=503, err_code=10008, description="JetStream system temporarily unavailable")
            attempts.append("stored, ack lost")
            await real_publish(self, channel, message, msg_id=msg_id, **tokens)
            raise nats.errors.TimeoutError
        await real_publish(self, channel, message, msg_id=msg_id, **tokens)

    monkeypatch.setattr(Bus, "publish", publish)
    failures: list[WeightPublishFailed] = []
    await bus.subscribe(WEIGHT_PUBLISH_FAILED, lambda f, _d: asyncio.sleep(0, failures.append(f)), model=model_name)
    states = {1: make_state(41)}
    states[2] = rl_step(states[1], 2)
    states[3] = rl_step(states[2], 3)
    async with WeightsClient(bus, model_name) as weights:
        await _publish_once_up(weights, states[1], 1)
        await weights.published(1, timeout=TIMEOUT)
        await weights.publish(states[2], 2)
        manifest = await weights.published(2, timeout=TIMEOUT)  # the stored announce is seen: the publisher may still retry it
        await weights.publish(states[3], 3)
        after = await weights.published(3, timeout=TIMEOUT)  # one worker per model: v2's publish is over
    assert manifest.version == 2 and attempts == ["unavailable", "stored, ack lost"] and failures == []
    assert after.base_version == 2  # v2 went out, and is the next version's base
    subject = WEIGHT_MANIFEST.subject(model=model_name, kind=manifest.kind, version="2")
    info = await bus.js.stream_info(MANIFESTS_STREAM.name, subjects_filter=subject)
    assert info.state.subjects == {subject: 1}  # one manifest of v2, not two
